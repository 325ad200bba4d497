"""Analytical costs traced on the meta device: agreement with the GPT closed form, the Table I models
on a TITAN RTX, and the accounting rules (per sample vs per micro-batch, tied weights, fused attention)."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch
import yaml
from google.protobuf.json_format import ParseDict
from torch.utils.flop_counter import FlopCounterMode

from ballast.v1 import model_pb2, profile_pb2
from services.profiler import meta_costs
from services.profiler.measure import iter_layer_args
from services.profiler.measure_bytes import SavedTensorBytes
from services.profiler.meta_costs import layer_costs_from_meta, trace_layers
from services.profiler.projection import ASSUMED_EFFICIENCY, analytical_profile, model_costs
from services.runtime.errors import InvalidArgument
from services.specs.catalog import to_proto
from services.specs.user_inputs import UserInputs
from services.zoo import build_model, count_parameters, example_input

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TITAN = "nvidia-titan-rtx-24gb"
TABLE_I = ("bert-huge-32", "vit-huge-32", "t5-large-32", "swin-huge-32")
SIZES = (1, 2, 4, 8)
FACTORY = "tests.zoo_factory:tiny_mlp"
H, S, HEADS, FFN = 128, 128, 4, 512
TINY = {
    "gpt": {
        "family": "MODEL_FAMILY_GPT",
        "transformer": {"num_layers": 2, "hidden_size": H, "num_heads": HEADS, "ffn_hidden_size": FFN}
        | {"vocab_size": 1024, "seq_length": S, "tie_embeddings": True},
    },
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


def example(name: str) -> model_pb2.ModelSpec:
    return ParseDict(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()), model_pb2.ModelSpec())


def tiny(name: str) -> model_pb2.ModelSpec:
    return ParseDict({"name": name, **TINY[name]}, model_pb2.ModelSpec())


def double_counted(spec: model_pb2.ModelSpec, allowed: tuple[str, ...] = ()) -> int:
    """Parameters counted once more per extra layer that uses them (tied weights, shared tables)."""
    model = build_model(spec, device="meta", user_inputs=UserInputs.of(allowed))
    params = dict(model.named_parameters())
    return sum((len(s.layers) - 1) * params[s.name].numel() for s in model.decompose().shared)


@pytest.fixture(scope="module")
def titan_profiles() -> dict[str, profile_pb2.Profile]:
    """The four Table I models on a TITAN RTX; costing them must allocate no weights (2.5+ GB each)."""
    meta_costs._cached_costs.cache_clear()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    found = {name: analytical_profile(example(name), TITAN, "fp32", SIZES) for name in TABLE_I}
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before < 512 * 2**20
    return found


def test_gpt_block_agrees_with_the_closed_form() -> None:
    spec = tiny("gpt")
    meta, closed = layer_costs_from_meta(spec), model_costs(spec)
    assert [c.name for c in meta] == [c.name for c in closed] == ["embed", "block.0", "block.1", "head"]
    for m, c in zip(meta, closed, strict=True):
        assert (m.parameter_count, m.tied_with) == (c.parameter_count, c.tied_with), m.name
        assert (m.boundary_elems_per_sample, m.output_elems_per_sample) == (
            c.boundary_elems_per_sample, c.output_elems_per_sample,
        ), m.name
    block, formula = meta[1], closed[1]
    # FlopCounterMode counts matmuls only; the closed form also counts biases and LayerNorm weights
    # (9h + f of them) at 2 FLOPs per token: exactly that gap, under 1% here.
    assert formula.flops("forward", 1) - block.flops("forward", 1) == 2 * (9 * H + FFN) * S
    assert block.flops("forward", 1) == pytest.approx(formula.flops("forward", 1), rel=0.01)
    assert block.flops("backward", 1) == 2 * block.flops("forward", 1)  # dX and dW per matmul
    assert block.stashed_elems_per_sample == pytest.approx(formula.stashed_elems_per_sample, rel=0.02)
    assert block.traffic_elems_fwd_per_sample == pytest.approx(formula.traffic_elems_fwd_per_sample, rel=0.1)
    # Weights are read once per micro-batch by forward; backward reads them (biases excepted) and
    # writes every gradient once.
    assert block.weight_elems_fwd == block.parameter_count
    assert 1.99 * block.parameter_count < block.weight_elems_bwd <= 2 * block.parameter_count


def test_unfused_attention_counts_the_materialised_scores() -> None:
    spec = tiny("gpt")
    fused, math = layer_costs_from_meta(spec)[1], layer_costs_from_meta(spec, fused_attention=False)[1]
    assert math.flops("forward", 1) == fused.flops("forward", 1)
    assert math.flops("backward", 1) == fused.flops("backward", 1)
    assert math.stashed_elems_per_sample > fused.stashed_elems_per_sample  # softmax output kept
    assert math.traffic_elems_fwd_per_sample > fused.traffic_elems_fwd_per_sample + HEADS * S * S


@pytest.mark.parametrize("name", TABLE_I)
def test_table_i_models_profile_on_a_titan(name: str, titan_profiles: dict[str, profile_pb2.Profile]) -> None:
    spec, profile = example(name), titan_profiles[name]
    layers = build_model(spec, device="meta").decompose().layers
    assert [(p.index, p.name, p.kind) for p in profile.layers] == [(x.index, x.name, x.kind) for x in layers]
    assert profile.projected and profile.software.startswith("analytical roofline")
    assert profile.device.kind == TITAN and profile.device.peak_flops == pytest.approx(16.3e12)
    for layer, decomposed in zip(profile.layers, layers, strict=True):
        assert list(layer.extra_inputs) == decomposed.extra_inputs and list(layer.tied_with) == decomposed.tied_with
        assert [s.micro_batch_size for s in layer.samples] == list(SIZES)
        for s in layer.samples:
            assert not s.measured and s.forward_s > 0 and s.backward_s > 0 and s.recompute_s == s.forward_s
    total = sum(layer.parameter_count for layer in profile.layers)
    assert total - double_counted(spec) == count_parameters(spec)


def test_t5_decoder_blocks_read_the_encoder_output(titan_profiles: dict[str, profile_pb2.Profile]) -> None:
    layers = titan_profiles["t5-large-32"].layers
    encoder_out = next(layer.index for layer in layers if layer.name == "encoder.norm")
    decoder = [layer for layer in layers if layer.kind == "decoder_block"]
    assert len(decoder) == 16 and all(list(layer.extra_inputs) == [encoder_out] for layer in decoder)
    encoder = next(layer for layer in layers if layer.name == "encoder.block.0")
    # Cross-attention: more parameters and more time than an encoder block.
    assert decoder[0].parameter_count > encoder.parameter_count
    assert decoder[0].samples[-1].forward_s > encoder.samples[-1].forward_s
    # The shared embedding is counted in both embeddings and the tied head.
    assert {layer.name for layer in layers if layer.tied_with and layer.kind in ("embed", "head")} == {
        "encoder.embed", "decoder.embed", "head",
    }


def test_swin_stages_widen(titan_profiles: dict[str, profile_pb2.Profile]) -> None:
    costs = {c.name: c for c in model_costs(example("swin-huge-32"))}
    firsts = [costs[f"stage.{s}.block.0"] for s in range(4)]
    params = [c.parameter_count for c in firsts]
    assert params == sorted(params) and len(set(params)) == 4  # width doubles per stage
    assert params[3] > 60 * params[0]
    # Quarter the tokens, double the width: per-block FLOPs stay within a few percent across stages.
    flops = [c.flops("forward", 1) for c in firsts]
    assert max(flops) / min(flops) < 1.05
    names = [layer.name for layer in titan_profiles["swin-huge-32"].layers]
    assert names.count("stage.2.merge") == 1 and sum(n.startswith("stage.2.block.") for n in names) == 26


def test_bert_block_time_on_a_titan_follows_its_flops(titan_profiles: dict[str, profile_pb2.Profile]) -> None:
    spec = example("bert-huge-32")
    t = spec.transformer
    h, s, f, mb = t.hidden_size, t.seq_length, t.ffn_hidden_size, 8
    block = next(c for c in model_costs(spec) if c.name == "block.0")
    flops = block.flops("forward", mb)
    assert flops == mb * (2 * (4 * h * h + 2 * h * f) * s + 4 * s * s * h)  # GEMMs + QK^T and AV
    titan = to_proto(TITAN, "fp32")
    compute_s = flops / titan.peak_flops
    memory_s = block.bytes_moved("forward", mb, 4) / titan.memory_bandwidth_bytes_per_s
    assert compute_s > 2 * memory_s  # a 1280-wide block at 8 x 512 tokens is compute-bound
    sample = next(x for x in titan_profiles["bert-huge-32"].layers[1].samples if x.micro_batch_size == mb)
    assert sample.forward_s == pytest.approx(compute_s / ASSUMED_EFFICIENCY)
    assert compute_s < sample.forward_s < compute_s / 0.3  # between peak and a poor 30% of it
    assert sample.backward_s == pytest.approx(2 * sample.forward_s, rel=0.01)


def test_identical_layers_are_traced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = meta_costs.trace_layer

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(meta_costs, "trace_layer", counting)
    spec = example("vit-huge-32")
    decomposition = build_model(spec, device="meta").decompose()
    batches = {m: example_input(spec, m, device="meta") for m in meta_costs.TRACE_SIZES}
    traces = trace_layers(decomposition, batches)
    assert len(calls) == 3 * len(meta_costs.TRACE_SIZES)  # embed, one block for all 32, head
    assert traces[1] is traces[32]


def test_shifted_and_unshifted_windows_are_not_merged() -> None:
    costs = {c.name: c for c in layer_costs_from_meta(tiny("swin"))}
    plain, shifted = costs["stage.0.block.0"], costs["stage.0.block.1"]
    assert plain.parameter_count == shifted.parameter_count and plain.flops("forward", 1) == shifted.flops("forward", 1)
    assert shifted.traffic_elems_fwd_per_sample > plain.traffic_elems_fwd_per_sample  # the two rolls


def test_attention_free_layers_match_a_real_cpu_run() -> None:
    """Meta tracing sees the same ops as real execution: FLOPs exact, stash within a percent."""
    spec, mb = tiny("swin"), 4
    costs = layer_costs_from_meta(spec)
    decomposition = build_model(spec, seed=0).decompose()
    for i, args in iter_layer_args(decomposition, example_input(spec, mb)):
        layer = decomposition.layers[i]
        if layer.kind == "block":
            continue
        n = len(layer.inputs)
        args = [a.detach().requires_grad_(j < n and a.is_floating_point()) for j, a in enumerate(args)]
        saved = SavedTensorBytes(exclude=[*layer.module.parameters(), *args])
        with FlopCounterMode(display=False) as counter, saved.hooks():
            layer.module(*args)
        assert counter.get_total_flops() == costs[i].flops("forward", mb), layer.name
        assert saved.total / 4 == pytest.approx(costs[i].stashed_elems_per_sample * mb, rel=0.01, abs=2), layer.name


def test_custom_models_need_the_allow_list() -> None:
    spec = tiny("custom")
    with pytest.raises(InvalidArgument) as err:
        model_costs(spec)
    assert err.value.field == "spec.custom.factory"
    costs = model_costs(spec, user_inputs=UserInputs.of([FACTORY]))
    layers = build_model(spec, device="meta", user_inputs=UserInputs.of([FACTORY])).decompose().layers
    assert [(c.name, list(c.tied_with)) for c in costs] == [(x.name, x.tied_with) for x in layers]
    total = sum(c.parameter_count for c in costs) - double_counted(spec, (FACTORY,))
    assert total == count_parameters(spec, user_inputs=UserInputs.of([FACTORY]))
    assert all(c.flops("forward", 1) > 0 for c in costs)


def test_costs_are_cached_and_deterministic() -> None:
    spec = tiny("swin")
    first = layer_costs_from_meta(spec)
    assert layer_costs_from_meta(spec) == first and layer_costs_from_meta(spec) is not first
    meta_costs._cached_costs.cache_clear()
    assert layer_costs_from_meta(spec) == first
    assert torch.get_default_device().type == "cpu"  # tracing leaves no device context behind


def test_a_layer_meta_cannot_run_is_an_invalid_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_meta_kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise NotImplementedError("aten::nonzero has no meta kernel")

    monkeypatch.setattr(meta_costs, "trace_layer", no_meta_kernel)
    meta_costs._cached_costs.cache_clear()
    with pytest.raises(InvalidArgument) as err:
        layer_costs_from_meta(tiny("swin"))
    assert err.value.field == "spec" and "'embed'" in str(err.value)


def test_traces_on_several_threads_at_once_match_one_alone() -> None:
    """A profiler serves analytical profiles on several threads; FlopCounterMode's module hooks are global, so
    two traces at once used to fail in autograd.grad (seen with three planner workers preparing jobs)."""
    from concurrent.futures import ThreadPoolExecutor

    spec = tiny("gpt")

    def trace() -> dict:
        decomposition = build_model(spec, device="meta").decompose()
        batches = {m: example_input(spec, m, device="meta") for m in meta_costs.TRACE_SIZES}
        return {i: {m: (t.flops_fwd, t.flops_bwd, t.stashed) for m, t in by.items()}
                for i, by in trace_layers(decomposition, batches).items()}

    alone = trace()
    with ThreadPoolExecutor(3) as pool:  # an error in any trace is raised here
        found = list(pool.map(lambda _: trace(), range(9)))
    assert all(f == alone for f in found)
