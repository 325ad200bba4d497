"""What one iteration-metrics row covers (IterationMetric.first_iteration .. iteration, `iterations` of them).

Agents summarise each worker's iterations in windows (services/executor/telemetry.py); a row from before windows,
or built without them, is one iteration. Readers weight a row by the iterations it covers, so a median or a mean
over rows is one over iterations."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def weight(row: Any) -> int:
    """Iterations the row covers (a row without the field is one)."""
    return row.iterations or 1


def first_iteration(row: Any) -> int:
    """The row's first iteration (`row.iteration` is its last)."""
    return row.first_iteration if row.iterations else row.iteration


def time_quantiles(row: Any) -> tuple[float, float, float]:
    """The row's median, p95 and longest iteration time (a row of one iteration: its own time, thrice)."""
    if row.iterations:
        return row.iteration_time_p50_s, row.iteration_time_p95_s, row.iteration_time_max_s
    return (row.iteration_time_s,) * 3


def weighted_median(pairs: Iterable[tuple[float, int]]) -> float:
    """The median of values each repeated `weight` times (on an even total, the mean of the two middle values,
    as statistics.median); 0 for none."""
    ordered = sorted((v, w) for v, w in pairs if w > 0)
    total = sum(w for _, w in ordered)
    if not total:
        return 0.0
    low, high = (total + 1) // 2, total // 2 + 1  # 1-based positions of the middle value(s)
    found: list[float] = []
    seen = 0
    for value, w in ordered:
        seen += w
        while len(found) < 2 and seen >= (low, high)[len(found)]:
            found.append(value)
        if len(found) == 2:
            break
    return (found[0] + found[1]) / 2


def weighted_mean(pairs: Iterable[tuple[float, int]]) -> float:
    """The mean of values each counted `weight` times; 0 for none."""
    total = value = 0.0
    for v, w in pairs:
        total, value = total + w, value + v * w
    return value / total if total else 0.0
