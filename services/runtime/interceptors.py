"""Server interceptor chain: logging, authentication, deadline propagation, error mapping, stream limits.

Each interceptor wraps the method handler's behaviour; logic below them raises domain errors
(services.runtime.errors) and reads the caller from services.runtime.context.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import sqlalchemy.exc

from services.runtime import context
from services.runtime.auth import Principal
from services.runtime.errors import BallastError, Unauthenticated

log = logging.getLogger("ballast.rpc")

# Health and reflection answer without a token: load balancers and `grpcurl list` must work unauthenticated.
PUBLIC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

Behavior = Callable[[Any, grpc.ServicerContext], Any]


def _wrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior, bool], Behavior]) -> grpc.RpcMethodHandler:
    """Rebuild a method handler with its behaviour wrapped; `streaming` tells the wrapper about responses."""
    if handler is None:
        return None
    for kind, factory in (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    ):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return factory(
                wrap(behavior, handler.response_streaming),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def abort_for(exc: BaseException, ctx: grpc.ServicerContext) -> None:
    """Map a domain or database error to a status code; never leak a traceback to the client."""
    if isinstance(exc, BallastError):
        ctx.abort(getattr(grpc.StatusCode, exc.code), str(exc))
    if isinstance(exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
        ctx.abort(grpc.StatusCode.UNAVAILABLE, "database unavailable; retry later")
    if not isinstance(exc, Exception) or ctx.code() is not None:
        raise exc  # GeneratorExit on a cancelled stream, or a status the handler already set
    log.error("unhandled error", exc_info=exc)
    ctx.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the service log has the details")


class CallInterceptor(grpc.ServerInterceptor):
    """Authenticates, records the deadline, maps errors and logs every call.

    `authenticate(token) -> Principal` raises Unauthenticated for a bad token. Streams (Watch, Connect)
    are capped at `max_streams` so they can never take every pool thread away from unary calls.
    """

    def __init__(self, authenticate: Callable[[str], Principal] | None, max_streams: int):
        self._authenticate = authenticate
        self._streams = threading.BoundedSemaphore(max_streams)
        self.max_streams = max_streams

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        method = details.method
        public = method.startswith(PUBLIC_PREFIXES) or self._authenticate is None

        def wrap(behavior: Behavior, streaming: bool) -> Behavior:
            long_lived = streaming and not public

            def begin(request: Any, ctx: grpc.ServicerContext) -> Principal | None:
                token = "" if public else _bearer(ctx)
                principal = None if public else self._authenticate(token)
                remaining = ctx.time_remaining()
                deadline = time.monotonic() + remaining if remaining is not None and remaining < 1e9 else None
                context.set_call(principal, deadline, token)
                return principal

            def unary(request: Any, ctx: grpc.ServicerContext) -> Any:
                start = time.monotonic()
                code = "OK"
                try:
                    begin(request, ctx)
                    return behavior(request, ctx)
                except BaseException as exc:  # noqa: BLE001 - mapped, then re-raised by abort
                    code = getattr(exc, "code", type(exc).__name__)
                    abort_for(exc, ctx)
                finally:
                    _log_call(method, start, code)

            def stream(request: Any, ctx: grpc.ServicerContext) -> Iterator[Any]:
                start = time.monotonic()
                code = "OK"
                acquired = False
                try:
                    principal = begin(request, ctx)
                    token = context.caller_token()
                    if long_lived:
                        acquired = self._streams.acquire(blocking=False)
                        if not acquired:
                            ctx.abort(
                                grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"server already holds {self.max_streams} open streams; retry later",
                            )
                    for item in behavior(request, ctx):
                        context.set_call(principal, None, token)
                        yield item
                except BaseException as exc:  # noqa: BLE001
                    code = getattr(exc, "code", type(exc).__name__)
                    abort_for(exc, ctx)
                finally:
                    if acquired:
                        self._streams.release()
                    _log_call(method, start, code)

            return stream if streaming else unary

        return _wrap(handler, wrap)


def _bearer(ctx: grpc.ServicerContext) -> str:
    header = dict(ctx.invocation_metadata()).get("authorization", "")
    if not header.lower().startswith("bearer ") or not header[7:].strip():
        raise Unauthenticated(
            "missing bearer token",
            fix="send 'authorization: Bearer <token>' (the CLI reads BALLAST_TOKEN or <data-dir>/admin.token)",
        )
    return header[7:].strip()


def _log_call(method: str, start: float, code: object) -> None:
    level = logging.INFO if code in ("OK", "NOT_FOUND", "INVALID_ARGUMENT") else logging.WARNING
    if method.startswith(PUBLIC_PREFIXES):
        level = logging.DEBUG
    log.log(level, "rpc", extra={"method": method, "code": str(code), "ms": round((time.monotonic() - start) * 1e3, 2)})
