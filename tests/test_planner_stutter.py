"""Fail-stutter detection's pure part: who is a straggler, and whether leaving it out is faster."""

from __future__ import annotations

import pytest

from services.planner.jobs.stutter import Finding, StutterWatch, faster_without


def fill(watch: StutterWatch, times: dict[tuple[int, int], float], count: int) -> None:
    for _ in range(count):
        for (stage, replica), t in times.items():
            watch.observe(stage, replica, t)


def test_a_replica_twice_as_slow_as_its_peers_is_found_once_its_window_is_full():
    watch = StutterWatch(window=10, threshold=0.2)
    times = {(0, 0): 0.10, (0, 1): 0.20, (0, 2): 0.10}
    fill(watch, times, 9)
    assert watch.straggler() is None  # not a full window yet
    fill(watch, times, 1)
    found = watch.straggler()
    assert (found.stage, found.replica) == (0, 1) and found.ratio == pytest.approx(2.0)
    assert found.evidence()["window"] == 10 and found.evidence()["peers_compute_s"] == pytest.approx(0.1)


def test_noise_below_the_threshold_and_a_lone_replica_are_not_stragglers():
    watch = StutterWatch(window=5, threshold=0.2)
    fill(watch, {(0, 0): 0.10, (0, 1): 0.115, (1, 0): 0.5}, 5)  # stage 1 has no peer to compare with
    assert watch.straggler() is None


def test_one_slow_iteration_in_a_window_is_not_persistent():
    watch = StutterWatch(window=5, threshold=0.2)
    for i in range(5):
        watch.observe(0, 0, 0.1)
        watch.observe(0, 1, 0.5 if i == 2 else 0.1)
    assert watch.straggler() is None


def test_the_simulators_re_plan_corrected_by_its_error_on_the_healthy_layout_decides():
    slow = Finding(stage=0, replica=2, ratio=2.0, own_s=0.2, peers_s=0.1, window=10)
    # measured 0.22 s: everyone waits for the straggler's 0.2 s of compute; healthy it would be 0.12 s.
    # The simulator predicted 0.10 s for the current plan (20% optimistic) and 0.14 s re-planned on the rest.
    assert faster_without(0.22, slow, 0.10, 0.14) == pytest.approx(0.168)  # < 0.22 s: worth leaving it out
    assert faster_without(0.22, slow, 0.10, 0.20) == pytest.approx(0.24)  # the rest too few: no better
    assert faster_without(0.22, slow, 0.10, 0.0) is None  # no plan fits the devices left
    assert faster_without(0.22, slow, 0.0, 0.14) is None
