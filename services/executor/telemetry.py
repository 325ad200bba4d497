"""A worker's per-iteration stats summarised over windows before they leave the host (issue 43, item 3).

One row per rank per iteration does not survive a fleet: 8,192 GPUs at an iteration a second are 8,192 rows a
second through the planner and the store. The agent keeps each worker's stats and sends one StageStats per
window instead: the mean of every time and byte count (so the parts still sum to the iteration time), the
largest peak memory, the mean loss, and the iteration time's count, median, p95 and max.

Windows are blocks of iteration numbers, [k*W, (k+1)*W), the same for every rank of a job, so the stages' windows
line up for the training monitor and a replica's windows for the straggler test; a plan-version change closes a
window (its timings say nothing about the new partition). A worker's first WARMUP iterations, at its start and
after a plan-version change, go one by one: the planner learns at once that the worker trains (a morph's resumed
iteration is timed from it), and every reader that leaves a run's first iterations out as warm-up (calibration,
fidelity, the straggler test: at most 3) leaves out exactly those. Pure: no clocks, no I/O.
"""

from __future__ import annotations

import math

from ballast.v1 import executor_pb2

WARMUP = 3  # iterations sent one by one after a start or a plan-version change
MEANS = ("forward_s", "backward_s", "comm_s", "idle_s", "recompute_s", "throughput_samples_per_s", "p2p_s",
         "allreduce_s", "optimizer_s", "overhead_s", "swap_s", "data_s", "iteration_time_s")
BYTE_MEANS = ("bytes_sent", "swapped_bytes", "swap_in_bytes", "swap_out_bytes")


def nearest_rank(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values by nearest rank (an observed value, never an interpolation)."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarise(samples: list[executor_pb2.StageStats]) -> executor_pb2.StageStats:
    """One worker's consecutive iterations (oldest first, one plan version) as one StageStats."""
    last = samples[-1]
    out = executor_pb2.StageStats()
    out.CopyFrom(last)  # identity, the layer lists and ended_at are the last iteration's
    n = len(samples)
    times = sorted(s.iteration_time_s for s in samples)
    out.first_iteration, out.iterations = samples[0].iteration, n
    out.iteration_time_p50_s, out.iteration_time_p95_s = nearest_rank(times, 0.5), nearest_rank(times, 0.95)
    out.iteration_time_max_s = times[-1]
    if n == 1:
        return out
    for name in MEANS:
        setattr(out, name, sum(getattr(s, name) for s in samples) / n)
    for name in BYTE_MEANS:
        setattr(out, name, round(sum(getattr(s, name) for s in samples) / n))
    out.peak_memory_bytes = max(s.peak_memory_bytes for s in samples)
    out.memory_bytes = last.memory_bytes
    losses = [s.loss for s in samples if s.has_loss]
    out.has_loss = bool(losses)
    out.loss = sum(losses) / len(losses) if losses else 0.0
    return out


class StatsWindow:
    """One worker's open window: `add` an iteration's stats, get back the windows it closed (oldest first)."""

    def __init__(self, size: int, warmup: int = WARMUP):
        self.size, self.warmup = max(1, size), warmup
        self._open: list[executor_pb2.StageStats] = []
        self._version: int | None = None
        self._alone = 0  # iterations still to send one by one

    def add(self, stats: executor_pb2.StageStats) -> list[executor_pb2.StageStats]:
        closed = []
        if stats.plan_version != self._version:  # a start, or a new partition: its warm-up goes one by one
            self._version, self._alone = stats.plan_version, self.warmup
        if self._open and (stats.plan_version != self._open[-1].plan_version
                           or stats.iteration // self.size != self._open[-1].iteration // self.size
                           or stats.iteration <= self._open[-1].iteration):
            closed.append(summarise(self._open))  # a new block, a new plan version, or the worker went back
            self._open = []
        self._open.append(stats)
        if self._alone > 0 or self.size == 1 or stats.iteration % self.size == self.size - 1:
            self._alone -= 1
            closed.append(summarise(self._open))
            self._open = []
        return closed

    def flush(self) -> list[executor_pb2.StageStats]:
        """The open window, if any (the worker exited, or the job is stopping)."""
        closed = [summarise(self._open)] if self._open else []
        self._open = []
        return closed
