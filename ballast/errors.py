"""The SDK's exceptions: each names the field at fault and the fix, like the services' own errors.

Layer 0 (contracts and SDK) cannot import the services' domain errors, so the SDK has its own: `InvalidInput`
for arguments refused before anything is sent, `CallFailed` for a call the control plane refused or could not
answer (with the field and fix its servers attach as trailing metadata), `PlanSearchFailed` for a queued search
that ended FAILED. `CallFailed` is also a `grpc.RpcError`, so code written against the raw stubs catches it too.
"""

from __future__ import annotations

import grpc

# Trailing metadata that carries a service error's parts across gRPC (binary keys: the text may be any UTF-8).
ERROR_MESSAGE = "ballast-error-message-bin"
ERROR_FIELD = "ballast-error-field-bin"
ERROR_FIX = "ballast-error-fix-bin"


class ClientError(Exception):
    """Base class: `message`, `field` (None when no one field is at fault) and `fix` (None when unknown)."""

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        self.message, self.field, self.fix = message, field, fix
        text = f"{field}: {message}" if field else message
        super().__init__(f"{text} ({fix})" if fix else text)


class InvalidInput(ClientError, ValueError):
    """An argument the SDK refuses before any call: `field` is the parameter's name."""


class CallFailed(ClientError, grpc.RpcError):
    """A call the control plane refused or could not answer. `code()` and `details()` as on a grpc.RpcError;
    `status` is the code's name ("NOT_FOUND"), `call` the RPC ("JobService.Submit")."""

    def __init__(self, call: str, code: grpc.StatusCode, message: str, *, field: str | None = None,
                 fix: str | None = None):
        super().__init__(message, field=field, fix=fix)
        self.call, self._code, self.status = call, code, code.name
        self._text = str(self)
        self.args = (f"{call} {code.name}: {self._text}",)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._text

    @classmethod
    def of(cls, call: str, exc: grpc.RpcError) -> CallFailed:
        """From a stub's error: the message, field and fix a Ballast server attached, else its details."""
        trailing = getattr(exc, "trailing_metadata", lambda: None)() or ()
        parts = {key: value.decode() for key, value in trailing if isinstance(value, bytes) and value}
        code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
        if ERROR_MESSAGE in parts:
            return cls(call, code, parts[ERROR_MESSAGE], field=parts.get(ERROR_FIELD), fix=parts.get(ERROR_FIX))
        return cls(call, code, exc.details() or code.name, fix=_fixes.get(code))


_fixes = {
    grpc.StatusCode.UNAUTHENTICATED: "set BALLAST_TOKEN, or run where the data dir's admin.token is readable",
    grpc.StatusCode.UNAVAILABLE: "is the control plane up? `ballast status` says; check the addresses and TLS CA",
}


class PlanSearchFailed(ClientError):
    """A queued plan search ended FAILED: `request_id` and the worker's reason."""

    def __init__(self, request_id: str, reason: str):
        self.request_id, self.reason = request_id, reason
        super().__init__(f"plan search {request_id} failed: {reason}", fix="the reason names what to change")


class SearchTimeout(ClientError, TimeoutError):
    """A queued plan search still running after the time given to wait for it (the search goes on)."""
