"""The planner service: PlannerService, JobService and ExecutorControl on one server, plus the sweeper."""

from __future__ import annotations

from ballast.config import Settings
from ballast.v1 import executor_pb2, executor_pb2_grpc, services_pb2, services_pb2_grpc
from services.planner import jobs, plans, queue
from services.planner.celery_app import make_app, sender
from services.planner.control import AgentRegistry
from services.planner.scheduler import Scheduler
from services.runtime.context import current_principal, remaining_time
from services.runtime.remote import StoreAuthenticator, anonymous_store, call, store_stubs
from services.runtime.server import Server, ServerSpec
from services.runtime.servicer import delegate

PLANNER = services_pb2.DESCRIPTOR.services_by_name["PlannerService"]
JOBS = services_pb2.DESCRIPTOR.services_by_name["JobService"]
CONTROL = executor_pb2.DESCRIPTOR.services_by_name["ExecutorControl"]


def build_server(settings: Settings, address: str | None = None, send: queue.Send | None = None) -> Server:
    as_caller, as_platform = store_stubs(settings)
    send = send or sender(make_app(settings), settings.queue)
    scheduler = Scheduler(as_platform, lambda host_id, message: registry.send(host_id, message),
                          lambda: registry.connected(), settings.data_dir / "checkpoints")
    registry = AgentRegistry(as_platform, listener=scheduler.on_message)
    sweeper = queue.Sweeper(as_platform, send, settings.sweep_interval_s, settings.requeue_unclaimed_s)

    what_if = plans.WhatIf()

    def echo(request: services_pb2.EchoRequest, ctx):
        return queue.submit(as_caller, "diagnostic.echo", {"text": request.text}, send)

    planner = delegate(
        PLANNER,
        None,
        overrides={
            "Plan": lambda request, ctx: plans.submit(as_caller, request, send),
            "GetPlanOperation": lambda request, ctx: plans.get_operation(as_caller, request),
            "GetPlan": lambda request, ctx: call(as_caller.GetPlan, request),
            "WhatIf": lambda request, ctx: what_if(as_caller, request, remaining_time),
            "Compare": lambda request, ctx: plans.compare(as_caller, request),
            "Echo": echo,
            "GetQueuedRequest": lambda request, ctx: call(as_caller.GetQueuedRequest, request),
        },
    )()
    job_service = delegate(
        JOBS,
        None,
        overrides={
            "Submit": lambda request, ctx: jobs.submit(as_caller, request, send),
            "Get": lambda request, ctx: call(as_caller.GetJob, request),
            "List": lambda request, ctx: call(as_caller.ListJobs, request),
            "Watch": lambda request, ctx: jobs.watch(as_caller, request.job_id, request.after_seq, ctx.is_active),
            "Cancel": lambda request, ctx: jobs.cancel(as_caller, request),
        },
    )()
    control = delegate(
        CONTROL,
        None,
        overrides={"Connect": lambda inbound, ctx: registry.connect(current_principal(), inbound, ctx.is_active)},
    )()

    def register(server) -> None:
        services_pb2_grpc.add_PlannerServiceServicer_to_server(planner, server)
        services_pb2_grpc.add_JobServiceServicer_to_server(job_service, server)
        executor_pb2_grpc.add_ExecutorControlServicer_to_server(control, server)

    server = Server(
        ServerSpec(
            name="planner",
            address=address or f"{settings.host}:{settings.planner_port}",
            register=register,
            services=[PLANNER.full_name, JOBS.full_name, CONTROL.full_name],
            authenticate=StoreAuthenticator(anonymous_store(settings)),
            on_stop=[sweeper.stop, scheduler.stop, registry.close_all, what_if.close],
            # One Connect stream per executor host, never crowded out by Watch streams.
            max_workers=160,
            max_streams=32,
            streams_per_tenant=8,
            reserved_streams={f"/{CONTROL.full_name}/Connect": 96},
        )
    )
    server.registry = registry  # type: ignore[attr-defined]
    server.scheduler = scheduler  # type: ignore[attr-defined]
    sweeper.start()
    scheduler.start()
    return server


def main(settings: Settings) -> int:
    server = build_server(settings).start()
    server.wait()
    return 0
