"""Choosing preemption victims: the fewest devices that let a waiting job start now.

A victim's devices already come back at its predicted end; preempting it only moves them to now. So a
set of victims works when, on every step of the job's window [now, now + duration), the devices
available (net of the reservations of the jobs ahead) plus those of the chosen victims still running at
that step reach the job's count. Victims sorted by end, latest first, make each step's helpers a prefix
of that list, which a subset-sum over prefixes solves exactly. The reachable totals are one integer's bits
(bit s: total s), so a victim is a shift and an OR over the fleet's device count, not a Python set: at 1,024
hosts a pass weighs hundreds of candidate victims, each checked again while the tie-break pins them in rank
order.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from services.planner.admission.model import Holding
from services.planner.admission.profile import Profile


def _feasible_sums(sizes: list[int], req: list[int], cap: int, forced: dict[int, bool]) -> int:
    """Totals reachable by subsets of the victims (in end order) meeting every prefix requirement, as a bit
    mask (bit s set: total s reachable, s <= cap).

    `req[k]` is the least total the first k victims must give; `forced` pins a victim in or out.
    """
    if req[0] > 0:
        return 0
    within = (1 << (cap + 1)) - 1
    sums = 1  # the empty set: total 0
    for k, size in enumerate(sizes, start=1):
        choice = forced.get(k - 1)
        grown = 0 if choice is True else sums
        if choice is not False:
            grown |= (sums << size) & within
        sums = grown >> req[k] << req[k]  # totals below the prefix's requirement dropped
        if not sums:
            break
    return sums


def _has(sums: int, total: int) -> bool:
    return bool(sums >> total & 1)


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
    later_first = [-end for _, end in by_end]  # ascending
    sizes = [len(h.slots) for h, _ in by_end]
    req = [0] * (len(by_end) + 1)
    for start, avail in window:
        helpers = bisect_left(later_first, -start)  # those ending after `start`: a prefix of by_end
        req[helpers] = max(req[helpers], count - avail)
    # A victim past the last prefix with a requirement ends before every short step: it never helps, and
    # taking it would only add devices, so the fewest-devices set never holds it.
    useful = max((k for k, r in enumerate(req) if r > 0), default=0)
    by_end, sizes, req = by_end[:useful], sizes[:useful], req[:useful + 1]
    reachable = _feasible_sums(sizes, req, sum(sizes), {})
    if not reachable:
        return None
    best = (reachable & -reachable).bit_length() - 1  # the lowest set bit: the fewest devices
    forced: dict[int, bool] = {}
    taken = 0
    rank = sorted(range(len(by_end)), key=lambda i: (by_end[i][0].priority, -by_end[i][1], by_end[i][0].job_id))
    for i in rank:
        if taken == best:
            break  # the pinned victims give the fewest devices already: every later one stays out
        forced[i] = True
        if _has(_feasible_sums(sizes, req, best, forced), best):
            taken += sizes[i]
        else:
            forced[i] = False
    return [by_end[i][0] for i in rank if forced.get(i)]
