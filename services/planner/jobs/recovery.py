"""The scheduler's recovery half (Varuna §4): lost workers and hosts morph a job, a job below its planned size
grows back onto free devices, a fail-stutter straggler is left out. No grpc imports.

A mixin of Scheduler (scheduler.py), which owns the store, the agents' send, the lock and the running jobs;
these methods only act through them. What a morph records (events, the job_morphs row) is in morph.py, the
straggler test in stutter.py.
"""

from __future__ import annotations

import json
import logging
import statistics
import time

from google.protobuf import timestamp_pb2

from ballast.v1 import executor_pb2, fleet_pb2, job_pb2, plan_pb2, store_pb2
from services.planner.jobs import cadence, morph, stutter
from services.planner.jobs.admit import HOLDING, Snapshot
from services.planner.jobs.assign import pipeline_shape
from services.planner.jobs.prepare import plan_inputs, shrink
from services.planner.jobs.running import (
    DEFAULT_MORPH_COST_S,
    GROW_WARMUP,
    GROW_WINDOW,
    PAROLE_CHECK_S,
    PERSIST_WINDOWS,
    RECONNECT_GRACE_S,
    Running,
    devices_of,
    parole_s,
)
from services.planner.plans.calibrate import measured_iteration_s
from services.planner.plans.fleet import executor_dims
from services.planner.plans.make import make_plan
from services.runtime.errors import BallastError, FailedPrecondition
from services.runtime.metrics import MORPHS
from services.runtime.store_api import every_page
from services.specs.parallel import ParallelDims

log = logging.getLogger("ballast.scheduler")
S = job_pb2.JobState


class Recovery:
    """Morph, grow and straggler handling for Scheduler."""

    def _morph_resumed(self, running: Running) -> None:
        """The first iteration after a morph is in: its recovery time is now known."""
        with self._lock:
            morph_id, running.morph_id = running.morph_id, ""
        if morph_id:
            first = timestamp_pb2.Timestamp()
            first.GetCurrentTime()
            try:
                done = self._store.morph_resumed(store_pb2.MorphResumedRequest(id=morph_id, first_iteration_at=first))
                self._recoveries.append(done.recovery_s)
            except BallastError:
                log.exception("could not record the morph's first iteration", extra={"job_id": running.job.id})

    def _lose_after_symptom(self, running: Running) -> None:
        """No other cause arrived within the grace period: a lost peer is all there is to say."""
        with self._lock:
            if running.stopping:
                return
        gone = tuple(h for h in running.hosts if h not in set(self._connected()))
        try:
            if gone:  # the broken link was a host whose agent is gone with its workers
                self._lose(running, morph.HOST_LOST, f"host {', '.join(gone)} is gone (its agent disconnected); "
                           f"{running.symptom}", lost_hosts=gone)
            else:
                self._lose(running, morph.WORKER_LOST, running.symptom)
        except Exception:  # noqa: BLE001 - a timer thread has nobody to raise to; the next exit retries
            with self._lock:
                running.symptom = ""
            log.exception("could not morph the job", extra={"job_id": running.job.id})

    # --- morphing (Varuna §4) -------------------------------------------------------------------------
    def _lose(self, running: Running, cause: str, detail: str, lost_hosts: tuple[str, ...] = ()) -> None:
        """A worker or host is lost: MORPHING, the lost devices' leases end (host_lost), the survivors are
        stopped; once they are gone the job queues to resume from its last checkpoint on what is left."""
        try:
            dims = pipeline_shape(running.plan)
        except FailedPrecondition:
            dims = ParallelDims(pp=max(len(running.plan.stages), 1))
        stages, replicas = dims.pp, dims.dp
        with self._lock:
            if running.stopping:
                return
            running.loss = morph.Loss(cause, detail, time.time(), stages, replicas,
                                      running.job.plan_version or running.plan.version, running.iteration,
                                      tuple(sorted(lost_hosts)))
            running.stopping = f"morphing after {cause.replace('_', ' ')}"
        used = morph.losses_since(self.admission.events(running.job.id), time.time() - morph.HOUR_S)
        if used >= self._max_morphs:
            with self._lock:
                running.stopping, running.loss = "", None
            self._fail(running, f"{detail}; the infrastructure retry budget is spent ({used} morphs in the last "
                                f"hour, at most {self._max_morphs})")
            return
        moved = self._transition(running.job, S.JOB_STATE_MORPHING,
                                 f"{cause.replace('_', ' ')}: {detail}; stopping the other workers to resume from "
                                 "the last checkpoint on the devices left", "MORPHING", running.loss.attributes())
        if moved is None:  # cancelled or ended meanwhile: the survivors are stopped all the same
            with self._lock:
                running.loss = None
        else:
            running.job = moved
            self.admission.lost(moved.id, running.loss)
        for host_id in running.hosts:
            if host_id in lost_hosts:
                self._host_gone(running, host_id)
            else:
                self._instruct(running, host_id, "stop",
                               stop=executor_pb2.StopInstruction(reason=running.stopping))
        self._settle(running)

    def _target(self, job: job_pb2.Job, devices: int) -> tuple[int, float, float]:
        """What a job grows back to, read once as it starts: --max-devices, else its first plan's device count
        (before any morph); the predicted iteration time of its first plan for that count (0: none); and the
        median iteration time the job measured under that plan before it shrank (0: it never ran on it)."""
        plans = sorted(self._store.list_plans(store_pb2.ListPlansRequest(job_id=job.id)).plans,
                       key=lambda p: p.version)
        target = job.spec.max_devices or max([devices] + [devices_of(p) for p in plans[:1]])
        planned = next((p for p in plans if devices_of(p) == target), None)
        if planned is None:
            return target, 0.0, 0.0
        # a shrunken job: how fast it ran on the target layout is known, not predicted
        measured = self._measured_s(job.id, planned.version) if devices < target else 0.0
        return target, planned.prediction.iteration_time_s, measured

    def _measured_s(self, job_id: str, version: int) -> float:
        """The job's median measured iteration time under plan `version` (0: it never ran steadily on it)."""
        request = store_pb2.ListIterationMetricsRequest(job_id=job_id)
        rows = (m for page in every_page(self._store.list_iteration_metrics, request) for m in page.metrics)
        return measured_iteration_s(rows, version, GROW_WARMUP)

    def _measured_on(self, r: Running, devices: int) -> tuple[float, int]:
        """(median iteration time, plan version) of the newest earlier plan of this job on `devices` devices
        that it ran steadily, (0, 0) if none: a job that grew onto a host, or shrank off one, has measured how
        fast it is without it, and a measurement beats the simulator (on CPU hosts that share a machine's cores,
        one worker can read well slower than its peer only because the OS schedules it less). Once per count."""
        if devices not in r.measured_on:
            plans = self._store.list_plans(store_pb2.ListPlansRequest(job_id=r.job.id)).plans
            found = (0.0, 0)
            for p in sorted(plans, key=lambda p: -p.version):
                if p.version != r.plan.version and devices_of(p) == devices:
                    seconds = self._measured_s(r.job.id, p.version)
                    if seconds > 0:
                        found = (seconds, p.version)
                        break
            r.measured_on[devices] = found
        return r.measured_on[devices]

    def _grow(self, snap: Snapshot) -> None:
        """Nothing waits and devices are free: a job below its target grows onto them at its next iteration
        boundary, if the iterations it has left gain more than a morph costs (Varuna's manager grows the job
        when machines come back)."""
        free: dict[str, int] = {}
        for slot in snap.free:
            free[slot.kind] = free.get(slot.kind, 0) + 1
        with self._lock:
            candidates = [r for r in self._running.values() if not r.stopping and r.target > r.world
                          and len(r.recent) == GROW_WINDOW and r.job.state == S.JOB_STATE_RUNNING
                          and not r.job.spec.elastic]  # the elastic pass sizes elastic jobs (elastic.py)
        for r in candidates:
            kind = r.plan.fleet.device.kind
            if free.get(kind, 0) < r.target - r.world:
                continue
            gain, cost = self._growth_gain(r)
            if gain > cost:
                free[kind] -= r.target - r.world
                self._drain_morph(r, morph.GROW, f"{r.target - r.world} {kind} device(s) free: {r.world} -> "
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
        return gain, self._morph_cost(r.job.id) if gain > 0 else DEFAULT_MORPH_COST_S

    def _drain_morph(self, r: Running, cause: str, detail: str, to_devices: int = 0) -> None:
        """MORPHING with every worker alive (grow, or leaving a straggler out): they drain to a checkpoint at an
        agreed boundary (nothing is trained again), then the job is re-planned and resumes -- onto its target
        when it grows, onto the devices free (a degraded host's are not) when it sheds a straggler."""
        dims = pipeline_shape(r.plan)
        stages, replicas = dims.pp, dims.dp
        with self._lock:
            if r.stopping:
                return
            r.loss = morph.Loss(cause, detail, time.time(), stages, replicas,
                                r.job.plan_version or r.plan.version, r.iteration, to_devices=to_devices)
            r.stopping = f"morphing: {cause.replace('_', ' ')}"
        moved = self._transition(r.job, S.JOB_STATE_MORPHING, f"{cause}: {detail}; draining to a checkpoint",
                                 "MORPHING", r.loss.attributes())
        if moved is None:
            with self._lock:
                r.stopping, r.loss = "", None
            return
        r.job = moved
        self.admission.lost(moved.id, r.loss)
        for host_id in r.hosts:
            self._instruct(r, host_id, "stop", stop=executor_pb2.StopInstruction(reason=r.stopping, checkpoint=True))

    def _check_stutter(self, r: Running) -> None:
        """A persistent straggler is reported (event STRAGGLER, with the evidence); if the job is predicted
        faster without its device by more than a morph costs over the iterations left, its host is marked
        degraded (the evidence in host_degradations) and the job morphs without it."""
        found = r.watch.straggler()
        r.stutter_seen = r.stutter_seen + 1 if found is not None else 0
        if found is None:
            return
        rank = pipeline_shape(r.plan).rank(pp=found.stage, dp=found.replica)
        host = next((h for h, ranks in r.ranks.items() if rank in ranks), "")
        now = statistics.median(r.recent) if r.recent else 0.0
        devices_left = r.world - len(r.ranks.get(host, []))
        without, source, why_not = self._time_without(r, found, devices_left, now)
        left = r.job.spec.iterations - r.iteration
        gain = (now - without) * left if without is not None else 0.0
        cost = self._morph_cost(r.job.id)
        # two windows in a row: one slow window is as often a busy neighbour as a slow host
        leave = bool(host) and without is not None and gain > cost and r.stutter_seen >= PERSIST_WINDOWS
        detail = (f"rank {rank} (stage {found.stage}, replica {found.replica}) on host {host} computes "
                  f"{found.ratio:.2f}x its peers' median over {found.window} iterations")
        verdict = (f"{source} against {now:.4f} s measured now: {gain:.1f} s saved over {left} iterations, a "
                   f"morph costs {cost:.1f} s" if without is not None else f"it cannot be left out: {why_not}")
        evidence = {"job_id": r.job.id, "rank": rank, "host_id": host, **found.evidence(),
                    "iteration_s": round(now, 6), "predicted_without_s": round(without or 0.0, 6),
                    "without_from": "measured" if r.measured_on.get(devices_left, (0.0, 0))[0] > 0 else "simulator",
                    "gain_s": round(gain, 3), "morph_cost_s": round(cost, 3), "left_out": leave}
        # Leaving it out is always said; keeping it once it persisted two windows (one may be noise on a busy host)
        if leave or (not r.stutter_reported and r.stutter_seen >= PERSIST_WINDOWS):
            r.stutter_reported = True
            self._store.append_job_event(store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
                job_id=r.job.id, type="STRAGGLER", message=f"{detail}; {verdict}; "
                                                           + ("leaving it out" if leave else "keeping it for now"),
                attributes={k: str(v) for k, v in evidence.items()})))
        if not leave:
            return
        try:
            self._store.mark_host_degraded(store_pb2.MarkHostDegradedRequest(
                id=host, reason=detail, evidence_json=json.dumps(evidence), job_id=r.job.id))
        except BallastError:
            log.exception("could not mark the host degraded", extra={"host_id": host})
            return  # without the mark admission would hand the same device back
        self._caught[host] = self._caught.get(host, 0) + 1
        self._drain_morph(r, morph.STRAGGLER, f"{detail}; {verdict}")

    def _stutter_watch(self, plan: plan_pb2.Plan, machines: list[str]) -> stutter.StutterWatch:
        """The job's straggler test; `machines` has each worker's machine (agents on one address share it). CPU
        workers sharing a machine's cores get the wider threshold: there the OS scheduler alone makes one read
        up to ~40% slower than its peer (faults.py), which is not a slow host."""
        shared = plan.fleet.device.kind == "cpu" and len(set(machines)) < len(machines)
        return stutter.StutterWatch(threshold=self._stutter_thresholds[1 if shared else 0])

    def _machines(self, ranks: dict[str, list[int]]) -> list[str]:
        """Each worker's machine address (a host gone from the store counts as a machine of its own)."""
        out = []
        for host_id, workers in ranks.items():
            try:
                address = self._store.get_host(store_pb2.GetRequest(id=host_id)).address or host_id
            except BallastError:
                address = host_id
            out += [address] * len(workers)
        return out

    def _time_without(self, r: Running, found: stutter.Finding, devices: int,
                      now: float) -> tuple[float | None, str, str]:
        """(iteration time expected on the `devices` left without the straggler, where that figure comes from,
        why there is none): the job's own measurement on that many devices if it has one, else the simulator's
        re-plan corrected by the current plan's error (stutter.faster_without)."""
        measured, version = self._measured_on(r, devices) if devices > 0 else (0.0, 0)
        if measured > 0:
            return measured, f"the job measured {measured:.4f} s/iteration on {devices} device(s) (plan v{version})", ""
        predicted, why_not = self._replanned_s(r, devices)
        without = stutter.faster_without(now, found, r.plan.prediction.iteration_time_s, predicted)
        return without, (f"the simulator predicts {without or 0.0:.4f} s/iteration re-planned on the {devices} "
                         f"device(s) left"), why_not

    def _replanned_s(self, r: Running, devices: int) -> tuple[float, str]:
        """The simulator's iteration time for this job re-planned on `devices` as a morph would (Varuna's P x D
        at the same global batch unless the job chose an engine); (0, why) when no plan fits. Once per count."""
        if devices in r.replanned:
            return r.replanned[devices]
        if devices < 1:
            found = (0.0, "no device would be left")
        else:
            try:
                profile = self._store.get_profile(store_pb2.GetRequest(id=r.plan.profile_id))
                plan = make_plan(profile, shrink(r.plan.fleet, devices),
                                 plan_inputs(r.job, executor_dims(self._store), devices,
                                             plan_pb2.PLAN_ENGINE_VARUNA))
                found = (plan.prediction.iteration_time_s, "")
            except BallastError as e:
                found = (0.0, f"no plan fits {devices} device(s): {e}")
        r.replanned[devices] = found
        return found

    def _parole(self, now: float | None = None) -> None:
        """A degraded host that still heartbeats rejoins on trial once its parole is served: degraded_parole_s,
        doubled for every earlier time it was caught, at most MAX_PAROLE_S. Its next job is the probe: the
        straggler watch judges it against its peers again and marks it again (a longer parole) if it is still
        slow. Checked every PAROLE_CHECK_S; a planner restart forgets the earlier catches (the store keeps them)."""
        now = time.time() if now is None else now
        if not self._parole_s or now < self._parole_at:
            return
        self._parole_at = now + PAROLE_CHECK_S
        request = store_pb2.ListHostsRequest(state=fleet_pb2.HOST_STATE_ONLINE)
        for host in [h for page in every_page(self._store.list_hosts, request) for h in page.hosts
                     if h.degraded_reason]:
            caught = max(self._caught.get(host.id, 1), 1)
            served = parole_s(self._parole_s, caught)
            since = host.degraded_at.ToSeconds() if host.HasField("degraded_at") else now
            if now - since < served:
                continue
            try:
                self._store.clear_host_degraded(store_pb2.ClearHostDegradedRequest(
                    id=host.id, reason=f"parole: degraded {now - since:.0f} s (parole {served:.0f} s after being "
                                       f"caught {caught} time(s)); it rejoins on trial, and a job that finds it "
                                       f"slow again marks it for {parole_s(self._parole_s, caught + 1):.0f} s"))
            except BallastError:
                log.exception("could not clear a degraded host's mark", extra={"host_id": host.id})

    # --- checkpoint cadence ---------------------------------------------------------------------------
    def _with_cadence(self, job: job_pb2.Job, plan: plan_pb2.Plan, devices: int) -> tuple[job_pb2.JobSpec, str]:
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
                                   plan.prediction.iteration_time_s, max_interval_s=self._checkpoint_max_s,
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

    def _morph_cost(self, job_id: str) -> float:
        """What a morph costs (detection to first resumed iteration): the job's last one, else the median of
        the fleet's recent ones, else a conservative default until any was measured."""
        morphs = self._store.list_morphs(store_pb2.ListMorphsRequest(job_id=job_id)).morphs
        costs = [m.recovery_s for m in morphs if m.recovery_s > 0]
        if costs:
            return costs[-1]
        recent = sorted(self._recoveries)
        return recent[len(recent) // 2] if recent else DEFAULT_MORPH_COST_S

    def _host_gone(self, running: Running, host_id: str) -> None:
        """Its ranks will never report: count them gone, and end its devices' leases as lost."""
        with self._lock:
            running.exited.update(running.ranks.get(host_id, []))
        self._store.end_leases(store_pb2.EndLeasesRequest(
            job_id=running.job.id, reason=fleet_pb2.LEASE_END_REASON_HOST_LOST, host_id=host_id))

    def _requeue_lost(self, running: Running) -> None:
        """Every survivor is gone: give back their devices and queue the job to resume, re-planned for what
        is free (admit.py lets a morphing job run on fewer devices)."""
        self._store.end_leases(store_pb2.EndLeasesRequest(job_id=running.job.id,
                                                          reason=fleet_pb2.LEASE_END_REASON_MORPHED))
        resume = self.admission.resume_point(running.job.id)
        where = f"from iteration {resume.iteration}" if resume else "from the start (no complete checkpoint)"
        moved = self._transition(running.job, S.JOB_STATE_QUEUED, f"waiting to resume {where} on the devices "
                                 "free", "QUEUED", {"reason": "morphing",
                                                    "checkpoint_iteration": str(resume.iteration if resume else 0)})
        if moved is not None and running.loss is not None and running.loss.cause in morph.CHOSEN:
            # planned for the devices it grows onto, or the count the elastic allocation gave it
            resize = running.loss.cause == morph.RESIZE
            self._replan_for(moved, running.loss.to_devices or running.target, None,
                             "the count the elastic allocation gave it" if resize else "")

    def _record_morph(self, job: job_pb2.Job, loss: morph.Loss, stages: int, replicas: int,
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
            stored = self._store.record_morph(store_pb2.RecordMorphRequest(morph=row)).id
            MORPHS.labels(loss.cause).inc()
            return stored
        except BallastError:
            log.exception("could not record the morph", extra={"job_id": job.id})
            return ""

    def _watch_hosts(self) -> None:
        """A job's host whose agent stays away HOST_LOST_S is lost: the job morphs without it (or, already
        stopping, stops counting on its ranks). A restarted planner first adopts the jobs the store says run."""
        if not self._adopted:
            for state in HOLDING:
                for job in self._jobs(state):
                    self._tracked(job.id)
            self._adopted = True
        connected, now = set(self._connected()), time.monotonic()
        self._missing = {h: t for h, t in self._missing.items() if h not in connected}
        if now - self._started < RECONNECT_GRACE_S:
            return
        with self._lock:
            running = list(self._running.values())
        for r in running:
            lost = tuple(h for h in r.hosts if h not in connected
                         and now - self._missing.setdefault(h, now) >= self._host_lost_s)
            if not lost:
                continue
            names = ", ".join(lost)
            if not r.stopping:
                self._lose(r, morph.HOST_LOST, f"host {names} stopped answering for {self._host_lost_s:.0f} s",
                           lost_hosts=lost)
                continue
            for host_id in lost:
                if not set(r.ranks.get(host_id, [])) <= r.exited:
                    self._host_gone(r, host_id)
            self._settle(r)

