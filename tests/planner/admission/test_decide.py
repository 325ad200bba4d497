"""The free-slot pool hands out hosts exactly as a scan over every host would (best fit, then fullest)."""

from __future__ import annotations

import random

from services.planner.admission import Slot
from services.planner.admission.decide import _Pool


def take_by_scan(hosts: dict[tuple[str, str], list[Slot]], n: int) -> tuple[Slot, ...]:
    taken: list[Slot] = []
    while n > 0:
        fitting = [k for k, v in hosts.items() if len(v) >= n]
        key = min(fitting, key=lambda k: (len(hosts[k]), k)) if fitting else \
            min(hosts, key=lambda k: (-len(hosts[k]), k))
        part = hosts[key][:n]
        taken.extend(part)
        hosts[key] = hosts[key][len(part):]
        if not hosts[key]:
            del hosts[key]
        n -= len(part)
    return tuple(sorted(taken, key=lambda s: s.sort_key))


def test_a_pool_takes_what_a_scan_of_every_host_takes():
    rng = random.Random(5)
    for _ in range(100):
        slots = [Slot(f"id{h}", d, "gpu", f"host{h:02d}") for h in range(rng.randint(1, 12))
                 for d in range(8) if rng.random() < 0.6]
        pool = _Pool(slots)
        mirror = {k: list(v) for k, v in pool.hosts.items()}
        while pool.count:
            n = rng.randint(1, min(pool.count, 12))
            assert pool.take(n) == take_by_scan(mirror, n)
            assert pool.count == sum(len(v) for v in mirror.values())
