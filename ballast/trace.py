"""The trace id a call carries from service to service (`x-ballast-trace-id`), so one request's log lines can
be found in every service's log. A client that sets none gets one from the first server it reaches."""

from __future__ import annotations

import contextvars
import uuid

HEADER = "x-ballast-trace-id"
_current: contextvars.ContextVar[str] = contextvars.ContextVar("trace_id", default="")


def current() -> str:
    return _current.get()


def set_current(trace_id: str) -> contextvars.Token:
    return _current.set(trace_id)


def reset(token: contextvars.Token) -> None:
    _current.reset(token)


def new() -> str:
    return uuid.uuid4().hex[:16]


def valid(trace_id: str) -> bool:
    """A header value worth keeping: short, printable, no spaces (a client's own ids are welcome)."""
    return 0 < len(trace_id) <= 64 and trace_id.isascii() and trace_id.isprintable() and " " not in trace_id
