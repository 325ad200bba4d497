"""The planner's default search uses the TP and SDP the executors declare, in the shapes they run (issue 18).

Executors declare DP, PP, ZeRO-1/2, TP and SDP (inventory.SUPPORTED); a plan that is not a what-if searches
only what the workers run (SearchOptions.executable_only): TP innermost with DP outside it, SDP alone, TP only
on layers whose profile says the workers can split them, neither on a layer holding a tied weight, every
micro-batch split over the stage's devices. Galvatron-BMW's example: BERT-Huge-32 on 8 RTX TITANs at 8 GB."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from google.protobuf.json_format import ParseDict

from ballast.v1 import job_pb2, model_pb2, plan_pb2
from services.executor.inventory import SUPPORTED
from services.executor.workers import hybrid_layers
from services.planner.jobs.prepare import plan_inputs
from services.planner.plans.make import PlanInputs, make_plan, runnable_dims
from services.planner.search.space import Candidate, executable
from services.profiler.projection import analytical_profile
from services.specs.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[3]
SINGLE_AND_DP_PP = ("DDP", "ZeRO-3", "Megatron TP", "GPipe", "DP+PP")


def profile(name: str):
    spec = ParseDict(yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text()), model_pb2.ModelSpec())
    out = analytical_profile(spec, "nvidia-titan-rtx-24gb", "fp32", (1, 2, 4, 8, 16, 32))
    out.id, out.model_id = f"prf-{name}", f"mdl-{name}"
    return out


@pytest.fixture(scope="module")
def titans():
    return load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")


def default_plan(name: str, fleet, gib: int) -> tuple[plan_pb2.Plan, object]:
    prof = profile(name)
    dims = runnable_dims([list(SUPPORTED)])
    assert {"tp", "sdp"} <= set(dims)
    return make_plan(prof, fleet, PlanInputs(memory_budget_bytes=gib * 2**30, runnable_dims=dims)), prof


def test_bert_huge_default_plan_mixes_sdp_or_tp_and_beats_every_single_strategy_and_dp_pp(titans):
    plan, prof = default_plan("bert-huge-32", titans, 8)
    hybrid = [x for x in plan.layers if x.tp > 1 or x.sdp > 1]
    assert hybrid, "no layer uses TP or SDP"
    ours = plan.prediction.throughput_samples_per_s
    priced = {a.name: a.prediction for a in plan.alternatives if a.engine == plan_pb2.PLAN_ENGINE_BASELINE}
    assert set(SINGLE_AND_DP_PP) <= set(priced)
    for name in SINGLE_AND_DP_PP:
        assert priced[name].out_of_memory or priced[name].throughput_samples_per_s < ours, name
    # and the workers can run it: the agent maps every layer; TP only where the profile allows, no tied layer split
    hybrid_layers(plan)
    # the explanation names the hybrid layers, what they save against plain DP, and why embed/head stay DP
    assert "Hybrid layers: sdp8" in plan.explanation and "as plain DP over the same devices" in plan.explanation
    assert "over the budget" in plan.explanation.split("Hybrid layers:")[1]
    assert "Not offered TP (the workers split attention + MLP blocks only, and no tied weight): embed, head." \
        in plan.explanation
    by_index = {layer.index: layer for layer in prof.layers}
    for x in hybrid:
        assert not by_index[x.layer_index].tied_with
        assert x.tp == 1 or by_index[x.layer_index].tensor_parallel % x.tp == 0


def test_layers_the_workers_cannot_split_get_no_tensor_parallelism(titans):
    """T5's blocks are not the zoo's attention + MLP block: the default plan never splits them with TP."""
    plan, prof = default_plan("t5-large-32", titans, 12)
    assert not any(layer.tensor_parallel for layer in prof.layers)
    assert all(x.tp <= 1 for x in plan.layers)
    hybrid_layers(plan)


def test_executable_shapes():
    def c(*dims):
        return Candidate(1, tuple(dims))

    assert executable(c(("dp", 8)))
    assert executable(c(("dp", 2), ("tp", 4))) and executable(c(("tp", 8)))
    assert executable(c(("sdp", 8)))
    assert not executable(c(("tp", 2), ("dp", 4)))  # DP inside TP
    assert not executable(c(("sdp", 2), ("tp", 4))) and not executable(c(("tp", 2), ("sdp", 4)))
    assert executable(Candidate(1, (("dp", 8),), False, "zero2"))
    assert not executable(Candidate(1, (("dp", 2), ("tp", 4)), False, "zero1"))  # ZeRO only beside plain DP


def test_a_job_kept_balanced_online_is_planned_without_tp_and_sdp():
    """The online planner (srp.py) prices pipeline x (ZeRO-)DP plans only: it could not rebalance a hybrid one."""
    dims = runnable_dims([list(SUPPORTED)])
    online = job_pb2.Job(spec=job_pb2.JobSpec(online_repartition=True))
    assert {"tp", "sdp"} <= set(plan_inputs(job_pb2.Job(), dims).runnable_dims)
    assert not {"tp", "sdp"} & set(plan_inputs(online, dims).runnable_dims)


def test_a_hugging_face_llama_gets_the_hybrid_layers_a_zoo_gpt_of_its_shape_gets(titans):
    """Issue 39: the default search treats a user's Hugging Face model as it treats the zoo. A Llama (RMSNorm,
    gated MLP of 8/3 the width: the GPT block's parameters) and the zoo GPT of the same width, heads, depth,
    vocabulary and sequence, each at 4 GiB on 8 TITANs: both shard most blocks with SDP (the TP their profiles
    offer stays unpicked on PCIe), and the explanation `ballast explain` prints says so."""
    shape = {"hidden": 1280, "heads": 16, "layers": 16, "vocab": 30522, "seq": 512}
    gpt = ParseDict({"name": "gpt-16", "family": "MODEL_FAMILY_GPT", "transformer": {
        "num_layers": shape["layers"], "hidden_size": shape["hidden"], "num_heads": shape["heads"],
        "vocab_size": shape["vocab"], "seq_length": shape["seq"]}}, model_pb2.ModelSpec())
    llama = ParseDict({"name": "hf-llama-16", "family": "MODEL_FAMILY_HF", "hf": {
        "task": "HF_TASK_CAUSAL_LM", "seq_length": shape["seq"], "config": {
            "model_type": "llama", "hidden_size": shape["hidden"], "num_attention_heads": shape["heads"],
            "num_key_value_heads": shape["heads"], "num_hidden_layers": shape["layers"], "intermediate_size": 3456,
            "vocab_size": shape["vocab"], "max_position_embeddings": shape["seq"]}}}, model_pb2.ModelSpec())
    dims = runnable_dims([list(SUPPORTED)])
    hybrid = {}
    for spec in (gpt, llama):
        prof = analytical_profile(spec, "nvidia-titan-rtx-24gb", "fp32", (1, 2, 4, 8, 16, 32))
        prof.id, prof.model_id = f"prf-{spec.name}", f"mdl-{spec.name}"
        assert [layer.tensor_parallel for layer in prof.layers[1:-1]] == [16] * shape["layers"]  # TP on offer
        plan = make_plan(prof, titans, PlanInputs(memory_budget_bytes=4 * 2**30, runnable_dims=dims))
        hybrid[spec.name] = [x.layer_index for x in plan.layers if x.tp > 1 or x.sdp > 1]
        assert "Hybrid layers: sdp8" in plan.explanation, spec.name
        hybrid_layers(plan)  # and the workers run it
    assert len(hybrid["hf-llama-16"]) >= shape["layers"] - 2 and len(hybrid["gpt-16"]) >= shape["layers"] - 2
