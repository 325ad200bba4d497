"""The per-stage DP (dp.py) and the partition search (partition.py) on small hand-built cases."""

from __future__ import annotations

import math
from itertools import product

import numpy as np
import pytest

from services.planner.cost import (
    CostContext,
    LayerStrategy,
    ModelView,
    layer_cost,
    stage_cost,
    stage_peak_memory,
)
from services.planner.search import layer_candidates
from services.planner.search import partition as part
from services.planner.search.dp import LayerTables, StagePlan, StageSolver, layer_tables, stage_dp
from services.planner.search.problem import to_strategy
from services.planner.sim import Schedule
from tests.cost_support import fleet, layer, model

MiB = 2**20
M, NM = 4, 4


def blocks_context(n: int = 6, params: int = 2_000_000, stashed: float = 1e6) -> CostContext:
    """Identical blocks, 4 devices in one node (TP/SDP/DP all intra-node)."""
    return CostContext(model(n, params=params, stashed=stashed, boundary=5e4, output=5e4),
                       fleet(devices_per_node=4, nodes=1, intra_bw=50e9))


def solve(ctx: CostContext, budget: int, *, group: int = 4, dims=("dp", "sdp", "tp"), checkpoint=(False, True),
          in_flight: int = 1, gran: int = MiB, **kw: object) -> StagePlan:
    tables = layer_tables(ctx, layer_candidates(group, dims=dims, checkpoint=checkpoint), M)
    return StageSolver(tables, num_micro_batches=NM, in_flight=in_flight, budget_bytes=budget,
                       granularity_bytes=gran, **kw).solve(0, len(ctx.view))


def memory_of(ctx: CostContext, plan: StagePlan, in_flight: int = 1) -> int:
    sc = stage_cost(ctx, plan.begin, plan.end, plan.strategies, M)
    return stage_peak_memory(sc, Schedule.GPIPE, 1, 0, in_flight)  # GPipe: in-flight = Nm = in_flight


def cost_of(ctx: CostContext, plan: StagePlan) -> float:
    sc = stage_cost(ctx, plan.begin, plan.end, plan.strategies, M)
    return NM * (sc.forward_s + sc.backward_s + sc.recompute_s) + sc.allreduce_s


def test_checkpointing_only_when_memory_forces_it():
    ctx = blocks_context()
    assert not any(st.checkpoint for st in solve(ctx, 10**12).strategies)
    roomy = solve(ctx, 10**12, dims=("dp",))
    assert roomy.feasible and not any(st.checkpoint for st in roomy.strategies)
    # Just under what the roomy plan needs: with DP only, recomputing is the one relief.
    tight = solve(ctx, int(roomy.memory_bytes) - 1, dims=("dp",))
    assert tight.feasible and any(st.checkpoint for st in tight.strategies)
    assert tight.cost_s > roomy.cost_s
    assert tight.memory_bytes <= roomy.memory_bytes - 1


def test_sharding_replaces_data_parallel_when_model_states_do_not_fit():
    ctx = blocks_context(params=20_000_000, stashed=1e4)  # 320 MB of states per block, tiny activations
    states = sum(layer_cost(ctx, i, LayerStrategy(dp=4), M).model_state_bytes for i in range(len(ctx.view)))
    assert not solve(ctx, int(states * 0.6), dims=("dp",)).feasible  # replicated states alone overflow
    plan = solve(ctx, int(states * 0.6))
    assert plan.feasible
    assert all(st.sdp > 1 or st.tp > 1 for st in plan.strategies)
    assert memory_of(ctx, plan) <= int(states * 0.6)


def test_more_memory_never_gives_a_worse_optimum():
    ctx = CostContext(ModelView(layers=(
        layer(0, params=1_500_000, kind="embed", fwd=2e-5, bwd=4e-5, boundary=8e3, stashed=1e5, output=1e5),
        *(layer(i, params=400_000 * (1 + i % 2), fwd=3e-4 * (1 + 0.3 * i), bwd=6e-4 * (1 + 0.3 * i),
                boundary=1e5, stashed=1.2e6 * (1 + 0.25 * i), output=1e5) for i in range(1, 5)),
        layer(5, params=2_000_000, kind="head", fwd=2.5e-4, bwd=5e-4, boundary=1e5, stashed=4e5, output=2e4),
    )), fleet(devices_per_node=2, nodes=2, intra_bw=20e9, inter_bw=2e9))
    for kw in ({}, {"enumerate_limit": 1 << 20}):
        costs = [solve(ctx, mb * MiB, gran=256 * 1024, **kw).cost_s for mb in range(18, 64, 2)]
        assert costs[0] == math.inf and math.isfinite(costs[-1])
        assert all(b <= a for a, b in zip(costs, costs[1:], strict=False)), costs


def test_nothing_fits_is_infeasible_not_an_error():
    ctx = blocks_context()
    for budget in (0, 1000, -5):
        plan = solve(ctx, budget)
        assert not plan.feasible and plan.cost_s == math.inf and plan.memory_bytes == math.inf
        assert plan.strategies == ()


def test_the_answer_is_priced_like_the_cost_model():
    ctx = CostContext(model(5, params=3_000_000), fleet(devices_per_node=2, nodes=2, intra_bw=20e9, inter_bw=2e9))
    for budget in (60 * MiB, 120 * MiB, 10**12):
        for in_flight in (1, 3):
            plan = solve(ctx, budget, in_flight=in_flight)
            assert plan.feasible
            assert plan.cost_s == pytest.approx(cost_of(ctx, plan), rel=1e-12)
            assert plan.memory_bytes == memory_of(ctx, plan, in_flight) <= budget


def test_vector_scalar_and_cost_model_checks_agree():
    ctx = CostContext(model(4, params=3_000_000), fleet(devices_per_node=2, nodes=2, intra_bw=20e9, inter_bw=2e9))
    tables = layer_tables(ctx, layer_candidates(4), M)
    rng = np.random.default_rng(3)
    slots = rng.integers(0, tables.layout.size, size=(4, 30))
    peaks, costs = tables.check(0, slots, 2, NM)
    for k in range(slots.shape[1]):
        sts = [tables.strategies[s] for s in slots[:, k]]
        sc = stage_cost(ctx, 0, 4, sts, M)
        assert peaks[k] == stage_peak_memory(sc, Schedule.GPIPE, 1, 0, 2)
        assert costs[k] == pytest.approx(NM * (sc.forward_s + sc.backward_s + sc.recompute_s) + sc.allreduce_s)
        assert tables.check_one(0, slots[:, k].tolist(), 2, NM) == pytest.approx((peaks[k], costs[k]))


def test_identical_layers_share_cost_model_calls_without_changing_prices():
    ctx = CostContext(ModelView(layers=(
        layer(0, params=10_000, kind="embed"), layer(1), layer(2), layer(3, params=5000), layer(4),
        layer(5, params=9000, kind="head"))), fleet())
    tables = layer_tables(ctx, layer_candidates(4), M)
    assert tables.layer_rep == (0, 1, 1, 3, 1, 5)
    for i, (k, st) in product(range(6), enumerate(tables.strategies)):
        c = layer_cost(ctx, i, st, M)
        assert tables.per_micro_batch_s[i, k] == c.per_micro_batch_s
        assert tables.model_state_bytes[i, k] == c.model_state_bytes


def synthetic(costs: list[list[float]], switch_s: float) -> LayerTables:
    """Two layouts (slots 0, 1), no memory, switching between them costs `switch_s` per micro-batch."""
    n = len(costs)
    zeros = np.zeros((n, 2))
    trans = np.zeros((n, 2, 2))
    trans[1:, 0, 1] = trans[1:, 1, 0] = switch_s
    return LayerTables(
        strategies=(LayerStrategy(dp=2), LayerStrategy(tp=2)), num_layouts=2, layout=np.array([0, 1]),
        per_micro_batch_s=np.array(costs), grad_sync_s=zeros, backward_compute_s=zeros, recompute_s=zeros,
        model_state_bytes=zeros + 1.0, forward_activation_bytes=zeros, backward_transient_bytes=zeros,
        transform_s=trans, layer_rep=tuple(range(n)), transform_rep=tuple(range(n)), baseline_bytes=0,
        micro_batch_size=1, overlap_slowdown=1.3, overlap_grad_sync=True,
    )


def test_transition_costs_discourage_layout_flips():
    # Each layer prefers the other layout by 0.2 s; a switch costs 0.05 s (flipping pays) or 0.3 s (it does not).
    costs = [[1.0, 1.2], [1.2, 1.0], [1.0, 1.2], [1.2, 1.0], [1.0, 1.2]]
    kinds = []
    for switch, expect in ((0.05, 5.0 + 4 * 0.05), (0.3, 5.4)):
        plan = stage_dp(synthetic(costs, switch), 0, 5, num_micro_batches=1, in_flight=1, budget_bytes=10**6,
                        granularity_bytes=1)
        kinds.append([st.tp for st in plan.strategies])
        assert plan.cost_s == pytest.approx(expect)
    assert kinds[0] == [1, 2, 1, 2, 1]
    assert kinds[1] == [1] * 5


# --- partition.py ------------------------------------------------------------------------------------


def test_balanced_is_the_min_max_partition():
    rng = np.random.default_rng(1)
    for _ in range(30):
        n, p = int(rng.integers(3, 9)), int(rng.integers(1, 4))
        weights = rng.random((p, n))
        got = part.balanced(weights)
        worst = max(weights[s, b:e].sum() for s, (b, e) in enumerate(got))
        best = min(max(weights[s, b:e].sum() for s, (b, e) in enumerate(bounds))
                   for bounds in part.all_partitions(n, p))
        assert worst == pytest.approx(best)
        assert [b for b, _ in got][1:] == [e for _, e in got][:-1] and got[0][0] == 0 and got[-1][1] == n


def test_memory_balanced_gives_later_1f1b_stages_more_layers():
    states, acts = np.full(16, 1.0), np.full(16, 1.0)
    bounds = part.memory_balanced(states, acts, in_flight=[4, 3, 2, 1])  # 1F1B with 4 stages
    sizes = [e - b for b, e in bounds]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def fake_solver(times: np.ndarray, mem: np.ndarray, budget: float):
    """Stage cost = sum of layer times; stage memory = sum of layer memory (inf cost when over budget)."""
    seen: list[tuple] = []

    def solve(b: int, e: int, s: int) -> StagePlan:
        seen.append((b, e, s))
        used = float(mem[b:e].sum())
        cost = float(times[b:e].sum()) if used <= budget else math.inf
        return StagePlan(b, e, 1, (), cost, used if used <= budget else math.inf)

    return solve, seen


def test_exhaustive_finds_the_best_partition_with_or_without_bounds():
    rng = np.random.default_rng(5)
    times, mem = rng.random(9), rng.random(9)
    for budget in (1.2, 2.0, 100.0):
        solve, _ = fake_solver(times, mem, budget)
        expect = min(part.pipeline_objective([solve(b, e, s).cost_s for s, (b, e) in enumerate(p)], NM)
                     for p in part.all_partitions(9, 3))
        plain = part.exhaustive(9, 3, NM, solve)
        bounded = part.exhaustive(9, 3, NM, solve, lambda b, e, s: float(times[b:e].sum()))
        assert plain.objective == pytest.approx(expect) and bounded.objective == pytest.approx(expect)
        assert plain.bounds == bounded.bounds
        assert bounded.evaluated <= plain.evaluated


def test_algorithm_2_only_queues_partitions_that_pass_its_three_checks():
    rng = np.random.default_rng(11)
    times, mem = rng.random(24) + 0.5, rng.random(24) + 0.5
    budget = 10.0
    solve, _ = fake_solver(times, mem, budget)
    p_m = part.memory_balanced(mem, np.zeros(24), [1, 1, 1, 1])
    p_t = part.time_balanced(times, 4)
    cap = max(solve(b, e, s).memory_bytes for s, (b, e) in enumerate(p_t))
    queued: list[tuple] = []
    original = part.deque.append

    class Spy(part.deque):  # type: ignore[misc]
        def append(self, item):  # noqa: D401 - records what Algorithm 2 queues
            queued.append(item)
            original(self, item)

    part_deque, part.deque = part.deque, Spy
    try:
        result = part.adjust(p_m, p_t, NM, budget, solve)
    finally:
        part.deque = part_deque
    for bounds in queued:
        stages = [solve(b, e, s) for s, (b, e) in enumerate(bounds)]
        assert all(p.memory_bytes <= budget and p.memory_bytes <= cap for p in stages)
    start = part.pipeline_objective([solve(b, e, s).cost_s for s, (b, e) in enumerate(p_m)], NM)
    assert result.objective <= start
    assert result.objective <= part.pipeline_objective([solve(b, e, s).cost_s for s, (b, e) in enumerate(p_t)], NM)


def test_pipeline_objective_is_eq_5():
    assert part.pipeline_objective([2.0, 3.0, 1.0], 4) == pytest.approx((3 * 3.0 + 6.0) / 4)
    assert part.pipeline_objective([2.0, math.inf], 4) == math.inf
    assert part.count_partitions(6, 3) == 10 == len(list(part.all_partitions(6, 3)))


def test_strategies_that_would_split_a_sample_are_infeasible():
    """A micro-batch of 2 on 4 devices: DP4 and SDP4 would need half samples; DP2xTP2 and TP4 do not."""
    ctx = blocks_context(2)
    candidates = layer_candidates(4, dims=("dp", "sdp", "tp"), checkpoint=(False,))
    tables = layer_tables(ctx, candidates, 2)
    for c in candidates:
        k = tables.strategies.index(to_strategy(c))
        assert math.isinf(tables.per_micro_batch_s[0, k]) == (2 % c.batch_split != 0), c.label
    plan = StageSolver(tables, num_micro_batches=NM, in_flight=1, budget_bytes=1 << 40,
                       granularity_bytes=MiB).solve(0, 2)
    assert all(2 % st.batch_split == 0 for st in plan.strategies)
