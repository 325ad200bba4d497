"""Varuna's P x D auto-configuration (Varuna §4.1-4.4) on hand-made views and an analytical GPT on 8x TITAN."""

from __future__ import annotations

import random
from itertools import combinations
from pathlib import Path

import pytest
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2
from services.planner.cost import CostContext, CostOptions, LayerTable, LayerView, ModelView, from_profile
from services.planner.cost.calibration import Calibration
from services.planner.search.problem import SearchOptions
from services.planner.search.varuna import (
    _pipeline_bound,
    _price_depth,
    balanced_bounds,
    configure,
    knee_micro_batch_size,
)
from services.planner.sim import Schedule
from services.profiler.projection import analytical_profile
from services.runtime.errors import InvalidArgument
from services.specs.fleet import load_fleet
from tests.cost_support import GB, fleet, model

ROOT = Path(__file__).resolve().parents[3]
GPT = {
    "name": "gpt-8",
    "family": "MODEL_FAMILY_GPT",
    "dtype": "DTYPE_FP32",
    "transformer": {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "vocab_size": 8192, "seq_length": 256},
}
BIG = 80 * 2**30


@pytest.fixture(scope="module")
def gpt_view() -> ModelView:
    spec = ParseDict(GPT, model_pb2.ModelSpec())
    return from_profile(analytical_profile(spec, "nvidia-titan-rtx-24gb", "fp32"))


@pytest.fixture(scope="module")
def titan():
    return load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")


KNEE_AT_4 = {1: 4.0, 2: 2.5, 4: 1.6, 8: 1.55, 16: 1.54}  # ms per sample: < 5% gain after m = 4
GENTLE_KNEE_AT_8 = {1: 1.0, 2: 0.94, 4: 0.88, 8: 0.83, 16: 0.82}  # 6% per doubling up to m = 8


def knee_view(num_layers: int = 4, per_sample: dict[int, float] = KNEE_AT_4) -> ModelView:
    """Forward time per sample as given (backward twice that), everything else proportional to m."""
    rows = [(m, f * m * 1e-3, 2 * f * m * 1e-3, f * m * 1e-3, 1e3 * m, 1e4 * m, 1e3 * m, 0)
            for m, f in per_sample.items()]
    table = LayerTable.from_rows(rows)
    layers = tuple(
        LayerView(index=i, parameter_count=1000, parameter_bytes=4000, gradient_bytes=4000,
                  optimizer_state_bytes=8000, table=table)
        for i in range(num_layers)
    )
    return ModelView(layers=layers)


def stages(plan) -> int:
    return len(plan.stage_bounds)


def test_knee_is_where_forward_time_per_sample_stops_improving():
    view = knee_view()
    assert knee_micro_batch_size(view, 64) == 4
    assert knee_micro_batch_size(view, 2) == 2  # capped by B / D
    assert knee_micro_batch_size(model(4), 64) == 1  # proportional times: no gain from batching at all


def test_configure_uses_the_knee_when_it_divides_the_batch():
    # G = 4, B = 96: B/D = 24, 48, 96, 96 for P = 1..4, all multiples of 4 with Nm >= 6P at m = 4.
    plans = configure(CostContext(knee_view(), fleet()), 4, 96, SearchOptions(memory_budget_bytes=BIG))
    assert sorted(stages(p) for p in plans) == [1, 2, 3, 4]
    assert all(p.micro_batch_size == 4 for p in plans)


def test_micro_batch_is_lowered_to_divide_the_batch_and_to_fit_memory():
    ctx = CostContext(knee_view(), fleet())
    (odd,) = configure(ctx, 1, 6, SearchOptions(memory_budget_bytes=BIG))
    assert (odd.micro_batch_size, odd.num_micro_batches) == (3, 2)  # largest divisor of 6 below the knee
    (roomy,) = configure(ctx, 1, 8, SearchOptions(memory_budget_bytes=BIG))
    assert roomy.micro_batch_size == 4
    (tight,) = configure(ctx, 1, 8, SearchOptions(memory_budget_bytes=max(roomy.peak_memory_bytes) - 1))
    assert tight.micro_batch_size == 2 and tight.num_micro_batches == 4 and not tight.out_of_memory


def test_six_micro_batches_per_stage_win_over_the_knee_when_bubbles_cost_more():
    """§3.2: Nm >= 6P keeps the bubble under 10%. With a gentle knee at m = 8, B = 64 on an 8-deep pipeline gives
    Nm = 8 at the knee (bubble ~7/15); m = 1 gives Nm = 64 for 20% slower compute per sample, and wins."""
    view = knee_view(8, GENTLE_KNEE_AT_8)
    assert knee_micro_batch_size(view, 64) == 8
    plans = configure(CostContext(view, fleet()), 8, 64, SearchOptions(memory_budget_bytes=BIG))
    deep = next(p for p in plans if stages(p) == 8)
    assert (deep.micro_batch_size, deep.num_micro_batches) == (1, 64) and "Nm >= 6P" in deep.reason
    flat = next(p for p in plans if stages(p) == 1)  # one stage has no bubble: the knee stays
    assert flat.micro_batch_size == 8


def test_every_plan_keeps_the_global_batch_and_its_devices(gpt_view, titan):
    for batch in (64, 96, 120):
        plans = configure(CostContext(gpt_view, titan), 8, batch, SearchOptions(memory_budget_bytes=BIG))
        assert plans
        for p in plans:
            assert p.num_micro_batches * p.micro_batch_size * p.replicas == batch == p.global_batch_size
            assert p.engine == "varuna" and p.schedule is Schedule.VARUNA and not p.out_of_memory
            assert p.devices == stages(p) * p.replicas <= 8 and p.replicas == 8 // stages(p)
            assert all(st.devices == 1 for st in p.strategies)
        assert [p.throughput for p in plans] == sorted((p.throughput for p in plans), reverse=True)


def test_recompute_everywhere_but_the_last_stage(gpt_view, titan):
    plans = configure(CostContext(gpt_view, titan), 8, 64, SearchOptions(memory_budget_bytes=BIG))
    deep = next(p for p in plans if stages(p) == 4)
    last = deep.stage_bounds[-1][0]
    assert all(st.checkpoint for st in deep.strategies[:last])
    assert not any(st.checkpoint for st in deep.strategies[last:])
    never = configure(CostContext(gpt_view, titan), 8, 64, SearchOptions(memory_budget_bytes=BIG, checkpoint=(False,)))
    assert not any(st.checkpoint for p in never for st in p.strategies)


def test_tight_memory_pushes_varuna_to_deeper_pipelines(gpt_view, titan):
    """Model states shrink as 1/P (§4.4: sweep from the smallest P where the model fits)."""
    roomy = configure(CostContext(gpt_view, titan), 8, 128, SearchOptions(memory_budget_bytes=BIG))
    tight_budget = 180 * 2**20
    tight = configure(CostContext(gpt_view, titan), 8, 128, SearchOptions(memory_budget_bytes=tight_budget))
    assert min(stages(p) for p in roomy) == 1
    assert min(stages(p) for p in tight) >= 4
    assert stages(tight[0]) > stages(roomy[0])
    assert all(max(p.peak_memory_bytes) <= tight_budget for p in tight)


def test_what_crosses_the_slow_link_decides_the_depth():
    """Varuna Obs. 2: on slow links a big gradient allreduce (large D) favours deep pipelines; heavy
    activations between stages favour shallow ones. Single-GPU VMs: every link is the network."""
    slow, fast = fleet(1, 8, inter_bw=1 * GB), fleet(1, 8, inter_bw=1000 * GB)
    options = SearchOptions(memory_budget_bytes=BIG, top_k=8)  # every depth, the worst included
    heavy_grads = model(8, params=50_000_000)
    heavy_acts = model(8, params=1000, boundary=50e6, output=50e6)
    assert stages(configure(CostContext(heavy_grads, slow), 8, 64, options)[0]) == 8
    assert stages(configure(CostContext(heavy_grads, fast), 8, 64, options)[0]) == 1
    acts = configure(CostContext(heavy_acts, slow), 8, 64, options)
    assert stages(acts[0]) == 1
    deep = next(p for p in acts if stages(p) == 8)
    assert deep.throughput < acts[0].throughput / 4


def test_batch_no_configuration_divides_names_the_nearest_sizes():
    ctx = CostContext(model(2), fleet())  # 8 devices, 2 layers: P in {1, 2}, D in {8, 4}
    with pytest.raises(InvalidArgument) as err:
        configure(ctx, 8, 6, SearchOptions(memory_budget_bytes=BIG))
    assert err.value.field == "global_batch_size"
    assert "nearest valid sizes: 4 or 8" in str(err.value)
    with pytest.raises(InvalidArgument, match="nearest valid sizes: 4\\)"):
        configure(ctx, 8, 2, SearchOptions(memory_budget_bytes=BIG))
    with pytest.raises(InvalidArgument, match="num_devices"):
        configure(ctx, 9, 8, SearchOptions(memory_budget_bytes=BIG))


def test_nothing_fits_returns_the_least_memory_plan_with_the_reason(gpt_view, titan):
    (plan,) = configure(CostContext(gpt_view, titan), 8, 64, SearchOptions(memory_budget_bytes=2**20))
    assert plan.out_of_memory and plan.throughput == 0.0
    assert "no P x D configuration fits" in plan.reason and "budget" in plan.reason


def test_configure_is_deterministic(gpt_view, titan):
    options = SearchOptions(memory_budget_bytes=BIG)
    first = configure(CostContext(gpt_view, titan), 8, 96, options)
    assert first == configure(CostContext(gpt_view, titan), 8, 96, options)


def _brute_max(weights, last, k):
    n, best = len(weights), float("inf")
    for cuts in combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        sums = [sum(weights[a:b]) for a, b in zip(edges[:-2], edges[1:-1], strict=True)]
        sums.append(sum(last[edges[-2]:]))
        best = min(best, max(sums))
    return best


def test_balanced_bounds_is_the_exact_min_max_partition():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 7)
        weights = [rng.choice((0.0, rng.random())) for _ in range(n)]
        last = [w * rng.uniform(0.3, 1.0) for w in weights]
        k = rng.randint(1, n)
        bounds = balanced_bounds(weights, k, last)
        assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(b < e for b, e in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))
        got = max([sum(weights[b:e]) for b, e in bounds[:-1]] + [sum(last[bounds[-1][0]:])])
        assert got == pytest.approx(_brute_max(weights, last, k), abs=1e-12)
    with pytest.raises(ValueError):
        balanced_bounds([1.0, 2.0], 3)


@pytest.mark.parametrize("schedule", [Schedule.VARUNA, Schedule.ONE_F_ONE_B, Schedule.GPIPE])
@pytest.mark.parametrize(("links", "calibrated"), [("titan", False), ("titan", True), ("slow", False)])
def test_no_depth_simulates_faster_than_its_bound(gpt_view, titan, schedule, links, calibrated):
    """configure stops pricing depths once their bound cannot enter the top k, so the bound must hold for every
    depth, micro-batch size and checkpointing choice, on the schedule asked for, with a calibration (whose
    scales below 1 make the simulated stages faster than the layer costs) and on slow links (one device per
    node on 1 GB/s: the sends between stages dominate)."""
    cal = Calibration(host_class=titan.device.kind, forward_scale=0.6, backward_scale=0.7, allreduce_scale=0.5,
                      update_scale=0.8, forward_fixed_s=1e-4) if calibrated else None
    ctx = CostContext(gpt_view, titan if links == "titan" else fleet(1, 8, inter_bw=1 * GB, inter_lat=1e-4),
                      CostOptions(calibration=cal))
    options = SearchOptions(memory_budget_bytes=BIG)
    tight = 0
    for ckpt in ((True, False), (True, True), (False, False)):
        for p in range(1, min(8, len(gpt_view)) + 1):
            d = 8 // p
            for batch in (16, 48):
                if batch % d:
                    continue
                for m in (1, 2, batch // d):
                    plan = _price_depth(ctx, p, d, m, batch, options, schedule, ckpt, "")
                    bound = _pipeline_bound(ctx, p, d, m, batch, ckpt, schedule)
                    assert plan.throughput <= bound
                    tight += plan.throughput >= 0.9 * bound
    assert tight > 20  # a bound far above every plan would skip nothing
