"""A prediction carries its upper bound (issue 45, item 2): the calibration's residual or its runs' spread,
whichever is larger (at least 5%), or x 2 uncalibrated; said in the explanation."""

from __future__ import annotations

import pytest

from ballast.v1 import plan_pb2
from services.planner.cost.calibration import Calibration
from services.planner.plans.make import MIN_ERROR, UNCALIBRATED_ERROR, error_bound, with_interval


@pytest.mark.parametrize(("cal", "bound", "why"), [
    (None, UNCALIBRATED_ERROR, "uncalibrated"),
    (Calibration(residual=0.08, spread=0.03), 0.08, "residual"),
    (Calibration(residual=0.04, spread=0.12), 0.12, "spread of the runs"),
    (Calibration(residual=0.01, spread=0.0), MIN_ERROR, "residual"),
])
def test_the_bound_is_the_larger_known_error(cal, bound, why):
    found, said = error_bound(cal)
    assert found == pytest.approx(bound) and why in said
    plan = with_interval(plan_pb2.Plan(prediction=plan_pb2.Prediction(iteration_time_s=2.0)), cal)
    assert plan.prediction.iteration_time_high_s == pytest.approx(2.0 * (1 + bound))
    assert plan.explanation.startswith("\nInterval: up to") and said in plan.explanation
