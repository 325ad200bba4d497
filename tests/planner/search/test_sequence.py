"""Sequence parallelism in the cost model and the search (issue 44 item 2).

Megatron-style SP on a TP layer splits its boundary activation by the sequence over the tp ranks, and turns each
TP all-reduce into an all-gather plus a reduce-scatter: the same ring volume and step count, so on fleet links it
is never slower and always holds less. The search therefore runs every TP layout with SP where the layer allows
it and it is no slower (dp.layer_tables), without doubling the strategy space."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ballast.v1 import common_pb2, plan_pb2
from services.executor.workers import hybrid_layers
from services.planner.cost import CostContext, LayerStrategy, layer_cost
from services.planner.cost.layer import missing_fraction, transform_cost
from services.planner.cost.profile_view import ModelView
from services.planner.search.dp import layer_tables
from services.planner.search.galvatron import Planner
from services.planner.search.space import layer_candidates
from tests.cost_support import fleet, layer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import planner_cases as cases  # noqa: E402

TP2, SP2 = LayerStrategy(dp=2, tp=2), LayerStrategy(dp=2, tp=2, sequence_parallel=True)


def ctx(sequence: int = 4) -> CostContext:
    view = ModelView(layers=tuple(replace(layer(i, boundary=400, stashed=4000, output=400), tensor_parallel=4,
                                          sequence_parallel=sequence) for i in range(4)))
    return CostContext(view, fleet())


def test_sp_is_only_a_tp_flag_and_names_its_capability():
    assert LayerStrategy(dp=4, sequence_parallel=True).sequence_parallel is False  # no tp ranks to split over
    assert SP2.requires == ("dp", "tp", "sp") and SP2.describe() == "dp2xtp2 +sp"
    assert SP2.layout != TP2.layout  # its tensors between layers are split differently
    assert LayerStrategy.from_proto(SP2.to_proto(3, 0)) == SP2


def test_sp_holds_the_boundary_split_by_sequence_at_the_time_of_plain_tp():
    c = ctx()
    tp, sp = layer_cost(c, 1, TP2, 8), layer_cost(c, 1, SP2, 8)
    share = 8 // 2
    assert tp.forward_activation_bytes == pytest.approx((400 + 4000 / 2) * share)
    assert sp.forward_activation_bytes == pytest.approx((400 / 2 + 4000 / 2) * share)
    # all-gather + reduce-scatter move what one all-reduce moves, in as many ring steps
    assert math.isclose(sp.per_micro_batch_s, tp.per_micro_batch_s, rel_tol=1e-12)
    assert sp.tp_comm_s > 0 and any(s.startswith("tp allgather") for s in sp.sources)
    assert any(s.startswith("tp reduce_scatter") for s in sp.sources)


def test_re_layouts_price_the_samples_times_sequence_rectangles():
    dp2, tp2, sp2 = LayerStrategy(dp=2), LayerStrategy(tp=2), LayerStrategy(tp=2, sequence_parallel=True)
    assert missing_fraction(dp2, tp2) == 0.5 and missing_fraction(tp2, dp2) == 0.0  # gather, then slice
    assert missing_fraction(dp2, sp2) == 0.25 and missing_fraction(sp2, dp2) == 0.25  # a quarter each way
    assert missing_fraction(tp2, sp2) == 0.0 and missing_fraction(sp2, tp2) == 0.5
    dp4, sp4 = LayerStrategy(dp=4), LayerStrategy(tp=4, sequence_parallel=True)
    assert missing_fraction(dp4, sp4) == missing_fraction(sp4, dp4) == pytest.approx(3 / 16)  # (t-1)/t^2
    c = ctx()
    assert transform_cost(c, 2, SP2, SP2, 8).forward_s == 0.0
    # dp4 -> dp2 x tp2 +sp: a device holds a quarter of the samples, whole; it needs half its group's sequence
    # (a quarter of the micro-batch), of which it holds half: an eighth is missing
    assert transform_cost(c, 2, LayerStrategy(dp=4), SP2, 8).forward_bytes == pytest.approx(400 * 8 / 8)


def test_the_tables_run_tp_layouts_with_sp_where_the_layer_allows_it():
    candidates = layer_candidates(4, dims=("dp", "tp"))
    on = layer_tables(ctx(), candidates, 8, sequence=True, executable_only=True)
    off = layer_tables(ctx(), candidates, 8, sequence=False, executable_only=True)
    none = layer_tables(ctx(sequence=0), candidates, 8, sequence=True, executable_only=True)
    tp_slots = [k for k, st in enumerate(on.strategies)  # the TP strategies the workers run (TP innermost)
                if st is not None and st.tp > 1 and math.isfinite(on.per_micro_batch_s[0, k])]
    assert tp_slots and on.sequence is not None
    assert all(on.sequence[:, on.layout[k]].all() for k in tp_slots)
    assert off.sequence is None and none.sequence is None  # not asked for; the profile says the layer cannot
    assert (on.forward_activation_bytes[:, tp_slots] < off.forward_activation_bytes[:, tp_slots]).all()
    assert (on.per_micro_batch_s[:, tp_slots] <= off.per_micro_batch_s[:, tp_slots] * (1 + 1e-12)).all()


@pytest.fixture(scope="module")
def searches():
    """The planner benchmark's 48 layers on 64 A100s, searched with and without SP (the default has it)."""
    return {sequence: Planner(CostContext(cases.view(48), cases.fleet(64)), 64,
                              cases.options(64, sequence)).run()[0] for sequence in (True, False)}


def test_the_default_search_uses_sp_on_its_tp_layers_and_is_never_worse_for_it(searches):
    with_sp, without = searches[True], searches[False]
    tp_layers = [st for st in with_sp.strategies if st.tp > 1]
    assert tp_layers and all(st.sequence_parallel for st in tp_layers)
    assert not any(st.sequence_parallel for st in without.strategies)
    assert with_sp.throughput >= without.throughput * (1 - 1e-9)


def test_the_agent_runs_a_plans_sp_layers():
    DP, TP_ = common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_TP
    plan = plan_pb2.Plan(layers=[
        plan_pb2.LayerStrategy(layer_index=0, dp=4, order=[DP]),
        plan_pb2.LayerStrategy(layer_index=1, dp=2, tp=2, order=[DP, TP_], sequence_parallel=True),
        plan_pb2.LayerStrategy(layer_index=2, dp=2, tp=2, order=[DP, TP_])])
    assert hybrid_layers(plan) == {"tp_layers": [[1, 2], [2, 2]], "sp_layers": [1]}
