"""What admission reads from the store: the queue, the fleet, its leases and policy, as the pure engine's
inputs (services/planner/admission). No grpc imports; the scheduler acts on the decision.

A queued job's demand comes from its plan (stages x replicas devices of the plan's kind, predicted run time =
iterations left x predicted iteration time; iterations left count from its last complete checkpoint once it
was preempted or lost a worker or host). A job that morphs after a loss may be re-planned for any device count
up to its plan's (Varuna: P x D <= G at the same global batch). Running jobs are the live leases grouped by
job. Fair share is each tenant's decayed device-seconds over the leases of the last few half-lives.

Hosts, jobs and leases are kept in memory and re-read only where they changed (fleet_hosts.py, active.py), and
a waiting job's demand is built once per change of the job, its history or the policy, so a pass costs about
the same with 50 or 5,000 jobs queued.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

from google.protobuf import timestamp_pb2

from ballast.v1 import common_pb2, fleet_pb2, job_pb2, plan_pb2, store_pb2
from services.planner import admission as adm
from services.planner.jobs import morph
from services.planner.jobs.active import WAITING, JobReader, LeaseBook, LeaseReader
from services.planner.jobs.assign import pipeline_shape
from services.planner.jobs.changes import Delta
from services.planner.jobs.fleet_hosts import FleetHosts, HostReader
from services.planner.plans.fleet import usable
from services.runtime.errors import BallastError, FailedPrecondition
from services.runtime.store_api import Store, every_page
from services.specs import policy as fleet_policy

S = job_pb2.JobState
PLANS_PER_CALL, PLANS_PAGE = 1000, 100  # plans asked for by id per ListPlans call, and per reply page
PLANS_KEPT = 4096  # plans held for jobs that no longer wait or hold devices before the cache drops them
MAX_CLASSES = 1024  # priority classes resolved per policy version, kept; past it the cache starts again
USAGE_HALF_LIVES = 4  # leases older than this many half-lives weigh < 7%: left out of fair share
HOUR_S = 3600.0


def epoch_s(ts: timestamp_pb2.Timestamp) -> float:
    """A proto Timestamp as the engine's epoch seconds (never via naive datetimes and the local zone)."""
    return ts.ToMicroseconds() / 1e6


def node_groups(plan: plan_pb2.Plan, job: job_pb2.Job, need: int, widest: int) -> tuple[int, int]:
    """(group, per_node) of a job's demand: its plan priced `devices_per_node` devices per node, so each such
    group of its ranks must share a host (as many of them as divide its world, and fit the widest host: hosts
    sharing a machine, as in tests, are one node to the planner but separate hosts to admission); and the
    devices per node a re-plan cuts (the job's fleet's, or the widest host's)."""
    if widest < 1:
        return 1, 0
    group = math.gcd(math.gcd(max(1, plan.fleet.devices_per_node), need), widest)
    per_node = job.spec.fleet.devices_per_node if job.spec.HasField("fleet") else widest
    return group, min(max(1, per_node), widest)


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

    def __init__(self, store: Store, **timing: Any):
        """`timing`: the readers' overlap_s, resync_s and clock (changes.py)."""
        self._store = store
        self.fleet = HostReader(store, **timing)  # the hosts, re-read only where they changed
        self.jobs = JobReader(store, **timing)  # the jobs waiting or holding devices, likewise
        self._horizon = 0.0  # epoch seconds: leases ended before it weigh nothing in fair share
        self.leases = LeaseReader(store, lambda: self._horizon, **timing)
        self.book = LeaseBook()  # the live leases by job and fair share's intervals, kept from the reader's deltas
        self._plans: dict[str, plan_pb2.Plan] = {}
        self._shapes: dict[str, int | str] = {}  # plan id -> its world size, or why executors cannot run it
        self._history: dict[str, History] = {}  # job id -> its interruptions, from its events
        self._lock = threading.Lock()
        self._pass = threading.Lock()  # one snapshot at a time keeps the queue below (the scheduler, ListQueue)
        self._queue = _Queue()
        self._dirty: set[str] = set()  # jobs whose demand must be built again (the job or its history moved)
        self._reread = False  # the jobs were read whole since the queue was last built
        self._half_life_s = 0.0  # fair share's half-life the kept leases were read for
        self._held: dict[str, tuple[tuple[adm.Slot, ...], float]] = {}  # running job -> its slots and start
        self._classes: dict[tuple[int, str], fleet_pb2.PriorityClass] = {}  # (policy version, name) -> class

    # --- caches the scheduler updates ---------------------------------------------------------------------
    def plan(self, plan_id: str) -> plan_pb2.Plan:
        with self._lock:
            plan = self._plans.get(plan_id)
        if plan is None:
            plan = self._store.get_plan(store_pb2.GetRequest(id=plan_id))
            with self._lock:
                self._plans[plan_id] = plan
        return plan

    def prefetch_plans(self, plan_ids: Iterable[str]) -> None:
        """Hold the plans not held yet, fetched PLANS_PER_CALL at a time (a planner starting with thousands of
        jobs queued makes a few calls, not one per job)."""
        with self._lock:
            missing = sorted({p for p in plan_ids if p and p not in self._plans})
        for start in range(0, len(missing), PLANS_PER_CALL):
            request = store_pb2.ListPlansRequest(ids=missing[start:start + PLANS_PER_CALL],
                                                 page=common_pb2.PageRequest(page_size=PLANS_PAGE))
            for page in every_page(self._store.list_plans, request):
                with self._lock:
                    self._plans.update((p.id, p) for p in page.plans)

    def history(self, job_id: str, job: job_pb2.Job | None = None) -> History:
        """The job's interruptions, from its events; one that never ran (`job` without started_at) has none,
        and its events are not read."""
        with self._lock:
            known = self._history.get(job_id)
        if known is None and job is not None and not job.HasField("started_at"):
            with self._lock:
                known = self._history.setdefault(job_id, History())
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
            self._dirty.add(job_id)

    def pending_loss(self, job_id: str) -> morph.Loss | None:
        return self.history(job_id).loss

    def lost(self, job_id: str, loss: morph.Loss | None) -> None:
        """The job's morph began (a Loss) or it resumed from it (None)."""
        history = self.history(job_id)
        with self._lock:
            history.loss = loss
            self._dirty.add(job_id)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._history.pop(job_id, None)
            self._dirty.add(job_id)

    def world_size(self, plan: plan_pb2.Plan) -> int:
        """The plan's device count (computed once per plan); FailedPrecondition when executors cannot run it."""
        with self._lock:
            shape = self._shapes.get(plan.id)
        if shape is None:
            try:
                shape = pipeline_shape(plan).world_size
            except FailedPrecondition as exc:
                shape = str(exc)
            with self._lock:
                self._shapes[plan.id] = shape
        if isinstance(shape, str):
            raise FailedPrecondition(shape, field="plan_id", fix="plan the job again")
        return shape

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
    def snapshot(self, connected: set[str], draining: set[str], now: float | None = None,
                 progress: dict[str, int] | None = None) -> Snapshot:
        """The pass's inputs. `progress`: running jobs' iterations as their workers report them (the stored
        ones move only with a state change)."""
        now = time.time() if now is None else now
        store = self._store
        policy_pb = store.get_fleet_policy(store_pb2.GetFleetPolicyRequest())
        tenants = {t.id: t.name for page in every_page(store.list_tenants, store_pb2.ListTenantsRequest())
                   for t in page.tenants}
        rules = {tid: fleet_policy.tenant_policy(policy_pb, name) for tid, name in tenants.items()}
        policy = adm.Policy(quotas={tid: r.device_quota for tid, r in rules.items() if r.device_quota},
                            weights={tid: r.weight for tid, r in rules.items()},
                            max_preemptions_per_hour=fleet_policy.max_preemptions(policy_pb))
        half = fleet_policy.half_life_s(policy_pb)
        with self._pass:
            if half > self._half_life_s > 0:  # fair share now looks further back than the leases kept
                self.leases.forget()
            self._half_life_s = half
            self._horizon = now - USAGE_HALF_LIVES * half
            fleet = self.fleet.read()
            self._note(self.jobs.refresh())
            book = self.book
            book.apply(self.leases.refresh(), self.leases.rows)
            if book.oldest_end() < self._horizon:
                book.apply(self.leases.prune(self.leases.keep), self.leases.rows)
            online = [h for h in fleet.hosts if usable(h) and h.id in connected]
            live = [x for held in book.live.values() for x in held.values()]
            free = [s for h in online if book.held_on[h.id] < len(fleet.slots[h.id])  # hosts with a device free
                    for s in fleet.slots[h.id] if (s.host_id, s.device_index) not in book.leased]
            kinds = set().union(*(fleet.kinds[h.id] for h in online))
            snap = Snapshot(now, [], free, [], policy, {}, kinds, {}, {}, fleet.by_id, policy_pb, tenants, {},
                            live=live, online=online)
            snap.usage = adm.counted_usage(book.intervals.items(), now, half)
            self._waiting(snap, fleet)
            self._holdings(snap, draining, progress or {})
            self._prune()
        return snap

    def _prune(self) -> None:
        """Drop the plans (and their shapes) of jobs that no longer wait or hold devices once more than
        PLANS_KEPT of them are held: a planner that runs for months reads every job's plan once, and would
        otherwise keep them all."""
        in_use = {job.plan_id for job in self.jobs.rows.values()}
        with self._lock:
            if len(self._plans) - len(in_use) <= PLANS_KEPT:
                return
            self._plans = {plan_id: plan for plan_id, plan in self._plans.items() if plan_id in in_use}
            self._shapes = {plan_id: shape for plan_id, shape in self._shapes.items() if plan_id in in_use}

    def _note(self, delta: Delta[job_pb2.Job]) -> None:
        """Mark what a refresh of the jobs changed as due for rebuilding before anything else can fail: a pass
        that fails later leaves it due for the next one, not forgotten until the next whole read."""
        with self._lock:
            self._reread = self._reread or delta.whole
            self._dirty.update(new.id for _, new in delta.put)
            self._dirty.update(old.id for old in delta.gone)

    def _waiting(self, snap: Snapshot, fleet: FleetHosts) -> None:
        """The waiting jobs' demands into `snap`, each built again only when the job, its history, the policy
        or the devices the fleet offers changed: a pass costs the same with 50 or 5,000 jobs queued."""
        queue, rows = self._queue, self.jobs.rows
        basis = (snap.fleet_policy.version, dict(fleet.offered))
        with self._lock:
            dirty, self._dirty, reread, self._reread = self._dirty, set(), self._reread, False
        if basis != queue.basis:
            queue.clear()
            dirty = {job_id for job_id, job in rows.items() if job.state in WAITING}
            queue.basis = basis
        elif reread:  # rows read anew: build again those that differ from the kept ones, either way
            dirty.update(job_id for job_id, held in queue.jobs.items() if job_id not in rows
                         or not self.jobs.same(held, rows[job_id]))
            dirty.update(job_id for job_id, job in rows.items() if job.state in WAITING and job_id not in queue.jobs)
        pending = list(dirty)
        try:
            self.prefetch_plans(rows[j].plan_id for j in pending if j in rows and rows[j].state in WAITING)
            while pending:
                job_id = pending[-1]
                queue.drop(job_id)
                job = rows.get(job_id)
                if job is not None and job.state in WAITING and job.plan_id:
                    self._demand(snap, job, fleet)
                pending.pop()
        finally:  # the store failed part way: what is left is built by the next pass
            if pending:
                with self._lock:
                    self._dirty.update(pending)
        snap.queue = list(queue.demands.values())
        snap.jobs, snap.plans, snap.classes = dict(queue.jobs), dict(queue.plans), dict(queue.classes)
        snap.preemptions, snap.unrunnable = dict(queue.preemptions), dict(queue.unrunnable)

    def _class(self, snap: Snapshot, job: job_pb2.Job) -> fleet_pb2.PriorityClass:
        key = (snap.fleet_policy.version, job.spec.priority_class)
        cls = self._classes.get(key)
        if cls is None:
            try:
                cls = fleet_policy.priority_class(snap.fleet_policy, job.spec.priority_class)
            except BallastError:  # the class was removed from the policy since submit: the default applies
                cls = fleet_policy.priority_class(snap.fleet_policy, "")
            if len(self._classes) > MAX_CLASSES:
                self._classes.clear()
            self._classes[key] = cls
        snap.classes[job.id] = cls.name
        return cls

    def _demand(self, snap: Snapshot, job: job_pb2.Job, fleet: FleetHosts) -> None:
        """A waiting job's demand (or why it can never run here) into the kept queue."""
        queue = self._queue
        plan = self.plan(job.plan_id)
        queue.jobs[job.id], queue.plans[job.id] = job, plan
        try:
            need = self.world_size(plan)
        except FailedPrecondition as exc:
            queue.unrunnable[job.id] = str(exc)
            return
        kind = plan.fleet.device.kind
        offered = fleet.offered[kind]
        if fleet.hosts and offered < need:
            queue.unrunnable[job.id] = (f"the plan needs {need} {kind} device(s); the fleet's registered executors "
                                        f"offer {offered}")
            return
        history = self.history(job.id, job)
        queue.preemptions[job.id] = len(history.preempted)
        resume = self.resume_point(job.id) if history.preempted or history.loss else None
        left = job.spec.iterations - (resume.iteration if resume else 0)
        cls = self._class(snap, job)
        queue.classes[job.id] = cls.name
        # A job morphing after a loss may run on fewer devices (P x D <= G, the global batch kept)
        low, high = job.spec.min_devices, job.spec.max_devices
        if history.loss and not high:
            low, high = 1, need
        group, per_node = node_groups(plan, job, need, fleet.widest.get(kind, 0))
        queue.demands[job.id] = adm.Demand(
            job_id=job.id, tenant_id=job.tenant_id, priority=cls.priority, preempts=cls.preempts,
            submitted_at=epoch_s(job.created_at), devices=need, kind=kind,
            duration_s=left * plan.prediction.iteration_time_s,
            duration_high_s=left * plan.prediction.iteration_time_high_s, min_devices=low,
            max_devices=high, preempted=bool(history.preempted), group=group, per_node=per_node)

    def _holdings(self, snap: Snapshot, draining: set[str], progress: dict[str, int]) -> None:
        jobs, held = self.jobs.rows, self._held
        for job_id in self.book.take_moved():
            held.pop(job_id, None)
        for job_id in [j for j in held if j not in self.book.live]:
            del held[job_id]
        for job_id, leases in sorted(self.book.live.items()):
            job = jobs.get(job_id)
            if job is None:  # it holds devices but is no longer active (the scheduler releases them): read it
                job = self._store.get_job(store_pb2.GetRequest(id=job_id))
            snap.jobs[job_id] = job
            cls = self._class(snap, job)
            if job_id not in held:
                hosts = snap.hosts
                slots = tuple(sorted((adm.Slot(x.device.host_id, x.device.device_index, x.device_kind,
                                               hosts[x.device.host_id].name if x.device.host_id in hosts else "")
                                      for x in leases.values()), key=lambda s: s.sort_key))
                held[job_id] = slots, min(epoch_s(x.started_at) for x in leases.values())
            slots, start = held[job_id]
            predicted = 0.0
            if job.plan_id:
                plan = self.plan(job.plan_id)
                snap.plans[job_id] = plan
                done = max(job.iteration, progress.get(job_id, 0))
                predicted = start + max(job.spec.iterations - done, 0) * plan.prediction.iteration_time_s
            hour = [t for t in self.history(job_id, job).preempted if t > snap.now - HOUR_S]
            snap.running.append(adm.Holding(job_id=job_id, tenant_id=job.tenant_id, priority=cls.priority,
                                            slots=slots, predicted_end=predicted or float("inf"),
                                            preemptions_last_hour=len(hour), draining=job_id in draining))


@dataclass
class _Queue:
    """The waiting jobs as the last pass left them, kept from one pass to the next (Reader._waiting)."""

    basis: tuple = ()  # (policy version, devices offered per kind) they were built on
    jobs: dict[str, job_pb2.Job] = field(default_factory=dict)
    plans: dict[str, plan_pb2.Plan] = field(default_factory=dict)
    demands: dict[str, adm.Demand] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    unrunnable: dict[str, str] = field(default_factory=dict)

    def drop(self, job_id: str) -> None:
        for part in (self.jobs, self.plans, self.demands, self.classes, self.preemptions, self.unrunnable):
            part.pop(job_id, None)

    def clear(self) -> None:
        for part in (self.jobs, self.plans, self.demands, self.classes, self.preemptions, self.unrunnable):
            part.clear()
