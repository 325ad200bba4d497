"""What admission reads from the store: the queue, the fleet, its leases and policy, as the pure engine's
inputs (services/planner/admission). No grpc imports; the scheduler acts on the decision.

A queued job's demand comes from its plan (stages x replicas devices of the plan's kind, predicted run time =
iterations left x predicted iteration time; iterations left count from its last complete checkpoint once it
was preempted or lost a worker or host). A job that morphs after a loss may be re-planned for any device count
up to its plan's (Varuna: P x D <= G at the same global batch). Running jobs are the live leases grouped by
job. Fair share is each tenant's decayed device-seconds over the leases of the last few half-lives.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

from google.protobuf import timestamp_pb2

from ballast.v1 import fleet_pb2, job_pb2, plan_pb2, store_pb2
from services.planner import admission as adm
from services.planner.jobs import morph
from services.planner.jobs.assign import pipeline_shape
from services.planner.jobs.fleet_hosts import FleetHosts, HostReader
from services.planner.plans.fleet import usable
from services.runtime.errors import BallastError, FailedPrecondition
from services.runtime.store_api import Store, every_page
from services.specs import policy as fleet_policy

S = job_pb2.JobState
WAITING = (S.JOB_STATE_SCHEDULED, S.JOB_STATE_QUEUED)
HOLDING = (S.JOB_STATE_RUNNING, S.JOB_STATE_REPARTITIONING, S.JOB_STATE_MORPHING, S.JOB_STATE_CANCELLING)
USAGE_HALF_LIVES = 4  # leases older than this many half-lives weigh < 7%: left out of fair share
HOUR_S = 3600.0


def epoch_s(ts: timestamp_pb2.Timestamp) -> float:
    """A proto Timestamp as the engine's epoch seconds (never via naive datetimes and the local zone)."""
    return ts.ToMicroseconds() / 1e6


@dataclass(frozen=True)
class Resume:
    """Where a preempted job starts again: its last complete checkpoint."""

    iteration: int
    directory: str


@dataclass
class Snapshot:
    """One admission pass's inputs, and what the scheduler needs to act on its decision."""

    now: float
    queue: list[adm.Demand]
    free: list[adm.Slot]
    running: list[adm.Holding]
    policy: adm.Policy
    usage: dict[str, float]
    kinds_online: set[str]
    jobs: dict[str, job_pb2.Job]
    plans: dict[str, plan_pb2.Plan]
    hosts: dict[str, fleet_pb2.Host]
    fleet_policy: fleet_pb2.FleetPolicy
    tenant_names: dict[str, str]
    classes: dict[str, str]  # job id -> priority class name
    unrunnable: dict[str, str] = field(default_factory=dict)  # job id -> why it can never run here
    live: list[fleet_pb2.DeviceLease] = field(default_factory=list)
    preemptions: dict[str, int] = field(default_factory=dict)  # queued job id -> times preempted
    online: list[fleet_pb2.Host] = field(default_factory=list)  # usable hosts whose agent is connected

    def decide(self, *, exact: bool = False) -> adm.Decision:
        depth = None if exact else adm.DEFAULT_RESERVE_DEPTH
        return adm.decide(self.queue, self.free, self.running, self.policy, self.usage, self.now,
                          self.kinds_online, reserve_depth=depth)


@dataclass
class History:
    """What a job's events say about its interruptions (read once, then kept up to date by the scheduler)."""

    preempted: list[float] = field(default_factory=list)  # when it was preempted
    loss: morph.Loss | None = None  # its morph in progress


class Reader:
    """Builds Snapshots; caches what never changes (plans) and what changes only through the scheduler
    (preemption times, morphs in progress), so a pass costs a few List calls however long the queue."""

    def __init__(self, store: Store):
        self._store = store
        self.fleet = HostReader(store)  # the hosts, re-read only where they changed
        self._plans: dict[str, plan_pb2.Plan] = {}
        self._history: dict[str, History] = {}  # job id -> its interruptions, from its events
        self._lock = threading.Lock()

    # --- caches the scheduler updates ---------------------------------------------------------------------
    def plan(self, plan_id: str) -> plan_pb2.Plan:
        with self._lock:
            plan = self._plans.get(plan_id)
        if plan is None:
            plan = self._store.get_plan(store_pb2.GetRequest(id=plan_id))
            with self._lock:
                self._plans[plan_id] = plan
        return plan

    def history(self, job_id: str) -> History:
        with self._lock:
            known = self._history.get(job_id)
        if known is None:
            events = self.events(job_id)
            known = History([epoch_s(e.created_at) for e in events if e.type == "PREEMPTED"],
                            morph.pending_loss(events))
            with self._lock:
                known = self._history.setdefault(job_id, known)
        return known

    def events(self, job_id: str) -> list[job_pb2.JobEvent]:
        request = store_pb2.ListJobEventsRequest(job_id=job_id)
        return [e for page in every_page(self._store.list_job_events, request) for e in page.events]

    def preemptions(self, job_id: str) -> list[float]:
        return self.history(job_id).preempted

    def preempted(self, job_id: str, at: float) -> None:
        history = self.history(job_id)
        with self._lock:
            history.preempted.append(at)

    def pending_loss(self, job_id: str) -> morph.Loss | None:
        return self.history(job_id).loss

    def lost(self, job_id: str, loss: morph.Loss | None) -> None:
        """The job's morph began (a Loss) or it resumed from it (None)."""
        history = self.history(job_id)
        with self._lock:
            history.loss = loss

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._history.pop(job_id, None)

    def resume_point(self, job_id: str) -> Resume | None:
        """The job's last complete checkpoint (its directory is where its layer files lie), if any."""
        page = self._store.list_checkpoints(store_pb2.ListCheckpointsRequest(job_id=job_id))
        done = [c for c in page.checkpoints if c.complete and c.layers and not c.HasField("deleted_at")]
        if not done:
            return None
        last = max(done, key=lambda c: c.iteration)
        path = unquote(urlparse(last.layers[0].uri).path)
        return Resume(last.iteration, path.rsplit("/", 1)[0])

    # --- a snapshot -----------------------------------------------------------------------------------
    def snapshot(self, connected: set[str], draining: set[str], now: float | None = None) -> Snapshot:
        now = time.time() if now is None else now
        store = self._store
        policy_pb = store.get_fleet_policy(store_pb2.GetFleetPolicyRequest())
        tenants = {t.id: t.name for page in every_page(store.list_tenants, store_pb2.ListTenantsRequest())
                   for t in page.tenants}
        rules = {tid: fleet_policy.tenant_policy(policy_pb, name) for tid, name in tenants.items()}
        policy = adm.Policy(quotas={tid: r.device_quota for tid, r in rules.items() if r.device_quota},
                            weights={tid: r.weight for tid, r in rules.items()},
                            max_preemptions_per_hour=fleet_policy.max_preemptions(policy_pb))
        fleet = self.fleet.read()
        online = [h for h in fleet.hosts if usable(h) and h.id in connected]
        live = [x for page in every_page(store.list_leases, store_pb2.ListLeasesRequest(live_only=True))
                for x in page.leases]
        leased = {(x.device.host_id, x.device.device_index) for x in live}
        free = [s for h in online for s in fleet.slots[h.id] if (s.host_id, s.device_index) not in leased]
        kinds = set().union(*(fleet.kinds[h.id] for h in online))
        snap = Snapshot(now, [], free, [], policy, {}, kinds, {}, {}, fleet.by_id, policy_pb, tenants, {}, live=live,
                        online=online)
        snap.usage = self._usage(policy_pb, now)
        for state in WAITING:
            for page in every_page(store.list_jobs, store_pb2.ListJobsRequest(state=state)):
                for job in page.jobs:
                    self._demand(snap, job, fleet)
        self._holdings(snap, live, draining)
        return snap

    def _class(self, snap: Snapshot, job: job_pb2.Job) -> fleet_pb2.PriorityClass:
        try:
            cls = fleet_policy.priority_class(snap.fleet_policy, job.spec.priority_class)
        except BallastError:  # the class was removed from the policy since submit: the default applies
            cls = fleet_policy.priority_class(snap.fleet_policy, "")
        snap.classes[job.id] = cls.name
        return cls

    def _demand(self, snap: Snapshot, job: job_pb2.Job, fleet: FleetHosts) -> None:
        if not job.plan_id:
            return
        plan = self.plan(job.plan_id)
        snap.jobs[job.id], snap.plans[job.id] = job, plan
        try:
            need = pipeline_shape(plan).world_size
        except FailedPrecondition as exc:
            snap.unrunnable[job.id] = str(exc)
            return
        kind = plan.fleet.device.kind
        offered = fleet.offered[kind]
        if fleet.hosts and offered < need:
            snap.unrunnable[job.id] = (f"the plan needs {need} {kind} device(s); the fleet's registered executors "
                                       f"offer {offered}")
            return
        history = self.history(job.id)
        snap.preemptions[job.id] = len(history.preempted)
        resume = self.resume_point(job.id) if history.preempted or history.loss else None
        left = job.spec.iterations - (resume.iteration if resume else 0)
        cls = self._class(snap, job)
        # A job morphing after a loss may run on fewer devices (P x D <= G, the global batch kept)
        low, high = job.spec.min_devices, job.spec.max_devices
        if history.loss and not high:
            low, high = 1, need
        snap.queue.append(adm.Demand(
            job_id=job.id, tenant_id=job.tenant_id, priority=cls.priority, preempts=cls.preempts,
            submitted_at=epoch_s(job.created_at), devices=need, kind=kind,
            duration_s=left * plan.prediction.iteration_time_s,
            duration_high_s=left * plan.prediction.iteration_time_high_s, min_devices=low,
            max_devices=high, preempted=bool(history.preempted)))

    def _holdings(self, snap: Snapshot, live: list[fleet_pb2.DeviceLease], draining: set[str]) -> None:
        held: dict[str, list[fleet_pb2.DeviceLease]] = defaultdict(list)
        for lease in live:
            held[lease.job_id].append(lease)
        for job_id, leases in sorted(held.items()):
            job = self._store.get_job(store_pb2.GetRequest(id=job_id))
            snap.jobs[job_id] = job
            cls = self._class(snap, job)
            start = min(epoch_s(x.started_at) for x in leases)
            predicted = 0.0
            if job.plan_id:
                plan = self.plan(job.plan_id)
                snap.plans[job_id] = plan
                predicted = start + max(job.spec.iterations - job.iteration, 0) * plan.prediction.iteration_time_s
            hour = [t for t in self.preemptions(job_id) if t > snap.now - HOUR_S]
            hosts = snap.hosts
            slots = tuple(sorted((adm.Slot(x.device.host_id, x.device.device_index, x.device_kind,
                                           hosts[x.device.host_id].name if x.device.host_id in hosts else "")
                                  for x in leases), key=lambda s: s.sort_key))
            snap.running.append(adm.Holding(job_id=job_id, tenant_id=job.tenant_id, priority=cls.priority,
                                            slots=slots, predicted_end=predicted or float("inf"),
                                            preemptions_last_hour=len(hour), draining=job_id in draining))

    def _usage(self, policy_pb: fleet_pb2.FleetPolicy, now: float) -> dict[str, float]:
        half = fleet_policy.half_life_s(policy_pb)
        since = store_pb2.ListLeasesRequest()
        since.since.FromMicroseconds(int((now - USAGE_HALF_LIVES * half) * 1e6))
        intervals = [(x.tenant_id, epoch_s(x.started_at),
                      epoch_s(x.ended_at) if x.HasField("ended_at") else None)
                     for page in every_page(self._store.list_leases, since) for x in page.leases]
        return adm.decayed_usage(intervals, now, half)
