"""Holding running jobs while the store cannot record them (issue 41, item 10).

A store whose disk is full refuses every write by name (services/runtime/disk.DiskFull). A job that trained on
through that would leave its iterations, checkpoints and events unrecorded, and a job whose end the store cannot
take would look RUNNING with nothing alive. So while the planner's own writes are refused for a full disk, every
running job is held: its workers wait at one iteration boundary they agree on (executor/train/hold.py), keeping
their devices and their state in memory, and they train on from there once the store takes writes again. The
job is not failed and nothing is trained twice; its HELD event (written once the store is back) says for how
long and why. No grpc imports."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ballast.v1 import executor_pb2, job_pb2, store_pb2
from services.planner.jobs.running import Running
from services.runtime.disk import refused_for_disk
from services.runtime.errors import BallastError

log = logging.getLogger("ballast.hold")

Send = Callable[[str, executor_pb2.PlannerMessage], None]
Record = Callable[[list[store_pb2.AppendJobEventRequest]], object]
REASON = "the store refuses writes: its database disk is full"


@dataclass
class Held:
    """One held job: since when (wall and monotonic), at which reported iteration, on which hosts."""

    since: float
    since_monotonic: float
    iteration: int
    hosts: tuple[str, ...]
    version: int


class StoreHold:
    """Holds every running job while the store refuses writes for a full disk, releases them when it takes
    writes again. `send` reaches an agent; `record` writes events (retained while the store refuses them)."""

    def __init__(self, send: Send, record: Record) -> None:
        self._send, self._record = send, record
        self._held: dict[str, Held] = {}

    @property
    def held(self) -> list[str]:
        return sorted(self._held)

    def update(self, refusals: Sequence[BallastError | None], running: Iterable[Running]) -> None:
        """One scheduler tick: `refusals` are why the store refused the rows the planner still keeps (None for
        each kind it took). A full disk holds every running job not already stopping; a store that takes writes
        again releases them all."""
        if any(refused_for_disk(r) for r in refusals):
            for r in running:
                if r.job.id not in self._held and not r.stopping:
                    self._hold(r)
        elif self._held and all(r is None for r in refusals):  # (a store restarting is not a store with room)
            for job_id in sorted(self._held):
                self._release(job_id)

    def forget(self, job_id: str) -> None:
        """The job ended (its workers are gone): nothing to release."""
        self._held.pop(job_id, None)

    def _hold(self, r: Running) -> None:
        held = Held(time.time(), time.monotonic(), r.iteration, tuple(r.hosts), max(1, r.job.plan_version))
        self._held[r.job.id] = held
        log.warning("holding the job: the store cannot record it", extra={"job_id": r.job.id,
                                                                          "iteration": r.iteration})
        self._instruct(r.job.id, held, True)

    def _release(self, job_id: str) -> None:
        held = self._held.pop(job_id)
        self._instruct(job_id, held, False)
        seconds = time.monotonic() - held.since_monotonic
        log.info("released the job: the store takes writes again", extra={"job_id": job_id, "held_s": seconds})
        self._record([store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(
            job_id=job_id, type="HELD",
            message=f"held after iteration {held.iteration} for {seconds:.1f} s: {REASON}; its workers waited at "
                    "an iteration boundary and train on from there (nothing lost, nothing trained twice)",
            attributes={"iteration": str(held.iteration), "held_s": f"{seconds:.3f}",
                        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(held.since)),
                        "reason": "store_disk_full"}))])

    def _instruct(self, job_id: str, held: Held, hold: bool) -> None:
        """The hold (or release) to every host of the job; a host gone is the loss path's to handle."""
        for host_id in held.hosts:
            message = executor_pb2.PlannerMessage(
                instruction_id=f"{job_id}-hold-{host_id}", version=held.version, job_id=job_id,
                hold=executor_pb2.HoldInstruction(held=hold, reason=REASON if hold else ""))
            try:
                self._send(host_id, message)
            except BallastError as exc:
                log.warning("hold not sent", extra={"job_id": job_id, "host_id": host_id, "error": str(exc)})
