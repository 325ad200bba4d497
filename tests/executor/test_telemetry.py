"""A worker's stats summarised over windows before they leave the host (services/executor/telemetry.py)."""

from __future__ import annotations

import random
import statistics

import pytest

from ballast.v1 import executor_pb2
from services.executor.telemetry import WARMUP, StatsWindow, nearest_rank, summarise


def stats(iteration: int, seconds: float = 1.0, version: int = 1, loss: float | None = None) -> executor_pb2.StageStats:
    s = executor_pb2.StageStats(job_id="job-t", iteration=iteration, plan_version=version, iteration_time_s=seconds,
                                forward_s=seconds / 4, backward_s=seconds / 2, optimizer_s=seconds / 8,
                                overhead_s=seconds / 8, peak_memory_bytes=int(seconds * 100), bytes_sent=3,
                                active_layers=[iteration % 3])
    if loss is not None:
        s.loss, s.has_loss = loss, True
    return s


def spans(windows: list[executor_pb2.StageStats]) -> list[tuple[int, int, int]]:
    return [(w.first_iteration, w.iteration, w.iterations) for w in windows]


def test_the_first_iterations_go_one_by_one_then_blocks_of_the_window_aligned_on_iteration_numbers():
    window, sent = StatsWindow(5), []
    for i in range(17):
        sent += window.add(stats(i))
    sent += window.flush()
    assert spans(sent) == [(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 4, 2), (5, 9, 5), (10, 14, 5), (15, 16, 2)]
    assert window.flush() == []


def test_a_resumed_worker_keeps_the_same_blocks_as_its_peers():
    """After a morph the ranks start at the checkpoint: their warm-up alone, then the job-wide blocks."""
    window, sent = StatsWindow(4), []
    for i in range(10, 19):
        sent += window.add(stats(i))
    assert spans(sent) == [(10, 10, 1), (11, 11, 1), (12, 12, 1), (13, 15, 3)]


def test_windows_restart_at_each_checkpoint_so_none_straddles_one():
    """A cadence that is not a multiple of the window (a prime one, 23): each period's last window is shorter, and
    a rank resumed from a checkpoint finds the same blocks as the ranks that never stopped."""
    window, sent = StatsWindow(10, period=23), []
    for i in range(50):
        sent += window.add(stats(i))
    sent += window.flush()
    assert spans(sent) == [(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 9, 7), (10, 19, 10), (20, 22, 3), (23, 32, 10),
                           (33, 42, 10), (43, 45, 3), (46, 49, 4)]
    assert not any(w.first_iteration < c <= w.iteration for w in sent for c in (23, 46))  # none straddles one
    resumed, again = StatsWindow(10, period=23), []
    for i in range(23, 50):
        again += resumed.add(stats(i))
    again += resumed.flush()
    assert spans(again)[3:] == [(26, 32, 7), *spans(sent)[7:]]  # its warm-up alone, then the same blocks


def test_a_new_plan_version_closes_the_window_and_its_warm_up_goes_one_by_one():
    window, sent = StatsWindow(10), []
    for i in range(8):
        sent += window.add(stats(i, version=1))
    for i in range(8, 14):
        sent += window.add(stats(i, version=2))
    assert [(w.plan_version, *span) for w, span in zip(sent, spans(sent), strict=True)] == [
        (1, 0, 0, 1), (1, 1, 1, 1), (1, 2, 2, 1), (1, 3, 7, 5), (2, 8, 8, 1), (2, 9, 9, 1), (2, 10, 10, 1)]


@pytest.mark.parametrize("size", [0, 1])
def test_a_window_of_one_sends_every_iteration(size: int):
    window = StatsWindow(size)
    assert [spans(window.add(stats(i))) for i in range(5)] == [[(i, i, 1)] for i in range(5)]


def test_a_summary_holds_means_that_still_sum_the_largest_peak_the_mean_loss_and_the_time_quantiles():
    rng = random.Random(3)
    times = [rng.uniform(0.5, 2.0) for _ in range(40)]
    samples = [stats(i, t, loss=float(i) if i % 2 else None) for i, t in enumerate(times, start=100)]
    got = summarise(samples)
    assert (got.first_iteration, got.iteration, got.iterations) == (100, 139, 40)
    assert got.iteration_time_s == pytest.approx(statistics.fmean(times))
    parts = got.forward_s + got.backward_s + got.optimizer_s + got.overhead_s
    assert parts == pytest.approx(got.iteration_time_s)
    ordered = sorted(times)
    assert got.iteration_time_p50_s == ordered[19] and got.iteration_time_p95_s == ordered[37]
    assert got.iteration_time_max_s == max(times)
    assert got.peak_memory_bytes == max(s.peak_memory_bytes for s in samples) and got.bytes_sent == 3
    assert got.has_loss and got.loss == pytest.approx(statistics.fmean(float(i) for i in range(101, 140, 2)))
    assert list(got.active_layers) == [139 % 3]  # the last iteration's


def test_a_window_without_a_loss_has_none():
    got = summarise([stats(0), stats(1)])
    assert not got.has_loss and got.loss == 0.0


def test_nearest_rank_returns_an_observed_value():
    assert [nearest_rank([1.0, 2.0, 3.0, 4.0], q) for q in (0.0, 0.25, 0.5, 0.95, 1.0)] == [1.0, 1.0, 2.0, 4.0, 4.0]


def test_the_warm_up_matches_the_readers_that_leave_it_out():
    from services.planner.jobs.running import GROW_WARMUP
    from services.planner.jobs.stutter import WARMUP as STUTTER_WARMUP
    from services.planner.plans.calibrate import WARMUP as CALIBRATION_WARMUP
    assert max(CALIBRATION_WARMUP, GROW_WARMUP, STUTTER_WARMUP) <= WARMUP


def test_a_report_missing_in_between_closes_the_window_so_a_window_is_always_consecutive_iterations():
    """A report the agent could not read (a garbled line) leaves a gap: the windows on each side of it are
    consecutive iterations, so the store takes them (iterations = last - first + 1)."""
    window, sent = StatsWindow(10), []
    for i in (*range(0, 5), *range(6, 12)):
        sent += window.add(stats(i))
    sent += window.flush()
    assert spans(sent) == [(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 4, 2), (6, 9, 4), (10, 11, 2)]
    assert all(last - first + 1 == n for first, last, n in spans(sent))
