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

Fairness guard (elastic). The average alone starves some jobs: a short job arriving while every running
job was just resized waits out the interval; a job admitted at its minimum never catches up; a big job is
overtaken by small ones for hours; a high-priority job grown far past its request keeps the surplus. So,
after Themis (NSDI'20), each job's finish-time fairness rho = (time since submission + predicted time
left) / (run time alone on its requested devices) is predicted, and a job is *behind* when rho on what it
holds passes `fairness_bound` (a queued job: on its minimum from the next look, `tick_s` away). Then:
- within a priority class, jobs behind are admitted first, the latest first;
- a queued job starts with the fewest devices, up to its request, that keep rho within the bound (fewer,
  down to its minimum, when no more are to be had);
- a job behind may also shrink jobs resized within the interval, and take from higher priorities what
  they hold beyond their request (lent, not owned);
- no donor is shrunk so far that its own rho passes the bound, counting its morph pause and the progress
  it loses while the claimant runs (a loan: the devices come back when the claimant ends); donors are chosen
  by time lost, the morph pause included;
- no job starts ahead of a job behind that does not fit yet; running jobs may grow into the devices
  that free up meanwhile and give them back (as above) once they cover its minimum.
Since fifo's fairness is never below 1, a job held within the bound is within `fairness_bound` x its fifo
fairness; most are held there. benchmarks/fleet_sim.py (replayed as the live scheduler runs it: simulate.py),
160 jobs: 1.74x at worst (2.21x without the guard) for 2.9% more average JCT; eight other seeds: 1.42x-2.16x
(1.63x-24.6x without). The overloaded 1,000-job trace: 5.64x (15.5x) for 22.4%.
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
    global_batch_size: int
    remaining_iterations: float
    requested_devices: int
    min_devices: int
    max_devices: int
    last_resize_s: float = -math.inf
    iterations: int = 0  # as submitted: the yardstick of its finish-time fairness (0: unknown, never behind)

    @property
    def curve_key(self) -> tuple[str, int]:
        return (self.model, self.global_batch_size)


@dataclass(frozen=True)
class ElasticPolicy:
    """Which policy, and its knobs. A tenant without a quota (or with 0) is uncapped."""

    name: str = ELASTIC
    quotas: Mapping[str, int] = field(default_factory=dict)
    min_interval_s: float = 600.0
    gain_factor: float = 2.0
    tick_s: float = 120.0  # how often the simulator re-allocates between events (elastic only)
    fairness_bound: float = 1.5  # predicted finish-time fairness beyond which a job is behind (0: no guard)

    def __post_init__(self) -> None:
        if 0 < self.fairness_bound < 1 or self.fairness_bound < 0:
            raise InvalidArgument(f"fairness_bound {self.fairness_bound} is below 1, which no job can meet",
                                  field="fairness_bound", fix="1 or more (1.5 by default), or 0 for no guard")

    def room(self, tenant: str, used: int) -> float:
        quota = self.quotas.get(tenant, 0)
        return quota - used if quota > 0 else math.inf


def remaining_s(job: JobState, curves: Curves, devices: int) -> float:
    """Predicted seconds to finish `job` holding `devices` devices, from now (its plan uses them all)."""
    return job.remaining_iterations * curves[job.curve_key].iteration_s_on(devices)


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
        return backfill(fleet_devices, jobs, curves, now, policy, current)
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


def backfill(fleet: int, jobs: Sequence[JobState], curves: Curves, now: float, policy: ElasticPolicy,
             current: Mapping[str, int], *, ranges: bool = False) -> dict[str, int]:
    """admission.decide over one host of `fleet` anonymous slots; run times are the curves' predictions.
    With `ranges` a queued job whose request is not free is started on the most free devices of its range
    (the engine's re-plan), as the live engine treats an elastic job."""
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
                      remaining_s(j, curves, j.requested_devices), min_devices=j.min_devices if ranges else 0,
                      max_devices=j.max_devices if ranges else 0) for j in queued]
    decision = decide(demands, slots[taken:], holdings, Policy(quotas=dict(policy.quotas)), {}, now, {KIND})
    out.update((name, len(got)) for name, got in decision.admit)
    out.update(decision.replan)
    return out


class _Elastic:
    """One elastic pass (see the module docstring); state: allocation, free devices, tenants' use, and
    the jobs behind with their predicted fairness."""

    def __init__(self, fleet: int, jobs: Sequence[JobState], curves: Curves, now: float, policy: ElasticPolicy,
                 current: Mapping[str, int], morph_cost_s: float):
        self.fleet, self.curves, self.now, self.policy, self.morph_cost_s = fleet, curves, now, policy, morph_cost_s
        self.bound = policy.fairness_bound or math.inf
        self.current = _running(jobs, current)
        self.pinned = {j.name for j in jobs if j.name in self.current and now - j.last_resize_s < policy.min_interval_s}
        self.alloc = dict(self.current)
        self.used: dict[str, int] = {}
        for j in jobs:
            self.used[j.tenant] = self.used.get(j.tenant, 0) + self.alloc.get(j.name, 0)
        self.free = fleet - sum(self.alloc.values())
        self.behind = {j.name: rho for j in jobs if (rho := self.lateness(j)) > self.bound}
        self.jobs = sorted(jobs, key=lambda j: (-j.priority, -self.behind.get(j.name, 0.0), j.submit_time_s, j.name))

    def floor(self, j: JobState) -> int:
        return max(j.min_devices, self.curves[j.curve_key].min_devices, 1)

    def ceiling(self, j: JobState) -> int:
        return min(j.max_devices, self.fleet, self.curves[j.curve_key].max_devices)

    def left(self, j: JobState, n: int) -> float:
        return remaining_s(j, self.curves, n)

    def fairness(self, j: JobState, n: int, delay_s: float = 0.0) -> float:
        """Predicted finish-time fairness of `j` on `n` devices from `delay_s` on (1: unknown iterations)."""
        alone = j.iterations * self.curves[j.curve_key].iteration_s_on(j.requested_devices)
        if not 0 < alone < math.inf:
            return 1.0
        return (self.now + delay_s - j.submit_time_s + self.left(j, n)) / alone

    def lateness(self, j: JobState) -> float:
        """rho on what `j` holds; a queued job's on its floor from the next look, a tick away."""
        if j.name in self.alloc:
            return self.fairness(j, self.alloc[j.name])
        return self.fairness(j, self.floor(j), self.policy.tick_s)

    def give(self, j: JobState, n: int) -> None:
        delta = n - self.alloc.get(j.name, 0)
        self.alloc[j.name] = n
        self.free -= delta
        self.used[j.tenant] = self.used.get(j.tenant, 0) + delta

    def run(self) -> dict[str, int]:
        for j in self.jobs:
            if j.name in self.alloc or self.floor(j) > min(self.ceiling(j), self.room(j)):
                continue
            if not self.admit(j) and j.name in self.behind:
                break  # nobody starts ahead of a job behind; running jobs may use the devices until it fits
        self.grow()
        return {name: n for name, n in self.alloc.items() if n > 0}

    def room(self, j: JobState) -> float:
        return self.policy.room(j.tenant, self.used.get(j.tenant, 0))

    def admit(self, j: JobState) -> bool:
        """Start `j` on its target, or on as many devices above its floor as the free ones and what donors
        can give allow; False (nothing changes) when not even its floor is to be had."""
        keeps = {d.name: self.keeps(d, j) for d in self.jobs if d.name in self.current}
        donors = [d for d in self.jobs if d.name in keeps and keeps[d.name] < self.alloc[d.name]]
        n = int(min(self.target(j), self.room(j), self.free + sum(self.alloc[d.name] - keeps[d.name] for d in donors)))
        if n < self.floor(j):
            return False
        for _ in range(n - self.free):  # a device at a time from the donor losing least (interval's last)
            d = min((d for d in donors if self.alloc[d.name] > keeps[d.name]),
                    key=lambda d: (d.name in self.pinned, self.shrink_cost_s(d), d.name))
            self.give(d, self.alloc[d.name] - 1)
        self.give(j, n)
        return True

    def target(self, j: JobState) -> int:
        """The fewest devices from `j`'s floor up to its request that keep its rho within the bound (its
        request when none does): a job must not start too small ever to catch up."""
        top = max(self.floor(j), min(j.requested_devices, self.ceiling(j)))
        return next((n for n in range(self.floor(j), top) if self.fairness(j, n) <= self.bound), top)

    def keeps(self, d: JobState, j: JobState) -> int:
        """The fewest devices running job `d` keeps when queued job `j` claims some: all of them for a
        claimant not behind when `d` was resized within the interval or has higher priority; else down to
        its floor (a higher priority's: to its request, the rest is lent), but never so far that `d`'s own
        rho, lending them for `j`'s run, passes the bound."""
        held, behind = self.alloc[d.name], j.name in self.behind
        if d.name in self.pinned and not behind:
            return held
        if d.priority > j.priority:
            if not behind:
                return held
            lowest = min(held, max(self.floor(d), d.requested_devices))
        else:
            lowest = min(held, self.floor(d))
        lent_s = self.left(j, self.floor(j))
        return next((n for n in range(lowest, held) if self.lending_fairness(d, n, lent_s) <= self.bound), held)

    def lending_fairness(self, d: JobState, n: int, lent_s: float) -> float:
        """`d`'s predicted rho if it runs on `n` of its devices for `lent_s` seconds (the claimant's run),
        then on all again: its morph pause, and the progress it loses meanwhile (at most all the rest)."""
        held, rate = self.alloc[d.name], self.curves[d.curve_key].rate_on
        lost_s = min(lent_s * (1 - rate(n) / rate(held)), self.left(d, n) - self.left(d, held))
        return self.fairness(d, held, self.morph_cost_s + lost_s)

    def shrink_cost_s(self, d: JobState) -> float:
        """Predicted seconds `d` loses giving one more device: the slower rate, and the morph pause on its
        first shrink in this pass."""
        n = self.alloc[d.name]
        pause = self.morph_cost_s if n == self.current[d.name] else 0.0
        return self.left(d, n - 1) - self.left(d, n) + pause

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
