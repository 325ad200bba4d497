"""Calibration from runs: fitted lines recover the runtime's scale and fixed costs; apply maps a StageCost."""

from __future__ import annotations

import pytest

from services.planner.cost.calibration import Calibration, HostClass, Observation, apply, fit, line
from services.planner.sim.model import StageCost

CPU2 = HostClass("cpu", cores=2, colocated=2)


def observe(forward: float, backward: float, nm: int, *, scale: float = 1.3, fixed: float = 0.002,
            allreduce: float = 0.0, update: float = 0.01, memory: int = 100 << 20) -> Observation:
    """A stage whose runtime is `scale` x the profile plus `fixed` per micro-batch (the truth to recover)."""
    predicted = StageCost(forward_s=forward, backward_s=backward, allreduce_s=allreduce, update_s=update)
    return Observation(
        predicted=predicted, num_micro_batches=nm, forward_s=nm * (scale * forward + fixed),
        backward_s=nm * (scale * backward + 2 * fixed), allreduce_s=1.5 * allreduce, optimizer_s=2 * update,
        overhead_s=0.0, peak_memory_bytes=int(1.1 * memory) + (30 << 20), predicted_peak_memory_bytes=memory,
        iterations=20)


def test_a_line_recovers_scale_and_fixed_cost_and_falls_back_to_a_ratio():
    assert line([1.0, 2.0, 4.0], [1.5, 2.5, 4.5]) == pytest.approx((1.0, 0.5))
    assert line([1.0, 1.05], [2.0, 2.1]) == pytest.approx((2.0, 0.0))  # too alike to separate: the ratio
    assert line([1.0, 2.0], [3.0, 2.0]) == pytest.approx((2.0, 0.0))  # negative slope: the median ratio
    assert line([], []) == (1.0, 0.0)
    assert line([0.001, 0.00101], [0.02, 0.021]) == pytest.approx((1.0, 0.0195), rel=1e-3)  # ratio ~20: a fixed cost
    # memory: one run's gap is the runtime's own (RSS of the interpreter and libraries), a fixed amount
    assert line([100.0], [300.0], offset=True) == pytest.approx((1.0, 200.0))
    assert line([25.0, 53.0], [363.0, 421.0], offset=True) == pytest.approx((58 / 28, 363 - 25 * 58 / 28))


def test_fit_recovers_the_runtime_from_stages_of_different_size():
    runs = [observe(0.010, 0.020, 2, allreduce=0.05), observe(0.004, 0.008, 8), observe(0.020, 0.040, 2)]
    cal = fit(runs, CPU2)
    assert cal.host_class == "cpu/2c/2w" and cal.iterations == 20
    assert (cal.forward_scale, cal.forward_fixed_s) == pytest.approx((1.3, 0.002))
    assert (cal.backward_scale, cal.backward_fixed_s) == pytest.approx((1.3, 0.004))
    assert cal.allreduce_scale == pytest.approx(1.5) and cal.update_scale == pytest.approx(2.0)
    assert cal.iteration_fixed_s == 0.0  # set by the caller from the simulated runs
    assert cal.residual == pytest.approx(0.0, abs=1e-9)


def test_memory_calibrates_from_predicted_and_measured_peaks():
    runs = [observe(0.01, 0.02, 2, memory=100 << 20), observe(0.01, 0.02, 2, memory=300 << 20)]
    cal = fit(runs, CPU2)
    assert cal.memory_scale == pytest.approx(1.1) and cal.memory_fixed_bytes == pytest.approx(30 << 20, rel=1e-6)


def test_apply_is_the_identity_without_a_calibration_and_maps_every_part_with_one():
    stage = StageCost(forward_s=0.01, backward_s=0.02, recompute_s=0.005, allreduce_s=0.1, update_s=0.02,
                      model_memory_bytes=1000, activation_bytes=100, transient_bytes=10)
    assert apply(stage, None) is stage and apply(stage, Calibration(host_class="x")) is stage
    cal = Calibration(host_class="x", forward_scale=2.0, forward_fixed_s=0.001, backward_scale=3.0,
                      backward_fixed_s=0.002, allreduce_scale=0.5, update_scale=1.5, iteration_fixed_s=0.01,
                      memory_scale=2.0, memory_fixed_bytes=7)
    out = apply(stage, cal)
    assert out.forward_s == pytest.approx(0.021) and out.backward_s == pytest.approx(0.062)
    assert out.recompute_s == pytest.approx(0.015) and out.allreduce_s == pytest.approx(0.05)
    assert out.update_s == pytest.approx(0.04)
    assert (out.model_memory_bytes, out.activation_bytes, out.transient_bytes) == (2007, 200, 20)


def test_no_observation_fits_the_identity():
    assert fit([], CPU2) == Calibration(host_class="cpu/2c/2w")
    assert fit([], CPU2).identity


def test_the_cost_model_applies_a_calibration_only_on_its_device_kind():
    """Priced through the real cost model: a cpu calibration changes a cpu fleet's stage, not a GPU fleet's."""
    from dataclasses import replace

    from services.planner.cost.context import CostContext, CostOptions
    from services.planner.cost.stage import stage_cost
    from services.planner.cost.strategy import LayerStrategy
    from tests.cost_support import fleet, model

    cal = Calibration(host_class="cpu/2c/2w", forward_scale=2.0, forward_fixed_s=0.001)
    for kind, changed in (("cpu", True), ("nvidia-a100-40gb", False)):
        layers, devices = model(), replace(fleet(), device_kind=kind)
        plain = stage_cost(CostContext(layers, devices), 0, 2, LayerStrategy(), 2)
        calibrated = stage_cost(CostContext(layers, devices, CostOptions(calibration=cal)), 0, 2, LayerStrategy(), 2)
        assert plain.forward_s > 0
        expected = 2.0 * plain.forward_s + 0.001 if changed else plain.forward_s
        assert calibrated.forward_s == pytest.approx(expected), kind
        assert calibrated.backward_s == pytest.approx(plain.backward_s)


def test_the_workers_overhead_is_fitted_as_a_fixed_cost_before_each_forward():
    runs = [replace_overhead(observe(0.010, 0.020, 2), 0.006), replace_overhead(observe(0.004, 0.008, 8), 0.024)]
    cal = fit(runs, CPU2)  # 3 ms per micro-batch on both: forward's fixed part grows by it
    assert (cal.forward_scale, cal.forward_fixed_s) == pytest.approx((1.3, 0.005))


def replace_overhead(o: Observation, overhead_s: float) -> Observation:
    from dataclasses import replace

    return replace(o, overhead_s=overhead_s)
