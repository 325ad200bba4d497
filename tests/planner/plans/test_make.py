"""make_plan: engines and baselines on one cost model, the choice, its explanation, and bad requests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2, plan_pb2
from services.planner.plans.make import PlanInputs, make_plan, runnable_dims
from services.profiler.projection import analytical_profile
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.specs.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[3]
BASELINES = ["DDP", "ZeRO-3", "Megatron TP", "GPipe", "DeepSpeed 3D", "DP+TP", "DP+PP"]
GPT = {
    "name": "gpt-8x512",
    "family": "MODEL_FAMILY_GPT",
    "dtype": "DTYPE_FP32",
    "transformer": {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "vocab_size": 8192, "seq_length": 256},
}


@pytest.fixture(scope="module")
def profile():
    prof = analytical_profile(ParseDict(GPT, model_pb2.ModelSpec()), "nvidia-titan-rtx-24gb", "fp32")
    prof.id, prof.model_id = "prf-test", "mdl-test"
    return prof


@pytest.fixture(scope="module")
def fleet():
    return load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")


@pytest.fixture(scope="module")
def plan(profile, fleet):
    return make_plan(profile, fleet, PlanInputs(max_global_batch_size=64))


def test_plan_covers_every_layer_once_in_contiguous_stages(plan, profile):
    assert [layer.layer_index for layer in plan.layers] == list(range(len(profile.layers)))
    assert plan.stages[0].layer_begin == 0 and plan.stages[-1].layer_end == len(profile.layers)
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        assert a.layer_end == b.layer_begin
    for layer in plan.layers:
        stage = plan.stages[layer.stage_index]
        assert stage.layer_begin <= layer.layer_index < stage.layer_end
    assert plan.global_batch_size == plan.micro_batch_size * plan.num_micro_batches
    assert sum(s.devices for s in plan.stages) <= 8


def test_plan_fits_and_is_never_below_a_baseline(plan):
    assert not plan.prediction.out_of_memory
    assert plan.prediction.peak_memory_bytes <= plan.memory_budget_bytes
    baselines = {a.name: a for a in plan.alternatives if a.engine == plan_pb2.PLAN_ENGINE_BASELINE}
    assert list(baselines) == BASELINES
    for b in baselines.values():
        if not b.prediction.out_of_memory:
            assert plan.prediction.throughput_samples_per_s >= b.prediction.throughput_samples_per_s - 1e-9


def test_default_runnable_dims_keep_the_plan_executable(plan):
    """Executors run pipeline x data parallel (issue 5 item 8): no TP or SDP in a plan they must run."""
    assert all(layer.tp == 1 and layer.sdp == 1 for layer in plan.layers)
    assert "Not yet executable" not in plan.explanation


def test_explanation_names_the_winner_the_runner_up_and_the_baselines(plan):
    text = plan.explanation
    assert text.startswith("Chosen: ")
    assert "samples/s" in text and "Best baseline:" in text
    if any(a.name.startswith("runner-up") for a in plan.alternatives):
        assert "Runner-up:" in text and "What decided it:" in text


def test_what_if_may_use_the_full_space_and_says_what_is_not_executable(profile, fleet):
    plan = make_plan(profile, fleet, PlanInputs(what_if=True, max_global_batch_size=64, runnable_dims=("dp",)))
    uses = {d for layer in plan.layers for d in ("tp", "sdp") if getattr(layer, d) > 1}
    assert ("Not yet executable" in plan.explanation) == bool(uses)


def test_fixed_global_batch_is_kept(profile, fleet):
    plan = make_plan(profile, fleet, PlanInputs(global_batch_size=32))
    assert plan.global_batch_size == 32


def test_nothing_fits_names_the_memory_or_devices_that_would(profile, fleet):
    with pytest.raises(FailedPrecondition) as err:
        make_plan(profile, fleet, PlanInputs(memory_budget_bytes=1 << 20, max_global_batch_size=8))
    assert "the leanest plan needs" in str(err.value) and "MiB per device" in str(err.value)
    assert err.value.field == "memory_budget_bytes"


def test_bad_requests_name_the_field(profile, fleet):
    with pytest.raises(InvalidArgument) as err:
        make_plan(profile, fleet, PlanInputs(engine=plan_pb2.PLAN_ENGINE_VARUNA))
    assert err.value.field == "global_batch_size"
    with pytest.raises(InvalidArgument) as err:
        make_plan(profile, fleet, PlanInputs(engine=plan_pb2.PLAN_ENGINE_VPIPE))
    assert err.value.field == "engine"
    with pytest.raises(FailedPrecondition, match="the executors do not run Harmony") as err:
        make_plan(profile, fleet, PlanInputs(engine=plan_pb2.PLAN_ENGINE_HARMONY))
    assert err.value.field == "engine"
    with pytest.raises(InvalidArgument) as err:
        make_plan(profile, fleet, PlanInputs(schedule=plan_pb2.SCHEDULE_HARMONY_WRAP))
    assert err.value.field == "schedule"


def test_runnable_dims_are_what_every_host_runs():
    from ballast.v1 import common_pb2 as c

    assert runnable_dims([]) == ("dp",)
    assert runnable_dims([[c.PARALLEL_DIM_PP, c.PARALLEL_DIM_DP], [c.PARALLEL_DIM_DP, c.PARALLEL_DIM_TP]]) == ("dp",)
    assert runnable_dims([[c.PARALLEL_DIM_DP, c.PARALLEL_DIM_TP]]) == ("dp", "tp")


def test_example_fleet_yaml_parses():
    assert yaml.safe_load((ROOT / "examples" / "fleet-8xTITAN.yaml").read_text())["nodes"] == 1


def test_a_batch_no_configuration_splits_names_the_nearest_sizes(profile, fleet):
    """16 devices, 10 layers: at most 8 stages, so every stage has 2+ replicas and batches must be even."""
    two_nodes = plan_pb2.Plan().fleet.__class__()
    two_nodes.CopyFrom(fleet)
    two_nodes.nodes = 2
    two_nodes.inter_node.CopyFrom(fleet.intra_node)
    with pytest.raises(InvalidArgument) as err:
        make_plan(profile, two_nodes, PlanInputs(global_batch_size=7))
    assert err.value.field == "global_batch_size" and "use 6 or 8" in str(err.value)
    assert make_plan(profile, fleet, PlanInputs(global_batch_size=7)).global_batch_size == 7  # 8 stages of one


def test_no_priced_plan_splits_a_sample(plan, profile, fleet):
    """The plan and every baseline give each device whole samples: dp x sdp divides the micro-batch."""
    from services.planner.cost import CostContext, CostOptions, from_profile
    from services.planner.search.baselines import baselines
    from services.planner.search.problem import SearchOptions

    for layer in plan.layers:
        assert plan.micro_batch_size % (layer.dp * layer.sdp) == 0
    ctx = CostContext(from_profile(profile), fleet, CostOptions())
    priced = baselines(ctx, 8, SearchOptions(memory_budget_bytes=24 << 30, max_global_batch_size=64))
    assert [p.name for p in priced] == BASELINES
    for p in priced:
        assert all(p.micro_batch_size % st.batch_split == 0 for st in p.strategies), p.name
    ddp = priced[0]
    assert not ddp.out_of_memory and ddp.global_batch_size >= 8  # batches 1, 2 and 4 cannot feed 8 replicas


def test_a_baseline_the_executors_cannot_run_is_never_chosen(profile, fleet):
    """Pipeline x data parallel executors: the plan uses DP only, whatever TP or ZeRO-3 would have given."""
    chosen = make_plan(profile, fleet, PlanInputs(max_global_batch_size=16, runnable_dims=("dp",)))
    assert all(layer.sdp == 1 and layer.tp == 1 for layer in chosen.layers)
    names = [a.name for a in chosen.alternatives]
    assert "Megatron TP" in names and "ZeRO-3" in names  # still priced for the table


def test_a_named_engine_is_what_plans_even_where_a_baseline_is_faster(profile, fleet):
    """A job that asks for Varuna gets Varuna's P x D; the faster DP+TP baseline stays in the table (before, it was
    chosen, and a run the calibration cannot price came of it)."""
    inputs = PlanInputs(global_batch_size=8, runnable_dims=("dp", "tp", "sdp"))
    varuna = make_plan(profile, fleet, replace(inputs, engine=plan_pb2.PLAN_ENGINE_VARUNA))
    assert varuna.engine == plan_pb2.PLAN_ENGINE_VARUNA
    assert all(layer.tp == 1 and layer.sdp == 1 for layer in varuna.layers)
    faster = [a for a in varuna.alternatives if a.engine == plan_pb2.PLAN_ENGINE_BASELINE
              and not a.prediction.out_of_memory
              and a.prediction.iteration_time_s < varuna.prediction.iteration_time_s]
    assert faster, [(a.name, a.prediction.iteration_time_s) for a in varuna.alternatives]
    # a budget only a leaner baseline fits: the refusal names the engine and that baseline
    lean = min((a for a in varuna.alternatives if a.engine == plan_pb2.PLAN_ENGINE_BASELINE
                and not a.prediction.out_of_memory), key=lambda a: a.prediction.peak_memory_bytes)
    assert lean.prediction.peak_memory_bytes < varuna.prediction.peak_memory_bytes
    tight = replace(inputs, engine=plan_pb2.PLAN_ENGINE_VARUNA, memory_budget_bytes=lean.prediction.peak_memory_bytes)
    with pytest.raises(FailedPrecondition, match="VARUNA was asked for and none of its plans fits") as caught:
        make_plan(profile, fleet, tight)
    assert caught.value.field == "engine" and "leave the engine unset" in caught.value.fix


@pytest.mark.parametrize("stages", [2, 4])
def test_a_fixed_pipeline_depth_is_respected(profile, fleet, stages):
    plan = make_plan(profile, fleet, PlanInputs(global_batch_size=32, pipeline_stages=stages,
                                                runnable_dims=("dp",), top_k=1))
    assert len(plan.stages) == stages
    assert not plan.prediction.out_of_memory


def test_a_pipeline_deeper_than_the_fleet_is_refused(profile, fleet):
    with pytest.raises(InvalidArgument) as caught:
        make_plan(profile, fleet, PlanInputs(global_batch_size=32, pipeline_stages=9))
    assert caught.value.field == "pipeline_stages" and "at most 8" in caught.value.fix


@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 2), (2, 8), (2, 2)])
def test_a_pinned_micro_batch_count_is_planned_by_varuna(profile, fleet, stages, micro_batches):
    plan = make_plan(profile, fleet, PlanInputs(global_batch_size=32, pipeline_stages=stages,
                                                micro_batches=micro_batches, runnable_dims=("dp",), top_k=1))
    assert len(plan.stages) == stages and plan.num_micro_batches == micro_batches
    assert plan.micro_batch_size * micro_batches == 32  # a micro-batch's samples over all replicas
    assert plan.engine == plan_pb2.PLAN_ENGINE_VARUNA


def test_a_micro_batch_count_that_splits_nothing_or_lacks_a_batch_is_refused(profile, fleet):
    with pytest.raises(InvalidArgument) as caught:  # 32 / D is at most 32 samples: 64 micro-batches never split
        make_plan(profile, fleet, PlanInputs(global_batch_size=32, micro_batches=64, runnable_dims=("dp",)))
    assert caught.value.field == "micro_batches" and "divides" in caught.value.fix
    with pytest.raises(InvalidArgument) as caught:
        make_plan(profile, fleet, PlanInputs(micro_batches=4))
    assert caught.value.field == "micro_batches" and "global_batch_size" in caught.value.fix


def test_a_calibration_for_the_fleets_device_kind_changes_the_prediction_and_is_explained(profile, fleet):
    from services.planner.cost.calibration import Calibration

    inputs = PlanInputs(global_batch_size=32)
    plain = make_plan(profile, fleet, inputs)
    slower = Calibration(host_class=f"{fleet.device.kind}/0c/8w", forward_scale=2.0, backward_scale=2.0,
                         iteration_fixed_s=0.05, iterations=50)
    calibrated = make_plan(profile, fleet, replace(inputs, calibration=slower, calibration_note="cal-1 v1"))
    assert calibrated.prediction.iteration_time_s > 1.5 * plain.prediction.iteration_time_s
    assert "Calibrated from earlier runs: cal-1 v1 (forward x2.00" in calibrated.explanation

    elsewhere = replace(slower, host_class="cpu/2c/2w")  # never applied to another device kind
    other = make_plan(profile, fleet, replace(inputs, calibration=elsewhere, calibration_note="cal-2 v1"))
    assert other.prediction.iteration_time_s == pytest.approx(plain.prediction.iteration_time_s)
    assert "Not calibrated: cal-2 v1 is for host class cpu/2c/2w" in other.explanation
