"""The live elastic pass (issue 20): jobs submitted with `--elastic` are resized by morphing them, by the very
allocation policy the fleet simulator replays (services/planner/elastic/policy.py). No grpc imports.

A collaborator of Scheduler (scheduler.py): it reads the shared SchedulerState (state.py) and acts only by two
calls it is given, Recovery's drain_morph (a resize) and the scheduler's re-plan. Every `elastic_interval_s`,
per device kind, the policy sees the devices that elastic jobs hold plus the free ones (none while a job that
is not elastic waits for that kind: those devices are its), the running elastic jobs with their device counts,
and the queued ones, each with its scaling curve: the planner's prediction for every count in its range, under
the calibration of the host class that count runs on, cached until the profile, fleet or calibration changes.
A running job given another count drains to a checkpoint and resumes re-planned for it (a `resize` morph: the
MORPHING event and the job_morphs row say what it is predicted to gain); a queued job given another count than
its plan asks for is re-planned for it, so the devices a shrink frees are shared as the policy decided rather
than taken whole by the first job in the queue. Jobs not steady yet (a window of iterations since they
started) are left as they are.
"""

from __future__ import annotations

import logging
import math
import statistics

from ballast.v1 import fleet_pb2, job_pb2, plan_pb2, profile_pb2, store_pb2
from services.planner.admission import Demand
from services.planner.elastic import ELASTIC, CurveCache, ElasticPolicy, JobState, ScalingCurve, allocate, remaining_s
from services.planner.elastic.curves import fleet_of
from services.planner.jobs import morph
from services.planner.jobs.admit import Snapshot, epoch_s
from services.planner.jobs.lifecycle import TERMINAL
from services.planner.jobs.prepare import MEASURED_KINDS, fleet_of_hosts, plan_inputs, with_calibration
from services.planner.jobs.recovery import Drain
from services.planner.jobs.running import GROW_WINDOW, Running
from services.planner.jobs.state import Replan, SchedulerState
from services.planner.plans.fleet import executor_dims, online_hosts

log = logging.getLogger("ballast.scheduler")
S = job_pb2.JobState
ELASTIC_INTERVAL_S = 10.0  # how often the pass runs (a plan search per new curve point, cached)
MIN_RESIZE_INTERVAL_S = 600.0  # hysteresis: a job is resized at most once in this long
FAIRNESS_BOUND = 1.5  # predicted finish-time fairness past which a job is behind (policy.py; 0: no guard)
UNDER_WAY_S = 600.0  # a resize or re-plan not in effect after this long is no longer waited for


class ElasticPass:
    """The elastic pass of Scheduler (see the module docstring)."""

    def __init__(self, state: SchedulerState, drain: Drain, replan_for: Replan, *,
                 interval_s: float = ELASTIC_INTERVAL_S, min_resize_interval_s: float = MIN_RESIZE_INTERVAL_S,
                 fairness_bound: float = FAIRNESS_BOUND):
        self._state, self._drain, self._replan_for = state, drain, replan_for
        self._interval_s, self._min_resize_s = interval_s, min_resize_interval_s
        self._fairness_bound = fairness_bound
        self._next_at = 0.0
        self._resized_at: dict[str, float] = {}  # job id -> when the pass last resized it (epoch seconds)
        self._curves = CurveCache()
        self._profiles: dict[str, profile_pb2.Profile] = {}
        # job id -> (device kind, count given, when): decisions under way (a drain, a re-plan); the pass decides
        # again for a kind only once they all took effect, so freed devices are not handed out twice
        self._under_way: dict[str, tuple[str, int, float]] = {}

    def run(self, snap: Snapshot) -> None:
        """One pass, at most every interval: per device kind whose earlier decisions took effect, allocate."""
        if snap.now < self._next_at:
            return
        self._next_at = snap.now + self._interval_s
        with self._state.lock:
            running = [r for r in self._state.running.values() if r.job.spec.elastic]
        queued = [d for d in snap.queue if d.job_id in snap.plans and snap.jobs[d.job_id].spec.elastic]
        kinds = {r.plan.fleet.device.kind for r in running} | {d.kind for d in queued}
        for kind in sorted(kinds):
            if not self._settled(snap, kind, running):
                continue
            try:
                self._allocate_kind(snap, kind, [r for r in running if r.plan.fleet.device.kind == kind],
                                    [d for d in queued if d.kind == kind])
            except Exception:  # noqa: BLE001 - the store away, a plan that cannot be priced: the tick goes on
                log.exception("elastic pass failed", extra={"device_kind": kind})

    def _allocate_kind(self, snap: Snapshot, kind: str, running: list[Running], queued: list[Demand]) -> None:
        steady = [r for r in running if self._resizable(r)]
        others_wait = any(d.kind == kind and not snap.jobs[d.job_id].spec.elastic for d in snap.queue)
        free = 0 if others_wait else sum(1 for slot in snap.free if slot.kind == kind)
        pool = free + sum(r.world for r in steady)
        priority = {h.job_id: h.priority for h in snap.running} | {d.job_id: d.priority for d in queued}
        states, curves, plans = [], {}, {}
        # what every curve of this pass is priced on, read once: the executors' dims and this kind's hosts
        dims = executor_dims(self._state.store)
        hosts = [h for h in online_hosts(self._state.store) if any(d.spec.kind == kind for d in h.devices)]
        predicted = {r.job.id: self._curve(r.job, r.plan, pool, dims, hosts) for r in steady}
        # the predictions as the jobs measured them: each running job's curve scaled by its measured iteration
        # time against its prediction on the devices it holds; a queued job's by the median of those
        slow = {r.job.id: statistics.median(r.recent) / predicted[r.job.id].iteration_s_on(r.world) for r in steady
                if predicted[r.job.id] is not None and 0 < predicted[r.job.id].iteration_s_on(r.world) < math.inf}
        typical = statistics.median(slow.values()) if slow else 1.0
        for job, plan, current in [(r.job, r.plan, r) for r in steady] + [
                (snap.jobs[d.job_id], snap.plans[d.job_id], None) for d in queued]:
            curve = predicted[job.id] if current else self._curve(job, plan, pool, dims, hosts)
            if curve is None:
                continue
            factor = slow.get(job.id, typical)
            curve = ScalingCurve(curve.model, curve.global_batch_size, {n: r / factor for n,
                                                                        r in curve.throughput.items()})
            done = current.iteration if current else job.iteration
            states.append(JobState(
                name=job.id, tenant=job.tenant_id, priority=priority.get(job.id, 0),
                submit_time_s=epoch_s(job.created_at), model=job.id, global_batch_size=job.spec.global_batch_size,
                remaining_iterations=max(job.spec.iterations - done, 0), requested_devices=job.spec.max_devices,
                min_devices=job.spec.min_devices, max_devices=job.spec.max_devices,
                last_resize_s=self._resized_at.get(job.id, -math.inf), iterations=job.spec.iterations))
            curves[curve.model, curve.global_batch_size] = curve
            plans[job.id] = plan
        if not states:
            return
        current = {r.job.id: r.world for r in steady}
        cost = self._state.morph_costs.of_fleet()
        policy = ElasticPolicy(name=ELASTIC, min_interval_s=self._min_resize_s,
                               fairness_bound=self._fairness_bound)
        given = allocate(pool, states, curves, snap.now, policy, current, cost)
        by_id = {s.name: s for s in states}
        starting = [s.name for s in states if s.name not in current and given.get(s.name, 0) > 0]
        for r in steady:
            n = given.get(r.job.id, r.world)
            if n != r.world and n >= r.job.spec.min_devices:
                self._resize(r, n, by_id[r.job.id], curves, cost, snap.now, starting)
        for d in queued:
            n = given.get(d.job_id, 0)
            if n and n != d.devices and snap.jobs[d.job_id].state in (S.JOB_STATE_QUEUED, S.JOB_STATE_SCHEDULED):
                self._under_way[d.job_id] = (kind, n, snap.now)
                self._replan_for(snap.jobs[d.job_id], n, snap,
                                 f"the elastic allocation gives it {n} of the {kind} devices (its plan asks for "
                                 f"{d.devices})")

    def _settled(self, snap: Snapshot, kind: str, running: list[Running]) -> bool:
        """Whether every decision under way for `kind` took effect: the job runs on its count, waits planned
        for it, or ended (or the decision is older than UNDER_WAY_S: something else moved the job)."""
        on = {r.job.id: r.world for r in running if not r.stopping and r.job.state == S.JOB_STATE_RUNNING}
        waiting = {d.job_id: d.devices for d in snap.queue}
        for job_id, (of_kind, n, at) in list(self._under_way.items()):
            if of_kind != kind:
                continue
            if on.get(job_id) == n or waiting.get(job_id) == n or snap.now - at > UNDER_WAY_S or (
                    job_id not in on and job_id not in waiting and self._state.store.get_job(
                        store_pb2.GetRequest(id=job_id)).state in TERMINAL):
                del self._under_way[job_id]
        return not any(of_kind == kind for of_kind, _, _ in self._under_way.values())

    def _resizable(self, r: Running) -> bool:
        """Running steadily on its plan, with nothing else under way."""
        return (not r.stopping and r.loss is None and r.job.state == S.JOB_STATE_RUNNING
                and len(r.recent) == GROW_WINDOW)

    def _resize(self, r: Running, n: int, state: JobState, curves: dict, cost: float, now: float,
                starting: list[str]) -> None:
        before, after = remaining_s(state, curves, r.world), remaining_s(state, curves, n)
        why = (f"{r.world} -> {n} device(s): predicted {before:.1f} s -> {after:.1f} s to finish this job"
               + (f", so that {len(starting)} queued elastic job(s) start now ({', '.join(starting)})" if n < r.world
                  else f", {before - after:.1f} s saved against a morph's {cost:.1f} s"))
        log.info("elastic resize: %s", why, extra={"job_id": r.job.id})
        self._drain(r, morph.RESIZE, f"elastic allocation: {why}", to_devices=n)
        if r.loss is not None and r.loss.cause == morph.RESIZE:  # the drain began (not cancelled meanwhile)
            self._resized_at[r.job.id] = now
            self._under_way[r.job.id] = (r.plan.fleet.device.kind, n, now)

    def _curve(self, job: job_pb2.Job, plan: plan_pb2.Plan, pool: int, dims: tuple[str, ...],
               hosts: list[fleet_pb2.Host]) -> ScalingCurve | None:
        """The job's predicted throughput on each count of its range the pool could give it: one plan search
        per count (a morph's re-plan: Varuna's P x D at the same global batch), under the calibration of
        the host class of that count; None when no count has a plan."""
        profile = self._profiles.get(plan.profile_id)
        if profile is None:
            profile = self._profiles[plan.profile_id] = self._state.store.get_profile(
                store_pb2.GetRequest(id=plan.profile_id))
        # counts are priced on the fleet the job was submitted for (its plan's may be cut to fewer devices)
        template = job.spec.fleet if job.spec.HasField("fleet") else fleet_of_hosts(hosts, job.spec.model.dtype)
        analytical = plan.fleet.device.kind not in MEASURED_KINDS  # as prepare decided
        rates: dict[int, float] = {}
        for n in range(max(1, job.spec.min_devices), min(job.spec.max_devices, pool) + 1):
            fleet = fleet_of(template, n)
            inputs = with_calibration(self._state.store, plan_inputs(job, dims, n, plan_pb2.PLAN_ENGINE_VARUNA), fleet,
                                      analytical)
            point = self._curves.get(profile, template, job.spec.global_batch_size, (n,), model=job.id,
                                     inputs=inputs)
            rates.update(point.throughput)
        if not any(rates.values()):
            return None
        return ScalingCurve(job.id, job.spec.global_batch_size, rates)
