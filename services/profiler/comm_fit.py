"""Latency + bandwidth fits of measured communication times (pure; no torch).

Each (collective, group size) series is fitted by ordinary least squares to ``t = a + b * bytes``:
``a`` is the per-call latency and ``1 / b`` the algorithm bandwidth. The planner extrapolates to
message sizes it never measured, so every fit carries its goodness of fit (R², worst relative
error) and a note when it must not be trusted.

``bytes`` is always the per-rank *input* buffer (CollectiveSample.bytes): the allreduce buffer,
the allgather shard (the output is ``n * bytes``), the full reduce-scatter input (each rank keeps
``bytes / n``), the all-to-all send buffer, the point-to-point payload.

Bus bandwidth follows the nccl-tests convention (bytes one rank actually moves over its link per
second, comparable across collectives and group sizes for ring algorithms), restated for the
per-rank input size above: ``busbw = algbw * factor`` with

==============  ===============
allreduce       2 (n - 1) / n
allgather       n - 1           (nccl-tests: (n - 1) / n of the n-times-larger output)
reduce_scatter  (n - 1) / n
all_to_all      (n - 1) / n
p2p             1
==============  ===============
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

COLLECTIVES = ("p2p", "allreduce", "allgather", "reduce_scatter", "all_to_all")


def bus_factor(collective: str, group_size: int) -> float:
    """Link bytes moved per input byte, so bandwidths of different collectives compare."""
    n = group_size
    if n < 2:
        raise ValueError(f"group size must be >= 2, got {n}")
    factors = {
        "p2p": 1.0,
        "allreduce": 2.0 * (n - 1) / n,
        "allgather": float(n - 1),
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
    }
    if collective not in factors:
        raise ValueError(f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}")
    return factors[collective]


@dataclass(frozen=True)
class LinkFit:
    """``t = latency_s + bytes / bandwidth`` for one collective and group size, with its quality.

    ``bandwidth`` (algorithm bandwidth, bytes/s) and ``bus_bandwidth`` are None when the slope was
    not positive: such a series says nothing about bandwidth and ``note`` explains why.
    """

    collective: str
    group_size: int
    latency_s: float
    seconds_per_byte: float
    bandwidth: float | None
    bus_bandwidth: float | None
    r2: float
    max_rel_error: float
    points: int
    min_bytes: int
    max_bytes: int
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.bandwidth is not None

    def predict(self, nbytes: float) -> float:
        """Seconds for ``nbytes`` per rank (the fitted line, whatever its quality)."""
        return self.latency_s + self.seconds_per_byte * nbytes

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able row for storage."""
        return asdict(self)


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """(intercept, slope, R²) of the OLS line through the points.

    R² = 1 - SS_res / SS_tot; it is at most 1 and may be negative only for fits worse than the mean
    (never for OLS with an intercept, barring rounding). Raises ValueError on inputs that cannot
    define a line: fewer than two points, mismatched lengths, non-finite values, one distinct x.
    """
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} sizes but {len(ys)} times")
    if len(xs) < 2:
        raise ValueError(f"need at least 2 points to fit a line, got {len(xs)}")
    if not all(math.isfinite(v) for v in (*xs, *ys)):
        raise ValueError("sizes and times must be finite")
    n = len(xs)
    mx = math.fsum(xs) / n
    my = math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx <= 0.0:
        raise ValueError("need at least 2 distinct sizes to fit a line")
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_res = math.fsum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = math.fsum((y - my) ** 2 for y in ys)
    # Constant y: the line is exact; R² is conventionally 1 (nothing left unexplained).
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0.0 else 1.0
    return intercept, slope, min(r2, 1.0)


def fit(collective: str, group_size: int, sizes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Latency + bandwidth fit of one series; degenerate input raises, a bad slope is noted."""
    if any(s < 0 for s in sizes):
        raise ValueError("sizes must be non-negative")
    if any(t <= 0 for t in seconds):
        raise ValueError("times must be positive")
    factor = bus_factor(collective, group_size)
    intercept, slope, r2 = least_squares(sizes, seconds)
    rel = max(abs(intercept + slope * x - y) / y for x, y in zip(sizes, seconds, strict=True))
    notes = []
    bandwidth = bus = None
    if slope > 0.0:
        bandwidth = 1.0 / slope
        bus = factor / slope
    else:
        notes.append(
            f"rejected: non-positive slope {slope:.3g} s/B (time does not grow with size: noise or too narrow a range)"
        )
    if intercept < 0.0:
        notes.append(f"negative latency {intercept:.3g} s: below what these sizes resolve; treat as ~0")
    return LinkFit(
        collective=collective,
        group_size=group_size,
        latency_s=intercept,
        seconds_per_byte=slope,
        bandwidth=bandwidth,
        bus_bandwidth=bus,
        r2=r2,
        max_rel_error=rel,
        points=len(sizes),
        min_bytes=int(min(sizes)),
        max_bytes=int(max(sizes)),
        note="; ".join(notes),
    )


def fit_series(rows: Iterable[tuple[str, int, int, float]]) -> tuple[list[LinkFit], list[str]]:
    """Fit every (collective, group size) in ``(collective, group_size, bytes, seconds)`` rows.

    Series with fewer than two distinct sizes are skipped with a note instead of raising, so one
    thin series does not lose the rest of a calibration.
    """
    series: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    for collective, group_size, nbytes, seconds in rows:
        series[(collective, group_size)].append((nbytes, seconds))
    fits, notes = [], []
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    for (collective, group_size), points in sorted(series.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])):
        if len({b for b, _ in points}) < 2:
            notes.append(f"{collective} n={group_size}: one distinct size, no fit")
            continue
        sizes, seconds = zip(*sorted(points), strict=True)
        fits.append(fit(collective, group_size, sizes, seconds))
    return fits, notes
