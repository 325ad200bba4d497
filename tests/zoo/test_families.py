"""Model zoo: layer-by-layer execution equals the whole model, declared graph facts, bad specs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2
from services.runtime.errors import InvalidArgument
from services.specs.model import load_model_spec
from services.specs.user_inputs import UserInputs
from services.zoo import build_model, count_parameters, example_input, run_layers

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FACTORY = "tests.zoo_factory:tiny_mlp"
TEXT = {"hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_length": 16, "tie_embeddings": True}
SPECS = {
    "gpt": {"family": "MODEL_FAMILY_GPT", "transformer": {**TEXT, "num_layers": 2}},
    "bert": {"family": "MODEL_FAMILY_BERT", "transformer": {**TEXT, "num_layers": 2, "max_positions": 20}},
    "t5": {
        "family": "MODEL_FAMILY_T5",
        "transformer": {**TEXT, "num_layers": 2, "num_decoder_layers": 2, "decoder_seq_length": 8},
    },
    "vit": {
        "family": "MODEL_FAMILY_VIT",
        "vision": {"image_size": 16, "patch_size": 4, "channels": 3, "num_classes": 5, "hidden_size": 32}
        | {"num_layers": 2, "num_heads": 4},
    },
    # Grid 16 -> 8 -> 4 -> 2 with window 4: shifted windows, an unshifted single window, and a
    # last stage smaller than the window.
    "swin": {
        "family": "MODEL_FAMILY_SWIN",
        "vision": {"image_size": 32, "patch_size": 2, "channels": 3, "num_classes": 5, "hidden_size": 16}
        | {"depths": [2, 2, 2, 2], "window_size": 4, "head_dim": 8},
    },
    "custom": {
        "family": "MODEL_FAMILY_CUSTOM",
        "custom": {"factory": FACTORY, "kwargs": {"width": 8, "depth": 3}, "cut_points": ["embed", "hidden1"]},
    },
}


pytestmark = pytest.mark.usefixtures("one_thread")  # timings and sums as the workers run them


def spec_of(name: str, **changes) -> model_pb2.ModelSpec:
    if name == "t5-512-4":
        spec = load_model_spec(EXAMPLES / "t5-512-4.yaml")
    else:
        spec = ParseDict({"name": name, **SPECS[name]}, model_pb2.ModelSpec())
    for key, value in changes.items():
        setattr(spec, key, value)
    return spec


def build(spec: model_pb2.ModelSpec):
    return build_model(spec, user_inputs=UserInputs.of([FACTORY]), seed=0)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name", [*SPECS, "t5-512-4"])
def test_layer_by_layer_equals_whole_model(name: str) -> None:
    spec = spec_of(name)
    model = build(spec)
    batch = example_input(spec, 2, user_inputs=UserInputs.of([FACTORY]))
    whole = model(batch)
    whole.backward()
    whole_grads = grads(model)
    layered = run_layers(model.decompose(), batch)
    layered.backward()
    layered_grads = grads(model)
    assert torch.equal(whole, layered)
    assert whole_grads.keys() == layered_grads.keys() == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(whole_grads[n], layered_grads[n]) for n in whole_grads)


def test_layer_names_and_kinds() -> None:
    names = [layer.name for layer in build(spec_of("gpt")).decompose().layers]
    assert names == ["embed", "block.0", "block.1", "head"]
    t5 = build(spec_of("t5")).decompose()
    assert [layer.name for layer in t5.layers] == [
        "encoder.embed",
        "encoder.block.0",
        "encoder.block.1",
        "encoder.norm",
        "decoder.embed",
        "decoder.block.0",
        "decoder.block.1",
        "head",
    ]
    custom = build(spec_of("custom")).decompose()
    assert [layer.name for layer in custom.layers] == ["embed", "hidden0..hidden1", "hidden2..out"]


def test_swin_stage_boundaries_are_patch_merges_where_width_doubles() -> None:
    spec = spec_of("swin")
    dec = build(spec).decompose()
    merges = [layer for layer in dec.layers if layer.kind == "merge"]
    assert [layer.name for layer in merges] == ["stage.1.merge", "stage.2.merge", "stage.3.merge"]
    assert all(layer.extra_inputs == [] for layer in dec.layers) and dec.relay == []
    x = example_input(spec, 1)["pixel_values"]
    for layer in dec.layers[:-1]:
        y = layer.module(x)
        if layer.kind == "merge":
            assert (y.shape[1], y.shape[2]) == (x.shape[1] // 4, x.shape[2] * 2)
        x = y


def test_tied_embedding_is_one_parameter_declared_on_both_layers() -> None:
    model = build(spec_of("gpt"))
    dec = model.decompose()
    assert model.head.lm.weight is model.embed.tokens.weight
    last = len(dec) - 1
    assert dec.layers[0].tied_with == [last] and dec.layers[last].tied_with == [0]
    assert [(s.name, s.layers) for s in dec.shared] == [("embed.tokens.weight", (0, last))]
    spec = spec_of("gpt")
    spec.transformer.tie_embeddings = False
    dec = build(spec).decompose()
    assert dec.shared == [] and all(layer.tied_with == [] for layer in dec.layers)
    assert count_parameters(spec) == count_parameters(spec_of("gpt")) + 64 * 32


def test_t5_decoder_reads_encoder_output_which_is_relayed() -> None:
    model = build(spec_of("t5-512-4"))
    dec = model.decompose()
    index = {layer.name: layer.index for layer in dec.layers}
    encoder_out = index["encoder.norm"]
    for name in ("decoder.block.0", "decoder.block.1"):
        assert dec.layers[index[name]].extra_inputs == [encoder_out]
    assert dec.layers[index["decoder.embed"]].inputs == ()
    assert dec.relay == [encoder_out]
    # A cut after decoder.block.0 carries both the boundary activation and the encoder output.
    assert dec.crossing(index["decoder.block.0"]) == [encoder_out, index["decoder.block.0"]]
    assert dec.crossing(index["encoder.block.0"]) == [index["encoder.block.0"]]
    # One embedding table for encoder input, decoder input and LM head; one bias table per stack.
    shared = {s.name: s.layers for s in dec.shared}
    assert shared["shared.weight"] == (index["encoder.embed"], index["decoder.embed"], index["head"])
    assert shared["encoder.0.rel.table.weight"] == (index["encoder.block.0"], index["encoder.block.1"])
    assert model.head.lm.weight is model.shared.weight is model.decoder_embed.shared.weight


def test_custom_segments_share_the_tied_weight() -> None:
    dec = build(spec_of("custom")).decompose()
    assert [s.layers for s in dec.shared] == [(0, 2)]
    assert [layer.batch_keys for layer in dec.layers] == [("x",), (), ("labels",)]


@pytest.mark.parametrize("name", ["gpt", "bert", "t5", "vit", "swin"])
def test_dropout_off_by_default_is_deterministic_and_on_differs(name: str) -> None:
    spec = spec_of(name)
    batch = example_input(spec, 2)
    model = build(spec).train()
    assert torch.equal(model(batch), model(batch))
    noisy = build(spec_of(name, dropout=0.3)).train()
    assert not torch.equal(noisy(batch), noisy(batch))
    assert torch.equal(noisy.eval()(batch), noisy(batch))


def test_loss_is_a_sum_and_loss_count_its_divisor() -> None:
    spec = spec_of("bert")
    batch = example_input(spec, 3)
    masked = int((batch["labels"] != -100).sum())
    assert 0 < masked < 3 * 16
    assert build(spec).loss_count(batch) == masked + 3
    assert build(spec_of("gpt")).loss_count(example_input(spec_of("gpt"), 3)) == 3 * 16
    assert torch.equal(example_input(spec, 3)["input_ids"], batch["input_ids"])  # deterministic


def test_custom_factory_refused_unless_allow_listed() -> None:
    spec = spec_of("custom")
    sys.modules.pop("tests.zoo_factory", None)
    with pytest.raises(InvalidArgument) as err:
        build_model(spec)
    assert err.value.field == "spec.custom.factory"
    assert "tests.zoo_factory" not in sys.modules  # refused before anything was imported
    with pytest.raises(InvalidArgument) as err:
        count_parameters(spec, user_inputs=UserInputs.of(["tests.zoo_factory:other"]))
    assert err.value.field == "spec.custom.factory"
    assert count_parameters(spec, user_inputs=UserInputs.of([FACTORY])) == 4 * 8 + 3 * (8 * 8 + 8)
    spec.custom.cut_points[:] = ["hidden1", "embed"]
    with pytest.raises(InvalidArgument) as err:
        build(spec)
    assert err.value.field == "spec.custom.cut_points[1]"
    spec.custom.cut_points[:] = ["nope"]
    with pytest.raises(InvalidArgument) as err:
        build(spec)
    assert err.value.field == "spec.custom.cut_points[0]"


def _changed(name: str, config: str, **changes) -> model_pb2.ModelSpec:
    spec = spec_of(name)
    for key, value in changes.items():
        if isinstance(value, list):
            getattr(spec, config).ClearField(key)
            getattr(getattr(spec, config), key).extend(value)
        else:
            setattr(getattr(spec, config), key, value)
    return spec


BAD = {
    "heads do not divide hidden": (_changed("gpt", "transformer", num_heads=5), "spec.transformer.num_heads"),
    "zero layers": (_changed("bert", "transformer", num_layers=0), "spec.transformer.num_layers"),
    "sequence past position table": (
        _changed("bert", "transformer", seq_length=32, max_positions=16),
        "spec.transformer.max_positions",
    ),
    "t5 without decoder": (_changed("t5", "transformer", num_decoder_layers=0), "spec.transformer.num_decoder_layers"),
    "vit heads": (_changed("vit", "vision", num_heads=3), "spec.vision.num_heads"),
    "unset family": (ParseDict({"transformer": TEXT}, model_pb2.ModelSpec()), "spec.family"),
    "unknown family": (model_pb2.ModelSpec(family=99), "spec.family"),
    "family without its config": (ParseDict({"family": "MODEL_FAMILY_VIT"}, model_pb2.ModelSpec()), "spec.vision"),
    "swin window misfits grid": (_changed("swin", "vision", window_size=3), "spec.vision.window_size"),
    "swin grid cannot halve": (_changed("swin", "vision", depths=[1, 1, 1, 1, 1, 1]), "spec.vision.depths"),
    "swin zero-depth stage": (_changed("swin", "vision", depths=[2, 0]), "spec.vision.depths[1]"),
    "dropout of one": (spec_of("vit", dropout=1.0), "spec.dropout"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_specs_raise_invalid_argument_naming_the_field(case: str) -> None:
    spec, field = BAD[case]
    for call in (build_model, count_parameters, lambda s: example_input(s, 1)):
        with pytest.raises(InvalidArgument) as err:
            call(spec)
        assert err.value.field == field
