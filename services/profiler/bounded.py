"""The default micro-batch sweep, bounded: double m from 1 until time per sample stops improving or the budget ends.

Sweeping every size up to 1024 (Harmony's slow start with nothing to stop it but memory) took minutes and
gigabytes on a CPU for a model whose time per sample stopped improving long before. Varuna (§4.4) "first picks
the lowest m at which F_i(m)/m stops improving" and reuses it for every configuration; the sweep needs no size
much beyond that one. So, with no cap asked for, the profiler doubles m and, at each size, probes the memory
peak and measures every distinct layer, then stops at the first of:

* plateau: the model's time per sample (forward+backward summed over its layers, over m) has not improved by
  at least PLATEAU_GAIN on the best so far for PLATEAU_PATIENCE doublings in a row. One doubling is not enough on
  a shared host: single measurements here swing by several percent (one gpt-tiny run went 15.4, 15.8, 12.1 ms per
  sample at m = 4, 8, 16), so the sweep keeps two sizes past the best one, which also gives the regression and the
  planner's extrapolation points well beyond it;
* the time budget: a size is not started when, predicted from the last size's time scaled by size (a layer's
  time is about linear in m), it would end past the budget;
* a size that does not fit (out of memory or the memory cap), or the ceiling.

Pure functions of sizes, timings and a clock, so the rules are tested without measuring anything.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.runtime.errors import InvalidArgument

PLATEAU_GAIN = 0.05  # a doubling must cut the best time per sample by 5% to count as improving
PLATEAU_PATIENCE = 2  # doublings without such a gain before the sweep stops
DEFAULT_TIME_BUDGET_S = 30.0  # gpt-tiny's sweep ends in ~3-15 s here; the budget bounds slower hosts and models
CEILING = 1024  # largest size the default sweep ever reaches


@dataclass(frozen=True)
class Plateau:
    """Where per-sample time stands after the sizes so far: `best` is Varuna's m, `stop` ends the sweep."""

    best: int  # lowest size after which no doubling improved by PLATEAU_GAIN (0: no sizes)
    stale: int  # doublings since `best`
    stop: bool


def plateau(sizes: Sequence[int], seconds: Sequence[float], *, gain: float = PLATEAU_GAIN,
            patience: int = PLATEAU_PATIENCE) -> Plateau:
    """The stopping rule on ascending `sizes` and the model's time at each (forward+backward, seconds)."""
    if len(sizes) != len(seconds):
        raise ValueError("need one time per size")
    best_m, best, stale = 0, math.inf, 0
    for m, t in zip(sizes, seconds, strict=True):
        per_sample = t / m
        if per_sample < best * (1.0 - gain):
            best_m, best, stale = m, per_sample, 0
        else:
            stale += 1
    return Plateau(best_m, stale, stale >= patience)


def predicted_end(elapsed_s: float, last_m: int, last_s: float, next_m: int) -> float:
    """When measuring `next_m` would end: the last size's time scaled by size (layer time is ~linear in m)."""
    return elapsed_s + last_s * next_m / last_m


def expected_end(elapsed_s: float, budget_s: float, last_m: int, last_step_s: float, stale: int,
                 patience: int = PLATEAU_PATIENCE) -> float:
    """When the sweep should end if time per sample has stopped improving: after the doublings the rule still
    needs (each predicted from the last step, scaled by size), and never past the budget. For progress only."""
    end, m, step = elapsed_s, last_m, last_step_s
    for _ in range(max(1, patience - stale)):
        end, m, step = end + step * 2, 2 * m, step * 2
    return min(end, budget_s)


def check_budget(budget_s: float) -> None:
    """A budget must be a finite, non-negative number of seconds (0: the default)."""
    if not math.isfinite(budget_s) or budget_s < 0:
        raise InvalidArgument(f"{budget_s} is not a number of seconds >= 0", field="time_budget_s",
                              fix=f"pass seconds > 0, or 0 for the default ({DEFAULT_TIME_BUDGET_S:g} s)")


@dataclass
class Ladder:
    """Outcome of the bounded sweep: the sizes measured (ascending), the model's time at each, why it stopped."""

    sizes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    best: int = 0  # Varuna's m: the lowest size with the best time per sample
    stale: int = 0  # doublings since `best`
    last_step_s: float = 0.0  # how long probing and measuring the last size took
    reason: str = ""


def ladder(fits: Callable[[int], bool], measure: Callable[[int], float | None], *, budget_s: float,
           cap: int = CEILING, clock: Callable[[], float] = time.monotonic, start: float | None = None,
           on_step: Callable[[Ladder], None] = lambda state: None) -> Ladder:
    """Double m from 1 to `cap`: `fits(m)` probes memory, `measure(m)` returns the model's forward+backward
    seconds at m (None if a layer failed there). Stops as the module docstring says; `start` is when the budget's
    clock started (default: now); `on_step` sees the state after each size. Micro-batch 1 is always tried,
    whatever the budget."""
    if cap < 1 or budget_s <= 0:
        raise ValueError("cap and budget_s must be positive")
    out = Ladder()
    start = clock() if start is None else start
    m = 1
    while True:
        began = clock()
        if not fits(m):
            out.reason = f"micro-batch {m} does not fit"
            break
        seconds = measure(m)
        if seconds is None:
            out.reason = f"micro-batch {m} failed while measuring"
            break
        out.sizes.append(m)
        out.seconds.append(seconds)
        verdict = plateau(out.sizes, out.seconds)
        out.best, out.stale, out.last_step_s = verdict.best, verdict.stale, clock() - began
        on_step(out)
        if verdict.stop:
            out.reason = (f"time per sample stopped improving after micro-batch {verdict.best} "
                          f"({verdict.stale} doublings without a {PLATEAU_GAIN:.0%} gain)")
            break
        if m >= cap:
            out.reason = f"reached the cap {cap}"
            break
        nxt = min(2 * m, cap)
        now = clock()
        end = predicted_end(now - start, m, out.last_step_s, nxt)
        if end > budget_s:
            out.reason = (f"time budget {budget_s:g} s: micro-batch {nxt} would end at ~{end:.0f} s "
                          f"(spent {now - start:.0f} s)")
            break
        m = nxt
    return out
