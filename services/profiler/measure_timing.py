"""Wall-clock timing of one call and a robust summary of repeated samples.

CPU calls are timed with `time.perf_counter`. CUDA kernels run asynchronously, so a host clock would
time the launch, not the work: there a pair of CUDA events brackets the call on the current stream
and the end event is synchronised before its elapsed time is read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from services.runtime.spread import MAD_SCALE, robust_spread

T = TypeVar("T")

# Samples farther than MAD_K scaled MADs from the median are dropped. The MAD is scaled by 1.4826
# so that it estimates the standard deviation of normal noise: k = 3 is the usual "3 sigma" cut,
# robust to the one-sided spikes (preemption, page faults, allocator growth) that timing shows.
MAD_K = 3.0


class Timer:
    """Times `fn()` on `device`: perf_counter on CPU, CUDA events + synchronize on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
        t0 = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - t0


@dataclass(frozen=True)
class Summary:
    """Median of the samples that survived the MAD filter; `samples` keeps every raw value."""

    median: float
    kept: int
    samples: tuple[float, ...]

    @property
    def spread(self) -> float:
        """1.4826 x the median absolute deviation of the samples the MAD filter kept, over their median: a
        robust coefficient of variation (how far a repeat strays; what a profile records beside each time)."""
        if self.median <= 0 or not self.samples:
            return 0.0
        med = statistics.median(self.samples)
        limit = MAD_K * MAD_SCALE * statistics.median(abs(s - med) for s in self.samples)
        kept = [s for s in self.samples if limit == 0 or abs(s - med) <= limit]
        return robust_spread(kept, self.median)


def robust_median(samples: Sequence[float], k: float = MAD_K) -> Summary:
    """Drop samples outside median +- k * 1.4826 * MAD, then take the median of the rest.

    With MAD = 0 (at least half the samples identical) nothing is dropped: a zero spread says
    nothing about how far the others may reasonably lie.
    """
    if not samples:
        return Summary(0.0, 0, ())
    med = statistics.median(samples)
    spread = k * MAD_SCALE * statistics.median(abs(s - med) for s in samples)
    kept = [s for s in samples if spread == 0 or abs(s - med) <= spread]
    return Summary(statistics.median(kept), len(kept), tuple(samples))
