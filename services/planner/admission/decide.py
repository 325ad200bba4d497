"""One admission pass over the queue: who starts now, on which devices, who is re-planned, who is
preempted, and why everyone else waits.

Rules, in the order jobs are considered (`admission_order`):
- gangs: a job starts only when all its devices are free now;
- conservative backfilling: each job that cannot start gets a reservation at its earliest predicted
  start in the availability profile, and a job further back starts now only if it fits the profile with
  those reservations, so it never delays a job ahead (only the first `reserve_depth` waiting jobs of a
  kind get reservations, which bounds a pass's cost on long queues);
- quotas cap a tenant's leased devices and reserve nothing;
- a job with a device range is re-planned for the devices free now when its plan cannot start;
- the first preempting job that devices freeing now (free and draining) cannot serve, but some victims
  can, picks the fewest devices of strictly lower-priority victims; one preemptor per pass, a job is
  preempted at most `max_preemptions_per_hour`, and a job owed draining devices keeps its reservation
  on them whatever the depth.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping, Sequence, Set

from services.planner.admission.model import (
    DEVICES_BUSY,
    JOB_AHEAD,
    NO_EXECUTOR,
    PREEMPTED,
    QUOTA,
    REPLANNING,
    Decision,
    Demand,
    Holding,
    Policy,
    Slot,
    Wait,
)
from services.planner.admission.order import admission_order
from services.planner.admission.preempt import choose_victims
from services.planner.admission.profile import Profile
from services.planner.cost.fleet_cut import cut_shape

DEFAULT_RESERVE_DEPTH = 64
# A running job past its predicted end still holds its devices: count them as coming back just after
# now, so they are not free now (nobody starts on them) yet can be reserved and preempted.
OVERDUE_S = 1e-3


def _duration(d: Demand) -> float:
    """Unknown (≤ 0, NaN) durations count as forever, so nobody backfills on a guess."""
    return d.duration_s if d.duration_s > 0 else math.inf


def _duration_high(d: Demand) -> float:
    """The run time at the prediction's upper bound, where a short guess is costly (starting now, ahead of a
    reservation); the nominal one where none was given."""
    return max(d.duration_high_s, _duration(d)) if d.duration_high_s > 0 else _duration(d)


class _Pool:
    """Free slots of one kind, grouped by host, handed out so a gang spans as few hosts as it can. Hosts are
    filed by their free count, so a take looks at the few distinct counts, not at every host of the fleet."""

    def __init__(self, slots: Iterable[Slot]):
        self.hosts: dict[tuple[str, str], list[Slot]] = {}
        for s in sorted(slots, key=lambda s: s.sort_key):
            self.hosts.setdefault((s.host_name, s.host_id), []).append(s)
        self.count = sum(len(v) for v in self.hosts.values())
        self.by_free: dict[int, list[tuple[str, str]]] = {}  # free count -> its hosts' keys, sorted
        for key in self.hosts:
            self._file(key)

    def _file(self, key: tuple[str, str]) -> None:
        insort(self.by_free.setdefault(len(self.hosts[key]), []), key)

    def _unfile(self, key: tuple[str, str]) -> None:
        free = len(self.hosts[key])
        keys = self.by_free[free]
        del keys[bisect_left(keys, key)]
        if not keys:
            del self.by_free[free]

    def fits(self, n: int, group: int = 1) -> bool:
        """Whether `n` slots can be taken in groups of `group`, each group on one host."""
        if group <= 1 or n % group:
            return n <= self.count
        return sum(len(keys) * (free // group) for free, keys in self.by_free.items()) >= n // group

    def take(self, n: int, group: int = 1) -> tuple[Slot, ...]:
        """n slots in groups of `group` (each on one host; `fits` first): one host that fits best (fewest free
        slots that suffice, then the first by name), else the fullest hosts, whole groups from each."""
        group = group if group > 1 and n % group == 0 else 1
        taken: list[Slot] = []
        while n > 0:
            fitting = [free for free in self.by_free if free >= n]
            key = self.by_free[min(fitting) if fitting else max(self.by_free)][0]
            self._unfile(key)
            part = self.hosts[key][:n - n % group if fitting else len(self.hosts[key]) // group * group]
            taken.extend(part)
            rest = self.hosts[key][len(part):]
            if rest:
                self.hosts[key] = rest
                self._file(key)
            else:
                del self.hosts[key]
            n -= len(part)
        self.count -= len(taken)
        return tuple(sorted(taken, key=lambda s: s.sort_key))


class _Pass:
    """The mutable state of one pass: free slots, profiles, leased counts, reservations made."""

    def __init__(
        self,
        free: Sequence[Slot],
        running: Sequence[Holding],
        policy: Policy,
        now: float,
        kinds_online: Set[str],
        reserve_depth: int | None,
    ):
        self.now, self.policy, self.kinds_online, self.reserve_depth = now, policy, kinds_online, reserve_depth
        by_kind: dict[str, list[Slot]] = {}
        for s in free:
            by_kind.setdefault(s.kind, []).append(s)
        self.pools = {k: _Pool(v) for k, v in by_kind.items()}
        self.running: dict[str, list[Holding]] = {}
        self.leased: dict[str, int] = {}
        for h in running:
            self.leased[h.tenant_id] = self.leased.get(h.tenant_id, 0) + len(h.slots)
            if h.slots:
                self.running.setdefault(h.kind, []).append(h)
        self.profiles: dict[str, Profile] = {}
        self.reservations: dict[str, int] = {}
        self.preemptor: str | None = None
        self.busy: dict[tuple[int, str], Wait] = {}  # (count, kind) -> the wait of a job beyond the depth
        self.out = Decision()

    def pool(self, kind: str) -> _Pool:
        if kind not in self.pools:
            self.pools[kind] = _Pool(())
        return self.pools[kind]

    def end_of(self, h: Holding) -> float:
        """When the profile gives a holding's devices back."""
        return self.now if h.draining else max(h.predicted_end, self.now + OVERDUE_S)

    def profile(self, kind: str) -> Profile:
        if kind not in self.profiles:
            holdings = self.running.get(kind, [])
            self.profiles[kind] = Profile(
                self.now, self.pool(kind).count, ((self.end_of(h), len(h.slots)) for h in holdings)
            )
        return self.profiles[kind]

    def room(self, tenant_id: str) -> float:
        """Devices the tenant may still lease (infinite without a quota)."""
        quota = self.policy.quotas.get(tenant_id, 0)
        return quota - self.leased.get(tenant_id, 0) if quota > 0 else math.inf

    def start(self, d: Demand, count: int, duration: float, group: int = 1) -> tuple[Slot, ...]:
        """Take `count` free slots for `d` now, in groups of `group` per host: out of the pool, the profile and
        the tenant's room."""
        self.profile(d.kind).reserve(self.now, duration, count)
        self.leased[d.tenant_id] = self.leased.get(d.tenant_id, 0) + count
        return self.pool(d.kind).take(count, group)

    def consider(self, d: Demand) -> Wait | None:
        """Admit, re-plan or make `d` wait; None when it was admitted."""
        if d.kind not in self.kinds_online:
            return Wait(NO_EXECUTOR, f"no executor serves {d.kind!r} devices")
        count, duration = max(1, d.devices), _duration(d)
        pool, room = self.pool(d.kind), self.room(d.tenant_id)
        if not pool.count and not d.preempts and count <= room:
            # Nothing of its kind free and it preempts nobody: it waits for devices (most of a deep queue, so
            # the same answer as below, reached without the profile)
            start, never = self.reserve(d.kind, count, duration)
            if start is None and not never:  # beyond the reservation depth: one answer per gang size and kind
                key = (count, d.kind)
                if key not in self.busy:
                    self.busy[key] = Wait(DEVICES_BUSY, f"needs {count} {d.kind}, 0 free")
                return self.busy[key]
            detail = f"needs {count} {d.kind}, 0 free"
            if never:
                detail += f"; never fits: only {self.profile(d.kind).avail[-1]} {d.kind} devices ever free up"
            return Wait(DEVICES_BUSY, detail, start)
        profile = self.profile(d.kind)
        placed = pool.fits(count, d.group)
        if count <= room and placed and profile.fits_now(count, _duration_high(d)):
            self.out.admit.append((d.job_id, self.start(d, count, _duration_high(d), d.group)))
            return None
        if d.replannable and pool.count:
            wait = self.replan(d, count, duration, room)
            if wait:
                return wait
        if count > room:
            quota = self.policy.quota(d.tenant_id)
            return Wait(QUOTA, f"tenant {d.tenant_id} leases {self.leased.get(d.tenant_id, 0)} of its {quota} "
                               f"devices; this job needs {count}")
        fits_free = placed
        reason = JOB_AHEAD if fits_free else DEVICES_BUSY
        detail = (f"{pool.count} {d.kind} free, but starting now would delay a job ahead" if fits_free
                  else f"needs {count} {d.kind}, {pool.count} free" if count > pool.count
                  else f"needs {count} {d.kind} as {count // d.group} host(s) with {d.group} free each (its plan's "
                       f"nodes); {pool.count} free on fewer")
        victims = self.victims(d, count, duration) if d.preempts and self.preemptor is None else None
        if victims:
            self.preemptor = d.job_id
            self.out.preempt.extend((v.job_id, d.job_id) for v in victims)
            reason = DEVICES_BUSY
            detail = f"needs {count} {d.kind}; preempting {', '.join(v.job_id for v in victims)}"
        # A job that preempts, or waits for devices draining for it, always reserves (whatever the depth),
        # so nobody behind it takes the devices it is owed.
        start, never = self.reserve(d.kind, count, duration, force=victims is not None)
        if never:
            detail += f"; never fits: only {self.profile(d.kind).avail[-1]} {d.kind} devices ever free up"
        return Wait(reason, detail, start)

    def replan(self, d: Demand, count: int, duration: float, room: float) -> Wait | None:
        """Re-plan `d` for the most devices it may have now (in its range, quota and the profile)."""
        profile = self.profile(d.kind)
        top = int(min(self.pool(d.kind).count, d.max_devices, room))
        for f in range(top, d.min_devices - 1, -1):
            scaled = duration * count / f  # same work on fewer devices: linear scaling, a safe guess
            group = cut_shape(f, d.per_node)[1] if d.per_node else 1
            if f != count and self.pool(d.kind).fits(f, group) and profile.fits_now(f, scaled):
                self.start(d, f, scaled, group)
                self.out.replan.append((d.job_id, f))
                return Wait(REPLANNING, f"re-planning from {count} to {f} {d.kind} devices", self.now)
        return None

    def victims(self, d: Demand, count: int, duration: float) -> list[Holding] | None:
        """Running jobs to preempt for `d`: [] when devices freeing now (draining ones included) are
        enough, None when no set of victims is."""
        limit = self.policy.max_preemptions_per_hour
        candidates = [
            (h, self.end_of(h)) for h in self.running.get(d.kind, ())
            if not h.draining and h.priority < d.priority and h.preemptions_last_hour < limit
        ]
        profile = self.profile(d.kind)
        chosen = choose_victims(profile, count, duration, candidates)
        for h in chosen or ():
            profile.add(self.now, self.end_of(h), len(h.slots))  # their devices now come back now
        return chosen

    def reserve(self, kind: str, count: int, duration: float, force: bool = False) -> tuple[float | None, bool]:
        """(start, never): reserve the earliest start of (count, duration) in the profile. Beyond the depth
        (unless forced) nothing is computed: (None, False); a count the fleet can never give: (None, True)."""
        made = self.reservations.get(kind, 0)
        if not force and self.reserve_depth is not None and made >= self.reserve_depth:
            return None, False
        profile = self.profile(kind)
        start = profile.earliest(count, duration)
        if start is None:
            return None, True
        profile.reserve(start, duration, count)
        self.reservations[kind] = made + 1
        return start, False


def decide(
    queue: Sequence[Demand],
    free: Sequence[Slot],
    running: Sequence[Holding],
    policy: Policy,
    usage: Mapping[str, float],
    now: float,
    kinds_online: Set[str],
    *,
    reserve_depth: int | None = DEFAULT_RESERVE_DEPTH,
) -> Decision:
    """One admission pass (see the module docstring).

    `free` are the unleased devices of online hosts, `running` the jobs holding leases, `usage` the
    tenants' decayed usage (`decayed_usage`). `reserve_depth` None gives every waiting job a reservation
    and so a predicted start: exact for listing the queue, slower on long queues.
    """
    p = _Pass(free, running, policy, now, kinds_online, reserve_depth)
    for d in admission_order(queue, usage, policy):
        p.out.order.append(d.job_id)
        wait = p.consider(d)
        if wait is None:
            continue
        if d.preempted and wait.reason in (DEVICES_BUSY, JOB_AHEAD) and p.preemptor != d.job_id:
            wait = Wait(PREEMPTED, f"preempted, waiting to resume: {wait.detail}", wait.predicted_start)
        p.out.waiting[d.job_id] = wait
    return p.out


def predicted_starts(
    queue: Sequence[Demand],
    free: Sequence[Slot],
    running: Sequence[Holding],
    policy: Policy,
    usage: Mapping[str, float],
    now: float,
    kinds_online: Set[str],
) -> dict[str, float | None]:
    """Every queued job's predicted start for the queue listing: `now` for jobs starting (or re-planned)
    now, None for jobs that cannot run (quota, no executor, never fits) or whose start is unknown."""
    decision = decide(queue, free, running, policy, usage, now, kinds_online, reserve_depth=None)
    starts: dict[str, float | None] = {job: now for job, _ in decision.admit}
    starts.update((job, w.predicted_start) for job, w in decision.waiting.items())
    return {job: starts.get(job) for job in decision.order}
