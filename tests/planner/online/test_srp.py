"""SRP planner (vPipe): calibration, bottleneck migration + KL, local swap/recompute, acceptance, new plans."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from google.protobuf.json_format import ParseDict

from ballast.v1 import common_pb2, executor_pb2, model_pb2, plan_pb2, profile_pb2
from services.planner.cost import CostContext, from_profile
from services.planner.online import (
    MonitorOptions,
    OnlineOptions,
    Pricer,
    RunningPlan,
    TrainingMonitor,
    propose,
    scaled_view,
)
from services.planner.online.srp import tied_stages
from services.profiler.projection import analytical_profile
from services.specs.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[3]
GPT = {
    "name": "gpt-8x512",
    "family": "MODEL_FAMILY_GPT",
    "dtype": "DTYPE_FP32",
    "transformer": {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "vocab_size": 8192, "seq_length": 256},
}
# Encoder and decoder of equal length: decoder blocks read the encoder output (layer 5) across any cut after it.
T5 = {
    "name": "t5-4-4",
    "family": "MODEL_FAMILY_T5",
    "dtype": "DTYPE_FP32",
    "transformer": {"num_layers": 4, "num_decoder_layers": 4, "hidden_size": 256, "num_heads": 4,
                    "ffn_hidden_size": 1024, "vocab_size": 1024, "seq_length": 128, "decoder_seq_length": 128},
}


@pytest.fixture(scope="module")
def gpt() -> profile_pb2.Profile:
    prof = analytical_profile(ParseDict(GPT, model_pb2.ModelSpec()), "nvidia-titan-rtx-24gb", "fp32")
    prof.id = "prf-gpt"
    return prof  # 10 layers: embed, 8 blocks, head


@pytest.fixture(scope="module")
def fleet():
    return load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")


def make_plan(fleet, bounds, *, mbs=4, nm=8, replicas=1, version=3, checkpoint=()) -> plan_pb2.Plan:
    plan = plan_pb2.Plan(id="pln-3", job_id="job", version=version, engine=plan_pb2.PLAN_ENGINE_VARUNA,
                         micro_batch_size=mbs * replicas, num_micro_batches=nm, schedule=plan_pb2.SCHEDULE_1F1B,
                         global_batch_size=mbs * replicas * nm)
    plan.fleet.CopyFrom(fleet)
    for s, (b, e) in enumerate(bounds):
        plan.stages.append(plan_pb2.Stage(index=s, layer_begin=b, layer_end=e, devices=replicas))
        for i in range(b, e):
            plan.layers.append(plan_pb2.LayerStrategy(layer_index=i, stage_index=s, dp=replicas,
                                                      checkpoint=i in checkpoint))
    return plan


def measured(profile, fleet, plan, *, inactive=(), slow=None, iterations=range(6)):
    """StageStats as the cost model predicts them (`slow`: stage -> factor on its compute)."""
    view = from_profile(profile)
    run = RunningPlan.from_plan(plan, len(view))
    pricer = Pricer(CostContext(scaled_view(view, (1.0,) * len(view), inactive), fleet, OnlineOptions().cost),
                    run, float("inf"))
    c = pricer.price(run.bounds, run.checkpoint, run.swap)
    slow = slow or {}
    out = []
    for it in iterations:
        for s, (b, e) in enumerate(run.bounds):
            busy = c.busy_s[s] * slow.get(s, 1.0)
            for r in range(run.replicas):
                out.append(executor_pb2.StageStats(
                    job_id="job", stage_index=s, replica_index=r, iteration=it, plan_version=plan.version,
                    forward_s=busy / 3, backward_s=2 * busy / 3, iteration_time_s=c.iteration_s,
                    idle_s=c.iteration_s - busy, peak_memory_bytes=c.peak_memory_bytes[s], layers=list(range(b, e)),
                    active_layers=[i for i in range(b, e) if i not in inactive]))
    return out


def observe(stats, plan):
    mon = TrainingMonitor(MonitorOptions(warmup=1, window=5))
    mon.observe_all(stats)
    obs = mon.observation("job", plan.version)
    assert obs is not None
    return obs


def check_valid(new: plan_pb2.Plan, old: plan_pb2.Plan, num_layers: int) -> None:
    assert new.version == old.version + 1 and new.parent_plan_id == old.id and not new.id
    assert new.engine == plan_pb2.PLAN_ENGINE_VPIPE
    assert new.stages[0].layer_begin == 0 and new.stages[-1].layer_end == num_layers
    for a, b in zip(new.stages, new.stages[1:], strict=False):
        assert a.layer_end == b.layer_begin and a.layer_begin < a.layer_end
    assert [layer.layer_index for layer in new.layers] == list(range(num_layers))
    for layer in new.layers:
        stage = new.stages[layer.stage_index]
        assert stage.layer_begin <= layer.layer_index < stage.layer_end
    assert len(new.stages) == len(old.stages) and all(s.devices == old.stages[0].devices for s in new.stages)
    assert new.micro_batch_size == old.micro_batch_size and new.num_micro_batches == old.num_micro_batches
    assert new.prediction.iteration_time_s > 0 and not new.prediction.out_of_memory


def test_unbalanced_plan_moves_layers_off_the_bottleneck(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 3), (3, 10)))  # embed + 2 blocks | 6 blocks + head
    obs = observe(measured(gpt, fleet, plan), plan)
    assert obs.bottleneck_stage == 1
    d = propose(gpt, fleet, plan, obs)
    assert d.accepted, d.reason
    assert d.moves and all(m.from_stage == 1 and m.to_stage == 0 for m in d.moves)
    assert d.predicted_after_s < d.predicted_before_s / (1 + OnlineOptions().margin)
    # Measurements that agree with the model: the calibrated current plan reproduces the measured time.
    assert d.predicted_before_s == pytest.approx(d.measured_s, rel=0.02)
    assert d.calibration.stage_factors == pytest.approx((1.0, 1.0), rel=1e-6)
    assert "stage 1 is the bottleneck" in d.reason and "stage 0" in d.reason
    check_valid(d.new_plan, plan, len(gpt.layers))
    assert tuple((s.layer_begin, s.layer_end) for s in d.new_plan.stages) == d.stage_bounds
    assert d.new_plan.prediction.iteration_time_s == pytest.approx(d.predicted_after_s)


def test_new_plan_applied_again_proposes_nothing(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 2), (2, 5), (5, 8), (8, 10)))
    d = propose(gpt, fleet, plan, observe(measured(gpt, fleet, plan), plan))
    assert d.accepted, d.reason
    new = d.new_plan
    again = propose(gpt, fleet, new, observe(measured(gpt, fleet, new), new))
    assert not again.accepted and again.new_plan is None and not again.moves
    assert again.stage_bounds == d.stage_bounds
    assert again.reason


def test_balanced_plan_is_rejected_with_a_reason(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 5), (5, 10)))  # 4 blocks each side
    d = propose(gpt, fleet, plan, observe(measured(gpt, fleet, plan), plan))
    assert not d.accepted and d.new_plan is None
    assert "margin" in d.reason or "best" in d.reason or "balanced" in d.reason
    assert d.predicted_after_s >= d.predicted_before_s / (1 + OnlineOptions().margin)
    gated = propose(gpt, fleet, plan, observe(measured(gpt, fleet, plan), plan),
                    OnlineOptions(imbalance_threshold=0.5))
    assert not gated.accepted and gated.reason.startswith("balanced")


def test_margin_decides_between_accept_and_reject(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 5), (5, 10)))
    obs = observe(measured(gpt, fleet, plan), plan)
    strict = propose(gpt, fleet, plan, obs, OnlineOptions(margin=0.5))
    eager = propose(gpt, fleet, plan, obs, OnlineOptions(margin=0.0, imbalance_threshold=0.0))
    assert not strict.accepted
    assert eager.accepted and eager.predicted_after_s < eager.predicted_before_s


def test_a_gain_within_the_measurement_noise_is_not_taken(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 4), (4, 10)))
    obs = observe(measured(gpt, fleet, plan), plan)
    quiet = propose(gpt, fleet, plan, obs)
    assert quiet.accepted, quiet.reason
    gain = quiet.predicted_before_s / quiet.predicted_after_s - 1
    noisy = propose(gpt, fleet, plan, dataclasses.replace(obs, noise=gain + 0.01))
    assert not noisy.accepted and "noise" in noisy.reason
    ignored = propose(gpt, fleet, plan, dataclasses.replace(obs, noise=gain + 0.01), OnlineOptions(noise_margin=False))
    assert ignored.accepted


def test_measured_slowness_is_calibrated(gpt, fleet) -> None:
    """A plan the model calls balanced, measured with stage 0 twice as slow: layers leave stage 0."""
    plan = make_plan(fleet, ((0, 5), (5, 10)))
    d = propose(gpt, fleet, plan, observe(measured(gpt, fleet, plan, slow={0: 2.0}), plan))
    assert d.calibration.stage_factors[0] == pytest.approx(2.0, rel=1e-6)
    assert d.accepted, d.reason
    assert d.moves and all(m.from_stage == 0 and m.to_stage == 1 for m in d.moves)


def test_inactive_layers_draw_layers_into_the_idle_stage(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 3), (3, 5), (5, 8), (8, 10)))
    obs = observe(measured(gpt, fleet, plan, inactive=(3, 4)), plan)
    assert obs.inactive_layers == (3, 4)
    d = propose(gpt, fleet, plan, obs)
    assert d.accepted, d.reason
    assert d.calibration.inactive_layers == (3, 4)
    assert any(m.to_stage == 1 for m in d.moves)
    assert not any(m.from_stage == 1 for m in d.moves)
    # With every layer active the same plan is not re-shaped that way.
    active = propose(gpt, fleet, plan, observe(measured(gpt, fleet, plan), plan))
    assert active.stage_bounds != d.stage_bounds


@pytest.mark.parametrize("max_moves", [0, 4])
def test_over_budget_stage_gets_recompute_or_swap_and_fits(gpt, fleet, max_moves) -> None:
    plan = make_plan(fleet, ((0, 4), (4, 6), (6, 8), (8, 10)), mbs=8, nm=16)
    stats = measured(gpt, fleet, plan)
    obs = observe(stats, plan)
    peaks = [s.peak_memory_bytes for s in obs.stages]
    budget = int(max(peaks) * 0.6)
    assert peaks[0] > budget
    d = propose(gpt, fleet, plan, obs, OnlineOptions(memory_budget_bytes=budget, max_moves=max_moves))
    assert d.accepted, d.reason
    assert "over the" in d.reason
    assert max(d.predicted_peak_memory_bytes) <= budget
    assert d.new_plan.prediction.peak_memory_bytes <= budget
    flagged = {layer.layer_index for layer in d.new_plan.layers if layer.checkpoint or layer.swap_activations}
    assert flagged == set(d.checkpoint_layers) | set(d.swap_layers)
    if max_moves == 0:
        assert not d.moves
        assert flagged and all(0 <= i < 4 for i in flagged)  # only the over-budget stage changes
    check_valid(d.new_plan, plan, len(gpt.layers))


def test_nothing_fits_is_rejected(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 5), (5, 10)))
    d = propose(gpt, fleet, plan, observe(measured(gpt, fleet, plan), plan), OnlineOptions(memory_budget_bytes=1 << 20))
    assert not d.accepted and "fits" in d.reason


def test_spare_memory_drops_recompute(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 5), (5, 10)), checkpoint=range(1, 9))
    opt = OnlineOptions(imbalance_threshold=0, margin=0.01)
    d = propose(gpt, fleet, plan, observe(measured(gpt, fleet, plan), plan), opt)
    assert d.accepted, d.reason
    assert len(d.checkpoint_layers) < 8 and "no longer recomputing" in d.reason


@pytest.fixture(scope="module")
def t5() -> profile_pb2.Profile:
    prof = analytical_profile(ParseDict(T5, model_pb2.ModelSpec()), "nvidia-titan-rtx-24gb", "fp32")
    prof.id = "prf-t5"
    return prof  # 0 embed, 1-4 encoder blocks, 5 encoder norm, 6 decoder embed, 7-10 decoder blocks, 11 head


def test_t5_cuts_are_priced_with_the_relayed_encoder_output(t5, fleet) -> None:
    slow = type(fleet)()
    slow.CopyFrom(fleet)
    slow.intra_node.bandwidth_bytes_per_s = 1e9  # communication matters
    view = from_profile(t5)
    assert view.crossing(8) == (5, 7)  # a decoder cut relays the encoder output too
    neighbour_only = type(t5)()
    neighbour_only.CopyFrom(t5)
    for layer in neighbour_only.layers:
        del layer.extra_inputs[:]

    plan = make_plan(slow, ((0, 8), (8, 12)), nm=8, mbs=8)
    # The best cut takes every decoder block (their shared relative bias) onto one stage, which the executors
    # cannot do live: by default the search keeps tied weights where they are ...
    kept = propose(t5, slow, plan, observe(measured(t5, slow, plan), plan))
    assert tied_stages(view, kept.stage_bounds) == tied_stages(view, ((0, 8), (8, 12)))
    # ... and, allowed to move them (a restart would), it prices the relay.
    free = OnlineOptions(keep_tied_stages=False)
    d = propose(t5, slow, plan, observe(measured(t5, slow, plan), plan), free)
    naive = propose(neighbour_only, slow, plan, observe(measured(neighbour_only, slow, plan), plan), free)
    assert d.accepted and naive.accepted
    cut, naive_cut = d.stage_bounds[0][1], naive.stage_bounds[0][1]
    # Blind to the relay, a cut inside the decoder looks as cheap as any; priced with it, the refinement keeps
    # the cut where only one tensor crosses.
    assert len(view.crossing(cut)) == 1
    assert len(view.crossing(naive_cut)) == 2
    # The relay-blind choice, priced with the relay, is worse than the one made with it.
    run = RunningPlan.from_plan(plan, len(view))
    pricer = Pricer(CostContext(view, slow, OnlineOptions().cost), run, float("inf"))
    blind = pricer.price(naive.stage_bounds, run.checkpoint, run.swap)
    assert blind.iteration_s > d.predicted_after_s


def test_same_inputs_same_decision(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 2), (2, 5), (5, 8), (8, 10)), replicas=2)
    stats = measured(gpt, fleet, plan, slow={2: 1.3})
    first = propose(gpt, fleet, plan, observe(stats, plan))
    second = propose(gpt, fleet, plan, observe(list(reversed(stats)), plan))
    assert first.accepted
    assert first.new_plan == second.new_plan
    assert (first.reason, first.stage_bounds, first.moves, first.predicted_after_s) == (
        second.reason, second.stage_bounds, second.moves, second.predicted_after_s)
    assert all(layer.dp == 2 for layer in first.new_plan.layers)


def test_mismatched_observation_or_plan_is_rejected(gpt, fleet) -> None:
    plan = make_plan(fleet, ((0, 3), (3, 10)))
    obs = observe(measured(gpt, fleet, plan), plan)
    other = make_plan(fleet, ((0, 3), (3, 10)), version=4)
    assert "version" in propose(gpt, fleet, other, obs).reason
    moved = make_plan(fleet, ((0, 4), (4, 10)))
    assert not propose(gpt, fleet, moved, obs).accepted
    tp = make_plan(fleet, ((0, 3), (3, 10)))
    tp.layers[0].tp = 2
    d = propose(gpt, fleet, tp, obs)
    assert not d.accepted and "pipeline x data" in d.reason


def test_a_repartition_keeps_each_layers_dp_flavour(gpt, fleet) -> None:
    """Moving a ZeRO layer to another stage moves it as ZeRO: the new plan does not re-shard it silently."""
    plan = make_plan(fleet, ((0, 3), (3, 10)), replicas=2)
    zero = {4: common_pb2.DP_SHARDING_ZERO2, 5: common_pb2.DP_SHARDING_ZERO1}
    for layer in plan.layers:
        layer.dp_sharding = zero.get(layer.layer_index, 0)
    d = propose(gpt, fleet, plan, observe(measured(gpt, fleet, plan), plan))
    assert d.accepted and any(m.layer in zero for m in d.moves), d.reason
    assert {x.layer_index: x.dp_sharding for x in d.new_plan.layers if x.dp_sharding} == zero
