"""The bounded default sweep: Varuna's stopping rule and the time budget, on made-up timings and a fake clock."""

from __future__ import annotations

import math

import pytest

from services.profiler.bounded import check_budget, expected_end, ladder, plateau, predicted_end
from services.runtime.errors import InvalidArgument

LADDER = [1, 2, 4, 8, 16, 32, 64]


def model_seconds(per_sample: list[float]) -> list[float]:
    """Times at LADDER sizes with the given time per sample."""
    return [p * m for p, m in zip(per_sample, LADDER, strict=False)]


def test_keeps_going_while_time_per_sample_improves():
    per = [10.0, 8.0, 6.0, 5.0, 4.0]
    verdict = plateau(LADDER[:5], model_seconds(per))
    assert not verdict.stop and verdict.best == 16 and verdict.stale == 0


def test_stops_two_doublings_after_the_best_and_names_it():
    per = [10.0, 8.0, 6.0, 6.1, 5.9]  # 8 and 16 gain < 5% on the best (6.0 at 4)
    assert not plateau(LADDER[:4], model_seconds(per[:4])).stop
    verdict = plateau(LADDER[:5], model_seconds(per))
    assert verdict.stop and verdict.best == 4 and verdict.stale == 2


def test_one_noisy_size_does_not_stop_it():
    per = [10.0, 8.0, 8.3, 6.0, 5.0]  # 4 came out slow, 8 improves again
    verdict = plateau(LADDER[:5], model_seconds(per))
    assert not verdict.stop and verdict.best == 16


def test_small_gains_add_up_against_the_best():
    per = [10.0, 9.6, 9.2]  # 4% then 4% more: 8% below the best (at 1) by 4
    verdict = plateau(LADDER[:3], model_seconds(per))
    assert verdict.best == 4 and verdict.stale == 0 and not verdict.stop


def test_gain_and_patience_are_parameters():
    per = [10.0, 9.0, 8.0]
    assert plateau(LADDER[:3], model_seconds(per), gain=0.2, patience=2).stop
    assert not plateau(LADDER[:3], model_seconds(per), gain=0.2, patience=3).stop
    with pytest.raises(ValueError):
        plateau([1, 2], [1.0])


class FakeClock:
    """Time that moves only when the fake measurement says so: no sleeping, no wall clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_sweep(per_sample: dict[int, float], cost_per_m: float = 1.0, fits_up_to: int = 10**6):
    """(fits, measure, clock, tried): measuring m takes cost_per_m * m fake seconds and returns per_sample[m] * m."""
    clock, tried = FakeClock(), []

    def fits(m: int) -> bool:
        return m <= fits_up_to

    def measure(m: int) -> float:
        tried.append(m)
        clock.now += cost_per_m * m
        return per_sample.get(m, 1.0) * m

    return fits, measure, clock, tried


def test_budget_stops_before_a_size_predicted_to_overrun():
    improving = {m: 10.0 / m for m in LADDER}  # never plateaus: only the budget stops it
    fits, measure, clock, tried = fake_sweep(improving)
    result = ladder(fits, measure, budget_s=20.0, clock=clock)
    # spent after 1, 2, 4, 8: 1, 3, 7, 15 s; 16 would take 16 s more, ending at 31 > 20
    assert tried == [1, 2, 4, 8] and result.sizes == [1, 2, 4, 8]
    assert result.reason.startswith("time budget 20 s: micro-batch 16 would end at ~31 s")
    assert clock.now - 100.0 <= 20.0


def test_budget_counts_from_the_given_start():
    improving = {m: 10.0 / m for m in LADDER}
    fits, measure, clock, tried = fake_sweep(improving)
    result = ladder(fits, measure, budget_s=20.0, clock=clock, start=clock.now - 14.0)  # 14 s already spent
    assert tried == [1, 2]  # 15 s after 1, 17 s after 2; 4 would take 4 s more
    assert result.reason.startswith("time budget 20 s: micro-batch 4 would end at ~21 s")


def test_micro_batch_one_is_measured_whatever_the_budget():
    fits, measure, clock, tried = fake_sweep({})
    result = ladder(fits, measure, budget_s=1e-9, clock=clock)
    assert tried == [1] and result.sizes == [1] and result.reason.startswith("time budget")


def test_plateau_stops_before_the_budget():
    per = {1: 10.0, 2: 8.0, 4: 6.0, 8: 6.0, 16: 6.2, 32: 1.0}
    fits, measure, clock, tried = fake_sweep(per)
    result = ladder(fits, measure, budget_s=1000.0, clock=clock)
    assert tried == [1, 2, 4, 8, 16] and result.best == 4
    assert result.reason.startswith("time per sample stopped improving after micro-batch 4")


def test_memory_failure_and_cap_stop_it():
    improving = {m: 10.0 / m for m in LADDER}
    fits, measure, clock, tried = fake_sweep(improving, fits_up_to=6)
    result = ladder(fits, measure, budget_s=1000.0, clock=clock)
    assert result.sizes == [1, 2, 4] and result.reason == "micro-batch 8 does not fit"
    fits, measure, clock, tried = fake_sweep(improving)
    result = ladder(fits, measure, budget_s=1000.0, cap=12, clock=clock)
    assert result.sizes == [1, 2, 4, 8, 12] and result.reason == "reached the cap 12"
    fits, _, clock, _ = fake_sweep(improving)
    result = ladder(fits, lambda m: None if m == 4 else float(m), budget_s=1000.0, clock=clock)
    assert result.sizes == [1, 2] and result.reason == "micro-batch 4 failed while measuring"
    result = ladder(lambda m: False, measure, budget_s=1000.0, clock=clock)
    assert result.sizes == [] and result.best == 0 and result.reason == "micro-batch 1 does not fit"


def test_predicted_end_scales_the_last_time_by_size():
    assert predicted_end(10.0, 8, 4.0, 16) == 18.0


def test_expected_end_adds_the_doublings_the_rule_still_needs_within_the_budget():
    assert expected_end(10.0, 30.0, 8, 1.0, stale=0) == 16.0  # two more: 2 s, then 4 s
    assert expected_end(10.0, 30.0, 8, 1.0, stale=1) == 12.0  # one more
    assert expected_end(10.0, 12.0, 8, 1.0, stale=0) == 12.0  # the budget ends it first


def test_each_step_is_reported_with_what_the_estimate_needs():
    seen = []
    fits, measure, clock, _ = fake_sweep({1: 10.0, 2: 10.0, 4: 10.0})
    ladder(fits, measure, budget_s=100.0, clock=clock,
           on_step=lambda state: seen.append((state.sizes[-1], state.stale, state.last_step_s)))
    assert seen == [(1, 0, 1.0), (2, 1, 2.0), (4, 2, 4.0)]


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_a_bad_budget_names_the_field_and_the_fix(bad):
    with pytest.raises(InvalidArgument) as info:
        check_budget(bad)
    assert info.value.field == "time_budget_s" and "0 for the default (30 s)" in str(info.value)


def test_zero_and_positive_budgets_are_fine():
    check_budget(0.0)
    check_budget(12.5)
