"""The planner's online loop for a running job (vPipe): watch its stages, repartition it live. No grpc imports.

Stage statistics from the control stream feed a per-job training monitor (services/planner/online). Once it
holds a full window of iterations under the plan in force, the SRP planner prices swap/recompute/repartition
proposals on the shared simulator; an accepted one becomes the job's next plan version: stored with its
parent, announced as a REPARTITION event (RUNNING -> REPARTITIONING) and sent to every host running the job
as a RepartitionInstruction. Workers apply it at the first iteration boundary they all reach holding it and
migrate the moved layers live; each host acks once its workers run the new version, and when every host
has, the job returns to RUNNING on the new plan. Each layer's migration (reported by every receiving replica)
is stored once as a layer_migrations row and announced as a MIGRATION event.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ballast.v1 import executor_pb2, job_pb2, plan_pb2, profile_pb2, store_pb2
from services.planner.online import Decision, MonitorOptions, OnlineOptions, TrainingMonitor, propose
from services.planner.online.toggles import unsettled
from services.runtime.errors import BallastError
from services.runtime.metrics import LAYER_MIGRATIONS
from services.runtime.store_api import Store
from services.specs.parallel import ParallelDims

log = logging.getLogger("ballast.rebalance")
S = job_pb2.JobState
Send = Callable[[str, executor_pb2.PlannerMessage], None]
Transition = Callable[..., job_pb2.Job | None]


@dataclass
class Pending:
    """A repartition sent and not yet acknowledged by every host."""

    plan: plan_pb2.Plan
    decision: Decision
    waiting: set[str]


@dataclass
class JobOnline:
    monitor: TrainingMonitor
    plans: dict[int, plan_pb2.Plan]  # by version: what each iteration's stats ran under
    replicas: int
    hosts: list[str]
    profile: profile_pb2.Profile | None = None
    pending: Pending | None = None
    skipped: set[int] = field(default_factory=set)  # plan versions already told "not worth it"
    deferred: set[int] = field(default_factory=set)  # toggle switches (iterations) already told "wait for it"
    moved: dict[tuple[int, int], list[job_pb2.LayerMigration]] = field(default_factory=dict)  # (version, layer)
    last_iteration: int = 0  # iterations done, as the stats tell
    considered_at: int = -1  # last_iteration when a proposal was last priced


def request_key(job_id: str, plan_id: str, iteration: int) -> str:
    """Idempotency key of one repartition decision (the store takes at most 40 characters)."""
    return "rp-" + hashlib.sha256(f"{job_id}/{plan_id}/{iteration}".encode()).hexdigest()[:32]


class Rebalancer:
    def __init__(self, store: Store, send: Send, transition: Transition,
                 options: OnlineOptions | None = None, monitor: MonitorOptions | None = None):
        self._store, self._send, self._transition = store, send, transition
        self.options, self.monitor_options = options or OnlineOptions(), monitor or MonitorOptions()
        self._jobs: dict[str, JobOnline] = {}
        self._lock = threading.Lock()

    def track(self, job: job_pb2.Job, plan: plan_pb2.Plan, hosts: list[str]) -> None:
        """Follow a job that may be rebalanced (JobSpec.online_repartition)."""
        if not job.spec.online_repartition:
            return
        replicas = ParallelDims.of_plan(plan).dp
        with self._lock:
            if job.id in self._jobs:
                return
            monitor = TrainingMonitor(self.monitor_options)
            monitor.expect(job.id, plan.version, len(plan.stages), replicas)
            self._jobs[job.id] = JobOnline(monitor, {plan.version: plan}, replicas, list(hosts))

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def due(self) -> list[str]:
        """Jobs with a fresh full window and no repartition in flight: the ones worth a decision now."""
        with self._lock:
            return sorted(job_id for job_id, online in self._jobs.items() if self._due(job_id, online))

    def _due(self, job_id: str, online: JobOnline) -> bool:
        fresh = online.considered_at < 0 or online.last_iteration - online.considered_at >= self.monitor_options.window
        return online.pending is None and fresh and online.monitor.ready(job_id)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def plan_for(self, job_id: str, version: int) -> plan_pb2.Plan | None:
        with self._lock:
            online = self._jobs.get(job_id)
            return online.plans.get(version) if online else None

    # --- agent messages (stream threads) --------------------------------------------------------------
    def observe(self, stats: executor_pb2.StageStats) -> bool:
        """Feed the job's monitor; True when it now holds enough to decide on (worth waking the loop for)."""
        with self._lock:
            online = self._jobs.get(stats.job_id)
            if online is None or not online.monitor.observe(stats):
                return False
            online.last_iteration = max(online.last_iteration, stats.iteration + 1)
            return self._due(stats.job_id, online)

    def acked(self, host_id: str, job_id: str, ack: executor_pb2.InstructionAck) -> None:
        with self._lock:
            online = self._jobs.get(job_id)
            pending = online.pending if online else None
            if pending is None or ack.version != pending.plan.version:
                stray = True  # e.g. an instruction sent before a planner restart, applied after it
            else:
                stray = False
                if not ack.ok:
                    online.pending = None
                else:
                    pending.waiting.discard(host_id)
                    if pending.waiting:
                        return
        if stray:
            if ack.ok:
                self.adopt(job_id, int(ack.version), f"host {host_id} applied it ({ack.message})")
            return
        if not ack.ok:
            self._abandon(job_id, pending.plan, f"failed on host {host_id}: {ack.message}")
            return
        moves = ", ".join(f"layer {m.layer} {m.from_stage}->{m.to_stage}" for m in pending.decision.moves)
        self.adopt(job_id, pending.plan.version, f"{ack.message}; {moves or 'no layer moved'}", pending.plan)

    def adopt(self, job_id: str, version: int, why: str, plan: plan_pb2.Plan | None = None) -> None:
        """Make `version` the job's plan in force (the workers run it): store, monitor, pending."""
        job = self._store.get_job(store_pb2.GetRequest(id=job_id))
        if version <= job.plan_version or job.state not in (S.JOB_STATE_RUNNING, S.JOB_STATE_REPARTITIONING):
            return
        if plan is None:
            plans = self._store.list_plans(store_pb2.ListPlansRequest(job_id=job_id)).plans
            plan = next((p for p in plans if p.version == version), None)
            if plan is None:
                log.warning("applied plan version not stored", extra={"job_id": job_id, "version": version})
                return
        with self._lock:
            online = self._jobs.get(job_id)
            if online is not None:
                online.plans[version] = plan
                online.monitor.expect(job_id, version, len(plan.stages), online.replicas)
                if online.pending is not None and online.pending.plan.version <= version:
                    online.pending = None
                online.moved = {k: v for k, v in online.moved.items() if k[0] >= version}
        if job.state == S.JOB_STATE_RUNNING:  # the planner had given up on it: through REPARTITIONING again
            job = self._transition(job, S.JOB_STATE_REPARTITIONING, f"plan version {version} found applied",
                                   "REPARTITION", {"plan_id": plan.id, "to_version": str(version)}) or job
        self._transition(job, S.JOB_STATE_RUNNING, f"plan version {version} in force ({why})", "REPARTITIONED",
                         {"plan_id": plan.id, "plan_version": str(version)}, plan_id=plan.id)

    def _abandon(self, job_id: str, plan: plan_pb2.Plan, why: str) -> None:
        with self._lock:
            online = self._jobs.get(job_id)
            if online is not None and online.pending is not None and online.pending.plan.version == plan.version:
                online.pending = None
        job = self._store.get_job(store_pb2.GetRequest(id=job_id))
        self._transition(job, S.JOB_STATE_RUNNING, f"repartition to plan version {plan.version} {why}; the job goes "
                         f"on under version {job.plan_version}", "REPARTITION_FAILED",
                         {"plan_id": plan.id, "plan_version": str(plan.version)})

    def migrated(self, message: executor_pb2.LayerMigrated) -> None:
        """One replica's report of a layer it took over; stored once every replica of the target stage did."""
        mig = message.migration
        with self._lock:
            online = self._jobs.get(mig.job_id)
            if online is None:
                return
            parts = online.moved.setdefault((mig.plan_version, mig.layer_index), [])
            parts.append(mig)
            if len(parts) < online.replicas:
                return
            online.moved.pop((mig.plan_version, mig.layer_index))
        row = job_pb2.LayerMigration(job_id=mig.job_id, layer_index=mig.layer_index, from_stage=mig.from_stage,
                                     to_stage=mig.to_stage, bytes=sum(p.bytes for p in parts),
                                     duration_s=max(p.duration_s for p in parts), iteration=mig.iteration,
                                     plan_version=mig.plan_version)
        stored = self._store.record_layer_migration(store_pb2.RecordLayerMigrationRequest(migration=row))
        LAYER_MIGRATIONS.inc()
        self._store.append_job_event(store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
            job_id=mig.job_id, type="MIGRATION",
            message=f"layer {mig.layer_index} moved stage {mig.from_stage} -> {mig.to_stage} live after iteration "
                    f"{mig.iteration}: {row.bytes / 2**20:.1f} MiB in {row.duration_s * 1e3:.0f} ms "
                    f"({len(parts)} replica(s))",
            attributes={"migration_id": stored.id, "layer": str(mig.layer_index),
                        "plan_version": str(mig.plan_version)})))

    # --- decisions (scheduler thread) -----------------------------------------------------------------
    def _defer(self, job: job_pb2.Job, online: JobOnline, since: int, iteration: int) -> bool:
        """Whether a layer toggle switches between the window's first iteration and the last one a move decided
        now needs to be applied and measured (services/planner/online/toggles.py). Then nothing is decided until
        a window measured after the switch; the job's events say so once per switch."""
        opt = self.monitor_options
        needs = opt.warmup + opt.window
        coming = unsettled(job.spec.layer_toggles, since, iteration + needs)
        if not coming:
            return False
        switch = coming[0]
        if switch.iteration not in online.deferred:
            online.deferred.add(switch.iteration)
            self._store.append_job_event(store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
                job_id=job.id, type="REPARTITION_SKIPPED",
                message=f"not deciding at iteration {iteration}: {switch.describe()}, within the window measured "
                        f"from iteration {since} and the {needs} iterations a move needs to be applied and "
                        f"measured; deciding on iterations measured after the switch",
                attributes={"plan_version": str(job.plan_version), "switch_iteration": str(switch.iteration)})))
        return True

    def consider(self, job: job_pb2.Job) -> Decision | None:
        """Propose and, when accepted, start a repartition of a RUNNING job. Returns the decision taken."""
        with self._lock:
            online = self._jobs.get(job.id)
            if online is None or online.pending is not None or job.state != S.JOB_STATE_RUNNING:
                return None
            plan = online.plans.get(job.plan_version)
            iteration = online.last_iteration
            if not self._due(job.id, online):
                return None
            online.considered_at = iteration  # also when nothing below is decided: no retry before a new window
            observation = online.monitor.observation(job.id, job.plan_version) if plan is not None else None
            if observation is None:
                return None
        if self._defer(job, online, observation.iterations[0], iteration):
            return None
        if online.profile is None:
            online.profile = self._store.get_profile(store_pb2.GetRequest(id=plan.profile_id))
        decision = propose(online.profile, plan.fleet, plan, observation, self.options)
        if not decision.accepted:
            notable = observation.imbalance >= self.options.imbalance_threshold or observation.workload_change
            if notable and plan.version not in online.skipped:
                online.skipped.add(plan.version)
                self._store.append_job_event(store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
                    job_id=job.id, type="REPARTITION_SKIPPED", message=decision.reason,
                    attributes={"plan_version": str(plan.version)})))
            return decision
        if job.spec.iterations - iteration < self.monitor_options.warmup + self.monitor_options.window:
            return None  # too late: the new plan could neither repay its migration nor be measured before the end
        new = plan_pb2.Plan()
        new.CopyFrom(decision.new_plan)
        new.version = 0  # the store picks the next free one (a refused version stays taken)
        stored = self._store.create_plan(store_pb2.CreatePlanRequest(
            plan=new, request_id=request_key(job.id, plan.id, iteration)))
        moves = ",".join(f"{m.layer}:{m.from_stage}->{m.to_stage}" for m in decision.moves)
        moved = self._transition(job, S.JOB_STATE_REPARTITIONING, decision.reason, "REPARTITION", {
            "plan_id": stored.id, "from_version": str(plan.version), "to_version": str(stored.version),
            "moves": moves, "measured_s": f"{decision.measured_s:.4f}",
            "predicted_before_s": f"{decision.predicted_before_s:.4f}",
            "predicted_after_s": f"{decision.predicted_after_s:.4f}"})
        if moved is None:
            return None
        with self._lock:
            online.pending = Pending(stored, decision, set(online.hosts))
        instruction = executor_pb2.RepartitionInstruction(
            plan=stored, effective_iteration=iteration,  # a floor: applied at the next boundary all reach
            moves=[executor_pb2.LayerMove(layer_index=m.layer, from_stage=m.from_stage, to_stage=m.to_stage)
                   for m in decision.moves])
        for host_id in online.hosts:
            message = executor_pb2.PlannerMessage(instruction_id=f"{job.id}-repartition-v{stored.version}-{host_id}",
                                                  version=stored.version, job_id=job.id, repartition=instruction)
            try:
                self._send(host_id, message)
            except BallastError as exc:  # every rank must hold the plan for any to apply it: give it up
                self._abandon(job.id, stored, f"could not reach host {host_id}: {exc}")
                break
        return decision
