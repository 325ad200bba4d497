"""Per-call context: the caller's principal and deadline, visible to logic without grpc imports."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator

from services.runtime.auth import Principal
from services.runtime.errors import Unauthenticated

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("principal", default=None)
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline", default=None)
_token: contextvars.ContextVar[str] = contextvars.ContextVar("token", default="")
# Work no caller waits on (a service's own background calls, or none at all) yields to calls someone waits on.
_cancellation: contextvars.ContextVar[Cancellation | None] = contextvars.ContextVar("cancellation", default=None)
_background: contextvars.ContextVar[bool] = contextvars.ContextVar("background", default=True)
LANE_HEADER = "ballast-lane"  # "background" on a service's own calls (store_client.remote_stores' platform side)
BACKGROUND = "background"




class Cancellation:
    """Fires once when the caller goes away (it cancelled, its deadline passed, its connection dropped), so work
    done for it stops instead of running on for nobody: `ballast sql`'s query, for one."""

    def __init__(self) -> None:
        self._fired = threading.Event()
        self._hooks: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    @property
    def fired(self) -> bool:
        return self._fired.is_set()

    def fire(self) -> None:
        with self._lock:
            self._fired.set()
            hooks = list(self._hooks)
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a hook that cannot stop its work must not break the others
                logging.getLogger("ballast.context").exception("a cancellation hook failed")

    @contextlib.contextmanager
    def hook(self, fn: Callable[[], object]) -> Iterator[None]:
        """Run `fn` if the call is cancelled while inside the block (at once if it already was)."""
        with self._lock:
            self._hooks.append(fn)
            fired = self._fired.is_set()
        try:
            if fired:
                fn()
            yield
        finally:
            with self._lock:
                self._hooks.remove(fn)


def set_call(principal: Principal | None, deadline: float | None, token: str = "", background: bool = False,
             cancellation: Cancellation | None = None) -> None:
    _principal.set(principal)
    _deadline.set(deadline)
    _token.set(token)
    _background.set(background)
    _cancellation.set(cancellation)


def cancelled() -> bool:
    """True once the incoming call's caller has gone away; False outside a call."""
    cancellation = _cancellation.get()
    return cancellation is not None and cancellation.fired


@contextlib.contextmanager
def on_cancel(fn: Callable[[], object]) -> Iterator[None]:
    """Within the block, call `fn` when the incoming call is cancelled (outside a call: never)."""
    cancellation = _cancellation.get()
    if cancellation is None:
        yield
        return
    with cancellation.hook(fn):
        yield


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
