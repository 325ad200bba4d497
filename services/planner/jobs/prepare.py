"""Preparing a submitted job on a planner worker: profile it, search its plan, hand it to scheduling.

Submit queues one "jobs.prepare" request per job; a Celery worker runs `prepare_job`, which moves the
job SUBMITTED -> PROFILING -> PLANNING -> SCHEDULED with an event at each step (the proto's SCHEDULED is
"plan chosen; stages being assigned"), or to FAILED with the reason and the step it failed in.

Every step is idempotent, so a re-run after a lost worker resumes where the job stands: the profiler
answers a repeated request from its cache, the plan is stored under the queued request's id, and every
state change is a compare-and-set on the state the worker last saw, so a cancel landing between two
steps wins and the worker finishes it (CANCELLING -> CANCELLED) instead of carrying on.

A payload with "devices" re-plans a QUEUED job (moved to PLANNING by the scheduler) for that many devices:
the ones free now, within the range the job allows (--min-devices/--max-devices, or any count up to its plan's
while it morphs after a loss; then "engine" is Varuna's, unless the job chose one); its new plan is the job's
next plan version, the one it was submitted with stays stored beside it.

Profiles: a fleet of this host's device kind (the local CPU executors) is measured by the profiler;
any other catalog device gets an analytical profile, since nothing here can measure it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ballast.v1 import fleet_pb2, job_pb2, plan_pb2, services_pb2, store_pb2
from services.planner.cost.fleet_cut import cut_shape
from services.planner.plans.calibrate import from_proto, host_class
from services.planner.plans.fleet import executor_dims, online_hosts
from services.planner.plans.make import PlanInputs, search_dims
from services.planner.plans.memo import PLANS
from services.planner.plans.operations import check_profile
from services.planner.queue import durable
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.runtime.remote import call
from services.runtime.store_api import Store
from services.specs.fleet import FleetFileError, fleet_from_dict

KIND = "jobs.prepare"


@dataclass
class CalibrationUse:
    """Set by the worker's app from its settings (BALLAST_CALIBRATION_MIN_ITERATIONS); 0 plans uncalibrated."""

    min_iterations: int = 20


CALIBRATION = CalibrationUse()
MEASURED_KINDS = ("cpu",)  # device kinds the profiler measures on (services/profiler/runner.local_device)
MAX_SWEEP = 64  # largest micro-batch profiled for a job, besides its global batch
GiB = float(1 << 30)

S = job_pb2.JobState


class Stopped(Exception):
    """The job left the state this worker expected (a cancel, or another worker got further)."""

    def __init__(self, job: job_pb2.Job):
        super().__init__(S.Name(job.state))
        self.job = job


def fleet_of_hosts(hosts: list[fleet_pb2.Host], dtype: int = 0) -> fleet_pb2.Fleet:
    """The fleet the online executors form: one node per machine (hosts sharing an address are one machine
    standing in for several, as in tests and the local demo), its smallest device count and memory.

    Devices of one machine share its memory link and cores, so the cost model prices their groups with the
    profile's loopback calibration and co-location slowdown; distinct machines are assumed on 10 Gb Ethernet.
    """
    fix = "start executors (`ballast up --executors 2`) or set spec.fleet to plan for a fleet not at hand"
    devices = [d for h in hosts for d in h.devices]
    if not hosts or not devices:
        raise FailedPrecondition("no executor host with devices is online", field="spec.fleet", fix=fix)
    kinds = sorted({d.spec.kind for d in devices})
    if len(kinds) != 1:
        raise FailedPrecondition(f"the online hosts mix device kinds {kinds}", field="spec.fleet",
                                 fix="set spec.fleet to the device kind to plan for")
    machines: dict[str, int] = {}
    for h in hosts:
        machines[h.address] = machines.get(h.address, 0) + len(h.devices)
    per_node = min(machines.values())
    memory = min(d.spec.memory_bytes for d in devices)
    entry: dict[str, Any] = {"name": f"online-{len(machines)}x{per_node}-{kinds[0]}", "device": kinds[0],
                             "nodes": len(machines), "devices_per_node": per_node}
    if memory:
        entry["memory_gib"] = memory / GiB
    if kinds[0] in MEASURED_KINDS:
        entry["intra_node"] = "shm"
    if len(machines) > 1:
        entry["inter_node"] = "eth-10"
    try:
        return fleet_from_dict(entry, dtype=dtype or None)
    except FleetFileError as err:
        raise FailedPrecondition(f"cannot plan for the online hosts: {err}", field="spec.fleet",
                                 fix="set spec.fleet to a catalog device") from None


def shrink(fleet: fleet_pb2.Fleet, devices: int, online: bool = False) -> fleet_pb2.Fleet:
    """The fleet cut to `devices` (a re-plan for the devices free now, --min-devices/--max-devices): one node
    when they fit in one, else nodes of as many devices as the count shares with a node (cost.fleet_cut.cut_shape:
    12 of 8-device hosts are planned as 3 x 4, not as the 8 of one host); 0 leaves it as it is. A cut of the
    `online` fleet is named for what it holds, not for how many hosts are online: a plan for 16 devices is the
    same whether 1,024 hosts are up or 1,023, so a host lost or joining does not make every later job's search
    miss the planner's memo (plans/memo.py keys on the whole fleet)."""
    if not devices or devices >= fleet.nodes * fleet.devices_per_node:
        return fleet
    out = fleet_pb2.Fleet()
    out.CopyFrom(fleet)
    out.nodes, out.devices_per_node = cut_shape(devices, fleet.devices_per_node)
    out.name = (f"online-{out.nodes}x{out.devices_per_node}-{fleet.device.kind}" if online
                else f"{fleet.name}-{out.nodes * out.devices_per_node}")
    return out


def profile_request(job: job_pb2.Job, fleet: fleet_pb2.Fleet) -> services_pb2.ProfileRequest:
    """Measured on this host's kind, analytical for any other; the sweep stops at the global batch.

    Where several measured devices share a node, the profile also calibrates this host's links for a group of
    that size and measures the co-location slowdown, so a plan's allreduce and crowded compute are priced as
    measured rather than from the nominal shared-memory link."""
    kind = fleet.device.kind
    top = min(job.spec.global_batch_size or MAX_SWEEP, MAX_SWEEP)
    request = services_pb2.ProfileRequest(model_id=job.model_id, device_kind=kind, max_micro_batch_size=top,
                                          analytical=kind not in MEASURED_KINDS)
    if not request.analytical and fleet.devices_per_node > 1:
        request.options.calibrate = True
        request.options.calibrate_group_sizes.append(fleet.devices_per_node)
    return request


def plan_inputs(job: job_pb2.Job, dims: tuple[str, ...], devices: int = 0, engine: int = 0):
    """The search's inputs; a job kept balanced online (JobSpec.online_repartition) is planned without TP and SDP,
    whose plans the online planner (srp.py) does not price yet; a pipeline depth the job asked for is dropped when
    a re-plan has fewer devices, a pinned micro-batch count on any re-plan (the width changes, the global batch
    stays), and
    `engine` (a morph's re-plan: Varuna's P x D at the same global batch) stands in for an unset one."""
    spec = job.spec
    stages = spec.pipeline_stages if not devices or spec.pipeline_stages <= devices else 0
    dims, offload, harmony = search_dims(dims)
    if spec.online_repartition:  # the online planner prices pipeline x (ZeRO-)DP plans only, and nothing offloaded
        dims, offload, harmony = tuple(d for d in dims if d not in ("tp", "sdp")), False, False
    return PlanInputs(global_batch_size=spec.global_batch_size, memory_budget_bytes=spec.memory_budget_bytes,
                      engine=spec.engine or engine, schedule=spec.schedule, runnable_dims=dims, offload=offload,
                      harmony=harmony,
                      pipeline_stages=stages, micro_batches=0 if devices else spec.micro_batches,
                      # the executors allreduce (and ZeRO-2 reduce-scatters) after the stage's last backward
                      overlap_grad_sync=False, zero2_reduce_scatter_per_layer=False)


def with_calibration(store: Store, inputs: PlanInputs, fleet: fleet_pb2.Fleet, analytical: bool) -> PlanInputs:
    """The inputs with the latest calibration of the host class the plan will run on, fitted on at least
    CALIBRATION.min_iterations iterations; unchanged for an analytical profile (no run measured that kind)
    or when the class has none yet."""
    if analytical or not CALIBRATION.min_iterations:
        return inputs
    cls = host_class(fleet, online_hosts(store), fleet.nodes * fleet.devices_per_node)
    try:
        found = store.get_calibration(store_pb2.GetCalibrationRequest(
            host_class=cls.key, min_iterations=CALIBRATION.min_iterations))
    except NotFound:
        return inputs
    return replace(inputs, calibration=from_proto(found),
                   calibration_note=f"{found.id} (version {found.version} for {found.host_class}, fitted on "
                                    f"{found.iterations} iterations of {len(found.job_ids)} run(s); iteration "
                                    f"error {found.residual_before:.1%} -> {found.residual:.1%})")


def plan_summary(plan: plan_pb2.Plan) -> tuple[str, dict[str, str]]:
    p = plan.prediction
    replicas = max((s.devices for s in plan.stages), default=1)
    attributes = {
        "plan_id": plan.id, "engine": plan_pb2.PlanEngine.Name(plan.engine), "stages": str(len(plan.stages)),
        "micro_batch_size": str(plan.micro_batch_size), "num_micro_batches": str(plan.num_micro_batches),
        "predicted_iteration_time_s": f"{p.iteration_time_s:.6g}",
        "predicted_throughput_samples_per_s": f"{p.throughput_samples_per_s:.6g}",
    }
    message = (f"plan {plan.id}: {len(plan.stages)} stage(s) x up to {replicas} device(s), "
               f"{plan.num_micro_batches} micro-batch(es) of {plan.micro_batch_size}, predicted "
               f"{p.iteration_time_s:.4g} s/iteration ({p.throughput_samples_per_s:.4g} samples/s)")
    return message, attributes


class _Job:
    """The job as this worker last saw it; every move is a compare-and-set on that state."""

    def __init__(self, store: Store, job: job_pb2.Job):
        self.store, self.job = store, job

    def move(self, target: int, message: str, event_type: str = "STATE_CHANGED",
             attributes: dict[str, str] | None = None, plan_id: str = "") -> None:
        try:
            self.job = self.store.transition_job(store_pb2.TransitionJobRequest(
                id=self.job.id, state=target, expected_state=self.job.state, message=message,
                event_type=event_type, attributes=attributes or {}, plan_id=plan_id))
        except FailedPrecondition:
            now = self.store.get_job(store_pb2.GetRequest(id=self.job.id))
            if now.state == self.job.state:
                raise
            raise Stopped(now) from None

    def fail(self, step: str, exc: BaseException) -> None:
        text = f"{step} failed: {exc}"
        try:
            self.move(S.JOB_STATE_FAILED, text[:2000], event_type="FAILED",
                      attributes={"step": step, "error": type(exc).__name__})
        except Stopped as stopped:  # a cancel got there first: finish that instead
            _finish_cancel(self.store, stopped.job)


def _finish_cancel(store: Store, job: job_pb2.Job) -> dict[str, Any]:
    """Nothing runs a job before it is scheduled, so a cancel during preparation completes here."""
    if job.state == S.JOB_STATE_CANCELLING:
        try:
            job = store.transition_job(store_pb2.TransitionJobRequest(
                id=job.id, state=S.JOB_STATE_CANCELLED, expected_state=S.JOB_STATE_CANCELLING,
                message="cancelled before it was scheduled", event_type="CANCELLED"))
        except FailedPrecondition:
            job = store.get_job(store_pb2.GetRequest(id=job.id))
    return {"job_id": job.id, "state": S.Name(job.state)}


def _owned(store: Store, job_id: str, tenant_id: str) -> job_pb2.Job:
    """The worker acts for the platform: only the job's tenant (or an admin) may have queued this."""
    job = store.get_job(store_pb2.GetRequest(id=job_id))
    if job.tenant_id != tenant_id and not store.get_tenant(store_pb2.GetRequest(id=tenant_id)).admin:
        raise NotFound(f"job {job_id!r} not found", field="job_id")
    return job


def check_toggles(spec: job_pb2.JobSpec, num_layers: int) -> None:
    """A toggle names a layer of the model (whether it can be switched, the workers check at build)."""
    for i, toggle in enumerate(spec.layer_toggles):
        if toggle.layer_index >= num_layers:
            raise InvalidArgument(f"layer {toggle.layer_index} does not exist: the model has {num_layers} layers",
                                  field=f"spec.layer_toggles[{i}].layer_index",
                                  fix=f"use a layer index below {num_layers}")


def prepare_job(payload: dict[str, Any], task: durable.Task) -> dict[str, Any]:
    """Profile, plan and schedule one job; resumes from whatever state a previous attempt reached."""

    job = _Job(task.store, _owned(task.store, str(payload.get("job_id", "")), task.request.tenant_id))
    state = job.job.state
    if state == S.JOB_STATE_CANCELLING:
        return _finish_cancel(task.store, job.job)
    if state not in (S.JOB_STATE_SUBMITTED, S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING):
        return {"job_id": job.job.id, "state": S.Name(state), "plan_id": job.job.plan_id}
    if task.profiler is None:
        raise Unavailable("this worker has no profiler connection", fix="start workers with `ballast worker`")
    step = "fleet"
    try:
        spec = job.job.spec
        fleet = spec.fleet if spec.HasField("fleet") else fleet_of_hosts(online_hosts(task.store),
                                                                          spec.model.dtype)
        fleet = shrink(fleet, int(payload.get("devices") or 0) or spec.max_devices, online=not spec.HasField("fleet"))
        request = profile_request(job.job, fleet)
        how = "analytical" if request.analytical else "measured"
        step = "profiling"
        if job.job.state == S.JOB_STATE_SUBMITTED:
            job.move(S.JOB_STATE_PROFILING, f"profiling {spec.model.name or job.job.model_id} for "
                     f"{fleet.device.kind} ({how}) on fleet {fleet.name}",
                     attributes={"device_kind": fleet.device.kind, "profile": how, "fleet": fleet.name})
        profile = call(task.profiler.Profile, request)
        check_profile(profile, fleet)
        check_toggles(spec, len(profile.layers))
        step = "planning"
        if job.job.state == S.JOB_STATE_PROFILING:
            job.move(S.JOB_STATE_PLANNING, f"profile {profile.id} ({how}, {len(profile.layers)} layers); "
                     f"searching a plan for {fleet.nodes * fleet.devices_per_node} {fleet.device.kind} device(s)",
                     event_type="PROFILED", attributes={"profile_id": profile.id, "profile": how})
        inputs = plan_inputs(job.job, executor_dims(task.store), int(payload.get("devices") or 0),
                             int(payload.get("engine") or 0))
        plan = PLANS.plan(profile, fleet, with_calibration(task.store, inputs, fleet, request.analytical))
        plan.job_id, plan.version = job.job.id, 0  # 0: the store gives the job's next version (a re-plan's 2, 3..)
        if task.lease_lost.is_set():
            raise durable.LeaseLost()
        stored = task.store.create_plan(store_pb2.CreatePlanRequest(plan=plan, request_id=task.request.id))
        message, attributes = plan_summary(stored)
        job.move(S.JOB_STATE_SCHEDULED, message, event_type="PLAN_CHOSEN", attributes=attributes,
                 plan_id=stored.id)
        return {"job_id": job.job.id, "state": S.Name(job.job.state), "plan_id": stored.id}
    except Stopped as stopped:
        return _finish_cancel(task.store, stopped.job)
    except durable.LeaseLost:
        raise
    except durable.TRANSIENT as exc:
        if task.request.attempts >= task.request.max_attempts:
            job.fail(step, exc)
        raise
    except Exception as exc:
        job.fail(step, exc)
        raise
