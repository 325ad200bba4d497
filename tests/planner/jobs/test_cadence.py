"""Checkpoint cadence from Young's interval: cost, failure rate and bounds."""

from __future__ import annotations

import math

import pytest

from services.planner.jobs import cadence


def test_young_interval_in_iterations():
    c = cadence.young(checkpoint_s=2.0, mtbf_s=3600.0, iteration_s=0.5)
    assert c.every == int(math.sqrt(2 * 2.0 * 3600.0) / 0.5)  # 120 s -> 240 iterations
    assert "every 240 iterations" in c.why and "120 s" in c.why


def test_more_failures_checkpoint_more_often_and_bounds_hold():
    rare = cadence.young(1.0, cadence.job_mtbf_s(1, 1000.0, 8), 0.1)
    often = cadence.young(1.0, cadence.job_mtbf_s(50, 1000.0, 8), 0.1)
    assert often.every < rare.every
    assert cadence.young(100.0, 1e9, 1.0, max_interval_s=600).every == 600  # capped
    assert cadence.young(1e-6, 1.0, 1.0, min_every=5).every == 5
    assert cadence.young(1.0, 100.0, 0.0).every == 0


def test_mtbf_and_cost_estimates():
    assert cadence.job_mtbf_s(0, 0.0, 4) == pytest.approx(cadence.NO_FAILURE_MTBF_S / 4)
    assert cadence.job_mtbf_s(2, 10.0, 1) == pytest.approx(5 * 3600.0)
    assert cadence.checkpoint_cost_s(200_000_000) == pytest.approx(3.0)
    assert cadence.checkpoint_cost_s(200_000_000, measured_s=0.4) == 0.4


def test_a_background_write_longer_than_youngs_interval_sets_the_interval():
    """One write in flight at a time: a checkpoint due while the previous one still writes would stall."""
    quick = cadence.young(checkpoint_s=0.01, mtbf_s=100.0, iteration_s=0.5)  # sqrt(2) s -> 2 iterations
    assert quick.every == 2
    slow = cadence.young(checkpoint_s=0.01, mtbf_s=100.0, iteration_s=0.5, write_s=3.2)
    assert slow.every == 7 and "no shorter than the 3.2 s background write" in slow.why
    assert "background write" not in cadence.young(0.01, 100.0, 0.5, write_s=0.4).why
