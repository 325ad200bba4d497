"""Weights out and in (issue 40): a job's last checkpoint, written under any strategy, exports to one state dict
under the model's own names whose every tensor is bit-equal to what the ranks held when they finished (each
rank's "done" event hashes its layers' whole weights, TP/SDP gathered); a job started from that export
(`init_from`) begins at the exported weights, under another layout."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from google.protobuf.json_format import MessageToDict
from safetensors.torch import load_file

from ballast.v1 import model_pb2
from services.executor.train import checkpoint as ckpt
from services.executor.train import weights
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import validation_loss
from services.executor.train.stage import build_stage, model_info
from services.runtime.allocator import STEADY_ALLOCATOR
from services.runtime.errors import InvalidArgument
from services.specs.user_inputs import NO_USER_INPUTS
from services.zoo import build_model
from tests.executor.train.test_hybrid import SPEC, template
from tests.harness import losses, of, torch_threads

STEPS = 3


def train(tmp_path, bounds, replicas, **changes) -> list[list[dict]]:
    changes = {"iterations": STEPS, **changes}
    config = template(bounds, checkpoint_dir=str(tmp_path / "ckpt"), final_checkpoint=True,
                      **changes)
    return run_local(plan_configs(config, bounds, replicas), env=STEADY_ALLOCATOR, timeout_s=240)


def exported(tmp_path, fmt: str = "safetensors") -> dict[str, torch.Tensor]:
    out = tmp_path / f"export-{fmt}"
    files, iteration = weights.export(ckpt.checkpoint_path(tmp_path / "ckpt", STEPS), SPEC, fmt, out,
                                      NO_USER_INPUTS, {"job_id": "job-hybrid"})
    assert iteration == STEPS and {f["name"] for f in files} >= {weights.META}
    if fmt == "torch":
        return torch.load(out / weights.TORCH_WEIGHTS, weights_only=True)
    return load_file(str(out / weights.WEIGHTS))


def held_digests(events: list[list[dict]]) -> dict[str, str]:
    """Layer -> the hash of its whole weights, from every rank's "done" (replicas must agree)."""
    out: dict[str, str] = {}
    for rank in events:
        for layer, digest in of(rank, "done")[0]["layer_sha256"].items():
            assert out.setdefault(layer, digest) == digest, f"layer {layer}: replicas disagree"
    return out


def digests_of(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """The same hashes, from an export: each layer's parameters under their names within the layer."""
    info = model_info(SPEC, 2)
    names = weights.layer_names(info.model, info.dec, SPEC)
    return {str(layer.index): weights.digest([(f"param/{local}", state[names[(layer.index, local)]])
                                              for local, _ in layer.module.named_parameters()])
            for layer in info.dec.layers}


LAYOUTS = {
    "pp2xdp2": ([[0, 2], [2, 4]], 2, {}),
    "zero1": ([[0, 4]], 2, {"zero1_layers": [0, 1, 2, 3]}),
    "zero2": ([[0, 2], [2, 4]], 2, {"zero2_layers": [1, 2]}),
    "tp2": ([[0, 4]], 2, {"tp_layers": [[1, 2], [2, 2]]}),
    "sdp": ([[0, 4]], 2, {"sdp_layers": [1, 2]}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_export_is_bit_equal_to_the_weights_every_strategy_trained(tmp_path, layout):
    bounds, replicas, changes = LAYOUTS[layout]
    events = train(tmp_path, bounds, replicas, **changes)
    state = exported(tmp_path)
    model = dict(model_info(SPEC, 2).model.named_parameters())  # the model's own names, a tied weight once
    assert sorted(state) == sorted(model)
    assert all(tuple(state[n].shape) == tuple(p.shape) for n, p in model.items())
    assert digests_of(state) == held_digests(events)
    torch_state = exported(tmp_path, "torch")
    assert all(torch.equal(torch_state[n], state[n]) for n in state)


@pytest.mark.slow
def test_init_from_an_export_starts_from_its_weights_under_another_layout(tmp_path):
    """Trained STEPS + 1 iterations on 2 stages x 2 replicas with a checkpoint after STEPS; a 1-stage x 2-replica
    job started from that checkpoint's export, on the same batch (start_iteration STEPS), computes the loss the
    first job computed at its last iteration: the forward ran on the exported weights."""
    first = train(tmp_path, [[0, 2], [2, 4]], 2, iterations=STEPS + 1, checkpoint_every=STEPS)
    state = exported(tmp_path)
    start = {"start_iteration": STEPS, "iterations": STEPS + 1}
    again = run_local(plan_configs(template([[0, 4]], init_from=str(tmp_path / "export-safetensors"), **start),
                                   [[0, 4]], 2), env=STEADY_ALLOCATOR, timeout_s=240)
    assert losses(again) == pytest.approx(losses(first)[-1:], rel=1e-6)
    # a checkpoint directory works too (its parameters only): the same loss, bit for bit, on the same layout
    directory = str(ckpt.checkpoint_path(tmp_path / "ckpt", STEPS))
    from_checkpoint = run_local(plan_configs(template([[0, 4]], init_from=directory, **start), [[0, 4]], 2),
                                env=STEADY_ALLOCATOR, timeout_s=240)
    assert losses(from_checkpoint) == losses(again)
    # in one process: the stage holds the export's tensors exactly
    info = model_info(SPEC, 2)
    stage = build_stage(SPEC, [[0, 4]], 0, seed=99, micro_batch_size=2)
    weights.load_into(stage.layers, weights.layer_names(info.model, info.dec, SPEC), state)
    held = {str(layer.index): weights.digest([(f"param/{n}", p) for n, p in layer.module.named_parameters()])
            for layer in stage.layers}
    assert held == digests_of(state)


def test_export_refuses_an_unknown_format_and_hf_for_a_zoo_model(tmp_path):
    with pytest.raises(InvalidArgument, match="format"):
        weights.export(tmp_path, SPEC, "onnx", tmp_path / "out", NO_USER_INPUTS, {})
    with pytest.raises(InvalidArgument, match="save_pretrained"):
        weights.export(tmp_path, SPEC, "hf", tmp_path / "out", NO_USER_INPUTS, {})


def test_initial_weights_refuse_a_directory_with_neither_a_checkpoint_nor_an_export(tmp_path):
    with pytest.raises(InvalidArgument, match="init_from"):
        weights.initial_weights(str(tmp_path), SPEC, NO_USER_INPUTS)
    model = model_info(SPEC, 2).model
    with pytest.raises(InvalidArgument, match="no 'embed.tokens.weight'"):
        weights.assign(model, SPEC, {})


def test_the_export_worker_answers_one_json_line_and_names_a_bad_field(tmp_path):
    job = {"checkpoint": str(tmp_path), "spec": MessageToDict(SPEC), "format": "onnx", "out": str(tmp_path / "o")}
    done = subprocess.run([sys.executable, "-m", "services.executor.train.export"], input=json.dumps(job),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    error = json.loads(done.stdout)["error"]
    assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "format")
    done = subprocess.run([sys.executable, "-m", "services.executor.train.export"], input="{}",
                          capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout)["error"]["field"] == "stdin"


def test_a_model_spec_family_decides_the_names_exported():
    assert weights.own_name(model_pb2.ModelSpec(family=model_pb2.MODEL_FAMILY_HF), "hf.model.embed.weight") == \
        "model.embed.weight"
    assert weights.own_name(model_pb2.ModelSpec(family=model_pb2.MODEL_FAMILY_CUSTOM), "inner.up.weight") == \
        "up.weight"
    assert weights.own_name(model_pb2.ModelSpec(family=model_pb2.MODEL_FAMILY_GPT), "blocks.0.x") == "blocks.0.x"


# --- offloaded modes: chunks (PatrickStar) and Harmony checkpoint, export, evaluate and resume too ----------------
def offloaded(tmp_path, configs, **changes) -> list[list[dict]]:
    configs = [replace(c, checkpoint_dir=str(tmp_path / "ckpt"), final_checkpoint=True, **changes) for c in configs]
    return run_local(configs, env=STEADY_ALLOCATOR, timeout_s=240)


def export_of(tmp_path, spec, iteration: int) -> dict[str, torch.Tensor]:
    out = tmp_path / f"export-{iteration}"
    weights.export(ckpt.checkpoint_path(tmp_path / "ckpt", iteration), spec, "safetensors", out, NO_USER_INPUTS, {})
    return load_file(str(out / weights.WEIGHTS))


def digests_for(spec, state: dict[str, torch.Tensor]) -> dict[str, str]:
    model = build_model(spec, device="meta")
    dec = model.decompose()
    names = weights.layer_names(model, dec, spec)
    return {str(layer.index): weights.digest([(f"param/{local}", state[names[(layer.index, local)]])
                                              for local, _ in layer.module.named_parameters()])
            for layer in dec.layers}


@pytest.mark.slow
def test_chunk_mode_checkpoints_exports_evaluates_and_resumes(tmp_path):
    from tests.executor.train.test_chunks import SPEC as CHUNKED
    from tests.executor.train.test_chunks_worker import LAYERS, TEMPLATE
    from tests.executor.train.test_chunks_worker import STEPS as CHUNK_STEPS

    configs = plan_configs(TEMPLATE, [[0, LAYERS]], 2)
    whole = offloaded(tmp_path, configs, checkpoint_every=2, eval_every=2, eval_batches=2)
    done = of(whole[0], "done")[0]
    state = export_of(tmp_path, CHUNKED, CHUNK_STEPS)
    assert digests_for(CHUNKED, state) == done["layer_sha256"]  # bit for bit the trained fp32 master
    assert [e["iteration"] for e in of(whole[0], "evaluation")] == [2, 4] and not of(whole[1], "evaluation")
    checkpoints = [e for e in of(whole[0], "checkpoint")]
    assert [e["iteration"] for e in checkpoints] == [2, 4] and len(checkpoints[0]["every_layer"]) == LAYERS
    with torch_threads(1):
        expected = validation_loss(CHUNKED, {}, TEMPLATE.seed, 4, 2, state)
    assert of(whole[0], "evaluation")[-1]["loss"] == pytest.approx(expected, rel=1e-5)
    # resumed from iteration 2 in chunk mode: the uninterrupted run's last losses and weights
    resumed = offloaded(tmp_path / "again", [replace(c, resume_from=str(ckpt.checkpoint_path(tmp_path / "ckpt", 2)))
                                             for c in configs])
    assert resumed[0][0]["start_iteration"] == 2
    assert losses(resumed) == pytest.approx(losses(whole)[2:], rel=1e-6)
    # and a chunk-mode checkpoint resumes in the stage trainer (per-layer files, whatever wrote them)
    stage = run_local(plan_configs(replace(TEMPLATE, chunk_bytes=0, device_budget_bytes=0, micro_batch_size=1,
                                           num_micro_batches=2, resume_from=str(ckpt.checkpoint_path(
                                               tmp_path / "ckpt", 2))), [[0, LAYERS]], 2),
                      env=STEADY_ALLOCATOR, timeout_s=240)
    assert losses(stage) == pytest.approx(losses(whole)[2:], rel=1e-5)


@pytest.mark.slow
def test_harmony_checkpoints_exports_evaluates_and_resumes(tmp_path):
    """Two devices of the search's schedule under a budget below the model: rank 0 reads the shared host store
    between iterations while rank 1 waits."""
    from services.planner.sim.harmony_search import Machine, search
    from tests.executor.train.test_harmony import BUDGET, GLOBAL_BATCH_SIZE, layers
    from tests.executor.train.test_harmony import SPEC as UNTIED
    from tests.executor.train.test_harmony_worker import LAYERS, settings, template

    steps = 4
    choice = search(layers(), GLOBAL_BATCH_SIZE, Machine(2, BUDGET, 5e9, 5e9))
    config = replace(template(settings(choice.schedule, tmp_path / "store", choice.prefetch)), iterations=steps)
    configs = plan_configs(config, [[0, LAYERS]], 2)
    whole = offloaded(tmp_path, configs, checkpoint_every=2, eval_every=2, eval_batches=2)
    state = export_of(tmp_path, UNTIED, steps)
    assert digests_for(UNTIED, state) == of(whole[0], "done")[0]["layer_sha256"]
    evaluations = of(whole[0], "evaluation")
    assert [e["iteration"] for e in evaluations] == [2, 4]
    with torch_threads(1):
        expected = validation_loss(UNTIED, config.data, config.seed, config.global_batch_size, 2, state)
    assert evaluations[-1]["loss"] == pytest.approx(expected, rel=1e-5)
    assert [len(e["every_layer"]) for e in of(whole[0], "checkpoint")] == [LAYERS, LAYERS]
    resumed = offloaded(tmp_path / "again", [replace(c, harmony={**c.harmony, "store_dir": str(tmp_path / "store2")},
                                                     resume_from=str(ckpt.checkpoint_path(tmp_path / "ckpt", 2)))
                                             for c in configs])
    assert resumed[0][0]["start_iteration"] == 2
    assert losses(resumed) == pytest.approx(losses(whole)[2:], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_hugging_face_models_export_is_a_save_pretrained_directory_transformers_loads(tmp_path, arch):
    """Trained as 2 pipeline stages (GPT-2 ties its head to its embedding), exported with format "hf": transformers
    loads the directory with AutoModelForCausalLM.from_pretrained, every tensor the trained one, and its loss on a
    batch is the exported weights' loss in Ballast's own model."""
    import transformers

    from services.data.batches import batch_for
    from tests.user_model_support import hf_spec

    spec = hf_spec(arch, name=f"export-{arch}")
    n = len(build_model(spec, device="meta").decompose())
    config = replace(template([[0, n]]), model=MessageToDict(spec, preserving_proto_field_name=True))
    events = offloaded(tmp_path, plan_configs(config, [[0, n // 2], [n // 2, n]], 1))
    state = export_of(tmp_path, spec, STEPS)
    assert digests_for(spec, state) == {k: v for rank in events for k, v in of(rank, "done")[0]["layer_sha256"].items()}
    out = tmp_path / "hf"
    weights.export(ckpt.checkpoint_path(tmp_path / "ckpt", STEPS), spec, "hf", out, NO_USER_INPUTS, {})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    for name, tensor in loaded.state_dict().items():
        if name in state:
            assert torch.equal(tensor, state[name]), name
    assert set(state) <= set(loaded.state_dict())
    batch = batch_for(spec, {}, 0, 0, 0, 2, global_batch_size=2)
    ours = build_model(spec, seed=1)
    weights.assign(ours, spec, state)
    with torch.no_grad():
        expected = float(ours.eval()(batch)) / ours.loss_count(batch)
        logits = loaded(input_ids=batch["input_ids"]).logits  # Ballast's labels are the next tokens already
        theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    assert float(theirs) == pytest.approx(expected, rel=1e-5)
