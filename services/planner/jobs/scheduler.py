"""Running jobs on a shared fleet: admit, lease, start, preempt and follow them, end the job. No grpc imports.

The planner's half of the executor protocol. Every tick is one admission pass (admit.py reads the queue,
leases and policy; services/planner/admission decides): admitted jobs get their devices leased in the store
(which refuses a busy device or a tenant over quota), their ranks placed on exactly those devices (assign.py;
one AssignInstruction per host) and move to RUNNING; jobs that must wait move to QUEUED with the reason; a
victim of preemption is drained (its ranks checkpoint at an agreed iteration boundary and exit) and goes back
to QUEUED, to resume from that checkpoint when admitted again. CANCELLING jobs get a Stop on every host.
Agent messages arrive through `on_message`: per-iteration StageStats become iteration metrics
(metrics.py: the plan's predicted iteration time, and the stage's predicted compute and peak memory, beside
the measured ones and their breakdown, so the estimator's error is a query),
worker exits end the job -- SUCCEEDED once every rank finished, FAILED at the first worker that did not,
after a Stop to the survivors (they would otherwise block in a collective until its timeout), CANCELLED
once a cancelled job's workers are gone -- and per-rank checkpoint parts become one stored checkpoint
when every layer is in. Jobs submitted with online_repartition are kept balanced while they run
(rebalance.py: training monitor, SRP planner, live layer migration).

The scheduler composes collaborators rather than inheriting them: Recovery (recovery.py: morph on a lost
worker or host, grow, the host watch), Stragglers (stragglers.py: the fail-stutter watch and the degraded
hosts' parole), ElasticPass (elastic.py: resizing elastic jobs), Cadence (recovery.py: the checkpoint interval)
and Rebalancer. What they share is one SchedulerState (state.py: the store, the lock, the running jobs, what a
morph costs); each keeps the rest as its own, and calls back into the scheduler only through what it was given
(Recovery's Moves, a drain, a re-plan).
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ballast.v1 import executor_pb2, fleet_pb2, job_pb2, plan_pb2, store_pb2
from ballast.windows import first_iteration, time_quantiles, weight
from services.planner import admission as adm
from services.planner.jobs import morph, references, stutter
from services.planner.jobs.active import HOLDING
from services.planner.jobs.admit import Reader, Snapshot, epoch_s
from services.planner.jobs.arrival import Arrival, Gate
from services.planner.jobs.assign import placement, placement_of_assigned_event
from services.planner.jobs.control import TRANSIENT
from services.planner.jobs.elastic import ELASTIC_INTERVAL_S, FAIRNESS_BOUND, MIN_RESIZE_INTERVAL_S, ElasticPass
from services.planner.jobs.hold import StoreHold
from services.planner.jobs.lifecycle import TERMINAL
from services.planner.jobs.metrics import RetainedRows, iteration_metric, observe_iteration, window_iterations
from services.planner.jobs.rebalance import Rebalancer
from services.planner.jobs.recovery import Cadence, Moves, Recovery
from services.planner.jobs.retention import Retention
from services.planner.jobs.running import (
    END_ATTEMPTS,
    GROW_WINDOW,
    HOST_LOST_S,
    MAX_MORPHS_PER_HOUR,
    SYMPTOM_GRACE_S,
    Running,
    is_symptom,
)
from services.planner.jobs.state import SchedulerState
from services.planner.jobs.stragglers import Stragglers
from services.planner.online import OnlineOptions
from services.planner.plans.make import CALIBRATED
from services.runtime.errors import BallastError, FailedPrecondition, NotFound
from services.runtime.metrics import ADMISSION_PASS_SECONDS, forget_job
from services.runtime.ports import free_port
from services.runtime.store_api import Store, every_page
from services.specs.placement import workers_on

log = logging.getLogger("ballast.scheduler")
S = job_pb2.JobState
STOPPED_EXIT = 143  # 128 + SIGTERM: a worker stopped at a boundary (executor/train/worker.py)
LOCAL_ADDRESSES = {"127.0.0.1", "localhost", "::1", ""}
MAX_OWED_CALIBRATIONS = 1000  # past it (a store away for hours) a success is left out of the calibrations
MAX_OWED_CHECKPOINTS = 1000  # complete checkpoints the store did not take yet; past it the oldest goes unrecorded
Send = Callable[[str, executor_pb2.PlannerMessage], None]
class Scheduler:
    """The planner's half of the executor protocol (the module docstring); it composes its collaborators."""

    def __init__(self, store: Store, send: Send, connected: Callable[[], list[str]],
                 checkpoint_root: Path, *, interval_s: float = 0.5,
                 process_group_timeout_s: int = 60, online: OnlineOptions | None = None,
                 replan: Callable[[job_pb2.Job, int, int], None] | None = None,
                 host_lost_s: float = HOST_LOST_S, max_morphs_per_hour: int = MAX_MORPHS_PER_HOUR,
                 checkpoint_max_interval_s: float = 1800.0, degraded_parole_s: float = 0.0,
                 calibrate: Callable[[str], None] | None = None,
                 straggler_thresholds: tuple[float, float] = (stutter.THRESHOLD, stutter.SHARED_CPU_THRESHOLD),
                 elastic_interval_s: float = ELASTIC_INTERVAL_S,
                 elastic_min_resize_interval_s: float = MIN_RESIZE_INTERVAL_S,
                 elastic_fairness_bound: float = FAIRNESS_BOUND, arrival: Arrival | None = None,
                 metrics_window_s: float = 0.0):
        # shared with the collaborators (state.py); the scheduler's code keeps its short names for those parts
        self.state = SchedulerState(store)
        self._store, self._lock, self._running = store, self.state.lock, self.state.running
        self._send, self._connected = send, connected
        self.latest: Snapshot | None = None  # the last admission snapshot (Prometheus reads it: jobs/gauges.py)
        self._calibrate = calibrate  # queues a succeeded job's recalibration of its host class
        self._calibrations_owed: set[str] = set()  # succeeded jobs whose calibration the store did not take yet
        self._arrival = arrival  # calibrates a host class the fleet forms before its first user job (None: off)
        self.gate = Gate()  # the last admission pass's hold for a class calibrating on arrival (`ballast queue`)
        self._adopted = False  # whether the jobs the store says run were taken back (after a restart)
        self._root = checkpoint_root
        self._retention = Retention(store, checkpoint_root)
        self._retention_due: set[str] = set()  # jobs with a new complete checkpoint, or just ended
        self._interval, self._pg_timeout = interval_s, process_group_timeout_s
        self._metrics_window_s = metrics_window_s  # seconds of iterations a worker's stats are summarised over
        self._rows = RetainedRows(lambda rows: store.write_iteration_metrics(  # every job's rows in one call
            store_pb2.WriteIterationMetricsRequest(metrics=rows)), TRANSIENT, isolate=True)
        self._checkpoints = RetainedRows(lambda checkpoints: [store.create_checkpoint(
            store_pb2.CreateCheckpointRequest(checkpoint=c)) for c in checkpoints], TRANSIENT,
            MAX_OWED_CHECKPOINTS, what="checkpoints", part=1)
        self._evaluations = RetainedRows(lambda evaluations: [self._record_evaluation(e) for e in evaluations],
                                         TRANSIENT, MAX_OWED_CHECKPOINTS, what="evaluations", part=1)
        self._events = RetainedRows(lambda events: [store.append_job_event(e) for e in events], TRANSIENT,
                                    MAX_OWED_CHECKPOINTS, what="job_events", part=1)
        self._hold = StoreHold(send, self._events.write)  # jobs wait while the store's disk is full
        self.admission = Reader(store)
        self._replan = replan  # queues a re-plan of a job for a device count (prepare.py); None: never
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when an online job has a full window to decide on
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.rebalancer = Rebalancer(store, send, self._transition, online)
        # the collaborators: each owns its fields, shares only self.state, and calls back only what it is given
        self.recovery = Recovery(self.state, Moves(transition=self._transition, instruct=self._instruct,
                                                   fail=self._fail, settle=self._settle,
                                                   replan_for=self._replan_for),
                                 self.admission, connected, host_lost_s=host_lost_s,
                                 max_morphs_per_hour=max_morphs_per_hour)
        self.stragglers = Stragglers(self.state, self.recovery.drain_morph, thresholds=straggler_thresholds,
                                     degraded_parole_s=degraded_parole_s, hosts=self.admission.fleet.read)
        self.elastic = ElasticPass(self.state, self.recovery.drain_morph, self._replan_for,
                                   interval_s=elastic_interval_s, min_resize_interval_s=elastic_min_resize_interval_s,
                                   fairness_bound=elastic_fairness_bound)
        self.cadence = Cadence(store, checkpoint_max_interval_s)

    # --- loop -----------------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._rows.flush()  # the rows kept for the next tick; a store that is away loses them with this process

    def _loop(self) -> None:
        """A full tick every interval; in between, woken by the stats that make an online job's window full,
        only the rebalancing step (a decision within an iteration of the evidence, not half a second later)."""
        next_tick = time.monotonic() + self._interval
        while not self._stop.is_set():
            woken = self._wake.wait(max(next_tick - time.monotonic(), 0.0))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self._interval
                    self.tick()
                elif woken:
                    self.rebalance()
            except Exception:  # noqa: BLE001 - the loop must outlive a store restart
                log.exception("scheduler tick failed")

    def tick(self) -> None:
        self._rows.flush()  # what a store that was away could not take
        self._checkpoints.flush()
        self._evaluations.flush()
        self._events.flush()
        with self._lock:
            running = list(self._running.values())
        self._hold.update([x.refusal for x in (self._rows, self._checkpoints, self._evaluations, self._events)],
                          running)
        self._retain()
        for job_id in self._owed_calibrations():
            if not self._queue_calibration(job_id):
                break  # the store still refuses: the rest wait for the next tick, not the whole pass
        self._adopt()
        self.recovery.watch_hosts()
        self.stragglers.parole()
        started = time.perf_counter()
        snap, idle = self.admit()
        ADMISSION_PASS_SECONDS.observe(time.perf_counter() - started)
        if snap is not None:
            if idle:  # devices free and nobody waiting for them
                self.recovery.grow(snap)
            self.elastic.run(snap)
        for job in self._jobs(S.JOB_STATE_CANCELLING):
            self._cancel(job)
        self.rebalance()

    def _adopt(self) -> None:
        """A restarted planner first adopts the jobs the store says run (before its hosts are watched)."""
        if not self._adopted:
            for state in HOLDING:
                for job in self._jobs(state):
                    self._tracked(job.id)
            self._adopted = True

    def _retain(self) -> None:
        """Apply the retention of the jobs with a new complete checkpoint (or just ended) since the last tick."""
        with self._lock:
            due, self._retention_due = self._retention_due, set()
        for job_id in sorted(due):
            try:
                self._retention.apply(self._store.get_job(store_pb2.GetRequest(id=job_id)))
            except Exception:  # noqa: BLE001 - its files stay until its next checkpoint; the job goes on
                log.exception("checkpoint retention failed", extra={"job_id": job_id})

    def rebalance(self) -> None:
        for job_id in self.rebalancer.due():
            try:
                self.rebalancer.consider(self._store.get_job(store_pb2.GetRequest(id=job_id)))
            except Exception:  # noqa: BLE001 - one job's failed decision must not hold back the others
                log.exception("rebalancing failed", extra={"job_id": job_id})

    def _jobs(self, state: int) -> list[job_pb2.Job]:
        request = store_pb2.ListJobsRequest(state=state)
        return [j for page in every_page(self._store.list_jobs, request) for j in page.jobs]

    # --- admission ------------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The admission engine's inputs now (also what `ballast queue` lists)."""
        with self._lock:
            draining = {job_id for job_id, r in self._running.items() if r.preempting}
            progress = {job_id: r.iteration for job_id, r in self._running.items()}
        self.latest = self.admission.snapshot(set(self._connected()), draining, progress=progress)
        return self.latest

    def admit(self) -> tuple[Snapshot | None, bool]:
        """One admission pass: free the leases of jobs no longer running, refuse plans the fleet can never
        run, then start, preempt for, and queue jobs as the engine decides. Returns the snapshot it decided on
        unless the pass changed the fleet under it (None: the devices it saw free may not be), and whether
        nothing waited."""
        snap = self.snapshot()
        if self._release_stale(snap):
            return None, False  # the fleet changed under this snapshot: decide on a fresh one next tick
        for job_id, why in sorted(snap.unrunnable.items()):
            self._transition(snap.jobs[job_id], S.JOB_STATE_FAILED, f"cannot run on this fleet: {why}", "FAILED",
                             {"step": "admission"})
        held = self._arrive(snap)
        if not snap.queue:
            return snap, not held
        decision = snap.decide()
        for job_id, slots in decision.admit:
            self._start(snap, job_id, slots)
        for victim, for_job in decision.preempt:
            self._preempt(victim, for_job, snap)
        for job_id, devices in decision.replan:
            self._replan_for(snap.jobs[job_id], devices, snap)
        for job_id, wait in decision.waiting.items():
            job = snap.jobs[job_id]
            if job.state == S.JOB_STATE_SCHEDULED:
                self._transition(job, S.JOB_STATE_QUEUED, f"waiting: {wait.detail}", "QUEUED",
                                 {"reason": wait.reason, "priority_class": snap.classes.get(job_id, "")})
        return (None if decision.admit or decision.preempt or decision.replan else snap), False

    def _arrive(self, snap: Snapshot) -> bool:
        """Hold user jobs back while the fleet's host class calibrates on arrival (jobs/arrival.py), and plan
        again those it held once it is done; they leave this pass's queue. Whether any job was held."""
        if self._arrival is None:
            return False
        gate = self.gate = self._arrival.update(snap.online, [d.job_id for d in snap.queue])
        demands = {d.job_id: d for d in snap.queue}
        for job_id in gate.replan:
            if CALIBRATED not in snap.plans[job_id].explanation:  # planned before the fit was stored
                self._replan_for(snap.jobs[job_id], demands[job_id].devices, snap,
                                 why=f"host class {gate.key} was calibrated on arrival")
        held = [d for d in snap.queue if gate.reason and d.job_id not in gate.workload or d.job_id in gate.replan]
        for d in held:
            job = snap.jobs[d.job_id]
            if gate.reason and job.state == S.JOB_STATE_SCHEDULED:
                self._transition(job, S.JOB_STATE_QUEUED, gate.reason, "QUEUED",
                                 {"reason": adm.CALIBRATING, "host_class": gate.key})
        snap.queue = [d for d in snap.queue if d not in held]
        return bool(held)

    def _replan_for(self, job: job_pb2.Job, devices: int, snap: Snapshot | None, why: str = "") -> None:
        """The devices its plan asks for are busy but `devices` are free and the job allows that many:
        plan it again for them (QUEUED -> PLANNING -> SCHEDULED, the next plan version)."""
        if self._replan is None:
            return
        if job.state == S.JOB_STATE_SCHEDULED:
            job = self._transition(job, S.JOB_STATE_QUEUED, f"waiting: re-planning for {devices} device(s)",
                                   "QUEUED", {"reason": adm.REPLANNING}) or job
        demand = next((d for d in snap.queue if d.job_id == job.id), None) if snap else None
        planned = demand.devices if demand else 0
        if why:
            why = f"re-planning for {devices} device(s): {why}"
        elif demand is None:  # growing back onto the devices it was first planned for
            why = f"re-planning for the {devices} device(s) it grows onto"
        else:
            allows = (f"the job allows {demand.min_devices}-{demand.max_devices}" if job.spec.max_devices
                      else f"morphing, it may run on 1-{demand.max_devices}")
            why = f"re-planning for the {devices} device(s) free now (the plan asks for {planned}; {allows})"
        moved = self._transition(job, S.JOB_STATE_PLANNING, why, "REPLANNING",
                                 {"devices": str(devices), "planned_devices": str(planned)})
        if moved is not None:
            try:
                morphing = self.admission.pending_loss(job.id) is not None  # Varuna re-plans a morph (§4)
                self._replan(moved, devices, plan_pb2.PLAN_ENGINE_VARUNA if morphing else 0)
            except Exception as exc:  # noqa: BLE001 - the job must not sit in PLANNING with nothing to plan it
                self._transition(moved, S.JOB_STATE_FAILED, f"could not queue the re-plan: {exc}", "FAILED",
                                 {"step": "replanning"})

    def _release_stale(self, snap: Snapshot) -> bool:
        """End the live leases of jobs that hold devices but no longer run (a planner that stopped between
        leasing and starting a job, or a job gone while this planner was away)."""
        stale = sorted({x.job_id for x in snap.live
                        if x.job_id in snap.jobs and snap.jobs[x.job_id].state not in HOLDING})
        released = 0
        for job_id in stale:  # a job that just ended has given its leases back itself: nothing to end
            if self._store.get_job(store_pb2.GetRequest(id=job_id)).state in HOLDING:
                continue  # the snapshot's row was behind the store: it runs, and keeps its devices
            ended = self._store.end_leases(store_pb2.EndLeasesRequest(
                job_id=job_id, reason=fleet_pb2.LEASE_END_REASON_RELEASED)).ended
            if ended:
                log.warning("released the leases of a job that is not running", extra={"job_id": job_id})
            released += ended
        return bool(released)

    def _start(self, snap: Snapshot, job_id: str, slots: tuple[adm.Slot, ...]) -> None:
        """Lease the devices (the store refuses a busy one), then start the workers on exactly them."""
        job, plan = snap.jobs[job_id], snap.plans[job_id]
        try:
            weights = references.initial_directory(self._store, job.spec) if job.spec.init_from else ""
        except BallastError as exc:  # the weights it starts from went since Submit
            self._transition(job, S.JOB_STATE_FAILED, f"init_from: {exc}", "FAILED", {"step": "init_from"})
            return
        placed = placement(job_id, plan, [(snap.hosts[x.host_id], x.device_index) for x in slots], _port)
        refs = [fleet_pb2.DeviceRef(host_id=x.host_id, device_index=x.device_index) for x in slots]
        try:
            placed = self._store.acquire_leases(store_pb2.AcquireLeasesRequest(job_id=job_id, devices=refs,
                                                                               placement=placed)).placement
        except FailedPrecondition as exc:  # another planner, or the quota moved: the next pass decides again
            log.warning("lease refused", extra={"job_id": job_id, "why": str(exc)})
            return
        preempted = bool(self.admission.preemptions(job_id))
        loss = self.admission.pending_loss(job_id)
        resume = self.admission.resume_point(job_id) if preempted or loss else None
        if resume is None and job.spec.resume_from:  # it continues another job until it has a checkpoint of its own
            resume = self.admission.resume_point(job.spec.resume_from)
        start_iteration = resume.iteration if resume else 0
        waited = snap.now - epoch_s(job.updated_at) if job.state == S.JOB_STATE_QUEUED else 0.0
        stages, replicas = placed.stages, placed.replicas  # the placement's, never derived again
        if loss is not None:
            kind, message = "MORPHED", morph.morphed_message(loss, stages, replicas, start_iteration)
        else:
            kind = "RESUMED" if preempted else "ADMITTED"
            where = f"from iteration {start_iteration}" if resume else "from the start"
            message = (f"{kind.lower()} on {len(slots)} device(s) after {waited:.1f} s queued"
                       + (f"; resumes {where}" if preempted else "")
                       + (f"; continues job {job.spec.resume_from} {where}" if resume and not preempted else "")
                       + (f"; starts from the weights of {job.spec.init_from}" if weights and not resume else ""))
        self._store.append_job_event(store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
            job_id=job_id, type=kind, message=message,
            attributes={"devices": str(len(slots)), "waited_s": f"{waited:.3f}",
                        "priority_class": snap.classes.get(job_id, ""), "start_iteration": str(start_iteration),
                        "stages": str(stages), "replicas": str(replicas)})))
        world, rendezvous = placed.world_size, placed.rendezvous
        running = Running.placed(job, plan, placed, iteration=start_iteration, resume_iteration=start_iteration,
                                 watch=self.stragglers.watch_for(plan, [snap.hosts[r.host_id].address or r.host_id
                                                                        for r in placed.ranks]))
        running.target, running.target_iteration_s, running.target_measured_s = self.recovery.target(
            job, placed.world_size)
        with self._lock:
            self._running[job.id] = running
        names = ", ".join(f"{snap.hosts[h].name} ({len(r)})" for h, r in running.ranks.items())  # ids: attributes
        spec, cadence_why = self.cadence.with_cadence(job, plan, world)
        moved = self._transition(job, S.JOB_STATE_RUNNING, f"{world} worker(s) on {names}; rendezvous {rendezvous}; "
                                 f"{cadence_why}", "ASSIGNED",
                                 {"hosts": ",".join(running.hosts), "world_size": str(world),
                                  "rendezvous": rendezvous, "ranks": _ranks_attribute(running.ranks),
                                  "placement_id": placed.id,
                                  "checkpoint_every": str(spec.checkpoint_every), "checkpoint_cadence": cadence_why})
        if moved is None:
            with self._lock:
                self._running.pop(job.id, None)
            self._store.end_leases(store_pb2.EndLeasesRequest(job_id=job_id,
                                                              reason=fleet_pb2.LEASE_END_REASON_RELEASED))
            return
        running.job = moved
        if loss is not None:
            self.admission.lost(job_id, None)
            self._rows.flush()  # the lost incarnation's rows first: recording the morph trims them from its checkpoint
            running.morph_id = self.recovery.record_morph(moved, loss, stages, replicas, start_iteration)
        self.rebalancer.track(moved, plan, running.hosts)
        # an online job's training monitor (vPipe) judges its stages iteration by iteration: its rows stay per iteration
        window = window_iterations(self._metrics_window_s, plan.prediction.iteration_time_s,
                                   job.spec.raw_metrics or job.spec.online_repartition, spec.checkpoint_every)
        for host_id in running.hosts:
            assign = executor_pb2.AssignInstruction(
                plan=plan, placement=placed, process_group_timeout_s=self._pg_timeout, spec=spec,
                workers=workers_on(placed, host_id),
                checkpoint_dir=str(self._root / job.id), metrics_window=window,
                start_iteration=resume.iteration if resume else 0,
                checkpoint_uri=resume.directory if resume else "",
                init_from="" if resume else weights)
            self._instruct(running, host_id, "assign", assign=assign)

    def _preempt(self, victim: str, for_job: str, snap: Snapshot) -> None:
        """Drain the victim: its ranks agree on the next iteration boundary, checkpoint there and exit; its
        exits then send it back to the queue (PREEMPTED), to resume from that checkpoint."""
        running = self._tracked(victim)
        if running is None:
            return
        with self._lock:
            if running.stopping:
                return
            running.preempting = for_job
        cls = snap.classes.get(for_job, "")
        self._store.append_job_event(store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
            job_id=victim, type="PREEMPTING",
            message=f"draining for job {for_job} (priority class {cls}): checkpoint at the next iteration boundary",
            attributes={"for_job": for_job, "priority_class": cls})))
        self._stop_workers(running, f"preempted by job {for_job}", checkpoint=True)

    def _requeue(self, running: Running) -> None:
        """A drained (preempted) job goes back to the queue; the store ends its leases as PREEMPTED."""
        resume = self.admission.resume_point(running.job.id)
        where = f"resumes from iteration {resume.iteration}" if resume else "no complete checkpoint: restarts"
        moved = self._transition(running.job, S.JOB_STATE_QUEUED,
                                 f"preempted by job {running.preempting}; {where}", "PREEMPTED",
                                 {"for_job": running.preempting, "reason": adm.PREEMPTED,
                                  "checkpoint_iteration": str(resume.iteration if resume else 0)})
        if moved is not None:
            self.admission.preempted(running.job.id, epoch_s(moved.updated_at))

    def _instruct(self, running: Running, host_id: str, what: str, **body) -> None:
        message = executor_pb2.PlannerMessage(instruction_id=f"{running.job.id}-{what}-{host_id}",
                                              version=max(1, running.job.plan_version), job_id=running.job.id, **body)
        try:
            self._send(host_id, message)
        except BallastError as exc:  # the agent just went away: its workers' exits will never come
            if what == "stop":
                self.recovery.host_gone(running, host_id)
            else:
                self.recovery.lose(running, morph.HOST_LOST, f"host {host_id} is gone: {exc}", lost_hosts=(host_id,))

    def _tracked(self, job_id: str) -> Running | None:
        """The job's Running, rebuilt from the store after a planner restart: the placement stored with its
        leases says which hosts run which ranks, and agents keep their workers' reports until they reconnect."""
        with self._lock:
            running = self._running.get(job_id)
        if running is not None or not job_id:
            return running
        job = self._store.get_job(store_pb2.GetRequest(id=job_id))
        if job.state not in HOLDING or not job.plan_id:
            return None
        plan = self._store.get_plan(store_pb2.GetRequest(id=job.plan_id))
        try:
            placed = self._store.get_placement(store_pb2.GetPlacementRequest(job_id=job_id))
        except NotFound:  # started by a planner from before stored placements (schema 0022), or never started
            events = self._store.list_job_events(store_pb2.ListJobEventsRequest(job_id=job_id)).events
            assigned = next((e for e in reversed(events) if e.type == "ASSIGNED"), None)
            if assigned is None:
                return None
            placed = placement_of_assigned_event(job_id, plan, assigned)
        running = Running.placed(job, plan, placed)
        running.watch = self.stragglers.watch_for(plan, self.stragglers.machines(running.ranks))
        if job.state == S.JOB_STATE_MORPHING:  # the morph goes on: the survivors' exits (replayed) requeue it
            running.loss = self.admission.pending_loss(job_id)
            running.stopping = "morphing"
        with self._lock:
            running = self._running.setdefault(job_id, running)
        if job.state == S.JOB_STATE_REPARTITIONING:  # the repartition's outcome was lost with the old planner
            job = self._transition(job, S.JOB_STATE_RUNNING, "planner restarted during a repartition; the job "
                                   f"goes on under plan version {job.plan_version}", "REPARTITION_FAILED") or job
        self.rebalancer.track(job, plan, running.hosts)
        return running

    # --- end ------------------------------------------------------------------------------------------
    def _cancel(self, job: job_pb2.Job) -> None:
        running = self._tracked(job.id)
        if running is None:  # nothing of it runs here: nothing to wait for
            self._transition(job, S.JOB_STATE_CANCELLED, "cancelled; no worker was running", "CANCELLED")
            return
        self._stop_workers(running, job.message or "cancelled")

    def _stop_workers(self, running: Running, reason: str, *, checkpoint: bool = False) -> None:
        with self._lock:
            if running.stopping:
                return
            running.stopping = reason
        for host_id in running.hosts:
            self._instruct(running, host_id, "stop",
                           stop=executor_pb2.StopInstruction(reason=reason, checkpoint=checkpoint))

    def _fail(self, running: Running, reason: str) -> None:
        """FAILED first (the reason is what the user needs), then stop the surviving workers."""
        self._transition(running.job, S.JOB_STATE_FAILED, reason[:2000], "FAILED", {"step": "running"})
        self._stop_workers(running, reason)

    def _transition(self, job: job_pb2.Job, state: int, message: str, event: str,
                    attributes: dict[str, str] | None = None, plan_id: str = "") -> job_pb2.Job | None:
        """Compare-and-set from the job's current state; None if it moved on meanwhile (or is terminal).

        An end (SUCCEEDED, FAILED, CANCELLED) is retried when a concurrent transition (the rebalancer's, on
        another thread) wins the race: refusing it would leave a job whose workers are all gone running."""
        for _ in range(END_ATTEMPTS if state in TERMINAL else 1):
            current = self._store.get_job(store_pb2.GetRequest(id=job.id))
            if current.state in TERMINAL:
                self.rebalancer.forget(job.id)
                return None
            if state == S.JOB_STATE_SUCCEEDED and current.state == S.JOB_STATE_REPARTITIONING:
                current = self._transition(current, S.JOB_STATE_RUNNING, "the job finished before the repartition "
                                           "took effect", "REPARTITION_FAILED") or current
            if state in TERMINAL:
                self.rebalancer.forget(job.id)
            try:
                return self._store.transition_job(store_pb2.TransitionJobRequest(
                    id=job.id, state=state, expected_state=current.state, message=message, event_type=event,
                    attributes=attributes or {}, plan_id=plan_id))
            except FailedPrecondition as exc:
                log.warning("transition refused", extra={"job_id": job.id, "why": str(exc)})
        return None

    # --- agent messages -------------------------------------------------------------------------------
    def on_message(self, host_id: str, message: executor_pb2.AgentMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "register":
            self._registered(host_id, message.register)
        elif kind == "heartbeat" and message.heartbeat.stages:
            self._metrics(message.heartbeat.stages)
            if any([self.rebalancer.observe(st) for st in message.heartbeat.stages]):
                self._wake.set()
        elif kind == "worker_exit":
            self._exited(host_id, message.worker_exit)
        elif kind == "ack" and "-repartition-" in message.ack.instruction_id:
            self.rebalancer.acked(host_id, message.ack.instruction_id.split("-repartition-")[0], message.ack)
        elif kind == "ack" and not message.ack.ok:
            self._refused(host_id, message.ack)
        elif kind == "layer_migrated":
            self.rebalancer.migrated(message.layer_migrated)
        elif kind == "checkpoint_written":
            self._checkpoint(message.checkpoint_written)
        elif kind == "evaluated" and self._tracked(message.evaluated.job_id) is not None:
            self._evaluations.write([message.evaluated])

    def _registered(self, host_id: str, register: executor_pb2.RegisterAgent) -> None:
        """An agent (re)connected: a job it runs under a newer plan version than the store says was repartitioned
        while the planner was away (the ack was lost with it), so that version is the job's plan now."""
        for job_id, version in sorted(register.applied_versions.items()):
            running = self._tracked(job_id)
            if running is None or host_id not in running.hosts or (running.loss is not None
                                                                   and host_id in running.loss.lost_hosts):
                self._stop_orphan(host_id, job_id)  # its job ended, or moved on without this host
                continue
            self.rebalancer.adopt(job_id, version, f"host {host_id} runs it: the repartition took effect while the "
                                  "planner was away")

    def _stop_orphan(self, host_id: str, job_id: str) -> None:
        log.warning("stopping workers of a job that no longer runs on this host",
                    extra={"host_id": host_id, "job_id": job_id})
        try:
            self._send(host_id, executor_pb2.PlannerMessage(
                instruction_id=f"{job_id}-stop-orphan-{host_id}", job_id=job_id,
                stop=executor_pb2.StopInstruction(reason="the job no longer runs on this host")))
        except BallastError:
            pass  # gone again: its next registration says the same

    def _metrics(self, stages) -> None:
        rows = []
        watched: dict[str, Running] = {}
        for st in stages:
            running = self._tracked(st.job_id)
            plan = self.rebalancer.plan_for(st.job_id, st.plan_version) or (running.plan if running else None)
            if running and st.has_loss:
                running.last_loss = st.loss
            if running:
                running.iteration = max(running.iteration, st.iteration + 1)
                if st.plan_version == running.plan.version:
                    # a window (executor/telemetry.py) stands for each of its iterations, as far as a bounded
                    # history holds them: the straggler test and the grow check wait as many iterations as before
                    if first_iteration(st) >= running.resume_iteration + stutter.WARMUP:  # first ones are noisy
                        running.watch.observe(st.stage_index, st.replica_index, st.forward_s + st.backward_s,
                                              st.iteration, times=weight(st))
                        watched[running.job.id] = running
                    if st.stage_index == 0 and st.replica_index == 0:
                        running.recent.extend([time_quantiles(st)[0]] * min(weight(st), GROW_WINDOW))
                if running.morph_id and st.iteration >= running.resume_iteration:
                    self.recovery.morph_resumed(running)
            rows.append(iteration_metric(st, plan))
            observe_iteration(rows[-1])
        # stored at the next tick, with every host's rows since in one call (a store that is away gets them later:
        # the workers report each iteration once)
        self._rows.add(rows)
        for running in watched.values():
            if running.iteration >= running.stutter_next and not running.stopping and running.watch.ready():
                running.stutter_next = running.iteration + stutter.WINDOW  # judged again on a fresh window
                self.stragglers.check(running)

    def _exited(self, host_id: str, exit_: executor_pb2.WorkerExit) -> None:
        running = self._tracked(exit_.job_id)
        if running is None:
            log.warning("exit of a worker of an unknown job", extra={"job_id": exit_.job_id, "rank": exit_.rank})
            return
        with self._lock:
            running.exited.add(exit_.rank)
            if exit_.finished:
                running.finished.add(exit_.rank)
            if exit_.drained:
                running.drained.add(exit_.rank)
            stopping = running.stopping or ("drained" if exit_.drained else "")
        if not exit_.finished and not stopping:
            self._unexpected(running, host_id, exit_)
        self._settle(running)

    def _unexpected(self, running: Running, host_id: str, exit_: executor_pb2.WorkerExit) -> None:
        """A worker ended before its job did: a broken collective waits briefly for its cause, lost
        infrastructure (a signal, a crash, a lost peer) morphs the job, an error in the model's code fails it."""
        where = f"stage {exit_.stage_index}, replica {exit_.replica_index}, host {host_id}"
        reason = (f"worker rank {exit_.rank} ({where}) exited with status {exit_.exit_code} after "
                  f"{exit_.iteration} iteration(s): {exit_.message or 'no message'}")
        if is_symptom(exit_.message):  # a peer's failure seen through a collective: wait for the cause
            with self._lock:
                first, running.symptom = not running.symptom, running.symptom or reason
            if first:
                timer = threading.Timer(SYMPTOM_GRACE_S, self.recovery.lose_after_symptom, args=(running,))
                timer.daemon = True
                timer.start()
        elif exit_.infrastructure or exit_.exit_code < 0 or exit_.exit_code == STOPPED_EXIT:
            # a signal is never the model's doing, nor is a stop this planner did not ask for: the worker's host
            # or its agent is going away (an agent shutting down stops its workers, which exit 143)
            self.recovery.lose(running, morph.WORKER_LOST, reason)
        else:  # the model raised: never retried; the traceback is what the user needs
            tail = exit_.traceback[-max(0, 1990 - len(reason)):] if exit_.traceback else ""
            self._fail(running, f"{reason}\n{tail}".strip())

    def _settle(self, running: Running) -> None:
        """Once every rank is accounted for: SUCCEEDED, CANCELLED, back to the queue (drained, or morphing)."""
        with self._lock:
            all_gone = len(running.exited) >= running.world
            all_finished = len(running.finished) == running.world
            stopping = running.stopping or ("drained" if running.drained else "")
        if all_gone:  # its last rows (each rank's last window came before its exit) stored before it ends, goes
            self._rows.flush()  # back to the queue or morphs: its calibration reads them, a morph trims them
        if all_finished:
            loss = f"; final loss {running.last_loss:.4f}" if running.last_loss is not None else ""
            done = self._transition(running.job, S.JOB_STATE_SUCCEEDED,
                                    f"trained {running.job.spec.iterations} iteration(s){loss}", "SUCCEEDED")
            if done is None:  # stored by an earlier attempt whose answer was lost (its exits came back replayed)
                found = self._store.get_job(store_pb2.GetRequest(id=running.job.id))
                done = found if found.state == S.JOB_STATE_SUCCEEDED else None
            if done is not None:
                self._queue_calibration(done.id)
        elif all_gone and stopping:
            job = self._store.get_job(store_pb2.GetRequest(id=running.job.id))
            if job.state == S.JOB_STATE_CANCELLING:
                self._transition(job, S.JOB_STATE_CANCELLED, f"cancelled: {stopping}", "CANCELLED")
            elif running.loss is not None and job.state == S.JOB_STATE_MORPHING:
                running.job = job
                self.recovery.requeue_lost(running)
            elif running.preempting or len(running.drained) == running.world:  # drained, also after a restart
                running.job = job
                running.preempting = running.preempting or "a higher-priority job"
                self._requeue(running)
        if all_gone:
            with self._lock:
                if self._running.get(running.job.id) is running:
                    self._running.pop(running.job.id)
                self._retention_due.add(running.job.id)  # what its last checkpoints left
            self.rebalancer.forget(running.job.id)
            self._hold.forget(running.job.id)
            forget_job(running.job.id)

    def _queue_calibration(self, job_id: str) -> bool:
        """Queue the succeeded job's recalibration (the queue dedupes a repeat); one the store did not take is
        owed and tried again each tick, so a store that was away does not cost the next plans its lesson.
        False when the store refused it."""
        if self._calibrate is None:
            return True
        try:
            self._calibrate(job_id)
        except Exception:  # noqa: BLE001 - the job succeeded; only the calibration waits
            with self._lock:
                kept = job_id in self._calibrations_owed or len(self._calibrations_owed) < MAX_OWED_CALIBRATIONS
                if kept:
                    self._calibrations_owed.add(job_id)
            if kept:
                log.warning("could not queue the job's calibration yet; trying again", exc_info=True,
                            extra={"job_id": job_id})
            else:
                log.error("could not queue the job's calibration; too many owed already, its run is left out",
                          exc_info=True, extra={"job_id": job_id})
            return False
        with self._lock:
            self._calibrations_owed.discard(job_id)
        return True

    def _owed_calibrations(self) -> list[str]:
        with self._lock:
            return sorted(self._calibrations_owed)

    def _refused(self, host_id: str, ack: executor_pb2.InstructionAck) -> None:
        job_id = ack.instruction_id.split("-assign-")[0] if "-assign-" in ack.instruction_id else ""
        running = self._tracked(job_id)
        if running is not None:
            self._fail(running, f"host {host_id} could not start its workers: {ack.message}")

    def _checkpoint_failed(self, running: Running, written: executor_pb2.CheckpointWritten) -> None:
        """One CHECKPOINT_FAILED event per checkpoint (each rank that met the error reports it); the job goes on."""
        ck = written.checkpoint
        with self._lock:
            if ck.iteration in running.failed_checkpoints:
                return
            running.failed_checkpoints.add(ck.iteration)
        self._events.write([store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
            job_id=ck.job_id, type="CHECKPOINT_FAILED",
            message=f"checkpoint after iteration {ck.iteration} not written (rank {written.rank}: {written.error}); "
                    "training goes on, the previous complete checkpoint stays the one to resume from",
            attributes={"iteration": str(ck.iteration), "rank": str(written.rank)}))])  # kept if the store refuses

    def _record_evaluation(self, evaluation: job_pb2.Evaluation) -> None:
        """The evaluation's row, and an EVALUATED event (`ballast watch` shows it)."""
        row = self._store.record_evaluation(store_pb2.RecordEvaluationRequest(evaluation=evaluation))
        self._store.append_job_event(store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
            job_id=row.job_id, type="EVALUATED", message=evaluated_message(row),
            attributes={"iteration": str(row.iteration), "loss": repr(row.loss), "perplexity": repr(row.perplexity),
                        "eval_s": f"{row.eval_s:.3f}", "samples": str(row.samples)})))

    def _checkpoint(self, written: executor_pb2.CheckpointWritten) -> None:
        ck = written.checkpoint
        running = self._tracked(ck.job_id)
        if running is None:
            return
        if written.error:
            self._checkpoint_failed(running, written)
            return
        if ck.complete and written.checkpoint_s > 0:  # rank 0's report: the whole checkpoint's times
            self.cadence.measured(ck.job_id, written.checkpoint_s, written.write_s if written.background else 0.0)
        with self._lock:
            if ck.iteration in running.stored:
                return  # rank 0 vouched for it already: the other ranks' parts add nothing
            parts = running.parts.setdefault(ck.iteration, {})  # by layer: a replayed part adds nothing
            parts.update((layer.layer_index, layer) for layer in ck.layers)
            complete = ck.complete or set(parts) == {layer.layer_index for layer in running.plan.layers}
            if complete:
                running.parts.pop(ck.iteration)
                running.stored.add(ck.iteration)
                layers = list(ck.layers) if ck.complete else list(parts.values())
        if complete:
            # one the store refused for a passing reason is kept and sent again, in order (RetainedRows)
            self._checkpoints.write([job_pb2.Checkpoint(
                job_id=ck.job_id, iteration=ck.iteration, plan_version=ck.plan_version,
                layers=sorted(layers, key=lambda x: x.layer_index), complete=True)])
            with self._lock:
                self._retention_due.add(ck.job_id)


def evaluated_message(row: job_pb2.Evaluation) -> str:
    perplexity = f", perplexity {row.perplexity:.3f}" if row.perplexity else ""
    return (f"iteration {row.iteration}: validation loss {row.loss:.4f}{perplexity} ({row.samples} samples, "
            f"{row.eval_s:.2f} s)")


def _ranks_attribute(ranks: dict[str, list[int]]) -> str:
    """host:0,1;host2:2,3 -- which ranks each host runs, in the ASSIGNED event (a restarted planner reads it)."""
    return ";".join(f"{host}:{','.join(map(str, r))}" for host, r in ranks.items())


def _port(address: str) -> int:
    """A free port when rank 0 is on this machine; elsewhere one from torch's customary range."""
    if address in LOCAL_ADDRESSES or address == socket.gethostname():
        return free_port("")
    return random.randint(29500, 29999)
