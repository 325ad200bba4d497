"""gRPC health checks, used by `ballast status`, `ballast up` and container health checks."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ballast.transport import PLAINTEXT, ClientTransport


def check(address: str, service: str = "", timeout: float = 2.0, transport: ClientTransport = PLAINTEXT) -> str:
    """The serving status name ("SERVING", "NOT_SERVING", …) or "UNREACHABLE: <why>" (a plaintext check of a
    TLS port is unreachable: pass `client_transport(settings)`)."""
    credentials = transport.credentials()
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            return f"UNREACHABLE: {exc.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
