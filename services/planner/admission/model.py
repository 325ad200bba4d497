"""What the admission engine reads and what it decides: plain values, no I/O, no clock.

Times are epoch seconds (floats). The callers (planner service, simulator, benchmark) build these from
the store's jobs, leases and fleet policy; the engine never looks anything up itself, so a decision is a
function of its arguments alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICES_BUSY = "devices_busy"  # not enough devices of the job's kind are free for it now
QUOTA = "quota"  # starting would take the tenant above its device quota
JOB_AHEAD = "job_ahead"  # devices are free, but using them would delay a job ahead's reservation
NO_EXECUTOR = "no_executor"  # no executor serves the job's device kind
PREEMPTED = "preempted"  # the job was preempted and waits to resume
REPLANNING = "replanning"  # the job is being re-planned for the devices free now
CALIBRATING = "calibrating"  # its host class is new: a short known workload fits its calibration first
REASONS = (DEVICES_BUSY, QUOTA, JOB_AHEAD, NO_EXECUTOR, PREEMPTED, REPLANNING, CALIBRATING)


@dataclass(frozen=True)
class Slot:
    """One device of a host."""

    host_id: str
    device_index: int
    kind: str
    host_name: str = ""

    @property
    def sort_key(self) -> tuple[str, str, int]:
        """Placement order: by host name, then host id, then device index."""
        return (self.host_name, self.host_id, self.device_index)


@dataclass(frozen=True)
class Demand:
    """A job waiting to run.

    `duration_s` is the predicted run time (iterations left x predicted iteration time); 0, negative or
    infinite means unknown, which the engine treats as "runs forever" so it never backfills on a guess.
    `min_devices`/`max_devices` (both 0 = none) is the range the job may be re-planned within.
    """

    job_id: str
    tenant_id: str
    priority: int
    submitted_at: float
    devices: int
    kind: str
    duration_s: float
    preempts: bool = False
    min_devices: int = 0
    max_devices: int = 0
    preempted: bool = False
    # The run time at the prediction's upper bound (Prediction.iteration_time_high_s); 0: duration_s. A job starts
    # ahead of a reservation only if it ends in time at this bound: a backfill that overran would delay the job
    # the devices were reserved for.
    duration_high_s: float = 0.0
    # Consecutive ranks that must share a host: the plan was priced with that many devices per node, so a group
    # split over two hosts would run its fastest links over the network. 1: anywhere.
    group: int = 1
    # Devices per node of the fleet a re-plan cuts (prepare.shrink), for the group of a re-planned count; 0: 1.
    per_node: int = 0

    @property
    def replannable(self) -> bool:
        return self.max_devices > 0 and 0 < self.min_devices <= self.max_devices


@dataclass(frozen=True)
class Holding:
    """A running job and the devices it holds. `draining` means it is being preempted: its devices are
    treated as freeing now, and kept for the waiting jobs ahead rather than for anyone who asks first."""

    job_id: str
    tenant_id: str
    priority: int
    slots: tuple[Slot, ...]
    predicted_end: float
    preemptions_last_hour: int = 0
    draining: bool = False

    @property
    def kind(self) -> str:
        return self.slots[0].kind if self.slots else ""


@dataclass(frozen=True)
class Policy:
    """The part of the fleet policy admission needs. A quota of 0 (or none) is no cap; a missing
    weight is 1."""

    quotas: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    max_preemptions_per_hour: int = 2

    def quota(self, tenant_id: str) -> int:
        return max(0, self.quotas.get(tenant_id, 0))

    def weight(self, tenant_id: str) -> float:
        w = self.weights.get(tenant_id, 1.0)
        return w if w > 0 else 1.0


@dataclass(frozen=True)
class Wait:
    """Why a job is not starting now, and when it is predicted to (None: not computed or never)."""

    reason: str
    detail: str
    predicted_start: float | None = None


@dataclass
class Decision:
    """One admission pass.

    `order` is every queued job in admission order; `admit` gangs start now on exactly these slots;
    `replan` jobs should be re-planned for that many devices (their slots were kept out of this pass);
    `preempt` pairs are (victim, for whom); every job not admitted has a `waiting` entry.
    """

    order: list[str] = field(default_factory=list)
    admit: list[tuple[str, tuple[Slot, ...]]] = field(default_factory=list)
    replan: list[tuple[str, int]] = field(default_factory=list)
    preempt: list[tuple[str, str]] = field(default_factory=list)
    waiting: dict[str, Wait] = field(default_factory=dict)
