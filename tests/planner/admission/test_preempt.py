"""Victim choice against an exhaustive search: the fewest devices, ties broken in rank order."""

from __future__ import annotations

import itertools
import random

from services.planner.admission import Holding, Slot
from services.planner.admission.preempt import choose_victims
from services.planner.admission.profile import Profile

NOW = 0.0


def brute_force(profile: Profile, count: int, duration: float,
                candidates: list[tuple[Holding, float]]) -> list[Holding] | None:
    window = profile.window(duration)

    def enough(chosen: tuple[int, ...]) -> bool:
        return all(avail + sum(len(candidates[i][0].slots) for i in chosen if candidates[i][1] > start) >= count
                   for start, avail in window)

    rank = sorted(range(len(candidates)),
                  key=lambda i: (candidates[i][0].priority, -candidates[i][1], candidates[i][0].job_id))
    feasible = [c for r in range(len(candidates) + 1) for c in itertools.combinations(range(len(candidates)), r)
                if enough(c)]
    if not feasible:
        return None
    fewest = min(sum(len(candidates[i][0].slots) for i in c) for c in feasible)
    best = [c for c in feasible if sum(len(candidates[i][0].slots) for i in c) == fewest]
    # the rank-order tie-break: the earliest-ranked victim in whenever some fewest set holds it
    chosen = max(best, key=lambda c: [i in c for i in rank])
    return [candidates[i][0] for i in rank if i in chosen]


def test_choose_victims_matches_an_exhaustive_search():
    rng = random.Random(7)
    for case in range(400):
        n = rng.randint(0, 7)
        holdings = []
        for i in range(n):
            size = rng.randint(1, 4)
            slots = tuple(Slot(f"h{i}", d, "gpu", f"h{i}") for d in range(size))
            holdings.append(Holding(job_id=f"j{i}", tenant_id="t", priority=rng.randint(0, 2), slots=slots,
                                    predicted_end=rng.choice((10.0, 20.0, 30.0, 40.0))))
        free_now = rng.randint(0, 3)
        profile = Profile(NOW, free_now, [(h.predicted_end, len(h.slots)) for h in holdings])
        if rng.random() < 0.5:  # a reservation ahead takes some of what comes back
            profile.reserve(rng.choice((10.0, 20.0)), rng.choice((5.0, 15.0, 100.0)), rng.randint(1, 3))
        count, duration = rng.randint(1, 8), rng.choice((5.0, 15.0, 25.0, 35.0, 50.0))
        candidates = [(h, h.predicted_end) for h in holdings]
        want = brute_force(profile, count, duration, candidates)
        got = choose_victims(profile, count, duration, candidates)
        assert (None if got is None else [h.job_id for h in got]) == \
            (None if want is None else [h.job_id for h in want]), f"case {case}"
