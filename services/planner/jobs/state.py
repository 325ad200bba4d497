"""What the scheduler and its collaborators (recovery.py, stragglers.py, elastic.py) share, and nothing else.
No grpc imports.

Each collaborator keeps what only it uses as its own attributes; what more than one of them reads or writes
is here, so the sharing is written down: the store, the lock, the running jobs, and what a morph costs.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ballast.v1 import job_pb2, store_pb2
from services.planner.jobs.admit import Snapshot
from services.planner.jobs.running import DEFAULT_MORPH_COST_S, Running
from services.runtime.store_api import Store

# the scheduler's re-plan of a job for a device count (scheduler.py `_replan_for`): (job, devices, snapshot or
# None, why); the collaborators ask for one, the scheduler alone moves the job and queues its plan
Replan = Callable[[job_pb2.Job, int, Snapshot | None, str], None]


class MorphCosts:
    """What a morph costs here (detection to first resumed iteration), as measured: recovery records each
    morph's, growing, leaving a straggler out and the elastic pass weigh a morph against what it gains."""

    def __init__(self, store: Store):
        self._store = store
        self._recent: deque[float] = deque(maxlen=20)  # the fleet's last measured morph times

    def measured(self, recovery_s: float) -> None:
        self._recent.append(recovery_s)

    def of_job(self, job_id: str) -> float:
        """The job's last morph, else the median of the fleet's recent ones, else a conservative default until
        any was measured."""
        morphs = self._store.list_morphs(store_pb2.ListMorphsRequest(job_id=job_id)).morphs
        costs = [m.recovery_s for m in morphs if m.recovery_s > 0]
        if costs:
            return costs[-1]
        recent = sorted(self._recent)
        return recent[len(recent) // 2] if recent else DEFAULT_MORPH_COST_S

    def of_fleet(self) -> float:
        """The median of the fleet's recent morphs, else a conservative default."""
        return statistics.median(self._recent) if self._recent else DEFAULT_MORPH_COST_S


@dataclass
class SchedulerState:
    """The scheduler's state its collaborators act on: `lock` guards `running` and every Running in it."""

    store: Store
    lock: threading.RLock = field(default_factory=threading.RLock)
    running: dict[str, Running] = field(default_factory=dict)  # job id -> what runs of it (started or adopted)
    morph_costs: MorphCosts = field(init=False)

    def __post_init__(self) -> None:
        self.morph_costs = MorphCosts(self.store)
