"""Hugging Face models as zoo models (issue 39): cut into layers whose loss and gradients equal the unmodified
transformers model's own, with their tied weights found and their tensor-parallel splits declared; built from an
inline config or a config.json directory, started from safetensors weights; every refusal names the field and
the fix. Configs are built in code; nothing touches a hub (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json

import pytest
import torch
from google.protobuf.json_format import MessageToDict

from ballast.v1 import model_pb2
from services.data.batches import batch_for
from services.executor.train.stage import model_info
from services.runtime.errors import InvalidArgument
from services.specs.user_inputs import UserInputs
from services.zoo import build_model, example_input
from services.zoo.graph import run_layers
from tests.user_model_support import CONFIGS, hf_spec

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_loss(model, arch: str, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The transformers model's own loss on the same samples (its own label convention), and the batch as
    Ballast's layers read it (causal LM labels shifted, -100 past the end)."""
    if CONFIGS[arch][0] == "HF_TASK_CAUSAL_LM":
        ids = batch["input_ids"]
        shifted = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], 1)
        return model.hf(input_ids=ids, labels=ids).loss, {"input_ids": ids, "labels": shifted}
    if arch == "bert":
        return model.hf(**batch).loss, batch
    return model.hf(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss, batch


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_layers_compute_the_hf_models_own_loss_and_gradients(arch):
    spec = hf_spec(arch)
    model = build_model(spec, seed=1)
    model.train()
    theirs, batch = hf_loss(model, arch, example_input(spec, 3))
    theirs.backward()
    their_grads = grads(model)
    dec = model.decompose()
    ours = run_layers(dec, batch) / model.loss_count(batch)
    ours.backward()
    our_grads = grads(model)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert our_grads.keys() == their_grads.keys() == {n for n, _ in model.named_parameters()}
    for name in our_grads:
        torch.testing.assert_close(our_grads[name], their_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert [layer.name for layer in dec.layers] == ["embed", "block.0", "block.1", "head"]


def test_tied_weights_and_tensor_parallel_splits_are_declared():
    def layers(spec):
        dec = build_model(spec, device="meta").decompose()
        return dec, [layer.tensor_parallel for layer in dec.layers]

    gpt2, ways = layers(hf_spec("gpt2"))  # GPT-2 ties its LM head to the token embedding
    assert [s.layers for s in gpt2.shared] == [(0, 3)] and ways == [0, 0, 0, 0]  # fused Conv1D: no TP
    llama, ways = layers(hf_spec("llama"))
    assert llama.shared == [] and ways == [0, 2, 2, 0]  # gcd(4 heads, 2 key-value heads, MLP 64)
    assert llama.layers[1].module.tensor_parallel_plan() == {
        "block.self_attn.q_proj": "colwise", "block.self_attn.k_proj": "colwise", "block.self_attn.v_proj": "colwise",
        "block.self_attn.o_proj": "rowwise", "block.mlp.gate_proj": "colwise", "block.mlp.up_proj": "colwise",
        "block.mlp.down_proj": "rowwise"}
    tied, _ = layers(hf_spec("llama", tie_word_embeddings=True))
    assert [s.layers for s in tied.shared] == [(0, 3)]
    assert layers(hf_spec("llama", dropout=0.1))[1] == [0, 0, 0, 0]  # tp ranks would draw different masks
    assert layers(hf_spec("bert"))[1] == [0, 4, 4, 0] and layers(hf_spec("vit"))[1] == [0, 4, 4, 0]
    # Llama's blocks split their 16 tokens too (gcd with their TP ways); BERT's and ViT's add the residual inside a
    # row-parallel region's module, so they name no regions
    assert [layer.sequence_parallel for layer in llama.layers] == [0, 2, 2, 0]
    assert llama.layers[1].module.sequence_parallel_regions() == {"block.self_attn": "hidden_states", "block.mlp": 0}
    assert all(layer.sequence_parallel == 0 for arch in ("bert", "vit", "gpt2")
               for layer in build_model(hf_spec(arch), device="meta").decompose().layers)


def test_the_specs_dropout_is_every_dropout_of_the_config():
    model = build_model(hf_spec("gpt2", dropout=0.25, resid_pdrop=0.1), device="meta")
    config = model.hf.config
    assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.25, 0.25, 0.25)
    assert build_model(hf_spec("bert"), device="meta").hf.config.hidden_dropout_prob == 0.0  # BERT's default 0.1


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_stage_boundaries_come_from_a_meta_dry_run(arch):
    info = model_info(hf_spec(arch), 2)
    assert len(info.outputs) == info.num_layers - 1 and all(b.shape[0] == 2 for b in info.outputs.values())


def test_a_causal_lm_trains_on_the_same_learnable_sequences_as_the_zoo_gpt():
    hf = hf_spec("llama")
    gpt = model_pb2.ModelSpec(family=model_pb2.MODEL_FAMILY_GPT, transformer=model_pb2.TransformerConfig(
        num_layers=1, hidden_size=8, num_heads=1, vocab_size=64, seq_length=16))
    a = batch_for(hf, {}, 3, 2, 0, 4, global_batch_size=4)
    b = batch_for(gpt, {}, 3, 2, 0, 4, global_batch_size=4)
    assert a.keys() == b.keys() == {"input_ids", "labels"}
    assert all(torch.equal(a[k], b[k]) for k in a)


def saved(tmp_path, arch: str = "llama", weights: bool = True):
    """A save_pretrained directory (config.json and model.safetensors) of the tiny model, and that model."""
    model = build_model(hf_spec(arch), seed=5)
    directory = tmp_path / "models" / arch
    model.hf.save_pretrained(directory, safe_serialization=True)
    if not weights:
        (directory / "model.safetensors").unlink()
    return directory, model


def test_a_config_directory_and_safetensors_weights_are_read_from_the_model_path(tmp_path):
    directory, trained = saved(tmp_path)
    user_inputs = UserInputs.of(path=[str(tmp_path / "models")])
    spec = model_pb2.ModelSpec(name="from-disk", family=model_pb2.MODEL_FAMILY_HF, hf=model_pb2.HuggingFaceModel(
        task=model_pb2.HF_TASK_CAUSAL_LM, config_dir=str(directory), weights_dir=str(directory), seq_length=16))
    loaded = build_model(spec, seed=99, user_inputs=user_inputs)  # another seed: the weights win
    theirs = dict(trained.hf.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in loaded.hf.named_parameters())
    assert build_model(spec, device="meta", user_inputs=user_inputs).hf.config.num_key_value_heads == 2


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"config": {"model_type": "t5"}}, "spec.hf.config.model_type", "no Ballast adapter for Hugging Face model_type"),
    ({"config": {"model_type": "bert"}}, "spec.hf.config.model_type", "supported as HF_TASK_MASKED_LM"),
    ({"config": {"model_type": "llama", "auto_map": {"AutoModel": "x.Y"}}}, "spec.hf.config",
     "asks for code from the hub"),
    ({"config": {"vocab_size": 8}}, "spec.hf.config.model_type", "no model_type"),
    ({"task": "HF_TASK_UNSPECIFIED"}, "spec.hf.task", "task is not set"),
    ({"seq_length": 0}, "spec.hf.seq_length", "seq_length 0"),
    ({"config_dir": "/etc"}, "spec.hf.config", "not both"),
    ({"weights_dir": "/etc"}, "spec.hf.weights_dir", "BALLAST_MODEL_PATH is empty"),
])
def test_a_bad_hugging_face_spec_names_the_field_and_the_fix(change, field, words):
    raw = MessageToDict(hf_spec("llama"), preserving_proto_field_name=True)
    raw["hf"].update(change)
    from google.protobuf.json_format import ParseDict

    spec = ParseDict(raw, model_pb2.ModelSpec())
    with pytest.raises(InvalidArgument) as err:
        build_model(spec, device="meta")
    assert err.value.field == field and words in err.value.message and err.value.fix


def test_directories_are_read_only_from_the_model_path_and_weights_only_from_safetensors(tmp_path):
    directory, _ = saved(tmp_path, weights=False)
    (directory / "pytorch_model.bin").write_bytes(b"a pickle is never read")
    inside = UserInputs.of(path=[str(tmp_path / "models")])

    def spec(**hf) -> model_pb2.ModelSpec:
        return model_pb2.ModelSpec(family=model_pb2.MODEL_FAMILY_HF, hf=model_pb2.HuggingFaceModel(
            task=model_pb2.HF_TASK_CAUSAL_LM, **{"seq_length": 16, **hf}))

    cases = [
        (spec(config_dir=str(directory)), UserInputs.of(path=[str(tmp_path / "elsewhere")]), "spec.hf.config_dir",
         "outside the model directories"),
        (spec(config_dir=str(tmp_path / "models" / ".." / "models" / "llama" / "..")), inside, "spec.hf.config_dir",
         "holds no config.json"),
        (spec(config_dir="models/llama"), inside, "spec.hf.config_dir", "not an absolute path"),
        (spec(config_dir=str(directory), weights_dir=str(directory)), inside, "spec.hf.weights_dir",
         "no safetensors weights"),
        (spec(config_dir=str(directory), seq_length=65), inside, "spec.hf.seq_length", "past the config's 64"),
    ]
    for bad, user_inputs, field, words in cases:
        with pytest.raises(InvalidArgument) as err:
            build_model(bad, user_inputs=user_inputs)
        assert (err.value.field, words in err.value.message) == (field, True), err.value
    other, _ = saved(tmp_path / "other", "gpt2")
    with pytest.raises(InvalidArgument, match="do not fit the config"):
        build_model(spec(config_dir=str(directory), weights_dir=str(other)),
                    user_inputs=UserInputs.of(path=[str(tmp_path)]))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "m.M"}}))
    with pytest.raises(InvalidArgument, match="never runs remote code"):
        build_model(spec(config_dir=str(directory)), user_inputs=inside)
