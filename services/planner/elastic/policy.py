"""Who gets how many devices: the allocation policies the simulator compares (and a live scheduler would
call), pure functions of the fleet, the jobs, their scaling curves and the current allocation.

- `fifo`: each job gets exactly its requested devices, exclusively, in submission order; the head of the
  queue blocks everyone behind it until it fits (the static-request baseline).
- `backfill`: the shared-fleet admission engine (admission.decide) on requested devices: priorities,
  tenant quotas, gangs and conservative backfilling with reservations from predicted run times.
- `elastic`: minimise predicted average completion time. Queued jobs are admitted (priority, then
  submission order) at their minimum, shrinking running jobs of no higher priority toward theirs when
  the free devices do not suffice; the devices left are handed out one step at a time to the job whose
  predicted remaining time drops most per device (higher priority classes first), within max devices
  and tenant quotas. Hysteresis: a running job grows only when the time it saves exceeds
  `gain_factor` x the morph cost, and no running job is resized within `min_interval_s` of its last
  resize. Running jobs are shrunk only to admit queued ones, never to rebalance.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.planner.admission import Demand, Holding, Policy, Slot, decide
from services.planner.elastic.curves import ScalingCurve
from services.runtime.errors import InvalidArgument

FIFO, BACKFILL, ELASTIC = "fifo", "backfill", "elastic"
POLICIES = (FIFO, BACKFILL, ELASTIC)
KIND = "sim"  # one device kind: the simulated fleet is uniform
Curves = Mapping[tuple[str, int], ScalingCurve]


@dataclass(frozen=True)
class JobState:
    """A job the scheduler knows now: queued (no devices) or running; `last_resize_s` is when it was last
    resized (-inf: never; starting is not a resize)."""

    name: str
    tenant: str
    priority: int
    submit_time_s: float
    model: str
    global_batch: int
    remaining_iterations: float
    requested_devices: int
    min_devices: int
    max_devices: int
    last_resize_s: float = -math.inf

    @property
    def curve_key(self) -> tuple[str, int]:
        return (self.model, self.global_batch)


@dataclass(frozen=True)
class ElasticPolicy:
    """Which policy, and its knobs. A tenant without a quota (or with 0) is uncapped."""

    name: str = ELASTIC
    quotas: Mapping[str, int] = field(default_factory=dict)
    min_interval_s: float = 600.0
    gain_factor: float = 2.0
    tick_s: float = 120.0  # how often the simulator re-allocates between events (elastic only)

    def room(self, tenant: str, used: int) -> float:
        quota = self.quotas.get(tenant, 0)
        return quota - used if quota > 0 else math.inf


def remaining_s(job: JobState, curves: Curves, devices: int) -> float:
    """Predicted seconds to finish `job` on `devices` devices, from now."""
    return job.remaining_iterations * curves[job.curve_key].iteration_s(devices)


def allocate(
    fleet_devices: int,
    jobs: Sequence[JobState],
    curves: Curves,
    now: float,
    policy: ElasticPolicy,
    current: Mapping[str, int],
    morph_cost_s: float,
) -> dict[str, int]:
    """Devices per job from now on (jobs left out wait); never more than the fleet in all."""
    if policy.name == FIFO:
        return _fifo(fleet_devices, jobs, current)
    if policy.name == BACKFILL:
        return _backfill(fleet_devices, jobs, curves, now, policy, current)
    if policy.name == ELASTIC:
        return _Elastic(fleet_devices, jobs, curves, now, policy, current, morph_cost_s).run()
    raise InvalidArgument(f"unknown policy {policy.name!r}", field="policy", fix=f"one of {', '.join(POLICIES)}")


def _running(jobs: Sequence[JobState], current: Mapping[str, int]) -> dict[str, int]:
    return {j.name: current[j.name] for j in jobs if current.get(j.name, 0) > 0}


def _fifo(fleet: int, jobs: Sequence[JobState], current: Mapping[str, int]) -> dict[str, int]:
    out = _running(jobs, current)
    free = fleet - sum(out.values())
    for j in sorted((j for j in jobs if j.name not in out), key=lambda j: (j.submit_time_s, j.name)):
        if j.requested_devices > free:
            break  # head-of-line blocking: nobody overtakes the first job that does not fit
        out[j.name] = j.requested_devices
        free -= j.requested_devices
    return out


def _backfill(fleet: int, jobs: Sequence[JobState], curves: Curves, now: float, policy: ElasticPolicy,
              current: Mapping[str, int]) -> dict[str, int]:
    """admission.decide over one host of `fleet` anonymous slots; run times are the curves' predictions."""
    out = _running(jobs, current)
    queued = [j for j in jobs if j.name not in out]
    if not queued:
        return out
    slots = [Slot("fleet", i, KIND) for i in range(fleet)]
    holdings, taken = [], 0
    for j in jobs:
        if j.name in out:
            held = tuple(slots[taken:taken + out[j.name]])
            taken += out[j.name]
            holdings.append(Holding(j.name, j.tenant, j.priority, held, now + remaining_s(j, curves, out[j.name])))
    demands = [Demand(j.name, j.tenant, j.priority, j.submit_time_s, j.requested_devices, KIND,
                      remaining_s(j, curves, j.requested_devices)) for j in queued]
    decision = decide(demands, slots[taken:], holdings, Policy(quotas=dict(policy.quotas)), {}, now, {KIND})
    out.update((name, len(got)) for name, got in decision.admit)
    return out


class _Elastic:
    """One elastic pass (see the module docstring); state: allocation, free devices, tenants' use."""

    def __init__(self, fleet: int, jobs: Sequence[JobState], curves: Curves, now: float, policy: ElasticPolicy,
                 current: Mapping[str, int], morph_cost_s: float):
        self.fleet, self.curves, self.policy, self.morph_cost_s = fleet, curves, policy, morph_cost_s
        self.jobs = sorted(jobs, key=lambda j: (-j.priority, j.submit_time_s, j.name))
        self.current = _running(jobs, current)
        self.pinned = {j.name for j in jobs if j.name in self.current and now - j.last_resize_s < policy.min_interval_s}
        self.alloc = dict(self.current)
        self.used: dict[str, int] = {}
        for j in jobs:
            self.used[j.tenant] = self.used.get(j.tenant, 0) + self.alloc.get(j.name, 0)
        self.free = fleet - sum(self.alloc.values())

    def floor(self, j: JobState) -> int:
        return max(j.min_devices, self.curves[j.curve_key].min_devices, 1)

    def ceiling(self, j: JobState) -> int:
        return min(j.max_devices, self.fleet, self.curves[j.curve_key].max_devices)

    def left(self, j: JobState, n: int) -> float:
        return remaining_s(j, self.curves, n)

    def give(self, j: JobState, n: int) -> None:
        delta = n - self.alloc.get(j.name, 0)
        self.alloc[j.name] = n
        self.free -= delta
        self.used[j.tenant] = self.used.get(j.tenant, 0) + delta

    def run(self) -> dict[str, int]:
        for j in self.jobs:
            if j.name not in self.alloc:
                self.admit(j)
        self.grow()
        return {name: n for name, n in self.alloc.items() if n > 0}

    def admit(self, j: JobState) -> None:
        need = self.floor(j)
        if need > self.ceiling(j) or need > self.policy.room(j.tenant, self.used.get(j.tenant, 0)):
            return
        if need > self.free and not self.shrink_for(j, need - self.free):
            return
        self.give(j, need)

    def shrink_for(self, j: JobState, short: int) -> bool:
        """Free `short` devices from unpinned running jobs of no higher priority, a device at a time from
        the one whose remaining time grows least; nothing changes when they cannot free enough."""
        donors = [d for d in self.jobs if d.name in self.current and d.name not in self.pinned
                  and d.priority <= j.priority]
        if sum(self.alloc[d.name] - self.floor(d) for d in donors if self.alloc[d.name] > self.floor(d)) < short:
            return False
        while short > 0:
            d = min((d for d in donors if self.alloc[d.name] > self.floor(d)),
                    key=lambda d: (self.left(d, self.alloc[d.name] - 1) - self.left(d, self.alloc[d.name]), d.name))
            self.give(d, self.alloc[d.name] - 1)
            short -= 1
        return True

    def grow(self) -> None:
        """Hand out the free devices by predicted time saved per device (priority classes first)."""
        heap: list[tuple[int, float, str, int]] = []
        by_name = {j.name: j for j in self.jobs}

        def push(j: JobState) -> None:
            step = self.step(j)
            if step:
                n, saved = step
                heapq.heappush(heap, (-j.priority, -saved / (n - self.alloc[j.name]), j.name, n))

        for j in self.jobs:
            if self.alloc.get(j.name, 0) > 0 and j.name not in self.pinned:
                push(j)
        while heap and self.free > 0:
            _, _, name, n = heapq.heappop(heap)
            j = by_name[name]
            extra = n - self.alloc[name]
            if extra > self.free or extra > self.policy.room(j.tenant, self.used.get(j.tenant, 0)):
                continue
            self.give(j, n)
            push(j)

    def step(self, j: JobState) -> tuple[int, float] | None:
        """(new count, seconds saved) for `j`'s next step up, None when no step is worth taking. A
        running job's first step is a morph: the smallest one saving more than gain_factor x its cost."""
        n, top = self.alloc[j.name], self.ceiling(j)
        c = self.current.get(j.name, 0)
        if c and n < c:
            return None  # shrunk in this pass to admit others: growing it back would undo that
        here = self.left(j, n)
        threshold = self.policy.gain_factor * self.morph_cost_s if c and n == c else 0.0
        rate = self.curves[j.curve_key].rate(n)
        for m in range(n + 1, min(top, n + self.free) + 1):
            if self.curves[j.curve_key].rate(m) <= rate:
                continue
            saved = here - self.left(j, m)
            if saved > threshold:
                return m, saved
            if not threshold:
                return None  # the next better count saves nothing worth having
        return None
