"""The planner service: PlannerService, JobService, FleetService and ExecutorControl on one server, plus the
sweeper."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ballast.client import open_channel
from ballast.config import Settings
from ballast.transport import client_transport, peer_common_name, server_credentials
from ballast.v1 import executor_pb2, executor_pb2_grpc, services_pb2, services_pb2_grpc
from services.planner.celery_app import make_app, sender
from services.planner.jobs import export, fleet_view
from services.planner.jobs import lifecycle as jobs
from services.planner.jobs.arrival import Arrival, submit_as
from services.planner.jobs.calibrate_job import KIND as CALIBRATE
from services.planner.jobs.control import AgentRegistry, refuse_off_the_agent_port
from services.planner.jobs.gauges import FleetGauges
from services.planner.jobs.inputs_check import InputsCheck
from services.planner.jobs.prepare import KIND as PREPARE
from services.planner.jobs.scheduler import Scheduler
from services.planner.plans import operations as plans
from services.planner.policy_file import apply_policy_file
from services.planner.queue import durable
from services.planner.queue.publisher import Publisher
from services.runtime.aio_port import stream_method
from services.runtime.audit import audit_to
from services.runtime.context import current_principal, remaining_time
from services.runtime.metrics_http import register_collector
from services.runtime.ratelimit import RateLimiter
from services.runtime.server import Server, ServerSpec
from services.runtime.servicer import delegate
from services.runtime.store_client import StoreAuthenticator, anonymous_store, remote_stores
from services.specs.ranges import check_bounds
from services.specs.user_inputs import UserInputs

PLANNER = services_pb2.DESCRIPTOR.services_by_name["PlannerService"]
JOBS = services_pb2.DESCRIPTOR.services_by_name["JobService"]
CONTROL = executor_pb2.DESCRIPTOR.services_by_name["ExecutorControl"]
FLEET = services_pb2.DESCRIPTOR.services_by_name["FleetService"]


class AgentControl(executor_pb2_grpc.ExecutorControlServicer):
    def __init__(self, connect):
        self.Connect = connect


@dataclass(frozen=True)
class PlannerServer:
    """The built (not yet started) server and the planner parts tests and tools reach into."""

    server: Server
    scheduler: Scheduler
    registry: AgentRegistry
    sweeper: durable.Sweeper


def build_server(settings: Settings, address: str | None = None, send: durable.Send | None = None,
                 agent_address: str | None = None) -> PlannerServer:
    """Build the server; the scheduler and the lease sweeper start now, the server on `.server.start()`.
    Agents connect on the second, mutual-TLS port (`agent_address`, default the planner_agent_port)."""
    as_caller, as_platform = remote_stores(settings)
    apply_policy_file(as_platform, settings.fleet_policy)  # --policy / BALLAST_FLEET_POLICY; a bad file stops here
    owned = send is None  # a publisher of its own, stopped (flushed) with the server
    send = send or sender(make_app(settings), settings.queue)
    def replan(job, devices: int, engine: int = 0) -> None:  # one request per plan version: never deduped
        durable.submit(as_platform, PREPARE, {"job_id": job.id, "devices": devices, "after": job.plan_version,
                                              "engine": engine}, send)

    def calibrate(job_id: str, runs: Sequence[str] = ()):  # one request per succeeded job (deduped): its run
        # recalibrates its host class; `runs`: fit on exactly these jobs' runs (a calibration on arrival)
        return durable.submit(as_platform, CALIBRATE, {"job_id": job_id, **({"runs": list(runs)} if runs else {})},
                              send)

    arrival = (Arrival(as_platform, submit_as(as_platform, send), calibrate, settings.calibration_min_iterations)
               if settings.calibrate_on_arrival and settings.calibration_min_iterations else None)

    scheduler = Scheduler(as_platform, lambda host_id, message: registry.send(host_id, message),
                          lambda: registry.connected(), settings.data_dir / "checkpoints", replan=replan,
                          host_lost_s=settings.host_lost_s, max_morphs_per_hour=settings.max_morphs_per_hour,
                          checkpoint_max_interval_s=settings.checkpoint_max_interval_s,
                          degraded_parole_s=settings.degraded_parole_s, calibrate=calibrate,
                          straggler_thresholds=(settings.straggler_threshold,
                                                settings.straggler_shared_cpu_threshold),
                          elastic_interval_s=settings.elastic_interval_s,
                          elastic_min_resize_interval_s=settings.elastic_min_resize_interval_s,
                          elastic_fairness_bound=settings.elastic_fairness_bound, arrival=arrival,
                          metrics_window_s=settings.metrics_window_s)
    registry = AgentRegistry(as_platform, settings.agent_heartbeat_s, listener=scheduler.on_message)
    sweeper = durable.Sweeper(as_platform, send, settings.sweep_interval_s, settings.requeue_unclaimed_s)

    what_if = plans.WhatIf()
    user_inputs = UserInputs.of_settings(settings)
    check_inputs = InputsCheck(lambda: services_pb2_grpc.ProfilerServiceStub(open_channel(
        settings.address("profiler"), settings.resolved_token(), transport=client_transport(settings))))
    # what Submit checks a job's fleet against: every tenant reads the hosts, and a caller waits on this read,
    # so it goes as the caller's call, not as the platform's background work (services/store/gate.py)
    hosts = jobs.HostsView(as_caller)

    def echo(request: services_pb2.EchoRequest, ctx):
        check_bounds(request)  # its text is stored twice (payload and result): at most 4 KiB
        return durable.submit(as_caller, "diagnostic.echo", {"text": request.text}, send)

    planner = delegate(
        PLANNER,
        None,
        overrides={
            "Plan": lambda request, ctx: plans.submit(as_caller, request, send),
            "GetPlanOperation": lambda request, ctx: plans.get_operation(as_caller, request),
            "GetPlan": lambda request, ctx: as_caller.get_plan(request),
            "WhatIf": lambda request, ctx: what_if(as_caller, request, remaining_time),
            "Compare": lambda request, ctx: plans.compare(as_caller, request),
            "Echo": echo,
            "GetQueuedRequest": lambda request, ctx: as_caller.get_queued_request(request),
        },
    )()
    job_service = delegate(
        JOBS,
        None,
        overrides={
            "Submit": lambda request, ctx: jobs.submit(as_caller, request, send, hosts, check_inputs),
            "Get": lambda request, ctx: as_caller.get_job(request),
            "List": lambda request, ctx: as_caller.list_jobs(request),
            "Watch": lambda request, ctx: jobs.watch(as_caller, request.job_id, request.after_seq, ctx.is_active),
            "Cancel": lambda request, ctx: jobs.cancel(as_caller, request),
            "Export": lambda request, ctx: export.export(as_caller, as_platform, request,
                                                         settings.data_dir / "checkpoints", user_inputs),
        },
    )()
    control = delegate(CONTROL, None, overrides={
        "Connect": lambda inbound, ctx: refuse_off_the_agent_port(settings.plaintext)})()

    def serve_agents(server, checks) -> None:
        """ExecutorControl on the agent port's event loop: a coroutine per connected host, not a thread."""
        connect = stream_method(checks, f"/{CONTROL.full_name}/Connect", lambda principal, inbound, ctx: (
            registry.connect(principal, inbound, None if settings.plaintext else peer_common_name(ctx))))
        executor_pb2_grpc.add_ExecutorControlServicer_to_server(AgentControl(connect), server)

    fleet_service = delegate(
        FLEET,
        None,
        overrides={
            "ListQueue": lambda request, ctx: fleet_view.list_queue(scheduler.snapshot(), current_principal(),
                                                                     scheduler.gate),
            "GetFleet": lambda request, ctx: fleet_view.get_fleet(scheduler.snapshot(), as_platform,
                                                                   current_principal()),
            "ListLeases": lambda request, ctx: as_caller.list_leases(request),
            "GetPolicy": lambda request, ctx: as_caller.get_fleet_policy(request),
            "SetPolicy": lambda request, ctx: as_caller.set_fleet_policy(request),
        },
    )()

    def register(server) -> None:
        services_pb2_grpc.add_PlannerServiceServicer_to_server(planner, server)
        services_pb2_grpc.add_JobServiceServicer_to_server(job_service, server)
        services_pb2_grpc.add_FleetServiceServicer_to_server(fleet_service, server)
        executor_pb2_grpc.add_ExecutorControlServicer_to_server(control, server)  # only to say where agents go

    server = Server(
        ServerSpec(
            name="planner",
            address=address or f"{settings.host}:{settings.planner_port}",
            register=register,
            services=[PLANNER.full_name, JOBS.full_name, FLEET.full_name],
            authenticate=StoreAuthenticator(anonymous_store(settings)),
            on_stop=[sweeper.stop, scheduler.stop, registry.close_all, what_if.close,
                     *([send.stop] if owned and isinstance(send, Publisher) else [])],
            max_workers=64,
            max_streams=32,  # Watch streams; agents' Connect streams live on the agent port
            streams_per_tenant=8,
            credentials=server_credentials(settings),
            agent_address=agent_address or f"{settings.host}:{settings.planner_agent_port}",
            agent_credentials=server_credentials(settings, require_client_auth=True),
            agent_register=serve_agents,
            agent_services=[CONTROL.full_name],
            agent_streams={f"/{CONTROL.full_name}/Connect": settings.planner_agent_streams},
            audit=audit_to(as_platform, "planner"),
            metrics_port=settings.planner_metrics_port,
            settings=settings,
            rate_limit=RateLimiter.of(settings),
        )
    )
    if settings.planner_metrics_port:  # the fleet gauges join this process's registry only while served
        gauges = FleetGauges(lambda: scheduler.latest, name_tenants=not settings.plaintext)
        server.spec.on_stop.append(register_collector("planner", gauges))
    sweeper.start()
    scheduler.start()
    return PlannerServer(server, scheduler, registry, sweeper)


def main(settings: Settings) -> int:
    server = build_server(settings).server.start()
    server.wait()
    return 0
