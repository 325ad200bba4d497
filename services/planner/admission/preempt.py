"""Choosing preemption victims: the fewest devices that let a waiting job start now.

A victim's devices already come back at its predicted end; preempting it only moves them to now. So a
set of victims works when, on every step of the job's window [now, now + duration), the devices
available (net of the reservations of the jobs ahead) plus those of the chosen victims still running at
that step reach the job's count. Victims sorted by end, latest first, make each step's helpers a prefix
of that list, which a subset-sum over prefixes solves exactly; devices per kind are few (tens), so the
table is small.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.planner.admission.model import Holding
from services.planner.admission.profile import Profile


def _feasible_sums(sizes: list[int], req: list[int], cap: int, forced: dict[int, bool]) -> set[int]:
    """Totals reachable by subsets of the victims (in end order) meeting every prefix requirement.

    `req[k]` is the least total the first k victims must give; `forced` pins a victim in or out.
    """
    sums = {0}
    if req[0] > 0:
        return set()
    for k, size in enumerate(sizes, start=1):
        choice = forced.get(k - 1)
        grown = set() if choice is True else set(sums)
        if choice is not False:
            grown.update(s + size for s in sums if s + size <= cap)
        sums = {s for s in grown if s >= req[k]}
        if not sums:
            break
    return sums


def choose_victims(
    profile: Profile, count: int, duration: float, candidates: Sequence[tuple[Holding, float]]
) -> list[Holding] | None:
    """Victims (from `candidates`: (holding, the end the profile counts it at)) with the fewest devices
    in total that let `count` devices run for `duration` from now; [] when none are needed, None when
    no set is enough. Ties: the lowest priority, then the latest predicted end, then the job id, go first.
    """
    window = profile.window(duration)
    if all(avail >= count for _, avail in window):
        return []
    by_end = sorted(candidates, key=lambda c: (-c[1], c[0].job_id))
    ends = [end for _, end in by_end]
    sizes = [len(h.slots) for h, _ in by_end]
    req = [0] * (len(by_end) + 1)
    for start, avail in window:
        helpers = sum(1 for e in ends if e > start)  # a prefix of by_end: they still run at `start`
        req[helpers] = max(req[helpers], count - avail)
    total = sum(sizes)
    reachable = _feasible_sums(sizes, req, total, {})
    if not reachable:
        return None
    best = min(reachable)
    forced: dict[int, bool] = {}
    rank = sorted(range(len(by_end)), key=lambda i: (by_end[i][0].priority, -by_end[i][1], by_end[i][0].job_id))
    for i in rank:
        forced[i] = True
        if best not in _feasible_sums(sizes, req, best, forced):
            forced[i] = False
    return [by_end[i][0] for i in rank if forced[i]]
