"""A profile taken on a busy host (issue 45, item 1): a fixed workload timed before and after the layers are
measured says the host's speed moved; the driver then measures again and keeps, per layer and size, the faster
row, and records how noisy the host was. Here the probe's readings and the first pass's slowdown are stand-ins
(this test's own logic around the real driver, measuring a real tiny GPT)."""

from __future__ import annotations

import pytest
import torch

from ballast.v1 import profile_pb2
from services.planner.plans.make import profile_note
from services.profiler import driver, noise
from tests.profiler.test_driver import request, spec


class Busy:
    """A measurement whose row reads `factor` times slower (what interference does to a whole pass)."""

    def __init__(self, measured, factor: float) -> None:
        self.measured, self.factor = measured, factor

    def sample(self) -> profile_pb2.LayerSample:
        row = self.measured.sample()
        row.forward_s, row.backward_s = row.forward_s * self.factor, row.backward_s * self.factor
        return row


def profile_with(monkeypatch, readings: list[float]) -> tuple[profile_pb2.Profile, list[float]]:
    """Profile with the probe reading `readings` in turn; every row of the first pass is 3x slow."""
    reads = iter(readings)
    passes = {"probes": 0}
    first_pass: list[float] = []

    def probe(device) -> float:
        passes["probes"] += 1
        return next(reads)

    real = driver.measure_layer

    def measure(*args, **kwargs):
        done = real(*args, **kwargs)
        if passes["probes"] < 3:  # between the first two probes: the first pass
            busy = Busy(done, 3.0)
            first_pass.append(busy.sample().forward_s)
            return busy
        return done

    monkeypatch.setattr(noise, "probe_s", probe)
    monkeypatch.setattr(driver, "measure_layer", measure)
    profile = driver.profile(spec(), request(micro_batch_sizes=[1, 2]))
    return profile, first_pass


def test_a_quiet_host_is_measured_once(monkeypatch):
    profile, _ = profile_with(monkeypatch, [1.0, 1.05])
    assert profile.measure_passes == 1 and profile.host_noise == pytest.approx(0.05) and not profile.noisy


def test_a_busy_host_is_measured_again_and_the_faster_rows_kept(monkeypatch):
    profile, slow = profile_with(monkeypatch, [1.0, 1.5, 1.0, 1.02])
    assert profile.measure_passes == 2 and profile.host_noise == pytest.approx(0.02) and not profile.noisy
    rows = [s for layer in profile.layers for s in layer.samples if s.measured]
    assert rows and not {s.forward_s for s in rows} & set(slow)  # none of the first, slowed pass is kept
    assert "measured twice" in profile_note(profile)


def test_a_host_busy_through_both_passes_is_flagged(monkeypatch):
    profile, _ = profile_with(monkeypatch, [1.0, 1.5, 1.0, 1.4])
    assert profile.measure_passes == 2 and profile.noisy and profile.host_noise == pytest.approx(0.4)
    assert "prefer a calibration" in profile_note(profile)


def test_the_probe_and_its_reading():
    assert noise.moved(1.0, 1.2) == pytest.approx(0.2) and noise.moved(1.2, 1.0) == pytest.approx(0.2)
    assert noise.moved(0.0, 1.0) == 0.0
    assert noise.probe_s(torch.device("cpu")) > 0
    assert profile_note(profile_pb2.Profile()) == ""  # a profile from before 0020 says nothing


def line_rows(slow: dict[int, float]) -> dict[int, profile_pb2.LayerSample]:
    """Rows of a layer whose forward + backward is 1 ms + 0.5 ms per sample, sizes in `slow` that much slower."""
    return {m: profile_pb2.LayerSample(micro_batch_size=m, measured=True,
                                       forward_s=(1e-3 + 5e-4 * m) / 3 * slow.get(m, 1.0),
                                       backward_s=2 * (1e-3 + 5e-4 * m) / 3 * slow.get(m, 1.0))
            for m in range(1, 9)}


def test_a_row_still_off_its_layers_line_is_flagged_and_the_rest_are_not():
    rows = line_rows({6: 1.2})
    driver.flag_off_line(rows, sorted(rows))
    assert rows[6].off_line == pytest.approx(0.2, rel=0.05)
    assert all(rows[m].off_line == 0.0 for m in rows if m != 6)
    within = line_rows({6: 1.03})  # inside the tolerance: no flag
    driver.flag_off_line(within, sorted(within))
    assert not any(r.off_line for r in within.values())
    dear_start = line_rows({1: 1.1})  # micro-batch 1's fixed cost is a real curve, not noise: not judged
    driver.flag_off_line(dear_start, sorted(dear_start))
    assert not any(r.off_line for r in dear_start.values())
    slow_end = line_rows({8: 1.15})  # the largest size, judged by the line through the two below it
    driver.flag_off_line(slow_end, sorted(slow_end))
    assert slow_end[8].off_line == pytest.approx(0.15, rel=0.05) and not slow_end[7].off_line


def test_the_profile_note_counts_the_rows_off_their_line():
    profile = profile_pb2.Profile(layers=[profile_pb2.LayerProfile(index=0, measured_as=0,
                                                                   samples=list(line_rows({}).values()))])
    profile.layers[0].samples[3].off_line = 0.12
    assert "1 of 8 measured rows still off their layer's line after re-measuring (worst 12%)" in profile_note(profile)
