"""The availability profile's window test and range update, against a step-by-step reading."""

from __future__ import annotations

import math
import random

from services.planner.admission.profile import Profile


def fits_by_steps(profile: Profile, count: int, duration: float) -> bool:
    end = profile.times[0] + duration
    return all(a >= count for t, a in zip(profile.times, profile.avail, strict=True) if t < end)


def test_fits_now_and_add_agree_with_the_steps():
    rng = random.Random(3)
    for _ in range(300):
        profile = Profile(0.0, rng.randint(0, 4), [(rng.uniform(0, 50), rng.randint(1, 4)) for _ in range(6)])
        for _ in range(4):
            start = rng.uniform(0, 40)
            end = math.inf if rng.random() < 0.2 else start + rng.uniform(0, 30)
            before = {t: profile.level(t) for t in (0.0, start, start + 1e-9, 25.0, 60.0) if t < end}
            delta = rng.randint(-3, 3)
            profile.add(start, end, delta)
            for t, level in before.items():
                assert profile.level(t) == level + (delta if start <= t < end else 0)
        for count, duration in ((1, 5.0), (3, 20.0), (5, math.inf), (2, 0.0)):
            assert profile.fits_now(count, duration) == fits_by_steps(profile, count, duration)
