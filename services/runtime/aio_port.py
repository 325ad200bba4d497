"""A port served by grpc.aio on an event loop of its own: streams held open by the thousand (executor agents'
Connect) cost a coroutine and an HTTP/2 stream each there, where the thread-pool server spends two threads on
each (its handler and the session's reader) and so caps them at its pool size.

The calls it serves get what `CallInterceptor` gives the pool server's: the token checked (off the loop: it
asks the store), rate limits, the stream cap, domain errors mapped to status codes with their field and fix,
a log line and an audit row per call; plus health and reflection.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ballast.transport import is_loopback
from services.runtime.auth import Principal
from services.runtime.errors import BallastError, ResourceExhausted
from services.runtime.interceptors import CallInterceptor, error_metadata, log_call, outcome

log = logging.getLogger("ballast.server")
T = TypeVar("T")

# (principal, the request stream, the call) -> the response stream
Behaviour = Callable[[Principal, AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]


def bind(server: grpc.Server | grpc.aio.Server, name: str, address: str,
         credentials: grpc.ServerCredentials | None) -> int:
    """Listen on `address` (TLS with `credentials`, else plaintext on loopback only); returns the port."""
    if credentials is None and not is_loopback(address):
        raise ValueError(f"{name}: refusing to serve plaintext on {address}: with plaintext (BALLAST_PLAINTEXT) "
                         "set, bind a loopback host (BALLAST_HOST=127.0.0.1), or unset plaintext to use TLS")
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise OSError(f"{name}: cannot listen on {address} (port in use?)") from exc


class AioPort:
    """A started-on-demand grpc.aio server on one address; its loop runs on a daemon thread."""

    def __init__(self, name: str, address: str, credentials: grpc.ServerCredentials | None,
                 register: Callable[[grpc.aio.Server], None], services: Sequence[str],
                 options: Sequence[tuple[str, Any]] = ()):
        self.name = name
        self.services = list(services)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-aio", daemon=True)
        self._thread.start()
        self._stopped = False
        try:
            self.port = self.call(self._build(address, credentials, register, options))
        except BaseException:
            self._end_loop()
            raise

    def call(self, coroutine: Awaitable[T], timeout: float | None = 30.0) -> T:
        """Run `coroutine` on this port's loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _build(self, address: str, credentials: grpc.ServerCredentials | None,
                     register: Callable[[grpc.aio.Server], None], options: Sequence[tuple[str, Any]]) -> int:
        self._server = grpc.aio.server(options=list(options))
        register(self._server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection([*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self._server)
        return bind(self._server, self.name, address, credentials)

    def start(self, serving: bool = True) -> AioPort:
        self.call(self._server.start())
        self.set_serving(serving)
        return self

    def set_serving(self, serving: bool) -> None:
        if self._stopped:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def flip() -> None:
            for name in ["", *self.services]:
                await self.health.set(name, status)

        self.call(flip())

    def stop(self, grace_s: float) -> None:
        if self._stopped:
            return
        self.set_serving(False)
        self._stopped = True
        try:
            self.call(self._server.stop(grace_s), timeout=grace_s + 30.0)
        finally:
            self._end_loop()

    def _end_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)


def stream_method(interceptor: CallInterceptor, method: str, behaviour: Behaviour,
                  pool: futures.Executor | None = None) -> Callable[..., AsyncIterator[Any]]:
    """A stream-stream aio handler for `method` ('/pkg.Service/Method') running `behaviour` as the caller the
    token names. `pool` runs the token check (None: the loop's default executor)."""

    async def handle(inbound: AsyncIterator[Any], ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        start, caller, failure, tenant = time.monotonic(), None, None, None
        try:
            peer, metadata = ctx.peer() or "", ctx.invocation_metadata()
            loop = asyncio.get_running_loop()
            caller = (await loop.run_in_executor(pool, interceptor.authenticated, method, peer, metadata))[1]
            interceptor.admit(method, caller, metadata)
            refused = interceptor.budget.acquire(method, caller.tenant_id)
            if refused:
                raise ResourceExhausted(f"{refused}; retry later", fix="raise the cap or spread the callers")
            tenant = caller.tenant_id
            async for reply in behaviour(caller, inbound, ctx):
                yield reply
        except BaseException as exc:  # noqa: BLE001 - mapped to a status below; cancellation passes on
            failure = exc
            if isinstance(exc, BallastError):
                ctx.set_trailing_metadata(error_metadata(exc))
                await ctx.abort(getattr(grpc.StatusCode, exc.code), str(exc))
            if isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
                log.error("unhandled error", exc_info=exc, extra={"method": method})
                await ctx.abort(grpc.StatusCode.INTERNAL,
                                f"internal error ({type(exc).__name__}); the service log has the details")
            raise
        finally:
            if tenant is not None:
                interceptor.budget.release(method, tenant)
            code = outcome(failure, ctx)[0] if failure is not None else "OK"
            log_call(method, start, code)
            interceptor.finished(method, caller, None, None, failure, ctx, start)

    return handle
