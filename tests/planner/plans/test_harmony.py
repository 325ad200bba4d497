"""Harmony planned (issue 19): a model that fits no plan in device memory is priced both as chunk offload and as
Harmony's swap schedule when the executors run them; the faster one that fits is chosen and explained, with the
search's four-tuple and its traffic in Plan.harmony."""

from __future__ import annotations

import dataclasses

import pytest
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2, plan_pb2, profile_pb2, services_pb2
from services.memory.harmony_schedule import HarmonySchedule, traffic
from services.planner.cost import CostContext, from_profile
from services.planner.cost.harmony import harmony_layers, price_harmony
from services.planner.plans.make import HARMONY, OFFLOAD, PlanInputs, make_plan, search_dims
from services.profiler import driver
from services.runtime.errors import FailedPrecondition
from tests.planner.plans.test_offload import fleet

SPEC = ParseDict({"name": "gpt-chain", "family": "MODEL_FAMILY_GPT", "dtype": "DTYPE_FP32", "transformer": {
    "num_layers": 8, "hidden_size": 128, "num_heads": 2, "vocab_size": 128, "seq_length": 8,
    "tie_embeddings": False}}, model_pb2.ModelSpec())
BUDGET = 4_500_000  # parameters 6.5 MB; plain DP needs 4x that


@pytest.fixture(scope="module")
def profile() -> profile_pb2.Profile:
    request = services_pb2.ProfileRequest(options=services_pb2.ProfileOptions(
        micro_batch_sizes=[1, 2], intra_op_threads=1, skip_memory_trace=True))
    out = driver.profile(SPEC, request)
    out.id, out.model_id = "prf-chain", "mdl-chain"
    return out


def schedule_of(h: plan_pb2.HarmonySwap) -> HarmonySchedule:
    return HarmonySchedule(h.forward_micro_batch, tuple((p.begin, p.end) for p in h.forward_packs),
                           h.backward_micro_batch, tuple((p.begin, p.end) for p in h.backward_packs), h.devices)


def test_a_model_over_device_memory_is_planned_as_a_harmony_schedule(profile):
    plan = make_plan(profile, fleet(profile, devices=2, memory=BUDGET), PlanInputs(global_batch_size=4, harmony=True))
    assert plan.engine == plan_pb2.PLAN_ENGINE_HARMONY and plan.HasField("harmony") and not plan.HasField("offload")
    assert plan.schedule == plan_pb2.SCHEDULE_HARMONY_WRAP
    assert [(s.layer_begin, s.layer_end, s.devices) for s in plan.stages] == [(0, 10, 2)]
    h = plan.harmony
    schedule = schedule_of(h)
    schedule.check(10, 4)  # packs tile the model, micro-batches divide the batch
    assert h.devices == 2 and h.device_budget_bytes == BUDGET and h.predicted_device_peak_bytes <= BUDGET
    layers = harmony_layers(CostContext(from_profile(profile), fleet(profile, devices=2, memory=BUDGET)))
    assert layers is not None
    moved = traffic(schedule, [x.bytes() for x in layers], 4).total
    assert (h.predicted_to_device_bytes, h.predicted_to_host_bytes, h.predicted_peer_bytes) == (
        moved["to_device"], moved["to_host"], moved["peer"])
    assert h.predicted_to_device_bytes > sum(x.weights for x in layers)  # weights come twice, states once
    assert list(h.predicted_to_device_by_device) == list(traffic(schedule, [x.bytes() for x in layers], 4).to_device)
    assert sum(h.predicted_to_host_by_device) == h.predicted_to_host_bytes
    assert plan.prediction.iteration_time_s == h.predicted_iteration_s > 0 and h.configurations_explored > 1
    assert "Harmony's swap schedule" in plan.explanation and "no plan fits" in plan.explanation
    assert "The executors do not run chunk offload" in plan.explanation


def test_with_both_offloads_runnable_the_faster_one_is_chosen_and_the_other_priced(profile):
    inputs = PlanInputs(global_batch_size=4, harmony=True, offload=True)
    plan = make_plan(profile, fleet(profile, devices=2, memory=BUDGET), inputs)
    ctx = CostContext(from_profile(profile), fleet(profile, devices=2, memory=BUDGET))
    swap = price_harmony(ctx, 4, BUDGET)
    assert swap.feasible and swap.choice is not None
    if plan.HasField("harmony"):
        assert "Chunk offload was priced at" in plan.explanation
        assert plan.prediction.iteration_time_s == swap.choice.iteration_s
    else:
        assert "Harmony's swap schedule was priced at" in plan.explanation
        assert plan.prediction.iteration_time_s <= swap.choice.iteration_s
    only_chunks = make_plan(profile, fleet(profile, devices=2, memory=BUDGET),
                            dataclasses.replace(inputs, harmony=False))
    assert only_chunks.HasField("offload")


@pytest.mark.parametrize("harmony", [True, False])
def test_an_offload_plan_is_priced_with_its_host_class_scale(profile, harmony: bool):
    """Issue 45: the host class's calibration multiplies the offload estimator it was fitted for; the plan keeps the
    estimator's own time (what the next fit compares its run with) and says how it was scaled."""
    from services.planner.cost.calibration import Calibration

    inputs = PlanInputs(global_batch_size=4, harmony=harmony, offload=not harmony)
    plain = make_plan(profile, fleet(profile, devices=2, memory=BUDGET), inputs)
    cal = Calibration(host_class="cpu/2c/2w", harmony_scale=1.5 if harmony else 0.0,
                      chunks_scale=0.0 if harmony else 1.25, iterations=30)
    scaled = make_plan(profile, fleet(profile, devices=2, memory=BUDGET),
                       dataclasses.replace(inputs, calibration=cal, calibration_note="cal-x"))
    part, scale = (scaled.harmony, 1.5) if harmony else (scaled.offload, 1.25)
    assert part.predicted_iteration_s == pytest.approx(plain.prediction.iteration_time_s)
    assert scaled.prediction.iteration_time_s == pytest.approx(scale * part.predicted_iteration_s)
    assert f"x {scale:.2f}, what this host class's" in scaled.explanation
    other = dataclasses.replace(cal, harmony_scale=cal.chunks_scale, chunks_scale=cal.harmony_scale)
    unscaled = make_plan(profile, fleet(profile, devices=2, memory=BUDGET),
                         dataclasses.replace(inputs, calibration=other, calibration_note="cal-x"))
    assert unscaled.prediction.iteration_time_s == pytest.approx(plain.prediction.iteration_time_s)


def test_harmony_needs_one_server_and_a_chain_of_untied_layers(profile):
    two_nodes = fleet(profile, devices=1, memory=BUDGET)
    two_nodes.nodes = 2
    price = price_harmony(CostContext(from_profile(profile), two_nodes), 4, BUDGET)
    assert not price.feasible and "one server" in price.reason
    tied = model_pb2.ModelSpec()
    tied.CopyFrom(SPEC)
    tied.transformer.tie_embeddings = True
    request = services_pb2.ProfileRequest(options=services_pb2.ProfileOptions(
        micro_batch_sizes=[1], intra_op_threads=1, skip_memory_trace=True))
    tied_profile = driver.profile(tied, request)
    price = price_harmony(CostContext(from_profile(tied_profile), fleet(tied_profile)), 4, BUDGET)
    assert not price.feasible and "tied weights" in price.reason


def test_a_budget_below_one_layer_is_refused_with_both_reasons(profile):
    with pytest.raises(FailedPrecondition, match="Harmony's swap schedule does not fit either: no layer pack fits"):
        make_plan(profile, fleet(profile, devices=2, memory=1_000_000),
                  PlanInputs(global_batch_size=4, harmony=True, offload=True))


def test_executor_dims_name_harmony_apart_from_the_search_dims():
    assert search_dims(("dp", OFFLOAD, HARMONY)) == (("dp",), True, True)


def test_an_offload_engine_asked_for_is_the_only_one_planned(profile):
    roomy = fleet(profile, devices=2, memory=1 << 30)  # the model would fit in device memory
    plan = make_plan(profile, roomy, PlanInputs(global_batch_size=4, harmony=True,
                                                engine=plan_pb2.PLAN_ENGINE_HARMONY))
    assert plan.HasField("harmony") and "engine PLAN_ENGINE_HARMONY was asked for" in plan.explanation
    assert "chunk offload" not in plan.explanation.lower()  # not priced, so not mentioned
    plan = make_plan(profile, fleet(profile, devices=2, memory=BUDGET),
                     PlanInputs(global_batch_size=4, offload=True, harmony=True,
                                engine=plan_pb2.PLAN_ENGINE_PATRICKSTAR))
    assert plan.HasField("offload") and not plan.HasField("harmony")
    with pytest.raises(FailedPrecondition, match="the executors do not run Harmony") as err:
        make_plan(profile, roomy, PlanInputs(global_batch_size=4, engine=plan_pb2.PLAN_ENGINE_HARMONY))
    assert err.value.field == "engine"


def test_host_memory_limits_both_offloads(profile):
    small_host = fleet(profile, devices=2, memory=BUDGET)
    small_host.host_memory_bytes_per_node = 8_000_000  # under the 26 MB of weights and Adam states
    with pytest.raises(FailedPrecondition, match="host_memory_bytes_per_node") as err:
        make_plan(profile, small_host, PlanInputs(global_batch_size=4, harmony=True, offload=True))
    assert "Harmony's swap schedule does not fit either: it keeps" in str(err.value)
    roomy = fleet(profile, devices=2, memory=BUDGET)
    roomy.host_memory_bytes_per_node = 1 << 30
    assert make_plan(profile, roomy, PlanInputs(global_batch_size=4, harmony=True)).HasField("harmony")
