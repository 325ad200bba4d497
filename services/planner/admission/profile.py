"""Availability profile: how many devices of one kind are available over time, net of reservations.

A step function from `now` on: `avail[i]` devices on [times[i], times[i+1]), the last step forever. Built
from the devices free now plus each running job's devices from its predicted end; every admission,
re-plan and reservation subtracts its count over its window. Conservative backfilling is then two
questions: when is the earliest start of (count, duration), and does it fit from `now`.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable


class Profile:
    """Devices of one kind over time (see the module docstring)."""

    __slots__ = ("times", "avail")

    def __init__(self, now: float, available_now: int, arrivals: Iterable[tuple[float, int]] = ()):
        """`arrivals` are (time, devices) becoming available then; times at or before `now` count now."""
        steps: dict[float, int] = {now: available_now}
        for t, n in arrivals:
            t = max(t, now)
            steps[t] = steps.get(t, 0) + n
        self.times: list[float] = sorted(steps)
        self.avail: list[int] = []
        level = 0
        for t in self.times:
            level += steps[t]
            self.avail.append(level)

    @property
    def now(self) -> float:
        return self.times[0]

    def earliest(self, count: int, duration: float) -> float | None:
        """The earliest t ≥ now with at least `count` devices over [t, t + duration); None if never."""
        times, avail, n = self.times, self.avail, len(self.times)
        i = 0
        while i < n:
            if avail[i] < count:
                i += 1
                continue
            end = times[i] + duration
            j = i + 1
            while j < n and times[j] < end:
                if avail[j] < count:
                    break
                j += 1
            else:
                return times[i]
            i = j + 1
        return None

    def fits_now(self, count: int, duration: float) -> bool:
        """Whether `count` devices are available from now for `duration` (backfilling's test)."""
        steps = bisect_left(self.times, self.times[0] + duration)  # those starting before the window ends
        return not steps or min(self.avail[:steps]) >= count

    def add(self, start: float, end: float, delta: int) -> None:
        """Add `delta` devices over [start, end) (negative to reserve); `end` may be infinite."""
        start = max(start, self.times[0])
        if end <= start:
            return
        lo = self._split(start)
        hi = len(self.times) if math.isinf(end) else self._split(end)
        self.avail[lo:hi] = [a + delta for a in self.avail[lo:hi]]

    def reserve(self, start: float, duration: float, count: int) -> None:
        self.add(start, start + duration, -count)

    def level(self, t: float) -> int:
        """Devices available at time t."""
        return self.avail[max(0, bisect_right(self.times, t) - 1)]

    def window(self, duration: float) -> list[tuple[float, int]]:
        """(step start, devices) for every step overlapping [now, now + duration)."""
        end = self.times[0] + duration
        return [(t, a) for t, a in zip(self.times, self.avail, strict=True) if t < end]

    def _split(self, t: float) -> int:
        """Index of a step starting exactly at t, splitting the step that contains it if needed."""
        i = bisect_left(self.times, t)
        if i < len(self.times) and self.times[i] == t:
            return i
        self.times.insert(i, t)
        self.avail.insert(i, self.avail[i - 1])
        return i
