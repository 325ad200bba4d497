"""One server factory for all four services.

Every server gets: message-size limits, keepalive, the interceptor chain, the standard health
service, server reflection, and graceful shutdown on SIGTERM/SIGINT (health flips to NOT_SERVING
first so load balancers stop routing, then in-flight calls get `grace_s` to finish).

Transport: `credentials` (TLS) on `address`; without them (the explicit plaintext opt-out) only a loopback
address may be bound, so plaintext never leaves the machine. `agent_address`, if given, is a second port on
its own grpc.aio server (aio_port.py) whose credentials require a client certificate: the planner's mutual-TLS
port for agents, where thousands of streams stay open.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ballast.config import Settings
from services.runtime.aio_port import AioPort, bind
from services.runtime.audit import AuditLog
from services.runtime.auth import Principal
from services.runtime.auth_failures import AuthFailures
from services.runtime.decode import DecodeInterceptor
from services.runtime.interceptors import CallGate, CallInterceptor, StreamBudget
from services.runtime.metrics_http import serve_metrics
from services.runtime.ratelimit import RateLimiter

log = logging.getLogger("ballast.server")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass
class ServerSpec:
    """What to serve. `register` adds servicers to the grpc server; `services` are their full names."""

    name: str
    address: str
    register: Callable[[grpc.Server], None]
    services: Iterable[str]
    authenticate: Callable[[str], Principal] | None = None
    max_workers: int = 32
    # Long-lived streams: a shared cap (with a per-tenant share) plus caps reserved per method.
    max_streams: int = 16
    streams_per_tenant: int = 8
    reserved_streams: dict[str, int] = field(default_factory=dict)
    grace_s: float = 5.0
    on_stop: list[Callable[[], None]] = field(default_factory=list)
    credentials: grpc.ServerCredentials | None = None  # None: plaintext, loopback only
    agent_address: str = ""  # "" : no agent port
    agent_credentials: grpc.ServerCredentials | None = None
    # adds the agent port's aio servicers, given the interceptor whose checks their handlers make (aio_port.py)
    agent_register: Callable[[grpc.aio.Server, CallInterceptor], None] = lambda server, interceptor: None
    agent_services: Iterable[str] = ()
    agent_streams: dict[str, int] = field(default_factory=dict)  # per method, the most open at once
    audit: AuditLog | None = None  # where state-changing calls are recorded (None: not at all)
    metrics_port: int = 0  # Prometheus metrics served on start (0: not at all); needs `settings`
    settings: Settings | None = None
    rate_limit: RateLimiter | None = None  # per-tenant token buckets (RateLimiter.of(settings)); None: no limits
    call_gate: CallGate | None = None  # orders unary calls by lane (the store's gate.CallGate); None: no order


class Server:
    """A started gRPC server with health and reflection; `port` is the bound port (useful with :0)."""

    def __init__(self, spec: ServerSpec):
        budget = StreamBudget(spec.max_streams, spec.streams_per_tenant, spec.reserved_streams)
        if budget.total >= spec.max_workers:
            raise ValueError("max_streams + reserved_streams must leave workers for unary calls (< max_workers)")
        self.spec = spec
        self.health = health.HealthServicer(experimental_non_blocking=True)
        auth_failures = AuthFailures.of(spec.settings)
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=spec.max_workers, thread_name_prefix=spec.name),
            interceptors=[DecodeInterceptor(),
                          CallInterceptor(spec.authenticate, budget, spec.audit, spec.name, spec.rate_limit,
                                          spec.call_gate, auth_failures)],
            options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=spec.max_workers * 4,
        )
        spec.register(self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.services = list(spec.services)
        reflection.enable_server_reflection(
            [*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME], self._grpc
        )
        self.port = bind(self._grpc, spec.name, spec.address, spec.credentials)
        self.agent: AioPort | None = None
        if spec.agent_address:
            checks = CallInterceptor(spec.authenticate, StreamBudget(0, 0, spec.agent_streams), spec.audit, spec.name,
                                     spec.rate_limit, None, auth_failures)
            self.agent = AioPort(f"{spec.name} (agent port)", spec.agent_address, spec.agent_credentials,
                                 lambda server: spec.agent_register(server, checks), spec.agent_services,
                                 options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)])
        self.agent_port = self.agent.port if self.agent else 0
        self._stopped = threading.Event()

    def start(self, serving: bool = True) -> Server:
        if self.spec.metrics_port and self.spec.settings is not None:
            self.spec.on_stop.append(serve_metrics(self.spec.settings, self.spec.metrics_port, self.spec.name))
        self._grpc.start()
        if self.agent is not None:
            self.agent.start(serving=False)
        if serving:
            self.set_serving(True)
        log.info("listening", extra={"server": self.spec.name, "port": self.port})
        return self

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.services]:
            self.health.set(name, status)
        if self.agent is not None:
            self.agent.set_serving(serving)

    def stop(self, grace_s: float | None = None) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.set_serving(False)
        for hook in self.spec.on_stop:
            try:
                hook()
            except Exception:  # noqa: BLE001 - shutdown must go on
                log.exception("stop hook failed")
        grace_s = self.spec.grace_s if grace_s is None else grace_s
        stopped = self._grpc.stop(grace_s)
        if self.agent is not None:
            self.agent.stop(grace_s)
        stopped.wait()
        if self.spec.audit is not None:
            self.spec.audit.close()  # the calls that just finished are recorded too
        log.info("stopped", extra={"server": self.spec.name})

    def wait(self) -> None:
        """Block until SIGTERM/SIGINT (then stop gracefully) or until stop() is called elsewhere."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: threading.Thread(target=self.stop, daemon=True).start())
        self._stopped.wait()
        self._grpc.wait_for_termination()
