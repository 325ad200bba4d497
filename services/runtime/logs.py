"""Structured logs: one JSON object per line on stderr (or plain text for a person at a terminal:
BALLAST_LOG_FORMAT=text), so they can be shipped and queried.

Every line carries the trace id of the call it belongs to (`trace_id`, passed from service to service in the
`x-ballast-trace-id` header) and, when the work concerns one, the job and plan it is about (`job_id`,
`plan_id`): set for a call by the server interceptor from its request, for a worker process at its start, and
overridable per line with `extra=`."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator

from ballast import trace

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_scope: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("log_scope", default={})  # noqa: B039


def scope() -> dict[str, str]:
    """The ids every line logged here now carries (trace id included)."""
    ids = dict(_scope.get())
    if trace.current():
        ids["trace_id"] = trace.current()
    return ids


def bind(**ids: str) -> contextvars.Token:
    """Carry `ids` (job_id, plan_id) on every line logged in this context from now on; empty values are
    dropped. Returns the token `unbind` takes."""
    return _scope.set({**_scope.get(), **{k: v for k, v in ids.items() if v}})


def set_scope(**ids: str) -> None:
    """Replace this context's ids: a server thread starts each call with only that call's."""
    _scope.set({k: v for k, v in ids.items() if v})


def unbind(token: contextvars.Token) -> None:
    _scope.reset(token)


@contextlib.contextmanager
def bound(**ids: str) -> Iterator[None]:
    token = bind(**ids)
    try:
        yield
    finally:
        unbind(token)


def fields(record: logging.LogRecord) -> dict[str, object]:
    """The line's own extra fields over the context's ids."""
    return {**scope(), **{k: v for k, v in record.__dict__.items() if k not in _RESERVED}}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`HH:MM:SS level service logger: message key=value ...`, for a person reading a terminal."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%H:%M:%S", time.gmtime(record.created))
        extra = " ".join(f"{k}={v}" for k, v in fields(record).items())
        line = f"{when} {record.levelname.lower():7} {self.service} {record.name}: {record.getMessage()}"
        line += f" {extra}" if extra else ""
        return line + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


FORMATS = {"json": JsonFormatter, "text": TextFormatter}


def configure_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    if fmt not in FORMATS:
        raise ValueError(f"BALLAST_LOG_FORMAT={fmt!r}: use one of {sorted(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FORMATS[fmt](service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
