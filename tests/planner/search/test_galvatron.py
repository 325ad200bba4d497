"""The Galvatron-BMW search end to end on an analytical GPT profile over examples/fleet-8xTITAN.yaml."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2
from services.planner.cost import CostContext, CostOptions, LayerStrategy, build_pipeline, from_profile
from services.planner.cost.calibration import Calibration
from services.planner.search import galvatron, layer_candidates
from services.planner.search.galvatron import Planner, batch_sizes, micro_batch_counts, search
from services.planner.search.problem import SearchOptions, price, to_strategy
from services.planner.sim import Schedule, SimOptions, simulate
from services.profiler.projection import analytical_profile
from services.specs.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[3]
GiB = 2**30
GPT = {
    "name": "gpt-12",
    "family": "MODEL_FAMILY_GPT",
    "dtype": "DTYPE_FP32",
    "transformer": {"num_layers": 12, "hidden_size": 1024, "num_heads": 16, "vocab_size": 16384, "seq_length": 512},
}


@pytest.fixture(scope="module")
def setting():
    view = from_profile(analytical_profile(ParseDict(GPT, model_pb2.ModelSpec()), "nvidia-titan-rtx-24gb", "fp32"))
    fleet = load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")
    return view, fleet


def options(**kw) -> SearchOptions:
    base = {"memory_budget_bytes": 4 * GiB, "global_batch_size": 32}
    base.update(kw)
    return SearchOptions(**base)


def pure_dp(view, fleet, opts: SearchOptions) -> float:
    """Best throughput of data parallelism alone (every layer DP8, one stage) at the search's batch sizes."""
    ctx = CostContext(view, fleet)
    n = len(view)
    best = 0.0
    for batch in batch_sizes(opts):
        for nm in micro_batch_counts(batch, 1):
            plan = price(ctx, [(0, n)], [LayerStrategy(dp=8)] * n, batch // nm, nm, Schedule.ONE_F_ONE_B,
                         opts.memory_budget_bytes)
            best = max(best, plan.throughput)
    return best


@pytest.mark.parametrize("budget_gib", [3, 6, 24])
def test_the_plan_fits_and_beats_or_equals_pure_data_parallelism(setting, budget_gib):
    view, fleet = setting
    opts = options(memory_budget_bytes=budget_gib * GiB)
    plans = search(CostContext(view, fleet), 8, opts)
    assert plans, "something must fit"
    best = plans[0]
    assert not best.out_of_memory and max(best.peak_memory_bytes) <= opts.memory_budget_bytes
    assert best.devices == 8 and best.global_batch_size == 32 and best.engine == "galvatron"
    assert best.throughput >= pure_dp(view, fleet, opts) * (1 - 1e-9)
    assert [p.throughput for p in plans] == sorted((p.throughput for p in plans), reverse=True)
    assert len({(p.stage_bounds, p.strategies, p.num_micro_batches) for p in plans}) == len(plans) <= opts.top_k


def test_a_tight_budget_needs_more_than_data_parallelism(setting):
    view, fleet = setting
    opts = options(memory_budget_bytes=int(1.5 * GiB))
    assert pure_dp(view, fleet, opts) == 0.0  # DP8 replicates ~2.7 GB of fp32 Adam states: out of memory
    plans = search(CostContext(view, fleet), 8, opts)
    assert plans and max(plans[0].peak_memory_bytes) <= opts.memory_budget_bytes
    st = plans[0]
    assert len(st.stage_bounds) > 1 or any(s.sdp > 1 or s.tp > 1 or s.checkpoint for s in st.strategies)


def test_nothing_fits_returns_no_plan(setting):
    view, fleet = setting
    assert search(CostContext(view, fleet), 8, options(memory_budget_bytes=64 * 2**20)) == []
    assert search(CostContext(view, fleet), 8, options(memory_budget_bytes=64 * 2**20, global_batch_size=None)) == []


def test_same_input_same_plans(setting):
    view, fleet = setting
    opts = options(memory_budget_bytes=3 * GiB, batch_radius=8)
    first = search(CostContext(view, fleet), 8, opts)
    again = search(CostContext(view, fleet), 8, opts)
    assert first == again and first


def test_the_throughput_sweep_and_its_bound(setting):
    view, fleet = setting
    opts = options(memory_budget_bytes=6 * GiB, global_batch_size=None, max_global_batch_size=128, top_k=3)
    planner = Planner(CostContext(view, fleet), 8, opts)
    found = []
    real_plan = planner.plan

    def plan(*cfg, floor=0.0):
        result = real_plan(*cfg)
        if result is not None:
            found.append((cfg, result))
        return result

    planner.plan = plan  # type: ignore[method-assign]
    plans = planner.run()
    assert len(plans) == 3 and plans[0].global_batch_size in batch_sizes(opts)
    for (pp, m, nm, _), p in found:  # the bound that lets the sweep skip configurations must hold
        assert p.throughput <= planner.throughput_bound(m * nm, pp, m, nm) * (1 + 1e-9)
    assert planner.stats.skipped_bound > 0
    exhaustive = dataclasses.replace(opts, top_k=len(found) + 100)
    every = Planner(CostContext(view, fleet), 8, exhaustive).run()
    assert [p.throughput for p in every[:3]] == [p.throughput for p in plans]


def test_a_plan_the_simulator_finds_out_of_memory_is_dropped(setting, monkeypatch):
    view, fleet = setting
    real = galvatron.price
    monkeypatch.setattr(galvatron, "price", lambda *a, **k: dataclasses.replace(real(*a, **k), out_of_memory=True))
    planner = Planner(CostContext(view, fleet), 8, options())
    assert planner.run() == []
    assert planner.stats.dropped_by_simulator == planner.stats.priced > 0


def test_schedules_and_pipeline_degrees_are_searched(setting):
    view, fleet = setting
    opts = options(memory_budget_bytes=2 * GiB, schedules=(Schedule.ONE_F_ONE_B, Schedule.GPIPE), top_k=50)
    plans = search(CostContext(view, fleet), 8, opts)
    assert {p.schedule for p in plans} == {Schedule.ONE_F_ONE_B, Schedule.GPIPE}
    assert len({len(p.stage_bounds) for p in plans}) > 1
    for p in plans:
        assert p.stage_bounds[0][0] == 0 and p.stage_bounds[-1][1] == len(view)
        assert all(s.devices == 8 // len(p.stage_bounds) for s in p.strategies)


def test_batch_and_micro_batch_ladders():
    assert batch_sizes(SearchOptions(memory_budget_bytes=1, max_global_batch_size=24)) == [1, 2, 4, 8, 16, 24]
    assert batch_sizes(SearchOptions(memory_budget_bytes=1, global_batch_size=6, batch_radius=2)) == [4, 5, 6, 7, 8]
    assert micro_batch_counts(32, 4) == [4, 8, 16]
    assert micro_batch_counts(12, 8) == [12]  # no divisor of 12 is >= 8 other than 12 itself
    assert micro_batch_counts(3, 8) == [3]  # fewer micro-batches than stages when nothing else divides
    assert micro_batch_counts(1, 1) == [1]


def test_device_count_is_checked(setting):
    view, fleet = setting
    with pytest.raises(ValueError):
        search(CostContext(view, fleet), 16, options())


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.GPIPE, Schedule.VARUNA])
def test_the_pipeline_bound_behind_the_sweep_holds_in_the_simulator(setting, schedule):
    """iteration >= sum_{s<b} t_s + nm t_b for every stage b (t: forward + backward per micro-batch), the
    inequality Planner.throughput_bound minimises over all splits; random plans, recomputes included."""
    view, fleet = setting
    ctx = CostContext(view, fleet)
    rng = np.random.default_rng(2)
    n = len(view)
    for _ in range(25):
        pp = int(rng.choice([2, 4, 8]))
        cuts = sorted(rng.choice(np.arange(1, n), size=pp - 1, replace=False).tolist())
        bounds = list(zip([0, *cuts], [*cuts, n], strict=True))
        cands = layer_candidates(8 // pp, pp=pp)
        strategies = [to_strategy(cands[int(rng.integers(len(cands)))]) for _ in range(n)]
        nm = int(rng.choice([1, 2, pp, 3 * pp]))
        pipe = build_pipeline(view, None, bounds, strategies, 2, nm, context=ctx)
        result = simulate(pipe, SimOptions(schedule=schedule, keep_timeline=False))
        t = [st.forward_s + st.backward_s for st in pipe.stages]
        bound = max(sum(t[:b]) + nm * t[b] for b in range(pp))
        assert result.iteration_s >= bound * (1 - 1e-9)


@pytest.mark.parametrize("calibrated", [False, True])
def test_the_sweeps_bounds_never_undercut_a_plan(setting, calibrated):
    """The sweep orders configurations by quick_bound >= throughput_bound and skips on them and on may_beat, so
    for every configuration: quick >= throughput bound >= its plan's simulated throughput, and may_beat never
    refuses a floor the plan beats. A calibration whose scales are below 1 makes the simulated plan faster than
    the tables say: the bounds must allow for it (without time_floor the calibrated case fails)."""
    view, fleet = setting
    cal = Calibration(host_class=fleet.device.kind, forward_scale=0.6, backward_scale=0.7, allreduce_scale=0.5,
                      update_scale=0.8) if calibrated else None
    ctx = CostContext(view, fleet, CostOptions(calibration=cal))
    assert (ctx.calibration is not None) == calibrated
    opts = options(memory_budget_bytes=3 * GiB, global_batch_size=None, max_global_batch_size=64)
    planner = Planner(ctx, 8, opts)
    checked = 0
    for batch in batch_sizes(opts):
        for pp, m, nm, schedule in planner.configurations(batch):
            bound = planner.throughput_bound(batch, pp, m, nm)
            assert planner.quick_bound(batch, pp, m, nm) >= bound
            plan = planner.plan(pp, m, nm, schedule)
            if plan is None:
                continue
            checked += 1
            assert plan.throughput <= bound * (1 + 1e-9)
            assert planner.may_beat(plan.throughput * (1 - 1e-6), batch, pp, m, nm)
            assert not planner.may_beat(plan.throughput * 50, batch, pp, m, nm)
    assert checked > 10
