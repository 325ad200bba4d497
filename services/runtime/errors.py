"""Domain errors raised by plain logic; the gRPC layer maps them to status codes.

Logic modules raise these instead of importing grpc, so they stay testable on their own.
Every error names the offending field (when there is one) and how to fix it.
"""

from __future__ import annotations

# Trailing metadata that carries an error's parts across gRPC; the SDK (layer 0) reads them back.
from ballast.errors import ERROR_FIELD, ERROR_FIX, ERROR_MESSAGE  # noqa: F401 - re-exported for the services


class BallastError(Exception):
    """Base class; `code` is the gRPC status name the servicer layer maps it to."""

    code = "INTERNAL"

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        self.message = message
        self.field = field
        self.fix = fix
        text = message
        if field:
            text = f"{field}: {text}"
        if fix:
            text = f"{text} ({fix})"
        super().__init__(text)


class InvalidArgument(BallastError):
    code = "INVALID_ARGUMENT"


class NotFound(BallastError):
    code = "NOT_FOUND"


class AlreadyExists(BallastError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(BallastError):
    code = "FAILED_PRECONDITION"


class PermissionDenied(BallastError):
    code = "PERMISSION_DENIED"


class Unauthenticated(BallastError):
    code = "UNAUTHENTICATED"


class Unavailable(BallastError):
    code = "UNAVAILABLE"


class ResourceExhausted(BallastError):
    code = "RESOURCE_EXHAUSTED"


class Unimplemented(BallastError):
    code = "UNIMPLEMENTED"


class DeadlineExceeded(BallastError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(BallastError):
    code = "CANCELLED"


class SchemaOutOfDate(FailedPrecondition):
    """The database schema is behind this build; the fix is always the same command."""

    def __init__(self, current: str | None, head: str):
        super().__init__(
            f"database schema is at revision {current or 'none'} but this build needs {head}",
            fix="run `ballast db upgrade`",
        )
        self.current = current
        self.head = head


def from_code(code: str, message: str, *, field: str | None = None, fix: str | None = None) -> BallastError:
    """The domain error for a status name (a downstream service's or a worker process's answer)."""
    for cls in BallastError.__subclasses__():
        if cls.code == code:
            return cls(message, field=field, fix=fix)
    return BallastError(message, field=field, fix=fix)
