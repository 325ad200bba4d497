"""Calling another service's generated stub: failures come back as domain errors.

The store is reached through the typed Store interface instead (services/runtime/store_client.py);
this is for the rest, such as a planner worker asking the profiler for a profile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from services.runtime.errors import BallastError, from_code


def domain_error(exc: grpc.RpcError) -> BallastError:
    """Turn a downstream status back into a domain error, so it surfaces to our caller unchanged."""
    return from_code(exc.code().name, exc.details() or exc.code().name)


def call(fn: Callable[..., Any], request: Any, **kwargs: Any) -> Any:
    """Call a stub method, re-raising a failure as the matching domain error."""
    try:
        return fn(request, **kwargs)
    except grpc.RpcError as exc:
        raise domain_error(exc) from None
