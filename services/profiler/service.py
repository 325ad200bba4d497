"""The profiler service: maps ProfilerService RPCs onto services.profiler.runner."""

from __future__ import annotations

from ballast.config import Settings
from ballast.transport import server_credentials
from ballast.v1 import services_pb2, services_pb2_grpc
from services.profiler.runner import Runner, list_device_kinds
from services.runtime.audit import audit_to
from services.runtime.context import current_principal
from services.runtime.ratelimit import RateLimiter
from services.runtime.server import Server, ServerSpec
from services.runtime.servicer import delegate
from services.runtime.store_client import StoreAuthenticator, anonymous_store, remote_stores
from services.specs.user_inputs import UserInputs

PROFILER = services_pb2.DESCRIPTOR.services_by_name["ProfilerService"]


def build_server(settings: Settings, address: str | None = None) -> Server:
    as_caller, as_platform = remote_stores(settings)
    runner = Runner(as_caller, UserInputs.of_settings(settings))
    servicer = delegate(
        PROFILER,
        None,
        overrides={
            "Profile": lambda request, ctx: runner.profile(request),
            "ProfileStream": lambda request, ctx: runner.stream(request, ctx.is_active),
            "GetProfile": lambda request, ctx: runner.get_profile(request),
            "ProjectProfile": lambda request, ctx: runner.project(request),
            "ListDeviceKinds": lambda request, ctx: list_device_kinds(),
            "Calibrate": lambda request, ctx: runner.calibrate(request, current_principal()),
            "Inspect": lambda request, ctx: runner.inspect(request),
        },
    )()
    return Server(
        ServerSpec(
            name="profiler",
            address=address or f"{settings.host}:{settings.profiler_port}",
            register=lambda s: services_pb2_grpc.add_ProfilerServiceServicer_to_server(servicer, s),
            services=[PROFILER.full_name],
            authenticate=StoreAuthenticator(anonymous_store(settings)),
            credentials=server_credentials(settings),
            audit=audit_to(as_platform, "profiler"),
            metrics_port=settings.profiler_metrics_port,
            settings=settings,
            rate_limit=RateLimiter.of(settings),
        )
    )


def main(settings: Settings) -> int:
    server = build_server(settings).start()
    server.wait()
    return 0
