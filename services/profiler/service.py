"""The profiler service: a thin servicer over services.profiler.runner."""

from __future__ import annotations

from ballast.config import Settings
from ballast.v1 import services_pb2, services_pb2_grpc, store_pb2
from services.profiler.runner import Runner, list_device_kinds
from services.runtime.remote import StoreAuthenticator, anonymous_store, call, store_stubs
from services.runtime.server import Server, ServerSpec
from services.runtime.servicer import delegate

PROFILER = services_pb2.DESCRIPTOR.services_by_name["ProfilerService"]


def calibrate(runner: Runner, request: services_pb2.CalibrateRequest):
    """Link calibration on this host (spawns its own process group; torch is imported only here)."""
    from services.profiler import calibrate as cal

    kwargs = {"group_sizes": tuple(request.group_sizes) or (2,), "backend": request.backend or None}
    if request.sizes_bytes:
        kwargs["sizes_bytes"] = tuple(request.sizes_bytes)
    with runner.turn():
        try:
            return cal.to_proto(cal.calibrate(**kwargs))
        except ValueError as exc:
            from services.runtime.errors import InvalidArgument

            raise InvalidArgument(str(exc), field="group_sizes") from None


def build_server(settings: Settings, address: str | None = None) -> Server:
    as_caller, _ = store_stubs(settings)
    runner = Runner(as_caller, settings.allowed_model_factories)
    servicer = delegate(
        PROFILER,
        None,
        overrides={
            "Profile": lambda request, ctx: runner.profile(request),
            "ProfileStream": lambda request, ctx: runner.stream(request, ctx.is_active),
            "GetProfile": lambda request, ctx: call(as_caller.GetProfile, store_pb2.GetRequest(id=request.id)),
            "ProjectProfile": lambda request, ctx: runner.project(request),
            "ListDeviceKinds": lambda request, ctx: list_device_kinds(),
            "Calibrate": lambda request, ctx: calibrate(runner, request),
        },
    )()
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
