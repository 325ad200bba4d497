"""The profiler service. Its measurements arrive with the profiler issue; the contract is served now."""

from __future__ import annotations

from ballast.config import Settings
from ballast.v1 import services_pb2, services_pb2_grpc
from services.runtime.remote import StoreAuthenticator, anonymous_store
from services.runtime.server import Server, ServerSpec
from services.runtime.servicer import delegate

PROFILER = services_pb2.DESCRIPTOR.services_by_name["ProfilerService"]
LATER = "per-layer profiling, link calibration and device projection arrive with the profiler issue (roadmap row 2)"


def build_server(settings: Settings, address: str | None = None) -> Server:
    servicer = delegate(PROFILER, None, missing={m.name: LATER for m in PROFILER.methods})()
    return Server(
        ServerSpec(
            name="profiler",
            address=address or f"{settings.host}:{settings.profiler_port}",
            register=lambda s: services_pb2_grpc.add_ProfilerServiceServicer_to_server(servicer, s),
            services=[PROFILER.full_name],
            authenticate=StoreAuthenticator(anonymous_store(settings)),
        )
    )


def main(settings: Settings) -> int:
    server = build_server(settings).start()
    server.wait()
    return 0
