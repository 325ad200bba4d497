"""A worker's per-iteration stats summarised over windows before they leave the host (issue 43, item 3).

One row per rank per iteration does not survive a fleet: 8,192 GPUs at an iteration a second are 8,192 rows a
second through the planner and the store. The agent keeps each worker's stats and sends one StageStats per
window instead: the mean of every time and byte count (so the parts still sum to the iteration time), the
largest peak memory, the mean loss, and the iteration time's count, median, p95 and max.

Windows are blocks of iteration numbers, [k*W, (k+1)*W), restarted at each checkpoint (with a cadence C, block k of
period c is [c*C + k*W, min(c*C + (k+1)*W, (c+1)*C)): a morph trims the rows from its checkpoint on, and no window
straddles one, whatever W and C are). They are the same for every rank of a job, so the stages' windows line up
for the training monitor and a replica's windows for the straggler test; a plan-version change closes a window
(its timings say nothing about the new partition). A worker's first WARMUP iterations, at its start and after a
plan-version change, go one by one: the planner learns at once that the worker trains (a morph's resumed
iteration is timed from it), and every reader that leaves a run's first iterations out as warm-up (calibration,
fidelity, the straggler test: at most 3) leaves out exactly those. Pure: no clocks, no I/O.
"""

from __future__ import annotations

import math
from array import array

from ballast.v1 import executor_pb2

WARMUP = 3  # iterations sent one by one after a start or a plan-version change
MEANS = ("forward_s", "backward_s", "comm_s", "idle_s", "recompute_s", "throughput_samples_per_s", "p2p_s",
         "allreduce_s", "optimizer_s", "overhead_s", "swap_s", "data_s", "iteration_time_s")
BYTE_MEANS = ("bytes_sent", "swapped_bytes", "swap_in_bytes", "swap_out_bytes")


def nearest_rank(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values by nearest rank (an observed value, never an interpolation)."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Summary:
    """A window being summed: running sums of its means, its largest peak, its losses' sum and its iteration
    times (8 bytes each: a window of thousands of iterations on thousands of emulated ranks stays small)."""

    def __init__(self, first: executor_pb2.StageStats):
        self.first = first.iteration
        self.last = first
        self.sums = dict.fromkeys(MEANS + BYTE_MEANS, 0.0)
        self.peak, self.loss_sum, self.losses = 0, 0.0, 0
        self.times = array("d")

    def add(self, stats: executor_pb2.StageStats) -> None:
        for name in self.sums:
            self.sums[name] += getattr(stats, name)
        self.peak = max(self.peak, stats.peak_memory_bytes)
        if stats.has_loss:
            self.loss_sum, self.losses = self.loss_sum + stats.loss, self.losses + 1
        self.times.append(stats.iteration_time_s)
        self.last = stats

    def stats(self) -> executor_pb2.StageStats:
        out = executor_pb2.StageStats()
        out.CopyFrom(self.last)  # identity, the layer lists, memory now and ended_at are the last iteration's
        n = len(self.times)
        times = sorted(self.times)
        out.first_iteration, out.iterations = self.first, n
        out.iteration_time_p50_s, out.iteration_time_p95_s = nearest_rank(times, 0.5), nearest_rank(times, 0.95)
        out.iteration_time_max_s = times[-1]
        if n == 1:
            return out
        for name in MEANS:
            setattr(out, name, self.sums[name] / n)
        for name in BYTE_MEANS:
            setattr(out, name, round(self.sums[name] / n))
        out.peak_memory_bytes = self.peak
        out.has_loss = self.losses > 0
        out.loss = self.loss_sum / self.losses if self.losses else 0.0
        return out


def summarise(samples: list[executor_pb2.StageStats]) -> executor_pb2.StageStats:
    """One worker's consecutive iterations (oldest first, one plan version) as one StageStats."""
    summary = Summary(samples[0])
    for s in samples:
        summary.add(s)
    return summary.stats()


class StatsWindow:
    """One worker's open window: `add` an iteration's stats, get back the windows it closed (oldest first)."""

    def __init__(self, size: int, warmup: int = WARMUP, period: int = 0):
        self.size, self.warmup, self.period = max(1, size), warmup, max(0, period)
        self._open: Summary | None = None
        self._version: int | None = None
        self._alone = 0  # iterations still to send one by one

    def add(self, stats: executor_pb2.StageStats) -> list[executor_pb2.StageStats]:
        closed = []
        if stats.plan_version != self._version:  # a start, or a new partition: its warm-up goes one by one
            self._version, self._alone = stats.plan_version, self.warmup
        last = self._open.last if self._open else None
        if last is not None and (stats.plan_version != last.plan_version or stats.iteration != last.iteration + 1
                                 or self._block(stats.iteration) != self._block(last.iteration)):
            closed.append(self._open.stats())  # a new block or plan version, or a report missing in between
            self._open = None
        if self._open is None:
            self._open = Summary(stats)
        self._open.add(stats)
        if self._alone > 0 or self.size == 1 or self._block(stats.iteration + 1) != self._block(stats.iteration):
            self._alone -= 1
            closed.append(self._open.stats())
            self._open = None
        return closed

    def _block(self, iteration: int) -> tuple[int, int]:
        """(checkpoint period, block within it) of an iteration: every rank of the job agrees on it."""
        if not self.period:
            return 0, iteration // self.size
        return iteration // self.period, iteration % self.period // self.size

    def flush(self) -> list[executor_pb2.StageStats]:
        """The open window, if any (the worker exited, or the job is stopping)."""
        closed = [self._open.stats()] if self._open else []
        self._open = None
        return closed
