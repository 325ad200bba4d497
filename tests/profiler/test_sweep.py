"""Harmony slow-start sweep, strided sampling and the linear regression that fills the gaps."""

from __future__ import annotations

import random

import pytest
import torch

from ballast.v1 import profile_pb2
from services.profiler.sweep import fit_samples, interpolate, is_oom, sweep, sweep_layer, sweep_sizes


def fails_above(limit: int):
    tried: list[int] = []

    def probe(m: int) -> bool:
        tried.append(m)
        return m <= limit

    return probe, tried


def assert_never_above_a_failure(probes) -> None:
    failed = None
    for p in probes:
        if failed is not None:
            assert p.size < failed, f"probed {p.size} after {failed} failed"
        if not p.fits:
            failed = p.size if failed is None else min(failed, p.size)


def test_multiplicative_then_halve_then_additive():
    probe, tried = fails_above(37)
    result = sweep(probe, cap=1024)
    assert tried == [1, 2, 4, 8, 16, 32, 64, 33, 34, 35, 36, 37, 38]
    assert [p.phase for p in result.probes] == ["multiplicative"] * 7 + ["additive"] * 6
    assert [p.size for p in result.probes if not p.fits] == [64, 38]
    assert result.max_fit == 37 and result.fits and result.reason == "failed at 38"
    assert_never_above_a_failure(result.probes)
    assert result.sizes == list(range(1, 38))


def test_stride_picks_sizes_to_measure_and_keeps_the_max():
    probe, _ = fails_above(37)
    assert sweep_sizes(probe, cap=1024, stride=4) == [1, 5, 9, 13, 17, 21, 25, 29, 33, 37]
    probe, _ = fails_above(37)
    assert sweep_sizes(probe, cap=1024, stride=8) == [1, 9, 17, 25, 33, 37]


def test_additive_step_never_crosses_the_first_failure():
    probe, tried = fails_above(37)
    result = sweep(probe, cap=1024, step=10)
    assert tried == [1, 2, 4, 8, 16, 32, 64, 42]
    assert result.max_fit == 32
    assert_never_above_a_failure(result.probes)


def test_cap_is_respected():
    probe, tried = fails_above(10_000)
    result = sweep(probe, cap=20)
    assert tried == [1, 2, 4, 8, 16, 20]
    assert result.max_fit == 20 and result.reason == "reached cap"
    probe, tried = fails_above(18)
    result = sweep(probe, cap=20)
    assert tried == [1, 2, 4, 8, 16, 20, 17, 18, 19] and result.max_fit == 18


def test_start_that_fails_halves_down():
    probe, tried = fails_above(5)
    result = sweep(probe, start=16, cap=64)
    assert tried == [16, 8, 4, 5, 6]
    assert [p.phase for p in result.probes] == ["multiplicative", "halving", "halving", "additive", "additive"]
    assert result.max_fit == 5


@pytest.mark.parametrize(
    "error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), RuntimeError("out of memory")]
)
def test_oom_is_a_failure(error):
    def probe(m: int) -> bool:
        if m > 12:
            raise error
        return True

    result = sweep(probe, cap=100)
    assert result.max_fit == 12
    assert "out of memory" in result.probes[-1].reason
    assert is_oom(error) and not is_oom(ValueError("out of memory"))


def test_other_errors_propagate():
    def probe(m: int) -> bool:
        raise ValueError("bug in the layer")

    with pytest.raises(ValueError, match="bug in the layer"):
        sweep(probe)


def test_does_not_fit_at_one():
    result = sweep(lambda m: False, cap=64)
    assert not result.fits and result.max_fit == 0 and result.sizes == []
    assert result.reason.startswith("does not fit at micro-batch 1")
    assert sweep_sizes(lambda m: False) == []

    def too_big(m: int) -> profile_pb2.LayerSample:
        return profile_pb2.LayerSample(micro_batch_size=m, measured=True, peak_memory_bytes=10**12)

    layer = sweep_layer(too_big, cap=64, memory_cap_bytes=10**9)
    assert not layer.fit and layer.samples == [] and "does not fit" in layer.reason


def test_fit_interpolates_linear_plus_noise_within_5_percent():
    rng = random.Random(7)

    def truth(m: float) -> float:
        return 0.003 + 0.0004 * m

    sizes = list(range(1, 65, 6))
    values = [truth(m) * (1 + rng.uniform(-0.02, 0.02)) for m in sizes]
    fit = fit_samples(sizes, values)
    assert fit.r2 > 0.99 and fit.n == len(sizes) and fit.max_rel_error < 0.05
    for m in range(1, 65):
        assert abs(fit(m) - truth(m)) / truth(m) < 0.05


def test_single_sample_fit_is_proportional():
    fit = fit_samples([4], [8.0])
    assert fit(2) == 4.0 and fit.intercept == 0.0


def test_interpolate_marks_predicted_rows():
    measured = [
        profile_pb2.LayerSample(micro_batch_size=m, measured=True, forward_s=0.1 * m, output_bytes=1000 * m)
        for m in (1, 3, 5)
    ]
    rows = interpolate(measured, range(1, 7))
    assert [r.micro_batch_size for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r.measured for r in rows] == [True, False, True, False, True, False]
    assert rows[1].output_bytes == 2000 and rows[5].output_bytes == 6000
    assert rows[3].forward_s == pytest.approx(0.4)


def test_sweep_layer_measures_each_size_once_and_fills_the_rest():
    calls: list[int] = []

    def measure(m: int) -> profile_pb2.LayerSample:
        calls.append(m)
        return profile_pb2.LayerSample(
            micro_batch_size=m, measured=True, forward_s=0.01 + 0.002 * m, peak_memory_bytes=1000 + 100 * m
        )

    layer = sweep_layer(measure, cap=1024, memory_cap_bytes=4750, stride=8)
    assert layer.sweep.max_fit == 37 and layer.fit
    assert len(calls) == len(set(calls))
    assert max(calls) == 64 and all(m < 64 for m in calls[calls.index(64) + 1 :])
    assert [r.micro_batch_size for r in layer.samples] == list(range(1, 38))
    measured = {r.micro_batch_size for r in layer.samples if r.measured}
    assert {1, 9, 17, 25, 33, 37} <= measured and 64 not in measured
    for r in layer.samples:
        assert r.peak_memory_bytes == pytest.approx(1000 + 100 * r.micro_batch_size, rel=1e-6)
    assert layer.fits["forward_s"].r2 == pytest.approx(1.0)
