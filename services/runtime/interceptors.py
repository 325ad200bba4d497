"""Server interceptor chain: logging, authentication, deadline propagation, error mapping, stream limits.

Each interceptor wraps the method handler's behaviour; logic below them raises domain errors
(services.runtime.errors) and reads the caller from services.runtime.context.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import grpc
import sqlalchemy.exc
from google.protobuf.message import Message

from ballast import trace
from ballast.v1 import common_pb2, store_pb2
from services.runtime import context, logs, rpcs
from services.runtime.audit import AuditLog, target_of
from services.runtime.auth import Principal
from services.runtime.auth_failures import AuthFailures, TooManyFailures, peer_address
from services.runtime.disk import DiskFull, disk_full
from services.runtime.errors import (
    ERROR_FIELD,
    ERROR_FIX,
    ERROR_MESSAGE,
    BallastError,
    PermissionDenied,
    Unauthenticated,
)
from services.runtime.metrics import RPC_SECONDS
from services.runtime.ratelimit import RateLimiter

log = logging.getLogger("ballast.rpc")

# Health and reflection answer without a token: load balancers and `grpcurl list` must work unauthenticated.
PUBLIC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

Behavior = Callable[[Any, grpc.ServicerContext], Any]
Metadata = Sequence[tuple[str, str | bytes]] | None  # a call's invocation metadata
CallGate = Callable[[bool], AbstractContextManager[None]]  # (is the call background?) -> held while it runs


def _wrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior, bool, bool], Behavior]) -> grpc.RpcMethodHandler:
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
                wrap(behavior, handler.response_streaming, handler.request_streaming),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def error_metadata(exc: BallastError) -> tuple[tuple[str, str | bytes], ...]:
    """The error's parts as trailing metadata, so a Ballast caller rebuilds it with its field and fix
    (services/runtime/remote.domain_error); other clients read the status message, which has all three."""
    parts = ((ERROR_MESSAGE, exc.message), (ERROR_FIELD, exc.field), (ERROR_FIX, exc.fix))
    return tuple((key, value.encode()) for key, value in parts if value) + getattr(exc, "trailing", ())


def abort_for(exc: BaseException, ctx: grpc.ServicerContext) -> None:
    """Map a domain or database error to a status code; never leak a traceback to the client."""
    if isinstance(exc, BallastError):
        ctx.set_trailing_metadata(error_metadata(exc))
        ctx.abort(getattr(grpc.StatusCode, exc.code), str(exc))
    if disk_full(exc):
        full = DiskFull()
        ctx.set_trailing_metadata(error_metadata(full))
        ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))
    if isinstance(exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
        ctx.abort(grpc.StatusCode.UNAVAILABLE, "database unavailable; retry later")
    if not isinstance(exc, Exception) or ctx.code() is not None:
        raise exc  # GeneratorExit on a cancelled stream, or a status the handler already set
    log.error("unhandled error", exc_info=exc)
    ctx.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the service log has the details")


class StreamBudget:
    """Caps on concurrently open long-lived streams, so they never take every pool thread from unary
    calls: a reserved cap per method (executor agents' Connect must never be locked out by watchers),
    a shared cap for every other stream, and a per-tenant share of that shared cap."""

    def __init__(self, shared: int, per_tenant: int, reserved: dict[str, int] | None = None):
        self.shared, self.per_tenant, self.reserved = shared, per_tenant, dict(reserved or {})
        self._open: dict[str, int] = {}
        self._tenants: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, method: str, tenant: str) -> str | None:
        """Take a slot; returns None on success, else why not."""
        with self._lock:
            if method in self.reserved:
                if self._open.get(method, 0) >= self.reserved[method]:
                    return f"{self.reserved[method]} {method} streams already open"
                self._open[method] = self._open.get(method, 0) + 1
                return None
            if self._open.get("", 0) >= self.shared:
                return f"server already holds {self.shared} open streams"
            if self._tenants.get(tenant, 0) >= self.per_tenant:
                return f"this tenant already holds {self.per_tenant} open streams"
            self._open[""] = self._open.get("", 0) + 1
            self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
            return None

    def release(self, method: str, tenant: str) -> None:
        with self._lock:
            if method in self.reserved:
                self._open[method] -= 1
            else:
                self._open[""] -= 1
                self._tenants[tenant] -= 1

    @property
    def total(self) -> int:
        return self.shared + sum(self.reserved.values())


class CallInterceptor(grpc.ServerInterceptor):
    """Authenticates, keeps viewers to reads, records the deadline, maps errors, logs every call and puts every
    state-changing one in the audit log.

    `authenticate(token) -> Principal` raises Unauthenticated for a bad token. Long-lived streams
    (Watch, Connect) are counted against `budget`. Health and reflection pass through untouched: they
    need no token, and the health servicer's Watch is non-blocking (it holds no pool thread).
    """

    def __init__(self, authenticate: Callable[[str], Principal] | None, budget: StreamBudget,
                 audit: AuditLog | None = None, server: str = "", limiter: RateLimiter | None = None,
                 call_gate: CallGate | None = None, auth_failures: AuthFailures | None = None):
        self._authenticate = authenticate
        self.budget = budget
        self.audit = audit
        self.server = server
        self.limiter = limiter or RateLimiter(0, 0)  # per-tenant rate limits; off by default
        self.call_gate = call_gate  # holds a service's own unary calls back while callers' are served (the store)
        self.auth_failures = auth_failures or AuthFailures()  # per peer address: bad tokens limited and audited

    def finished(self, method: str, caller: Principal | None, request: Any, reply: Any,
                  failure: BaseException | None, ctx: grpc.ServicerContext, start: float) -> None:
        """A call's end: its latency by status (Prometheus), and its audit row if it changed state."""
        try:
            code = outcome(failure, ctx)[0]
            RPC_SECONDS.labels(self.server, rpcs.split(method)[1], code).observe(time.monotonic() - start)
        except Exception:  # noqa: BLE001 - measuring must never fail the call
            log.exception("could not observe the call", extra={"method": method})
        self._audit(method, caller, request, reply, failure, ctx, start)

    def _audit(self, method: str, caller: Principal | None, request: Any, reply: Any, failure: BaseException | None,
               ctx: grpc.ServicerContext, start: float) -> None:
        """The finished call as an audit row, if it changed (or tried to change) state; never fails the call."""
        service, name = rpcs.split(method)
        if self.audit is None or not rpcs.audited(name, caller, request) or isinstance(failure, TooManyFailures):
            return  # a call held back for its address's failed tokens is counted in their aggregated row
        try:
            self._record(service, name, caller, request, reply, failure, ctx, start)
        except Exception:  # noqa: BLE001 - a bug here must not turn a finished call into an error
            log.exception("could not build an audit record", extra={"method": method})

    def _record(self, service: str, name: str, caller: Principal | None, request: Any, reply: Any,
                failure: BaseException | None, ctx: grpc.ServicerContext, start: float) -> None:
        code, message = outcome(failure, ctx)
        record = store_pb2.AuditRecord(
            tenant_id=caller.tenant_id if caller else "", tenant_name=caller.tenant_name if caller else "",
            service=service, method=name, target=target_of(request, reply), code=code, message=message[:500],
            duration_ms=round((time.monotonic() - start) * 1e3, 3), peer=ctx.peer() or "")
        if caller is not None:
            record.role = common_pb2.TenantRole.Value(caller.role)
        record.at.GetCurrentTime()
        self.audit.record(record)

    def authenticated(self, method: str, peer: str, metadata: Metadata) -> tuple[str, Principal]:
        """The caller's token and principal; a peer that keeps failing is held back (auth_failures.py). Also the
        agent port's (aio_port.py), which runs it off its event loop: the token is checked with the store."""
        try:
            token = _bearer(metadata)
            self.auth_failures.check(peer, token)
            principal = self._authenticate(token)
            self.auth_failures.succeeded(token)
            return token, principal
        except (Unauthenticated, TooManyFailures) as exc:
            service, name = rpcs.split(method)
            own_row = isinstance(exc, Unauthenticated) and rpcs.changes_state(name)  # _audit writes it
            refusals = self.auth_failures.refused(peer, aggregate=not own_row)
            if refusals and self.audit is not None:
                record = store_pb2.AuditRecord(
                    service=service, method=name, code="UNAUTHENTICATED", peer=peer,
                    message=(f"{refusals} refused authentication(s) from {peer_address(peer)} since its last "
                             f"record (one a minute at most): {exc}")[:500])
                record.at.GetCurrentTime()
                self.audit.record(record)
            raise

    def admit(self, method: str, principal: Principal, metadata: Metadata) -> None:
        """Rate limits (raises Throttled) and a viewer's token kept to reads."""
        self.limiter.admit(principal, method, metadata)
        if principal.viewer and rpcs.changes_state(rpcs.split(method)[1]):
            raise PermissionDenied(f"{method} changes state and a viewer's token only reads",
                                   fix="use a member's token (or the platform admin's) to change things")

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        method = details.method
        if method.startswith(PUBLIC_PREFIXES) or self._authenticate is None:
            return handler

        def wrap(behavior: Behavior, streaming: bool, streaming_in: bool) -> Behavior:
            def begin(ctx: grpc.ServicerContext, called: list[Principal],
                      request: Any = None) -> tuple[Principal, float | None, str, bool, context.Cancellation]:
                metadata = ctx.invocation_metadata()  # read once: each read builds a new tuple
                headers = dict(metadata or ())
                trace_scope(headers.get(trace.HEADER, ""), request)
                token, principal = self.authenticated(method, ctx.peer() or "", metadata)
                called.append(principal)  # who, for the audit log, even if refused below
                self.admit(method, principal, metadata)
                remaining = ctx.time_remaining()
                deadline = time.monotonic() + remaining if remaining is not None and remaining < 1e9 else None
                background = headers.get(context.LANE_HEADER) == context.BACKGROUND
                cancellation = context.Cancellation()
                ctx.add_callback(cancellation.fire)  # grpc calls it when the RPC ends: done, cancelled or expired
                context.set_call(principal, deadline, token, background, cancellation)
                return principal, deadline, token, background, cancellation

            def unary(request: Any, ctx: grpc.ServicerContext) -> Any:
                start, cpu_start = time.monotonic(), time.thread_time()
                code, reply, failure, called = "OK", None, None, []
                try:
                    background = begin(ctx, called, request)[3]
                    if self.call_gate is None:
                        reply = behavior(request, ctx)
                    else:
                        with self.call_gate(background):
                            reply = behavior(request, ctx)
                    return reply
                except BaseException as exc:  # noqa: BLE001 - mapped, then re-raised by abort
                    code, failure = getattr(exc, "code", type(exc).__name__), exc
                    abort_for(exc, ctx)
                finally:
                    log_call(method, start, code, cpu_start)
                    self.finished(method, called[0] if called else None, request, reply, failure, ctx, start)

            def stream(request: Any, ctx: grpc.ServicerContext) -> Iterator[Any]:
                start = time.monotonic()
                code, failure, called = "OK", None, []
                tenant = None
                try:
                    principal, deadline, token, background, cancellation = begin(
                        ctx, called, None if streaming_in else request)
                    refused = self.budget.acquire(method, principal.tenant_id)
                    if refused:
                        ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{refused}; retry later")
                    tenant = principal.tenant_id
                    for item in behavior(request, ctx):
                        yield item
                        context.set_call(principal, deadline, token, background, cancellation)  # resumed code sees it
                except BaseException as exc:  # noqa: BLE001
                    code, failure = getattr(exc, "code", type(exc).__name__), exc
                    abort_for(exc, ctx)
                finally:
                    if tenant is not None:
                        self.budget.release(method, tenant)
                    log_call(method, start, code)
                    self.finished(method, called[0] if called else None, None if streaming_in else request, None,
                                   failure, ctx, start)

            return stream if streaming else unary

        return _wrap(handler, wrap)


def trace_scope(given: str, request: Any) -> None:
    """This call's log scope: the caller's trace id `given` (or a new one) and the job and plan its request names."""
    trace.set_current(given if trace.valid(given) else trace.new())
    ids: dict[str, str] = {}
    if isinstance(request, Message):
        fields = request.DESCRIPTOR.fields_by_name
        for name in ("job_id", "plan_id", "id"):
            value = getattr(request, name) if name in fields and fields[name].type == fields[name].TYPE_STRING else ""
            for key, prefix in (("job_id", "job-"), ("plan_id", "pln-")):
                if value.startswith(prefix):
                    ids.setdefault(key, value)
    logs.set_scope(**ids)


def outcome(failure: BaseException | None, ctx: grpc.ServicerContext) -> tuple[str, str]:
    """(status code name, error text) a call ended with, as its caller saw it."""
    if failure is None:
        return "OK", ""
    if isinstance(failure, BallastError):
        return failure.code, str(failure)
    if disk_full(failure):
        return "RESOURCE_EXHAUSTED", str(DiskFull())
    if isinstance(failure, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
        return "UNAVAILABLE", "database unavailable"
    status = ctx.code() if hasattr(ctx, "code") else None
    if isinstance(status, grpc.StatusCode):
        return status.name, ctx.details() or ""
    if isinstance(failure, GeneratorExit | asyncio.CancelledError):
        return "CANCELLED", "the caller went away"
    return "INTERNAL", type(failure).__name__


def _bearer(metadata: Metadata) -> str:
    header = dict(metadata or ()).get("authorization", "")
    if not header.lower().startswith("bearer ") or not header[7:].strip():
        raise Unauthenticated(
            "missing bearer token",
            fix="send 'authorization: Bearer <token>' (the CLI reads BALLAST_TOKEN or <data-dir>/admin.token)",
        )
    return header[7:].strip()


def log_call(method: str, start: float, code: object, cpu_start: float | None = None) -> None:
    """One line per call; a unary call also logs the CPU its handler thread spent (`cpu_ms`: where a loaded
    server's time goes, beside `ms`, which includes waiting for locks, the database and the GIL)."""
    level = logging.INFO if code in ("OK", "NOT_FOUND", "INVALID_ARGUMENT") else logging.WARNING
    extra = {"method": method, "code": str(code), "ms": round((time.monotonic() - start) * 1e3, 2)}
    if cpu_start is not None:
        extra["cpu_ms"] = round((time.thread_time() - cpu_start) * 1e3, 2)
    log.log(level, "rpc", extra=extra)
