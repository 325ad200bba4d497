"""The straggler watch (Varuna §4.6, fail-stutter) of running jobs, and the parole of the hosts it caught.
No grpc imports.

A collaborator of Scheduler (scheduler.py): each job's StutterWatch (the pure test, stutter.py) is judged
every window; a persistent straggler is reported, and left out when the job is predicted faster without its
device by more than a morph costs: its host is marked degraded and the job drains through Recovery's
drain_morph (recovery.py), the one call this class makes outside itself. A degraded host rejoins on trial
once its parole is served, and the next job that finds it slow marks it again.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable

from ballast.v1 import fleet_pb2, job_pb2, plan_pb2, store_pb2
from services.planner.jobs import morph, stutter
from services.planner.jobs.assign import pipeline_shape
from services.planner.jobs.fleet_hosts import FleetHosts, HostReader
from services.planner.jobs.prepare import plan_inputs, shrink
from services.planner.jobs.recovery import Drain, measured_s
from services.planner.jobs.running import PAROLE_CHECK_S, PERSIST_WINDOWS, Running, devices_of, parole_s
from services.planner.jobs.state import SchedulerState
from services.planner.plans.fleet import executor_dims
from services.planner.plans.make import make_plan
from services.runtime.errors import BallastError, InvalidArgument

log = logging.getLogger("ballast.scheduler")


class Stragglers:
    """Judge running jobs' stragglers, leave a persistent one out, parole the hosts caught."""

    def __init__(self, state: SchedulerState, drain: Drain, *,
                 thresholds: tuple[float, float] = (stutter.THRESHOLD, stutter.SHARED_CPU_THRESHOLD),
                 degraded_parole_s: float = 0.0, hosts: Callable[[], FleetHosts] | None = None):
        if min(thresholds) <= 0:
            raise InvalidArgument(f"straggler thresholds {thresholds} must be positive",
                                  field="straggler_threshold", fix="use e.g. 0.25 (25% slower than its peers)")
        self._state, self._drain = state, drain
        self._thresholds = thresholds  # (distinct machines, CPU workers sharing one)
        self._parole_s, self._parole_at = degraded_parole_s, 0.0
        self.caught: dict[str, int] = {}  # host id -> times marked degraded since this planner started
        self._hosts = hosts or HostReader(state.store).read  # the fleet as admission keeps it (fleet_hosts.py)

    def watch_for(self, plan: plan_pb2.Plan, machines: list[str]) -> stutter.StutterWatch:
        """The job's straggler test; `machines` has each worker's machine (agents on one address share it). CPU
        workers sharing a machine's cores get the wider threshold: there the OS scheduler alone makes one read
        up to ~40% slower than its peer (faults.py), which is not a slow host."""
        shared = plan.fleet.device.kind == "cpu" and len(set(machines)) < len(machines)
        return stutter.StutterWatch(threshold=self._thresholds[1 if shared else 0])

    def machines(self, ranks: dict[str, list[int]]) -> list[str]:
        """Each worker's machine address (a host gone from the store counts as a machine of its own)."""
        out = []
        for host_id, workers in ranks.items():
            try:
                address = self._state.store.get_host(store_pb2.GetRequest(id=host_id)).address or host_id
            except BallastError:
                address = host_id
            out += [address] * len(workers)
        return out

    def check(self, r: Running) -> None:
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
        cost = self._state.morph_costs.of_job(r.job.id)
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
            self._state.store.append_job_event(store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
                job_id=r.job.id, type="STRAGGLER", message=f"{detail}; {verdict}; "
                                                           + ("leaving it out" if leave else "keeping it for now"),
                attributes={k: str(v) for k, v in evidence.items()})))
        if not leave:
            return
        try:
            self._state.store.mark_host_degraded(store_pb2.MarkHostDegradedRequest(
                id=host, reason=detail, evidence_json=json.dumps(evidence), job_id=r.job.id))
        except BallastError:
            log.exception("could not mark the host degraded", extra={"host_id": host})
            return  # without the mark admission would hand the same device back
        self.caught[host] = self.caught.get(host, 0) + 1
        self._drain(r, morph.STRAGGLER, f"{detail}; {verdict}")

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

    def _measured_on(self, r: Running, devices: int) -> tuple[float, int]:
        """(median iteration time, plan version) of the newest earlier plan of this job on `devices` devices
        that it ran steadily, (0, 0) if none: a job that grew onto a host, or shrank off one, has measured how
        fast it is without it, and a measurement beats the simulator (on CPU hosts that share a machine's cores,
        one worker can read well slower than its peer only because the OS schedules it less). Once per count."""
        if devices not in r.measured_on:
            plans = self._state.store.list_plans(store_pb2.ListPlansRequest(job_id=r.job.id)).plans
            found = (0.0, 0)
            for p in sorted(plans, key=lambda p: -p.version):
                if p.version != r.plan.version and devices_of(p) == devices:
                    seconds = measured_s(self._state.store, r.job.id, p.version)
                    if seconds > 0:
                        found = (seconds, p.version)
                        break
            r.measured_on[devices] = found
        return r.measured_on[devices]

    def _replanned_s(self, r: Running, devices: int) -> tuple[float, str]:
        """The simulator's iteration time for this job re-planned on `devices` as a morph would (Varuna's P x D
        at the same global batch unless the job chose an engine); (0, why) when no plan fits. Once per count."""
        if devices in r.replanned:
            return r.replanned[devices]
        if devices < 1:
            found = (0.0, "no device would be left")
        else:
            try:
                profile = self._state.store.get_profile(store_pb2.GetRequest(id=r.plan.profile_id))
                plan = make_plan(profile, shrink(r.plan.fleet, devices),
                                 plan_inputs(r.job, executor_dims(self._state.store), devices,
                                             plan_pb2.PLAN_ENGINE_VARUNA))
                found = (plan.prediction.iteration_time_s, "")
            except BallastError as e:
                found = (0.0, f"no plan fits {devices} device(s): {e}")
        r.replanned[devices] = found
        return found

    def parole(self, now: float | None = None) -> None:
        """A degraded host that still heartbeats rejoins on trial once its parole is served: degraded_parole_s,
        doubled for every earlier time it was caught, at most MAX_PAROLE_S. Its next job is the probe: the
        straggler watch judges it against its peers again and marks it again (a longer parole) if it is still
        slow. Checked every PAROLE_CHECK_S; a planner restart forgets the earlier catches (the store keeps them)."""
        now = time.time() if now is None else now
        if not self._parole_s or now < self._parole_at:
            return
        self._parole_at = now + PAROLE_CHECK_S
        for host in [h for h in self._hosts().hosts if h.state == fleet_pb2.HOST_STATE_ONLINE and h.degraded_reason]:
            caught = max(self.caught.get(host.id, 1), 1)
            served = parole_s(self._parole_s, caught)
            since = host.degraded_at.ToSeconds() if host.HasField("degraded_at") else now
            if now - since < served:
                continue
            try:
                self._state.store.clear_host_degraded(store_pb2.ClearHostDegradedRequest(
                    id=host.id, reason=f"parole: degraded {now - since:.0f} s (parole {served:.0f} s after being "
                                       f"caught {caught} time(s)); it rejoins on trial, and a job that finds it "
                                       f"slow again marks it for {parole_s(self._parole_s, caught + 1):.0f} s"))
            except BallastError:
                log.exception("could not clear a degraded host's mark", extra={"host_id": host.id})
