"""New host classes calibrate on arrival (issue 45): the first job on a host class is not priced blind.

A calibration (cost/calibration.py) is learnt from the runs a host class has stored; a class that has none
prices its first jobs from profiles alone, and on this 2-core machine that read 60% fast. So when the online
fleet forms a host class (device kind, cores, workers per machine) with no calibration, the scheduler runs a
short known workload on all of it first -- a small GPT trained as one stage over every device, then as a
pipeline over them, WORKLOAD_ITERATIONS each -- and the class's calibration is fitted from those runs by the
same Celery task that fits it after any job. User jobs planned meanwhile wait (QUEUED, with the reason) and are
planned again once the fit is stored, so the first user job is priced with it.

The hosts must settle first (SETTLE_S without one joining or leaving: agents started together register a few
seconds apart), and nothing waits forever: the arrival gives up (the class stays uncalibrated, as before) when
its jobs fail, or when the workload has not finished within GIVE_UP_S (busy devices, a broken fit).
No grpc imports; the scheduler calls `update` once per admission pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ballast.v1 import common_pb2, fleet_pb2, job_pb2, model_pb2, queue_pb2, store_pb2
from services.planner.jobs.prepare import MEASURED_KINDS
from services.planner.plans.calibrate import host_class
from services.planner.plans.fleet import usable
from services.runtime.errors import BallastError, NotFound
from services.runtime.store_api import Store, every_page

log = logging.getLogger("ballast.arrival")
S = job_pb2.JobState
NAME = "calibrate-on-arrival"  # the workload's job names start with it: `ballast jobs` tells them apart
WORKLOAD_ITERATIONS = 30  # past the fit's warm-up (3) and its minimum (20 iterations) with some to spare
SETTLE_S = 3.0  # the online hosts unchanged this long before a class is judged (agents start seconds apart)
GIVE_UP_S = 600.0  # an arrival not done by then is abandoned: the class is planned uncalibrated
WAITING = "waiting: host class"  # the held jobs' message starts with it
LIVE = (S.JOB_STATE_SUBMITTED, S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING, S.JOB_STATE_SCHEDULED,
        S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING)
DONE = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)

# The known workload: a GPT small enough that one iteration over a few CPU workers takes tens of milliseconds,
# different from the zoo's demo model so that a demo's prediction is not fitted on itself.
PROBE = model_pb2.ModelSpec(
    name="calibration-probe", family=model_pb2.MODEL_FAMILY_GPT, dtype=common_pb2.DTYPE_FP32, dropout=0.0,
    transformer=model_pb2.TransformerConfig(num_layers=4, hidden_size=96, num_heads=4, ffn_hidden_size=384,
                                          vocab_size=768, seq_length=96, tie_embeddings=True))


def workload(key: str, devices: int) -> list[job_pb2.JobSpec]:
    """The jobs that calibrate a class of `devices` workers: all of them as one data-parallel stage, then (two or
    more) as a pipeline, so the fit sees stages of different sizes and both all-reduce and p2p traffic."""
    # (stages, micro-batches): whole micro-batches on one stage, then small ones through a pipeline, so the fit
    # sees per-micro-batch predictions 8x apart and can tell a fixed cost per micro-batch from a slower machine
    layouts = [(1, 1), (1, 8)] if devices == 1 else [(1, 1), (min(devices, PROBE.transformer.num_layers + 2), 8)]
    return [job_pb2.JobSpec(
        name=f"{NAME} {key} {stages}x{micro_batches}", model=PROBE, global_batch_size=8 * devices,
        iterations=WORKLOAD_ITERATIONS, seed=1, pipeline_stages=stages, micro_batches=micro_batches,
        min_devices=devices, max_devices=devices, optimizer=job_pb2.OptimizerSpec(name="adam", learning_rate=1e-3))
        for stages, micro_batches in layouts]


def is_workload(job: job_pb2.Job) -> bool:
    return job.spec.name.startswith(NAME + " ")


@dataclass
class Pending:
    """One class being calibrated: its workload jobs and, once they ended, the one fit queued over their runs."""

    key: str
    devices: int
    since: float
    job_ids: list[str] = field(default_factory=list)
    request: str = ""  # the calibration request fitted on all of the workload's runs
    held: set[str] = field(default_factory=set)  # user jobs it held back, planned again when it is done
    given_up: bool = False  # ended without a fit: the held jobs' plans stand as they are


@dataclass(frozen=True)
class Gate:
    """What one admission pass does about arrivals: hold `reason` jobs back (all but the workload's), and plan
    `replan` again (held while their class was calibrated; it is now, or was given up)."""

    reason: str = ""
    workload: frozenset[str] = frozenset()
    replan: tuple[str, ...] = ()
    key: str = ""


Submit = Callable[[job_pb2.JobSpec], job_pb2.Job]
Calibrate = Callable[[str, Sequence[str]], queue_pb2.QueuedRequest]  # (a job, the runs to fit on): queued


class Arrival:
    """Calibrates each host class the online fleet forms before user jobs are planned on it (module docstring)."""

    def __init__(self, store: Store, submit: Submit, calibrate: Calibrate, min_iterations: int,
                 clock: Callable[[], float] = time.monotonic):
        self._store, self._submit, self._calibrate = store, submit, calibrate
        self._min_iterations, self._clock = min_iterations, clock
        self._known: set[str] = set()  # classes calibrated (or given up on): never judged again
        self._pending: Pending | None = None
        self._hosts: frozenset[str] = frozenset()
        self._hosts_at = clock()

    def update(self, online: Sequence[fleet_pb2.Host], queued: Sequence[str]) -> Gate:
        """Judge the online fleet's class; start, follow or end its arrival. `queued`: the jobs waiting to start."""
        now = self._clock()
        ids = frozenset(h.id for h in online)
        if ids != self._hosts:
            self._hosts, self._hosts_at = ids, now
            if self._pending is not None and not self._pending.job_ids:  # still settling: judge the fleet anew
                self._pending = None
        pending = self._pending
        if pending is None:
            pending = self._start(online, now)
            if pending is None:
                return Gate()
        if not self._done(pending, now):
            pending.held.update(j for j in queued if j not in pending.job_ids)
            return Gate(reason=f"{WAITING} {pending.key} is calibrating on arrival (jobs {', '.join(pending.job_ids)})"
                        if pending.job_ids else f"{WAITING} {pending.key} is new: calibrating it once its hosts "
                                                f"settle", workload=frozenset(pending.job_ids), key=pending.key)
        self._pending = None
        self._known.add(pending.key)
        again = () if pending.given_up else tuple(sorted(j for j in pending.held if j in set(queued)))
        return Gate(replan=again, key=pending.key)

    def _start(self, online: Sequence[fleet_pb2.Host], now: float) -> Pending | None:
        """The pending arrival of the online fleet's class, if it has no calibration yet."""
        if not online or not all(usable(h) and h.devices and all(d.spec.kind in MEASURED_KINDS for d in h.devices)
                                 for h in online):  # stops at the first host that is not: this runs every pass
            return None  # nothing measured here, or a mixed fleet: its jobs' runs calibrate it, as before
        measured = list(online)
        devices = sum(len(h.devices) for h in measured)
        fleet = fleet_pb2.Fleet(device=fleet_pb2.DeviceSpec(kind=measured[0].devices[0].spec.kind),
                                nodes=1, devices_per_node=devices)
        key = host_class(fleet, measured, devices).key
        if key in self._known:
            return None
        try:
            self._store.get_calibration(store_pb2.GetCalibrationRequest(host_class=key,
                                                                        min_iterations=self._min_iterations))
            self._known.add(key)
            return None
        except NotFound:
            pass
        self._pending = Pending(key, devices, now)
        return self._pending

    def _done(self, pending: Pending, now: float) -> bool:
        """Whether the arrival is over: its calibration stored, or given up."""
        if now - pending.since > GIVE_UP_S:
            log.warning("calibration on arrival given up: not done in time", extra={"host_class": pending.key})
            pending.given_up = True
            return True
        if not pending.job_ids:
            if now - self._hosts_at < SETTLE_S:
                return False
            pending.job_ids = self._adopt(pending.key) or [
                self._submit(spec).id for spec in workload(pending.key, pending.devices)]
            log.info("calibrating a new host class", extra={"host_class": pending.key, "jobs": pending.job_ids})
            return False
        jobs = {j: self._store.get_job(store_pb2.GetRequest(id=j)) for j in pending.job_ids}
        if any(job.state not in DONE for job in jobs.values()):
            return False
        succeeded = [j for j, job in jobs.items() if job.state == S.JOB_STATE_SUCCEEDED]
        if not succeeded:
            log.warning("calibration on arrival given up: its jobs failed", extra={"host_class": pending.key})
            pending.given_up = True
            return True
        if not pending.request:  # one fit over every run of the workload (the same request again after a restart)
            pending.request = self._calibrate(succeeded[-1], succeeded).id
        return self._store.get_queued_request(store_pb2.GetRequest(id=pending.request)).state in (
            queue_pb2.REQUEST_STATE_SUCCEEDED, queue_pb2.REQUEST_STATE_FAILED)

    def _adopt(self, key: str) -> list[str]:
        """The workload jobs of `key` already in the store (a planner restarted mid-arrival), oldest first."""
        found = [j for state in LIVE for page in every_page(self._store.list_jobs, store_pb2.ListJobsRequest(
            state=state)) for j in page.jobs if is_workload(j) and j.spec.name.split(" ")[1] == key]
        return [j.id for j in sorted(found, key=lambda j: j.created_at.ToNanoseconds())]


def submit_as(store: Store, send: Callable[[str], None]) -> Submit:
    """Submit a workload job as the platform (lifecycle.submit: stored, its preparation queued)."""
    from ballast.v1 import services_pb2
    from services.planner.jobs import lifecycle

    def submit(spec: job_pb2.JobSpec) -> job_pb2.Job:
        try:
            return lifecycle.submit(store, services_pb2.SubmitJobRequest(spec=spec), send)
        except BallastError:
            log.exception("could not submit the calibration workload", extra={"job": spec.name})
            raise
    return submit
