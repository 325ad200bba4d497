"""Client SDK: authenticated channels with retries, and typed stubs for every Ballast service.

Calls that fail with UNAVAILABLE (a service restarting, the database down) are retried with
exponential backoff by gRPC's own retry policy. Services calling services pass
`deadline_source` so a downstream call never outlives the incoming call's deadline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from ballast import trace
from ballast.config import Settings
from ballast.transport import PLAINTEXT, ClientTransport, client_transport
from ballast.v1 import common_pb2, executor_pb2_grpc, job_pb2, services_pb2_grpc, store_pb2, store_pb2_grpc

TokenSource = str | Callable[[], str]
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 30.0

RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.5s",
                    "maxBackoff": "5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


class _CallInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer token and the current trace id, and caps the timeout by the propagated deadline."""

    def __init__(self, token: TokenSource, default_timeout: float | None, deadline_source: Callable[[], float | None]):
        self.token = token
        self.default_timeout = default_timeout
        self.deadline_source = deadline_source

    def _details(self, details: grpc.ClientCallDetails, streaming: bool) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or [])
        token = self.token() if callable(self.token) else self.token
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        if trace.current() and not any(key == trace.HEADER for key, _ in metadata):
            metadata.append((trace.HEADER, trace.current()))  # the call this one serves, in every service's log
        timeout = details.timeout
        if timeout is None and not streaming:
            timeout = self.default_timeout
        remaining = self.deadline_source()
        if remaining is not None:
            remaining = max(remaining, 0.001)  # an expired deadline must fail fast, never mean "no deadline"
            timeout = remaining if timeout is None else min(timeout, remaining)
        return _Details(details.method, timeout, metadata, details.credentials, details.wait_for_ready,
                        getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details, False), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details, True), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details, False), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details, True), request_iterator)


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: object
    wait_for_ready: bool | None
    compression: object


def open_channel(
    address: str,
    token: TokenSource = "",
    *,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    deadline_source: Callable[[], float | None] = lambda: None,
    transport: ClientTransport = PLAINTEXT,
) -> grpc.Channel:
    """A channel with auth, retries and limits: TLS when `transport` has a CA (`client_transport(settings)`),
    else plaintext, which a TLS server refuses."""
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", RETRY_SERVICE_CONFIG),
    ]
    credentials = transport.credentials()
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, credentials, options=options)
    return grpc.intercept_channel(channel, _CallInterceptor(token, timeout, deadline_source))


def pages(list_call: Callable[[Any], Any], request: Any) -> Iterator[Any]:
    """Every reply of a paged List call, in order (the request's page token is advanced in place)."""
    while True:
        reply = list_call(request)
        yield reply
        if not reply.next_page_token:
            return
        request.page.page_token = reply.next_page_token


class Client:
    """Stubs for the services at the given addresses (any may be omitted); `Client.of(settings)` for the
    configured ones with their transport security."""

    def __init__(self, *, store: str = "", planner: str = "", profiler: str = "", token: TokenSource = "",
                 deadline_source: Callable[[], float | None] = lambda: None, transport: ClientTransport = PLAINTEXT):
        self._channels: list[grpc.Channel] = []

        def channel(address: str) -> grpc.Channel | None:
            if not address:
                return None
            ch = open_channel(address, token, deadline_source=deadline_source, transport=transport)
            self._channels.append(ch)
            return ch

        store_ch, planner_ch, profiler_ch = channel(store), channel(planner), channel(profiler)
        self.store = store_pb2_grpc.StoreServiceStub(store_ch) if store_ch else None
        self.planner = services_pb2_grpc.PlannerServiceStub(planner_ch) if planner_ch else None
        self.jobs = services_pb2_grpc.JobServiceStub(planner_ch) if planner_ch else None
        self.fleet = services_pb2_grpc.FleetServiceStub(planner_ch) if planner_ch else None
        self.executor_control = executor_pb2_grpc.ExecutorControlStub(planner_ch) if planner_ch else None
        self.profiler = services_pb2_grpc.ProfilerServiceStub(profiler_ch) if profiler_ch else None

    @classmethod
    def of(cls, settings: Settings, services: tuple[str, ...] = ("store", "planner", "profiler"),
           token: TokenSource | None = None) -> Client:
        """A client of the configured `services`, TLS-verified with the configured CA (or plaintext)."""
        return cls(**{name: settings.address(name) for name in services},
                   token=settings.resolved_token() if token is None else token, transport=client_transport(settings))

    def iteration_metrics(self, job_id: str, **filters: int) -> list[job_pb2.IterationMetric]:
        """Every iteration metric of a job (all pages), by (iteration, stage, replica)."""
        request = store_pb2.ListIterationMetricsRequest(job_id=job_id, page=common_pb2.PageRequest(page_size=1000),
                                                        **filters)
        return [m for reply in pages(self.store.ListIterationMetrics, request) for m in reply.metrics]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
