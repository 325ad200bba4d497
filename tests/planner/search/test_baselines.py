"""Galvatron-BMW §VII baselines on the shared cost model: structure, best batch, OOM reasons, memory order."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2
from services.planner.cost import CostContext, ModelView, from_profile
from services.planner.search.baselines import BASELINES, baselines, batch_sizes, best_baseline
from services.planner.search.problem import SearchOptions
from services.planner.sim import Schedule
from services.profiler.projection import analytical_profile
from services.runtime.errors import InvalidArgument
from services.specs.fleet import load_fleet
from tests.cost_support import fleet, model

ROOT = Path(__file__).resolve().parents[3]
GPT = {
    "name": "gpt-8",
    "family": "MODEL_FAMILY_GPT",
    "dtype": "DTYPE_FP32",
    "transformer": {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "vocab_size": 8192, "seq_length": 256},
}
GiB = 2**30


@pytest.fixture(scope="module")
def gpt_view() -> ModelView:
    spec = ParseDict(GPT, model_pb2.ModelSpec())
    return from_profile(analytical_profile(spec, "nvidia-titan-rtx-24gb", "fp32"))


@pytest.fixture(scope="module")
def titan():
    return load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")


@pytest.fixture(scope="module")
def on_titan(gpt_view, titan):
    """The GPT baselines on 8x TITAN with 2 GiB per device (a fixture: priced once for several tests)."""
    return baselines(CostContext(gpt_view, titan), 8, SearchOptions(memory_budget_bytes=2 * GiB))


def degrees(plan) -> set[tuple[int, int, int]]:
    return {(st.dp, st.sdp, st.tp) for st in plan.strategies}


def test_every_baseline_in_order_on_all_devices(on_titan):
    assert [p.name for p in on_titan] == list(BASELINES)
    for p in on_titan:
        assert p.engine == "baseline" and not p.out_of_memory and p.throughput > 0
        assert p.devices == 8 and p.replicas == 1
        assert p.global_batch_size in batch_sizes(SearchOptions(memory_budget_bytes=0))
        assert p.num_micro_batches * p.micro_batch_size == p.global_batch_size
        assert max(p.peak_memory_bytes) <= 2 * GiB


def test_baseline_structures(on_titan):
    ddp, zero3, megatron, gpipe, ds3d, dp_tp, dp_pp = on_titan
    for single, shape in ((ddp, (8, 1, 1)), (zero3, (1, 8, 1)), (megatron, (1, 1, 8))):
        assert len(single.stage_bounds) == 1 and degrees(single) == {shape} and single.num_micro_batches == 1
        assert not any(st.checkpoint for st in single.strategies)
    assert len(gpipe.stage_bounds) == 8 and degrees(gpipe) == {(1, 1, 1)} and gpipe.schedule is Schedule.GPIPE
    assert all(st.checkpoint for st in gpipe.strategies)  # torch Pipe's default checkpoint="except_last"
    assert len(ds3d.stage_bounds) == 2 and degrees(ds3d) == {(2, 1, 2)} and ds3d.schedule is Schedule.ONE_F_ONE_B
    (split,) = degrees(dp_tp)
    assert len(dp_tp.stage_bounds) == 1 and split[1] == 1 and split[0] * split[2] == 8
    (split,) = degrees(dp_pp)
    assert split[1:] == (1, 1) and split[0] * len(dp_pp.stage_bounds) == 8 and dp_pp.schedule is Schedule.ONE_F_ONE_B
    assert not any(st.checkpoint for p in (ds3d, dp_tp, dp_pp) for st in p.strategies)


def test_searched_baselines_are_at_least_their_pure_members(on_titan):
    by_name = {p.name: p for p in on_titan}
    assert by_name["DP+TP"].throughput >= max(by_name["DDP"].throughput, by_name["Megatron TP"].throughput)
    assert by_name["DP+PP"].throughput >= by_name["DDP"].throughput


def test_megatron_keeps_tp_inside_a_node():
    plan = best_baseline(CostContext(model(4), fleet(4, 2)), "Megatron TP", 8, SearchOptions(memory_budget_bytes=GiB))
    assert degrees(plan) == {(2, 1, 4)} and "inside a node" in plan.reason


def test_deepspeed_3d_keeps_its_tp_inside_a_node():
    plan = best_baseline(CostContext(model(8), fleet(2, 8)), "DeepSpeed 3D", 16, SearchOptions(memory_budget_bytes=GiB))
    ((dp, _, tp),) = degrees(plan)
    assert dp == 2 and tp == 2 and len(plan.stage_bounds) == 4


def test_tiny_budget_is_out_of_memory_with_a_reason(gpt_view, titan):
    plans = baselines(CostContext(gpt_view, titan), 8, SearchOptions(memory_budget_bytes=2**20))
    for p in plans:
        assert p.out_of_memory and p.throughput == 0.0
        assert "out of memory" in p.reason and "budget" in p.reason


def test_gpipe_needs_a_layer_per_device():
    plan = best_baseline(CostContext(model(4), fleet()), "GPipe", 8, SearchOptions(memory_budget_bytes=GiB))
    assert plan.out_of_memory and "4 layers" in plan.reason and plan.stage_bounds == ()


def test_ddp_holds_more_memory_than_zero3_at_the_same_batch(gpt_view, titan):
    ctx = CostContext(gpt_view, titan)
    options = SearchOptions(memory_budget_bytes=24 * GiB, global_batch_size=32)
    ddp, zero3 = (best_baseline(ctx, name, 8, options) for name in ("DDP", "ZeRO-3"))
    assert ddp.global_batch_size == zero3.global_batch_size == 32
    assert max(ddp.peak_memory_bytes) > max(zero3.peak_memory_bytes)


def test_batch_sweep_follows_the_options():
    assert batch_sizes(SearchOptions(memory_budget_bytes=0, max_global_batch_size=20)) == [1, 2, 4, 8, 16]
    around = SearchOptions(memory_budget_bytes=GiB, global_batch_size=24, batch_radius=2)
    assert batch_sizes(around) == [22, 23, 24, 25, 26]
    plan = best_baseline(CostContext(model(4), fleet()), "DP+PP", 8, around)
    assert 22 <= plan.global_batch_size <= 26


def test_tight_memory_lowers_the_best_batch(gpt_view, titan):
    ctx = CostContext(gpt_view, titan)
    roomy = best_baseline(ctx, "DDP", 8, SearchOptions(memory_budget_bytes=24 * GiB, max_global_batch_size=256))
    tight = best_baseline(ctx, "DDP", 8, SearchOptions(memory_budget_bytes=GiB, max_global_batch_size=256))
    assert not tight.out_of_memory and tight.global_batch_size < roomy.global_batch_size


def test_executability_is_only_a_flag(gpt_view, titan):
    options = SearchOptions(memory_budget_bytes=2 * GiB, dims=("dp",), checkpoint=(False,))
    plans = {p.name: p for p in baselines(CostContext(gpt_view, titan), 8, options)}
    assert "not executable" in plans["Megatron TP"].reason and "tp" in plans["Megatron TP"].reason
    assert "not executable" in plans["GPipe"].reason and "checkpointing" in plans["GPipe"].reason
    assert "not executable" not in plans["DDP"].reason
    assert all(not p.out_of_memory for p in plans.values())


def test_bad_input():
    ctx = CostContext(model(4), fleet())
    with pytest.raises(InvalidArgument, match="num_devices"):
        best_baseline(ctx, "DDP", 9, SearchOptions(memory_budget_bytes=GiB))
    with pytest.raises(InvalidArgument, match="unknown baseline"):
        best_baseline(ctx, "Alpa", 8, SearchOptions(memory_budget_bytes=GiB))


def test_baselines_are_deterministic(gpt_view, titan, on_titan):
    assert baselines(CostContext(gpt_view, titan), 8, SearchOptions(memory_budget_bytes=2 * GiB)) == on_titan
