"""Profile proto -> cost model -> simulator: measured calibration enters the simulation unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2, profile_pb2
from services.planner.cost import LayerStrategy, build_pipeline, from_profile
from services.planner.cost.pipeline import pipeline_peak_memory
from services.planner.sim import Schedule, SimOptions, simulate
from services.planner.sim.gantt import plot_timeline
from services.profiler.projection import analytical_profile
from services.specs.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[3]
GPT = {
    "name": "gpt-8",
    "family": "MODEL_FAMILY_GPT",
    "dtype": "DTYPE_FP32",
    "transformer": {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "vocab_size": 8192, "seq_length": 256},
}


@pytest.fixture(scope="module")
def profile() -> profile_pb2.Profile:
    return analytical_profile(ParseDict(GPT, model_pb2.ModelSpec()), "nvidia-titan-rtx-24gb", "fp32")


@pytest.fixture(scope="module")
def fleet():
    return load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")


def four_stages(view):
    n = len(view.layers)
    cuts = [0, 3, 5, 7, n]
    return [(cuts[i], cuts[i + 1]) for i in range(4)]


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_cost_model_peaks_match_the_simulated_peaks(profile, fleet, schedule):
    view = from_profile(profile)
    pipe = build_pipeline(view, fleet, four_stages(view), LayerStrategy(dp=2), 4, 8)
    result = simulate(pipe, SimOptions(schedule=schedule, keep_timeline=False))
    assert result.peak_memory_bytes == pipeline_peak_memory(pipe, schedule)
    per_stage = [s.forward_s + s.backward_s for s in pipe.stages]
    # The slowest stage runs every micro-batch; the pipeline cannot beat it, nor be slower than running serially.
    assert 8 * max(per_stage) < result.iteration_s
    assert result.iteration_s < 8 * sum(per_stage) + sum(s.allreduce_s for s in pipe.stages) + 1.0


def test_a_measured_allreduce_fit_changes_the_iteration_time(profile, fleet):
    """The executor issue compares predictions with runs by feeding measured fits in: they must be used."""
    view = from_profile(profile)
    base = simulate(build_pipeline(view, fleet, four_stages(view), LayerStrategy(dp=2), 4, 8), SimOptions())
    slow = profile_pb2.Profile()
    slow.CopyFrom(profile)
    slow.comm.fits.add(collective="allreduce", group_size=2, latency_s=0.5, bandwidth_bytes_per_s=1e6, r2=0.99)
    slow_view = from_profile(slow)
    pipe = build_pipeline(slow_view, fleet, four_stages(slow_view), LayerStrategy(dp=2), 4, 8)
    result = simulate(pipe, SimOptions())
    assert min(s.allreduce_s for s in pipe.stages) > 0.5
    assert result.iteration_s > base.iteration_s + 0.5


def test_overlap_slowdown_from_the_profile_slows_overlapped_backward(profile, fleet):
    view = from_profile(profile)
    sdp = LayerStrategy(sdp=2)
    plain = build_pipeline(view, fleet, four_stages(view), sdp, 4, 8)
    slowed = profile_pb2.Profile()
    slowed.CopyFrom(profile)
    slowed.comm.overlap_slowdown = 2.0
    slowed_view = from_profile(slowed)
    heavier = build_pipeline(slowed_view, fleet, four_stages(slowed_view), sdp, 4, 8)
    assert all(h.backward_s > p.backward_s for h, p in zip(heavier.stages, plain.stages, strict=True))
    assert all(h.forward_s == p.forward_s for h, p in zip(heavier.stages, plain.stages, strict=True))


def test_gantt_of_a_priced_plan(profile, fleet, tmp_path):
    view = from_profile(profile)
    pipe = build_pipeline(view, fleet, four_stages(view), LayerStrategy(dp=2, checkpoint=True), 2, 6)
    result = simulate(pipe, SimOptions(schedule=Schedule.VARUNA))
    kinds = {e.kind for e in result.events}
    assert {"forward", "backward", "recompute", "send_activation", "send_gradient", "allreduce"} <= kinds
    assert not any(e.kind == "recompute" and e.stage == 3 for e in result.events)  # Varuna's last stage
    png = plot_timeline(result, tmp_path / "plan.png", title="gpt-8 on 8x TITAN")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_example_fleet_is_yaml_the_docs_can_show():
    assert yaml.safe_load((ROOT / "examples" / "fleet-8xTITAN.yaml").read_text())["devices_per_node"] == 8
