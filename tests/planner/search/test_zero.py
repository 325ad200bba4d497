"""DP flavours in the search (issue 24): the space, the DP's exactness with them, capabilities, the acceptance.

Acceptance: at a memory budget between what one-stage ZeRO-2 and one-stage plain data parallelism need, the
default search for executors declaring ZeRO-2 runs layers as ZeRO-2, fits, and beats every plan it finds
without the flavours; executors that do not declare ZeRO-2 never get a ZeRO-2 layer.
"""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
from google.protobuf.json_format import ParseDict

from ballast.cli.plan import strategy as cli_strategy
from ballast.v1 import common_pb2, model_pb2
from services.planner.cost import CostContext, DpSharding, LayerStrategy, from_profile
from services.planner.plans.make import PlanInputs, make_plan, runnable_dims
from services.planner.search import count, layer_candidates, strategy_space
from services.planner.search.dp import StageSolver, layer_tables
from services.planner.search.problem import price
from services.planner.sim import Schedule
from services.profiler.projection import analytical_profile
from services.specs.fleet import fleet_from_dict
from tests.cost_support import GB, fleet, model

ALL = ("pp", "dp", "sdp", "tp", "zero1", "zero2")
BATCH = 32
BERT = {  # BERT-large's width and sequence, 12 layers so the searches stay quick
    "name": "bert-12x1024",
    "family": "MODEL_FAMILY_BERT",
    "dtype": "DTYPE_FP16",
    "transformer": {"num_layers": 12, "hidden_size": 1024, "num_heads": 16, "vocab_size": 30522, "seq_length": 512},
}


# --- the space --------------------------------------------------------------------------------------------


def test_flavours_double_only_the_strategies_with_data_parallel_replicas():
    """8 devices: 22 Takeaway-3 strategies per checkpoint flag, 9 of them with dp > 1 (space docstring)."""
    assert count(8) == 44  # Galvatron-BMW's space is unchanged by default
    assert count(8, dims=ALL) == 44 + 2 * 2 * 9
    assert count(8, dims=ALL, checkpoint=(False,)) == 22 + 2 * 9
    assert count(8, dims=("pp", "dp", "sdp", "tp", "zero2")) == 44 + 2 * 9
    for cands in strategy_space(8, dims=ALL).values():
        for c in cands:
            assert c.dp_sharding == "plain" or c.dp > 1
            assert not (c.dp > 1 and c.sdp > 1)  # Takeaway 3 drops the flavoured mixes with the plain ones
    # Without Takeaway 3 the DP+SDP mixes come in every flavour too.
    mixes = [c for c in layer_candidates(4, dims=ALL, takeaway3=False, checkpoint=(False,)) if c.dp > 1 and c.sdp > 1]
    assert {c.dp_sharding for c in mixes} == {"plain", "zero1", "zero2"}
    # A flavour needs dp; the ParallelDim enums name them too.
    assert count(8, dims=("pp", "sdp", "tp", "zero1", "zero2")) == count(8, dims=("pp", "sdp", "tp"))
    cands = layer_candidates(2, dims=[common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_ZERO2], checkpoint=(False,))
    assert [c.label for c in cands] == ["PP1 · DP2", "PP1 · DP2 ZeRO-2"]


# --- the per-stage DP stays exact with them ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tables():
    """Six identical layers, dp 4 on one node of a slow link (the sync outlasts the backward) with ZeRO-1/2 and
    checkpointing: 6 slots, 6^6 assignments, so the DP runs its sweep and enumeration, not the tiny path."""
    ctx = CostContext(model(6, params=2_000_000, stashed=20_000_000, boundary=1_000_000), fleet(intra_bw=2 * GB))
    return layer_tables(ctx, layer_candidates(4, dims=("dp", "zero1", "zero2")), 8)


def brute_force(tables, end: int, nm: int, in_flight: int, budget: int) -> float:
    every = np.array(list(product(range(tables.layout.size), repeat=end))).T
    peaks, costs = tables.check(0, every, in_flight, nm)
    fits = (peaks <= budget) & np.isfinite(costs)
    return float(costs[fits].min()) if fits.any() else float("inf")


@pytest.mark.parametrize("end", [5, 6])  # a forward pass from layer 0; a backward one from the model's end
@pytest.mark.parametrize("nm, in_flight", [(1, 1), (4, 1), (4, 4)])
def test_the_stage_dp_finds_the_exact_optimum_with_flavours(tables, nm, in_flight, end):
    assert tables.layout.size == 6 and any(st.sharded for st in tables.strategies)
    least, most = (tables.check(0, np.full((end, 1), k), in_flight, nm)[0][0] for k in (5, 0))  # z2 +ckpt, plain
    assert least < most
    for budget in np.linspace(least, most, 7).astype(int):
        solver = StageSolver(tables, num_micro_batches=nm, in_flight=in_flight, budget_bytes=int(budget),
                             granularity_bytes=1 << 20)
        plan = solver.solve(0, end)
        expect = brute_force(tables, end, nm, in_flight, int(budget))
        assert plan.cost_s == pytest.approx(expect, rel=1e-9, abs=1e-15) if np.isfinite(expect) else not plan.feasible
        if plan.feasible:
            assert plan.memory_bytes <= budget


# --- capabilities -----------------------------------------------------------------------------------------


def test_runnable_dims_keep_a_flavour_only_where_every_host_declares_it():
    d = common_pb2
    both = [d.PARALLEL_DIM_PP, d.PARALLEL_DIM_DP, d.PARALLEL_DIM_ZERO1, d.PARALLEL_DIM_ZERO2]
    assert runnable_dims([both]) == ("dp", "zero1", "zero2")
    assert runnable_dims([both, [d.PARALLEL_DIM_DP, d.PARALLEL_DIM_ZERO1]]) == ("dp", "zero1")
    assert runnable_dims([both, [d.PARALLEL_DIM_DP]]) == ("dp",)
    assert runnable_dims([]) == ("dp",)


@pytest.fixture(scope="module")
def setting():
    profile = analytical_profile(ParseDict(BERT, model_pb2.ModelSpec()), "nvidia-a100-80gb")
    profile.id, profile.model_id = "prf-bert", "mdl-bert"
    fleet_ = fleet_from_dict({"name": "8xa100", "device": "nvidia-a100-80gb", "nodes": 1, "devices_per_node": 8,
                              "intra_node": "nvlink3"})
    return profile, fleet_


def one_stage_need(profile, fleet_, zero: DpSharding) -> int:
    """Least peak of a one-stage dp 8 plan of this flavour at BATCH, over checkpointing and micro-batch counts."""
    ctx = CostContext(from_profile(profile), fleet_)
    n = len(ctx.view)
    return min(max(price(ctx, ((0, n),), [LayerStrategy(dp=8, dp_sharding=zero, checkpoint=ckpt)] * n,
                         BATCH // nm, nm, Schedule.ONE_F_ONE_B, 1 << 62).peak_memory_bytes)
               for ckpt in (False, True) for nm in (1, 2, 4) if (BATCH // nm) % 8 == 0)


@pytest.fixture(scope="module")
def budget(setting):
    plain, zero2 = (one_stage_need(*setting, z) for z in (DpSharding.PLAIN, DpSharding.ZERO2))
    assert zero2 < plain
    return (plain + zero2) // 2


def plan_for(setting, budget, dims):
    profile, fleet_ = setting
    return make_plan(profile, fleet_, PlanInputs(global_batch_size=BATCH, memory_budget_bytes=budget,
                                                 runnable_dims=dims))


def flavours(plan) -> set[int]:
    return {layer.dp_sharding for layer in plan.layers if layer.dp > 1}


@pytest.mark.parametrize("without, with_zero", [
    (("dp",), ("dp", "zero2")),
    (("dp", "sdp", "tp"), ("dp", "sdp", "tp", "zero1", "zero2")),
])
def test_zero2_is_chosen_where_plain_dp_does_not_fit_and_beats_every_plan_without_it(setting, budget, without,
                                                                                     with_zero):
    chosen = plan_for(setting, budget, with_zero)
    assert common_pb2.DP_SHARDING_ZERO2 in flavours(chosen)
    assert not chosen.prediction.out_of_memory and chosen.prediction.peak_memory_bytes <= budget
    # Its ZeRO-2 layers as plain DP would not fit: the flavour is what makes the layout possible.
    assert "as plain DP it would peak at" in chosen.explanation and "(over the budget)" in chosen.explanation
    best_without = plan_for(setting, budget, without)
    assert flavours(best_without) <= {common_pb2.DP_SHARDING_UNSPECIFIED}
    assert chosen.prediction.iteration_time_s < best_without.prediction.iteration_time_s


def test_executors_without_zero2_never_get_a_zero2_layer(setting, budget):
    only_zero1 = plan_for(setting, budget, ("dp", "zero1"))
    assert common_pb2.DP_SHARDING_ZERO2 not in flavours(only_zero1)
    assert flavours(plan_for(setting, budget, ("dp",))) == {common_pb2.DP_SHARDING_UNSPECIFIED}
    assert flavours(plan_for(setting, budget, ("dp", "sdp", "tp"))) <= {common_pb2.DP_SHARDING_UNSPECIFIED}


def test_explain_and_the_layer_table_name_the_flavour(setting, budget):
    plan = plan_for(setting, budget, ("dp", "zero2"))
    zero2 = [layer for layer in plan.layers if layer.dp_sharding == common_pb2.DP_SHARDING_ZERO2]
    assert "+zero2" in plan.explanation.splitlines()[0]  # Chosen: PP1 [dp8, dp8 +zero2]
    assert f"DP flavours: ZeRO-2 on {len(zero2)} of {len(plan.layers)} layers" in plan.explanation
    assert cli_strategy(zero2[0]) == f"dp{zero2[0].dp} +zero2" + (" +ckpt" if zero2[0].checkpoint else "")


def test_what_if_searches_the_flavours_and_says_the_executors_lack_them(setting, budget):
    profile, fleet_ = setting
    plan = make_plan(profile, fleet_, PlanInputs(global_batch_size=BATCH, memory_budget_bytes=budget,
                                                 runnable_dims=("dp",), what_if=True))
    needs = {d for layer in plan.layers for d in LayerStrategy.from_proto(layer).requires}
    assert ("Not yet executable" in plan.explanation) == bool(needs - {"dp"})
    if "zero2" in needs:
        assert "ZERO2" in plan.explanation
