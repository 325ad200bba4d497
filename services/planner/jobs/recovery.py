"""The scheduler's recovery (Varuna §4): lost workers and hosts morph a job, a job below its planned size grows
back onto free devices, a chosen morph (grow, a straggler left out, an elastic resize) drains the job first.
And the checkpoint cadence those morphs resume from (Cadence). No grpc imports.

A collaborator of Scheduler (scheduler.py), which owns the jobs' lifecycle: Recovery acts on the shared
SchedulerState (state.py: the store, the lock, the running jobs, what a morph costs) and moves a job or
talks to its agents only through the scheduler's Moves. What a morph records (events, the job_morphs row) is
in morph.py; the straggler watch is stragglers.py.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from google.protobuf import timestamp_pb2

from ballast.v1 import executor_pb2, fleet_pb2, job_pb2, plan_pb2, store_pb2
from services.planner.jobs import cadence, morph
from services.planner.jobs.admit import Reader, Snapshot
from services.planner.jobs.assign import pipeline_shape
from services.planner.jobs.running import (
    DEFAULT_MORPH_COST_S,
    GROW_WARMUP,
    GROW_WINDOW,
    RECONNECT_GRACE_S,
    Running,
    devices_of,
)
from services.planner.jobs.state import Replan, SchedulerState
from services.planner.plans.calibrate import measured_iteration_s
from services.runtime.errors import BallastError, FailedPrecondition
from services.runtime.metrics import MORPHS
from services.runtime.store_api import Store, every_page
from services.specs.parallel import ParallelDims

log = logging.getLogger("ballast.scheduler")
S = job_pb2.JobState


@dataclass(frozen=True)
class Moves:
    """What Recovery asks of the scheduler, which alone moves a job through its states and talks to its agents."""

    # compare-and-set (job, state, message, event type, attributes): the moved job, None if it moved on meanwhile
    transition: Callable[[job_pb2.Job, int, str, str, dict[str, str]], job_pb2.Job | None]
    instruct: Callable[..., None]  # (running, host id, what, **PlannerMessage body): one instruction to a host
    fail: Callable[[Running, str], None]  # FAILED with the reason, then stop the survivors
    settle: Callable[[Running], None]  # once every rank is accounted for: end it, requeue it
    replan_for: Replan


class Drain(Protocol):
    """Recovery.drain_morph, as the straggler watch and the elastic pass call it."""

    def __call__(self, r: Running, cause: str, detail: str, to_devices: int = 0) -> None: ...


def measured_s(store: Store, job_id: str, version: int) -> float:
    """The job's median measured iteration time under plan `version` (0: it never ran steadily on it)."""
    request = store_pb2.ListIterationMetricsRequest(job_id=job_id)
    rows = (m for page in every_page(store.list_iteration_metrics, request) for m in page.metrics)
    return measured_iteration_s(rows, version, GROW_WARMUP)


class Recovery:
    """Morph (a lost worker or host, a chosen drain), grow, and the watch on hosts whose agent went away."""

    def __init__(self, state: SchedulerState, moves: Moves, admission: Reader, connected: Callable[[], list[str]],
                 *, host_lost_s: float, max_morphs_per_hour: int):
        self._state, self._moves, self._admission, self._connected = state, moves, admission, connected
        self._host_lost_s, self._max_morphs = host_lost_s, max_morphs_per_hour
        self._missing: dict[str, float] = {}  # host id -> when its agent was first seen gone (monotonic)
        self._started = time.monotonic()  # agents reconnecting after a planner start are not lost yet

    def morph_resumed(self, running: Running) -> None:
        """The first iteration after a morph is in: its recovery time is now known."""
        with self._state.lock:
            morph_id, running.morph_id = running.morph_id, ""
        if morph_id:
            first = timestamp_pb2.Timestamp()
            first.GetCurrentTime()
            try:
                done = self._state.store.morph_resumed(store_pb2.MorphResumedRequest(id=morph_id,
                                                                                     first_iteration_at=first))
                self._state.morph_costs.measured(done.recovery_s)
            except BallastError:
                log.exception("could not record the morph's first iteration", extra={"job_id": running.job.id})

    def lose_after_symptom(self, running: Running) -> None:
        """No other cause arrived within the grace period: a lost peer is all there is to say."""
        with self._state.lock:
            if running.stopping:
                return
        gone = tuple(h for h in running.hosts if h not in set(self._connected()))
        try:
            if gone:  # the broken link was a host whose agent is gone with its workers
                self.lose(running, morph.HOST_LOST, f"host {', '.join(gone)} is gone (its agent disconnected); "
                          f"{running.symptom}", lost_hosts=gone)
            else:
                self.lose(running, morph.WORKER_LOST, running.symptom)
        except Exception:  # noqa: BLE001 - a timer thread has nobody to raise to; the next exit retries
            with self._state.lock:
                running.symptom = ""
            log.exception("could not morph the job", extra={"job_id": running.job.id})

    # --- morphing (Varuna §4) -------------------------------------------------------------------------
    def lose(self, running: Running, cause: str, detail: str, lost_hosts: tuple[str, ...] = ()) -> None:
        """A worker or host is lost: MORPHING, the lost devices' leases end (host_lost), the survivors are
        stopped; once they are gone the job queues to resume from its last checkpoint on what is left."""
        try:
            dims = pipeline_shape(running.plan)
        except FailedPrecondition:
            dims = ParallelDims(pp=max(len(running.plan.stages), 1))
        stages, replicas = dims.pp, dims.dp
        with self._state.lock:
            if running.stopping:
                return
            running.loss = morph.Loss(cause, detail, time.time(), stages, replicas,
                                      running.job.plan_version or running.plan.version, running.iteration,
                                      tuple(sorted(lost_hosts)))
            running.stopping = f"morphing after {cause.replace('_', ' ')}"
        used = morph.losses_since(self._admission.events(running.job.id), time.time() - morph.HOUR_S)
        if used >= self._max_morphs:
            with self._state.lock:
                running.stopping, running.loss = "", None
            self._moves.fail(running, f"{detail}; the infrastructure retry budget is spent ({used} morphs in the "
                                      f"last hour, at most {self._max_morphs})")
            return
        moved = self._moves.transition(running.job, S.JOB_STATE_MORPHING,
                                       f"{cause.replace('_', ' ')}: {detail}; stopping the other workers to resume "
                                       "from the last checkpoint on the devices left", "MORPHING",
                                       running.loss.attributes())
        if moved is None:  # cancelled or ended meanwhile: the survivors are stopped all the same
            with self._state.lock:
                running.loss = None
        else:
            running.job = moved
            self._admission.lost(moved.id, running.loss)
        for host_id in running.hosts:
            if host_id in lost_hosts:
                self.host_gone(running, host_id)
            else:
                self._moves.instruct(running, host_id, "stop",
                                     stop=executor_pb2.StopInstruction(reason=running.stopping))
        self._moves.settle(running)

    def target(self, job: job_pb2.Job, devices: int) -> tuple[int, float, float]:
        """What a job grows back to, read once as it starts: --max-devices, else its first plan's device count
        (before any morph); the predicted iteration time of its first plan for that count (0: none); and the
        median iteration time the job measured under that plan before it shrank (0: it never ran on it)."""
        plans = sorted(self._state.store.list_plans(store_pb2.ListPlansRequest(job_id=job.id)).plans,
                       key=lambda p: p.version)
        target = job.spec.max_devices or max([devices] + [devices_of(p) for p in plans[:1]])
        planned = next((p for p in plans if devices_of(p) == target), None)
        if planned is None:
            return target, 0.0, 0.0
        # a shrunken job: how fast it ran on the target layout is known, not predicted
        measured = measured_s(self._state.store, job.id, planned.version) if devices < target else 0.0
        return target, planned.prediction.iteration_time_s, measured

    def grow(self, snap: Snapshot) -> None:
        """Nothing waits and devices are free: a job below its target grows onto them at its next iteration
        boundary, if the iterations it has left gain more than a morph costs (Varuna's manager grows the job
        when machines come back)."""
        with self._state.lock:
            candidates = [r for r in self._state.running.values() if not r.stopping and r.target > r.world
                          and len(r.recent) == GROW_WINDOW and r.job.state == S.JOB_STATE_RUNNING
                          and not r.job.spec.elastic]  # the elastic pass sizes elastic jobs (elastic.py)
        if not candidates:
            return  # the free devices are only counted for a job that could grow (a fleet has tens of thousands)
        free: dict[str, int] = {}
        for slot in snap.free:
            free[slot.kind] = free.get(slot.kind, 0) + 1
        for r in candidates:
            kind = r.plan.fleet.device.kind
            if free.get(kind, 0) < r.target - r.world:
                continue
            gain, cost = self._growth_gain(r)
            if gain > cost:
                free[kind] -= r.target - r.world
                self.drain_morph(r, morph.GROW, f"{r.target - r.world} {kind} device(s) free: {r.world} -> "
                                 f"{r.target} devices gains {gain:.1f} s over the "
                                 f"{r.job.spec.iterations - r.iteration} iterations left against a morph's "
                                 f"{cost:.1f} s")

    def _growth_gain(self, r: Running) -> tuple[float, float]:
        """(seconds the rest of the run saves on the target layout, seconds a morph costs): the target's iteration
        time as the job measured it there before it shrank, else its prediction corrected by how far the current
        plan's prediction is from its measurement (two plans priced under different host-class calibrations
        compare badly: a measurement beats both). The cost is only looked up when there is a gain (this runs
        every tick while devices are free)."""
        now = statistics.median(r.recent)
        predicted_now = r.plan.prediction.iteration_time_s
        if r.target_measured_s > 0:
            target = r.target_measured_s
        elif r.target_iteration_s > 0 and predicted_now > 0:
            target = r.target_iteration_s * now / predicted_now
        else:
            return 0.0, DEFAULT_MORPH_COST_S
        gain = (now - target) * (r.job.spec.iterations - r.iteration)
        return gain, self._state.morph_costs.of_job(r.job.id) if gain > 0 else DEFAULT_MORPH_COST_S

    def drain_morph(self, r: Running, cause: str, detail: str, to_devices: int = 0) -> None:
        """MORPHING with every worker alive (grow, or leaving a straggler out): they drain to a checkpoint at an
        agreed boundary (nothing is trained again), then the job is re-planned and resumes -- onto its target
        when it grows, onto the devices free (a degraded host's are not) when it sheds a straggler."""
        dims = pipeline_shape(r.plan)
        stages, replicas = dims.pp, dims.dp
        with self._state.lock:
            if r.stopping:
                return
            r.loss = morph.Loss(cause, detail, time.time(), stages, replicas,
                                r.job.plan_version or r.plan.version, r.iteration, to_devices=to_devices)
            r.stopping = f"morphing: {cause.replace('_', ' ')}"
        moved = self._moves.transition(r.job, S.JOB_STATE_MORPHING, f"{cause}: {detail}; draining to a checkpoint",
                                       "MORPHING", r.loss.attributes())
        if moved is None:
            with self._state.lock:
                r.stopping, r.loss = "", None
            return
        r.job = moved
        self._admission.lost(moved.id, r.loss)
        for host_id in r.hosts:
            self._moves.instruct(r, host_id, "stop",
                                 stop=executor_pb2.StopInstruction(reason=r.stopping, checkpoint=True))

    def host_gone(self, running: Running, host_id: str) -> None:
        """Its ranks will never report: count them gone, and end its devices' leases as lost."""
        with self._state.lock:
            running.exited.update(running.ranks.get(host_id, []))
        self._state.store.end_leases(store_pb2.EndLeasesRequest(
            job_id=running.job.id, reason=fleet_pb2.LEASE_END_REASON_HOST_LOST, host_id=host_id))

    def requeue_lost(self, running: Running) -> None:
        """Every survivor is gone: give back their devices and queue the job to resume, re-planned for what
        is free (admit.py lets a morphing job run on fewer devices)."""
        self._state.store.end_leases(store_pb2.EndLeasesRequest(job_id=running.job.id,
                                                                reason=fleet_pb2.LEASE_END_REASON_MORPHED))
        resume = self._admission.resume_point(running.job.id)
        where = f"from iteration {resume.iteration}" if resume else "from the start (no complete checkpoint)"
        moved = self._moves.transition(running.job, S.JOB_STATE_QUEUED, f"waiting to resume {where} on the "
                                       "devices free", "QUEUED",
                                       {"reason": "morphing",
                                        "checkpoint_iteration": str(resume.iteration if resume else 0)})
        if moved is not None and running.loss is not None and running.loss.cause in morph.CHOSEN:
            # planned for the devices it grows onto, or the count the elastic allocation gave it
            resize = running.loss.cause == morph.RESIZE
            self._moves.replan_for(moved, running.loss.to_devices or running.target, None,
                                   "the count the elastic allocation gave it" if resize else "")

    def record_morph(self, job: job_pb2.Job, loss: morph.Loss, stages: int, replicas: int,
                     resume_iteration: int) -> str:
        """The morph's row, before the new workers start (the store drops the metrics of the iterations they
        train again). Returns its id ("" if the store refused it: the job runs on regardless)."""
        row = job_pb2.Morph(job_id=job.id, cause=loss.cause, detail=loss.detail[:1000], from_stages=loss.from_stages,
                            from_replicas=loss.from_replicas, from_plan_version=loss.from_plan_version,
                            to_stages=stages, to_replicas=replicas, to_plan_version=job.plan_version,
                            failed_iteration=max(loss.failed_iteration, resume_iteration),
                            checkpoint_iteration=resume_iteration)
        row.detected_at.FromMicroseconds(int(loss.detected_at * 1e6))
        row.resumed_at.GetCurrentTime()
        try:
            stored = self._state.store.record_morph(store_pb2.RecordMorphRequest(morph=row)).id
            MORPHS.labels(loss.cause).inc()
            return stored
        except BallastError:
            log.exception("could not record the morph", extra={"job_id": job.id})
            return ""

    def watch_hosts(self) -> None:
        """A job's host whose agent stays away HOST_LOST_S is lost: the job morphs without it (or, already
        stopping, stops counting on its ranks)."""
        connected, now = set(self._connected()), time.monotonic()
        self._missing = {h: t for h, t in self._missing.items() if h not in connected}
        if now - self._started < RECONNECT_GRACE_S:
            return
        with self._state.lock:
            running = list(self._state.running.values())
        for r in running:
            lost = tuple(h for h in r.hosts if h not in connected
                         and now - self._missing.setdefault(h, now) >= self._host_lost_s)
            if not lost:
                continue
            names = ", ".join(lost)
            if not r.stopping:
                self.lose(r, morph.HOST_LOST, f"host {names} stopped answering for {self._host_lost_s:.0f} s",
                          lost_hosts=lost)
                continue
            for host_id in lost:
                if not set(r.ranks.get(host_id, [])) <= r.exited:
                    self.host_gone(r, host_id)
            self._moves.settle(r)


class Cadence:
    """How often a job that left checkpoint_every to Ballast checkpoints: Young's interval (cadence.py) for the
    fleet's failure rate and the job's measured checkpoint cost."""

    def __init__(self, store: Store, max_interval_s: float):
        self._store, self._max_interval_s = store, max_interval_s
        # job id -> its last checkpoint's (stall, background write) seconds, rank 0's
        self._checkpoint_s: dict[str, tuple[float, float]] = {}
        self._failure_rate: tuple[float, int, float] = (0.0, 0, 0.0)  # (read at, failures, device-hours), 7 days

    def measured(self, job_id: str, stall_s: float, write_s: float) -> None:
        """Rank 0's report of a whole checkpoint's times: what the job's next cadence is priced on."""
        self._checkpoint_s[job_id] = (stall_s, write_s)

    def with_cadence(self, job: job_pb2.Job, plan: plan_pb2.Plan, devices: int) -> tuple[job_pb2.JobSpec, str]:
        """The spec the workers get, and why its cadence: a job that left checkpoint_every to Ballast checkpoints
        at Young's interval for the fleet's failure rate and its checkpoint cost (shown on its ASSIGNED event)."""
        if job.spec.checkpoint_every:
            return job.spec, f"checkpoints every {job.spec.checkpoint_every} iterations (as submitted)"
        try:
            profile = self._store.get_profile(store_pb2.GetRequest(id=plan.profile_id))
            parameter_bytes = sum(layer.parameter_bytes for layer in profile.layers)
            failures, device_hours = self._fleet_failures()
            stall_s, write_s = self._checkpoint_s.get(job.id, (0.0, 0.0))
            chosen = cadence.young(cadence.checkpoint_cost_s(parameter_bytes, stall_s),
                                   cadence.job_mtbf_s(failures, device_hours, devices),
                                   plan.prediction.iteration_time_s, max_interval_s=self._max_interval_s,
                                   write_s=write_s)
        except BallastError:
            log.exception("could not choose a checkpoint cadence", extra={"job_id": job.id})
            return job.spec, "no checkpoints (the cadence could not be chosen)"
        spec = job_pb2.JobSpec()
        spec.CopyFrom(job.spec)
        spec.checkpoint_every = chosen.every
        return spec, (f"checkpoints {chosen.why}; the fleet lost {failures} worker(s) or host(s) in "
                      f"{device_hours:.1f} device-hours over 7 days")

    def _fleet_failures(self) -> tuple[int, float]:
        """(lost workers and hosts, leased device-hours) over the last 7 days; read at most every 10 minutes."""
        read_at, failures, hours = self._failure_rate
        now = time.time()
        if now - read_at < 600:
            return failures, hours
        week = now - 7 * 24 * 3600.0
        failures = sum(1 for page in every_page(self._store.list_morphs, store_pb2.ListMorphsRequest())
                       for m in page.morphs if m.cause in (morph.WORKER_LOST, morph.HOST_LOST)
                       and m.detected_at.ToMicroseconds() / 1e6 >= week)
        since = store_pb2.ListLeasesRequest()
        since.since.FromMicroseconds(int(week * 1e6))
        hours = 0.0
        for page in every_page(self._store.list_leases, since):
            for x in page.leases:
                end = x.ended_at.ToMicroseconds() / 1e6 if x.HasField("ended_at") else now
                hours += max(end - max(x.started_at.ToMicroseconds() / 1e6, week), 0.0) / 3600.0
        self._failure_rate = (now, failures, hours)
        return failures, hours
