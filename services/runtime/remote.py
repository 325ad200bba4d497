"""Calling another service's generated stub: failures come back as domain errors.

The store is reached through the typed Store interface instead (services/runtime/store_client.py);
this is for the rest, such as a planner worker asking the profiler for a profile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from services.runtime.errors import ERROR_FIELD, ERROR_FIX, ERROR_MESSAGE, BallastError, from_code


def domain_error(exc: grpc.RpcError) -> BallastError:
    """Turn a downstream status back into a domain error, so it surfaces to our caller unchanged: with its
    field and fix when a Ballast service sent them (interceptors.error_metadata), else from the message."""
    trailing = getattr(exc, "trailing_metadata", lambda: None)() or ()
    parts = {key: value for key, value in trailing if isinstance(value, bytes)}
    code = exc.code().name
    if ERROR_MESSAGE in parts:
        return from_code(code, parts[ERROR_MESSAGE].decode(), field=_text(parts.get(ERROR_FIELD)),
                         fix=_text(parts.get(ERROR_FIX)))
    return from_code(code, exc.details() or code)


def _text(value: bytes | None) -> str | None:
    return value.decode() if value else None


def call(fn: Callable[..., Any], request: Any, **kwargs: Any) -> Any:
    """Call a stub method, re-raising a failure as the matching domain error."""
    try:
        return fn(request, **kwargs)
    except grpc.RpcError as exc:
        raise domain_error(exc) from None
