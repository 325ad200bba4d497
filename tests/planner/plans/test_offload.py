"""Chunk offload planned (issue 19): a model that fits no plan in device memory is planned with its model data in
chunks when the executors run them, priced by the simulator the runtime shares, and explained."""

from __future__ import annotations

import pytest
from google.protobuf.json_format import ParseDict

from ballast.v1 import common_pb2, fleet_pb2, model_pb2, plan_pb2, profile_pb2, services_pb2
from services.planner.cost import CostContext, from_profile
from services.planner.cost.offload import chunk_model, price_chunks
from services.planner.plans.make import OFFLOAD, PlanInputs, make_plan, offload_runnable, search_dims
from services.planner.sim.chunks import ChunkOptions, simulate_chunks
from services.profiler import driver
from services.runtime.errors import FailedPrecondition

SPEC = ParseDict({"name": "gpt-wide", "family": "MODEL_FAMILY_GPT", "dtype": "DTYPE_FP32", "transformer": {
    "num_layers": 4, "hidden_size": 256, "num_heads": 2, "vocab_size": 128, "seq_length": 8,
    "tie_embeddings": True}}, model_pb2.ModelSpec())
BUDGET = 11_000_000  # under the 12.8 MB of parameters alone; plain DP needs 51 MB of model states


@pytest.fixture(scope="module")
def profile() -> profile_pb2.Profile:
    request = services_pb2.ProfileRequest(options=services_pb2.ProfileOptions(
        micro_batch_sizes=[1, 2], intra_op_threads=1, skip_memory_trace=True))
    out = driver.profile(SPEC, request)
    out.id, out.model_id = "prf-test", "mdl-test"
    return out


def fleet(profile: profile_pb2.Profile, devices: int = 2, memory: int = BUDGET) -> fleet_pb2.Fleet:
    link = fleet_pb2.Link(kind=fleet_pb2.LINK_KIND_SHARED_MEMORY, bandwidth_bytes_per_s=5e9, latency_s=2e-5)
    device = fleet_pb2.DeviceSpec()
    device.CopyFrom(profile.device)
    device.memory_bytes = memory
    device.host_link.CopyFrom(link)
    return fleet_pb2.Fleet(name="cpu", nodes=1, devices_per_node=devices, device=device, intra_node=link)


def test_the_profile_lists_every_parameter_tensor_once_in_layer_order(profile):
    owned = [n for layer in profile.layers for n in layer.parameter_numels]
    assert sum(owned) == sum(layer.parameter_count for layer in profile.layers) - 128 * 256  # the tied weight once
    assert list(profile.layers[-1].parameter_tensors)[-1] == 0  # the head uses the embedding's token weight
    used = sorted({i for layer in profile.layers for i in layer.parameter_tensors})
    assert used == list(range(len(owned)))


def test_a_model_over_device_memory_is_planned_with_chunks(profile):
    plan = make_plan(profile, fleet(profile), PlanInputs(global_batch_size=4, offload=True))
    assert plan.engine == plan_pb2.PLAN_ENGINE_PATRICKSTAR and plan.HasField("offload")
    assert [(s.layer_begin, s.layer_end, s.devices) for s in plan.stages] == [(0, 6, 2)]
    assert {(x.dp, x.stage_index) for x in plan.layers} == {(2, 0)} and len(plan.layers) == 6
    assert (plan.global_batch_size, plan.micro_batch_size, plan.num_micro_batches) == (4, 4, 1)
    off = plan.offload
    assert off.device_budget_bytes == BUDGET and off.predicted_device_peak_bytes <= BUDGET
    assert off.predicted_to_device_bytes > 0 and off.predicted_gathered_bytes > 0 and off.predicted_reduced_bytes > 0
    assert off.plain_peak_memory_bytes > BUDGET
    # the prediction is the shared simulator's, fed the profile at 2 samples per device
    ctx = CostContext(from_profile(profile), fleet(profile))
    sim = simulate_chunks(chunk_model(ctx, 2), ChunkOptions(off.chunk_bytes, BUDGET, world=2))
    assert off.predicted_to_device_bytes == sim.steady.to_device and off.chunks == sim.chunks
    assert plan.prediction.iteration_time_s > 0 and plan.prediction.peak_memory_bytes <= BUDGET
    assert "chunk offload (PatrickStar)" in plan.explanation and "no plan fits" in plan.explanation
    assert "chunk moves" in plan.explanation


def test_without_executors_that_run_chunks_nothing_fits_and_says_why(profile):
    with pytest.raises(FailedPrecondition, match="run neither chunk offload .* nor Harmony"):
        make_plan(profile, fleet(profile), PlanInputs(global_batch_size=4))


def test_a_budget_too_small_even_for_chunks_is_refused_with_both_reasons(profile):
    with pytest.raises(FailedPrecondition, match="chunk offload does not fit either: no chunk size fits"):
        make_plan(profile, fleet(profile, memory=2_000_000), PlanInputs(global_batch_size=4, offload=True))


def test_a_profile_without_parameter_tensors_cannot_be_offloaded(profile):
    old = profile_pb2.Profile()
    old.CopyFrom(profile)
    for layer in old.layers:
        del layer.parameter_numels[:]
        del layer.parameter_tensors[:]
    with pytest.raises(FailedPrecondition, match="profile the model again"):
        make_plan(old, fleet(old), PlanInputs(global_batch_size=4, offload=True))


def test_an_uneven_batch_is_not_offloaded(profile):
    ctx = CostContext(from_profile(profile), fleet(profile))
    price = price_chunks(ctx, 2, 3, BUDGET)
    assert not price.feasible and "splits the global batch evenly" in price.reason


def test_offload_is_runnable_only_where_every_executor_declares_it():
    chunks = [common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_CHUNKS]
    assert offload_runnable([chunks, chunks]) and not offload_runnable([chunks, [common_pb2.PARALLEL_DIM_DP]])
    assert not offload_runnable([])
    assert search_dims(("dp", "zero1", OFFLOAD)) == (("dp", "zero1"), True, False)
