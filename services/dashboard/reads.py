"""What each page shows, read over gRPC as the visitor and turned into plain rows.

`Backend` holds one channel per service whose token is the current visitor's (`acting_as`), so the store
and planner decide what that tenant may see; nothing here filters by tenant itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from ballast.v1 import common_pb2, job_pb2, plan_pb2, services_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.remote import domain_error
from services.runtime.store_api import Store, every_page

LIST_LIMIT = 500  # rows a list page shows (newest first)
METRICS_LIMIT = 50_000  # iteration metric rows a job page reads (iterations x ranks)

_caller: contextvars.ContextVar[str] = contextvars.ContextVar("dashboard_caller", default="")


def caller_token() -> str:
    """The bearer token of the visit being served ("" outside one); the channels send it."""
    return _caller.get()


@contextlib.contextmanager
def acting_as(token: str) -> Iterator[None]:
    """Every read inside runs as `token`."""
    reset = _caller.set(token)
    try:
        yield
    finally:
        _caller.reset(reset)


@dataclass
class Backend:
    """The typed store interface, the planner's FleetService and a token check, all as the visitor."""

    store: Store
    fleet: Any  # services_pb2_grpc.FleetServiceStub on a channel that sends caller_token()
    authenticate: Callable[[str], Principal]

    def fleet_call(self, name: str, request: Any) -> Any:
        """A FleetService RPC; a gRPC failure becomes the matching domain error."""
        try:
            return getattr(self.fleet, name)(request)
        except grpc.RpcError as exc:
            raise domain_error(exc) from None


def when(ts: Any) -> str:
    """A protobuf Timestamp as 'YYYY-MM-DD HH:MM:SS' UTC ('' when unset)."""
    if not ts or not ts.seconds:
        return ""
    return datetime.datetime.fromtimestamp(ts.seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def iso(ts: Any) -> str:
    """A protobuf Timestamp as ISO 8601 with milliseconds, for chart axes ('' when unset)."""
    if not ts or not (ts.seconds or ts.nanos):
        return ""
    moment = datetime.datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]


def state_name(state: int) -> str:
    return job_pb2.JobState.Name(state).removeprefix("JOB_STATE_") if state else ""


def _first(list_method: Callable[[Any], Any], request: Any, field: str, limit: int) -> list[Any]:
    rows: list[Any] = []
    for reply in every_page(list_method, request):
        rows.extend(getattr(reply, field))
        if len(rows) >= limit:
            return rows[:limit]
    return rows


def _page(size: int = 200) -> common_pb2.PageRequest:
    return common_pb2.PageRequest(page_size=size)


def tenant_names(backend: Backend, principal: Principal) -> dict[str, str]:
    """Tenant id -> name as far as the visitor may know: every tenant for the admin and viewers, its own for
    a member (listing tenants is theirs alone)."""
    if not principal.reads_all:
        return {principal.tenant_id: principal.tenant_name}
    tenants = _first(backend.store.list_tenants, store_pb2.ListTenantsRequest(page=_page()), "tenants", 10_000)
    return {t.id: t.name for t in tenants}


def jobs(backend: Backend) -> list[dict[str, Any]]:
    """Every job the visitor may see, newest first."""
    found = _first(backend.store.list_jobs, store_pb2.ListJobsRequest(page=_page()), "jobs", LIST_LIMIT)
    found.sort(key=lambda j: (j.created_at.seconds, j.created_at.nanos), reverse=True)
    return [{"id": j.id, "name": j.spec.name, "tenant_id": j.tenant_id, "state": state_name(j.state),
             "iteration": j.iteration, "iterations": j.spec.iterations, "plan_id": j.plan_id,
             "plan_version": j.plan_version, "created": when(j.created_at), "updated": when(j.updated_at),
             "message": j.message} for j in found]


@dataclass
class JobView:
    """One job and its history, as plain rows."""

    job: dict[str, Any]
    events: list[dict[str, Any]]
    metrics: list[job_pb2.IterationMetric]
    migrations: list[dict[str, Any]]
    morphs: list[dict[str, Any]]
    evaluations: list[job_pb2.Evaluation]


def job(backend: Backend, job_id: str) -> JobView:
    """A job, its events, metrics, evaluations, layer migrations and morphs (NotFound when the visitor may not see
    it)."""
    store = backend.store
    j = store.get_job(store_pb2.GetRequest(id=job_id))
    events = _first(store.list_job_events, store_pb2.ListJobEventsRequest(job_id=job_id, page=_page(1000)),
                    "events", 10_000)
    metrics = _first(store.list_iteration_metrics,
                     store_pb2.ListIterationMetricsRequest(job_id=job_id, page=_page(1000)), "metrics",
                     METRICS_LIMIT)
    migrations = _first(store.list_layer_migrations,
                        store_pb2.ListLayerMigrationsRequest(job_id=job_id, page=_page(1000)), "migrations", 10_000)
    morphs = _first(store.list_morphs, store_pb2.ListMorphsRequest(job_id=job_id, page=_page()), "morphs", 1000)
    evaluations = _first(store.list_evaluations, store_pb2.ListEvaluationsRequest(job_id=job_id, page=_page(1000)),
                         "evaluations", 10_000)
    return JobView(
        job={"id": j.id, "name": j.spec.name, "tenant_id": j.tenant_id, "state": state_name(j.state),
             "iteration": j.iteration, "iterations": j.spec.iterations, "plan_id": j.plan_id,
             "plan_version": j.plan_version, "message": j.message, "created": when(j.created_at),
             "updated": when(j.updated_at), "batch": j.spec.global_batch_size, "online": j.spec.online_repartition,
             "priority_class": j.spec.priority_class},
        events=[{"seq": e.seq, "type": e.type, "state": state_name(e.state), "message": e.message,
                 "at": when(e.created_at), "iso": iso(e.created_at)} for e in events],
        metrics=metrics,
        migrations=[{"layer": m.layer_index, "from_stage": m.from_stage, "to_stage": m.to_stage, "bytes": m.bytes,
                     "duration_s": m.duration_s, "iteration": m.iteration, "plan_version": m.plan_version,
                     "at": when(m.created_at), "iso": iso(m.created_at)} for m in migrations],
        morphs=[{"cause": m.cause, "detail": m.detail, "from": f"{m.from_stages}x{m.from_replicas}",
                 "to": f"{m.to_stages}x{m.to_replicas}", "failed_iteration": m.failed_iteration,
                 "lost_iterations": m.lost_iterations, "recovery_s": m.recovery_s, "at": when(m.detected_at),
                 "iso": iso(m.detected_at)} for m in morphs],
        evaluations=evaluations,
    )


def fleet(backend: Backend) -> dict[str, Any]:
    """Every device, who leases it since when, its use over the last hour; the policy in one line."""
    reply = backend.fleet_call("GetFleet", services_pb2.GetFleetRequest())
    devices = [{"host": d.host_name or d.device.host_id, "index": d.device.device_index, "kind": d.device_kind,
                "online": d.online, "job_id": d.lease.job_id, "tenant_id": d.lease.tenant_id,
                "since": when(d.lease.started_at) if d.lease.job_id else "",
                "utilisation": d.utilisation_last_hour} for d in reply.devices]
    policy = reply.policy
    classes = ", ".join(f"{c.name} {c.priority}" for c in policy.priority_classes)
    line = f"version {policy.version}: classes {classes or 'default'}" if policy.version else "no policy stored"
    return {"devices": devices, "policy": line}


def queue(backend: Backend) -> list[dict[str, Any]]:
    """The queue in admission order (another tenant's rows carry no job id: the planner blanks them)."""
    reply = backend.fleet_call("ListQueue", services_pb2.ListQueueRequest())
    return [{"position": e.position, "job_id": e.job_id, "tenant": e.tenant or e.tenant_id,
             "priority_class": e.priority_class, "devices": e.devices, "device_kind": e.device_kind,
             "reason": services_pb2.WaitReason.Name(e.reason).removeprefix("WAIT_REASON_").lower().replace("_", " "),
             "detail": e.detail, "predicted_start_s": e.predicted_start_s, "submitted": when(e.submitted_at),
             "preemptions": e.preemptions} for e in reply.entries]


def engine_name(engine: int) -> str:
    return plan_pb2.PlanEngine.Name(engine).removeprefix("PLAN_ENGINE_").lower() if engine else ""


def schedule_name(schedule: int) -> str:
    return plan_pb2.Schedule.Name(schedule).removeprefix("SCHEDULE_").lower() if schedule else ""


def plans(backend: Backend) -> list[dict[str, Any]]:
    found = _first(backend.store.list_plans, store_pb2.ListPlansRequest(page=_page()), "plans", LIST_LIMIT)
    found.sort(key=lambda p: (p.created_at.seconds, p.created_at.nanos), reverse=True)
    return [{"id": p.id, "job_id": p.job_id, "version": p.version, "engine": engine_name(p.engine),
             "fleet": p.fleet.name, "stages": len(p.stages), "batch": p.global_batch_size,
             "micro_batches": p.num_micro_batches, "iteration_s": p.prediction.iteration_time_s,
             "throughput": p.prediction.throughput_samples_per_s, "created": when(p.created_at)} for p in found]


def plan(backend: Backend, plan_id: str) -> plan_pb2.Plan:
    return backend.store.get_plan(store_pb2.GetRequest(id=plan_id))


def profiles(backend: Backend) -> list[dict[str, Any]]:
    found = _first(backend.store.list_profiles, store_pb2.ListProfilesRequest(page=_page()), "profiles", LIST_LIMIT)
    found.sort(key=lambda p: (p.created_at.seconds, p.created_at.nanos), reverse=True)
    return [{"id": p.id, "model_id": p.model_id, "device": p.device.kind, "layers": len(p.layers),
             "projected": p.projected, "micro_batches": list(p.measured_micro_batch_sizes),
             "profiling_s": p.profiling_time_s, "created": when(p.created_at)} for p in found]


def profile(backend: Backend, profile_id: str) -> Any:
    return backend.store.get_profile(store_pb2.GetRequest(id=profile_id))
