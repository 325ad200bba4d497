"""Per-call context: the caller's principal and deadline, visible to logic without grpc imports."""

from __future__ import annotations

import contextvars
import time

from services.runtime.auth import Principal
from services.runtime.errors import Unauthenticated

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("principal", default=None)
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline", default=None)
_token: contextvars.ContextVar[str] = contextvars.ContextVar("token", default="")
# Work no caller waits on (a service's own background calls, or none at all) yields to calls someone waits on.
_background: contextvars.ContextVar[bool] = contextvars.ContextVar("background", default=True)
LANE_HEADER = "ballast-lane"  # "background" on a service's own calls (store_client.remote_stores' platform side)
BACKGROUND = "background"


def set_call(principal: Principal | None, deadline: float | None, token: str = "", background: bool = False) -> None:
    _principal.set(principal)
    _deadline.set(deadline)
    _token.set(token)
    _background.set(background)


def in_background() -> bool:
    """True unless this thread serves a call that did not say it is background work: what the store's write
    gate orders by (services/store/gate.py). Threads outside any call (sweepers, audit flushers) are background."""
    return _background.get()


def caller_token() -> str:
    """The incoming call's bearer token, so a service acts on the store as its caller (tenant isolation)."""
    return _token.get()


def current_principal() -> Principal:
    principal = _principal.get()
    if principal is None:
        raise Unauthenticated("no authenticated caller", fix="send an 'authorization: Bearer <token>' header")
    return principal


def remaining_time() -> float | None:
    """Seconds left before the incoming call's deadline, for propagating it to downstream calls."""
    deadline = _deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())
