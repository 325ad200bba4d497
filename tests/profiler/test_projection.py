"""Roofline projection of measured profiles and analytical profiles from FLOP/byte counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ballast.v1 import common_pb2, model_pb2, profile_pb2
from services.profiler import projection
from services.profiler.layer_cost import LayerCost
from services.profiler.projection import (
    ASSUMED_EFFICIENCY,
    analytical_profile,
    block_cost,
    project,
    transformer_layer_costs,
)
from services.runtime.errors import InvalidArgument
from services.specs.catalog import device, to_proto

A100, H100 = device("A100"), device("H100")
FP16_RATIO = A100.fp16_flops / H100.fp16_flops  # 312 / 989.5
BW_RATIO = A100.memory_bandwidth_bytes_per_s / H100.memory_bandwidth_bytes_per_s  # 1555 / 3350
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def measured_profile(times: tuple[float, float, float] = (4e-3, 8e-3, 4e-3), **layer_bytes) -> profile_pb2.Profile:
    """One layer measured on an A100 in fp16 at micro-batch sizes 1 and 2 (times double with size)."""
    p = profile_pb2.Profile(
        id="prf-source",
        tenant_id="tnt-1",
        model_id="mdl-1",
        model_signature="sig",
        dtype=common_pb2.DTYPE_FP16,
        device=to_proto("A100", common_pb2.DTYPE_FP16),
        software="torch 2.13.0, ballast 0.1.0",
        intra_op_threads=4,
        non_model_memory_bytes=123,
    )
    p.comm.links.add(bytes=1 << 20, seconds=1e-4)
    p.comm.overlap_slowdown = 1.3
    fields = {"parameter_bytes": 2000, "gradient_bytes": 2000, "optimizer_state_bytes": 12000} | layer_bytes
    layer = p.layers.add(index=0, name="block.0", kind="block", parameter_count=1000, **fields)
    fwd, bwd, rec = times
    for mb in (1, 2):
        layer.samples.add(
            micro_batch_size=mb,
            measured=True,
            forward_s=fwd * mb,
            backward_s=bwd * mb,
            recompute_s=rec * mb,
            boundary_activation_bytes=100 * mb,
            stashed_activation_bytes=800 * mb,
            output_bytes=100 * mb,
            peak_memory_bytes=5000 + 1000 * mb,
        )
    return p


def synthetic_cost(flops_per_sample: float, traffic_elems_per_sample: float) -> LayerCost:
    return LayerCost(
        name="block.0",
        kind="block",
        parameter_count=1000,
        flops_fwd_per_sample=flops_per_sample,
        traffic_elems_fwd_per_sample=traffic_elems_per_sample,
        boundary_elems_per_sample=50,
        stashed_elems_per_sample=400,
        output_elems_per_sample=50,
    )


def times(p: profile_pb2.Profile) -> list[tuple[float, float, float]]:
    return [(s.forward_s, s.backward_s, s.recompute_s) for layer in p.layers for s in layer.samples]


def assert_scaled(before: profile_pb2.Profile, after: profile_pb2.Profile, ratio: float) -> None:
    for old, new in zip(times(before), times(after), strict=True):
        assert new == pytest.approx(tuple(t * ratio for t in old), rel=1e-9)


def test_compute_bound_layer_scales_by_fp16_flop_ratio() -> None:
    src = measured_profile()
    out = project(src, "H100", costs=[synthetic_cost(1e12, 1e3)])  # 10^9 FLOP per byte: compute-bound on both
    assert_scaled(src, out, FP16_RATIO)


def test_bandwidth_bound_layer_scales_by_bandwidth_ratio() -> None:
    src = measured_profile()
    out = project(src, "H100", costs=[synthetic_cost(1e3, 1e9)])  # ~0 FLOP per byte: bandwidth-bound on both
    assert_scaled(src, out, BW_RATIO)


def test_without_costs_intensity_comes_from_profile_bytes() -> None:
    compute = measured_profile(times=(10e-3, 20e-3, 10e-3))  # kilobytes moved in milliseconds
    assert_scaled(compute, project(compute, "H100"), FP16_RATIO)
    # 2 GB of weights read in 1 ms per sample on a 1.555 TB/s A100: the traffic alone takes 1.29 ms.
    memory = measured_profile(times=(1e-3, 2e-3, 1e-3), parameter_bytes=2 * 10**9, gradient_bytes=2 * 10**9)
    assert_scaled(memory, project(memory, "H100"), BW_RATIO)


def test_regime_change_takes_the_slower_bound() -> None:
    # Intensity 250 FLOP/B: compute-bound on the A100 (ridge ~201), bandwidth-bound on the H100 (~295).
    cost = synthetic_cost(250 * 2e9 * 2, 2e9)  # traffic 2e9 elements x 2 bytes per sample
    src = measured_profile()
    out = project(src, "H100", costs=[cost])
    mb = 1
    f, b = cost.flops("forward", mb), cost.bytes_moved("forward", mb, 2)
    a100, h100 = to_proto("A100", "fp16"), to_proto("H100", "fp16")
    expected = max(f / h100.peak_flops, b / h100.memory_bandwidth_bytes_per_s)
    expected /= max(f / a100.peak_flops, b / a100.memory_bandwidth_bytes_per_s)
    assert out.layers[0].samples[0].forward_s == pytest.approx(4e-3 * expected)
    assert FP16_RATIO < expected < BW_RATIO


def test_projection_marks_the_data_and_keeps_memory() -> None:
    src = measured_profile()
    out = project(src, "H100", costs=[synthetic_cost(1e12, 1e3)])
    assert out.projected and out.source_profile_id == "prf-source" and out.id == ""
    assert out.device == to_proto("H100", common_pb2.DTYPE_FP16)
    assert out.software.startswith("projected by roofline from nvidia-a100-40gb")
    assert "torch 2.13.0" in out.software
    assert (out.model_id, out.model_signature, out.tenant_id, out.dtype) == ("mdl-1", "sig", "tnt-1", src.dtype)
    assert out.non_model_memory_bytes == 123 and out.intra_op_threads == 4
    assert not out.comm.links and out.comm.overlap_slowdown == 1.3  # source fleet's wires do not carry over
    old, new = src.layers[0], out.layers[0]
    for f in ("index", "name", "kind", "parameter_count", "parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert getattr(new, f) == getattr(old, f)
    for s_old, s_new in zip(old.samples, new.samples, strict=True):
        for f in (
            "micro_batch_size",
            "boundary_activation_bytes",
            "stashed_activation_bytes",
            "output_bytes",
            "peak_memory_bytes",
        ):
            assert getattr(s_new, f) == getattr(s_old, f)
        assert not s_new.measured  # nothing was measured on the H100
    assert src.layers[0].samples[0].forward_s == 4e-3  # the input is not modified


def test_precision_change_rescales_element_sizes_and_master_copy() -> None:
    src = measured_profile(parameter_bytes=4000, gradient_bytes=4000, optimizer_state_bytes=8000)
    src.dtype = common_pb2.DTYPE_FP32
    src.device.CopyFrom(to_proto("A100", "fp32"))
    out = project(src, "H100", "bf16", costs=[synthetic_cost(1e12, 1e3)])
    layer = out.layers[0]
    assert (layer.parameter_bytes, layer.gradient_bytes, layer.optimizer_state_bytes) == (2000, 2000, 12000)
    s = layer.samples[0]
    assert (s.boundary_activation_bytes, s.stashed_activation_bytes, s.output_bytes) == (50, 400, 50)
    assert s.peak_memory_bytes == 6000 - 4000 - 500  # weights+grads shrink by 4000, activations by 500
    assert out.dtype == common_pb2.DTYPE_BF16 and out.device.peak_flops == H100.bf16_flops
    assert s.forward_s == pytest.approx(4e-3 * A100.fp32_flops / H100.bf16_flops)


def test_device_reported_by_kind_only_is_filled_from_the_catalog() -> None:
    src = measured_profile()
    src.device.Clear()
    src.device.kind = "nvidia-a100-40gb"  # what an agent that knows its GPU but not its peaks reports
    assert_scaled(src, project(src, "H100", costs=[synthetic_cost(1e12, 1e3)]), FP16_RATIO)
    src.device.kind = "nvidia-gpu"
    with pytest.raises(InvalidArgument) as err:
        project(src, "H100")
    assert err.value.field == "profile.device"
    assert_scaled(src, project(src, "H100", source="A100", costs=[synthetic_cost(1e12, 1e3)]), FP16_RATIO)


def test_bad_arguments_name_their_field() -> None:
    src = measured_profile()
    with pytest.raises(InvalidArgument) as err:
        project(src, "H100", costs=[])
    assert err.value.field == "costs"
    with pytest.raises(InvalidArgument) as err:
        project(src, "not-a-gpu")
    assert err.value.field == "device"
    src.dtype = common_pb2.DTYPE_UNSPECIFIED
    with pytest.raises(InvalidArgument) as err:
        project(src, "H100")
    assert err.value.field == "profile.dtype"


def test_projection_is_deterministic() -> None:
    src = measured_profile()
    assert project(src, "L4") == project(src, "L4")


# --- Analytical ------------------------------------------------------------------------------------

H, S, HEADS, F = 64, 16, 4, 256


def test_gpt_block_forward_flops_by_hand() -> None:
    # Parameters of one block, module by module.
    qkv = H * 3 * H + 3 * H
    proj = H * H + H
    fc1 = H * F + F
    fc2 = F * H + H
    norms = 2 * (H + H)
    params = qkv + proj + fc1 + fc2 + norms
    assert params == 49_984
    # Forward: every parameter does one multiply-add per token; QK^T and AV each S x S x H multiply-adds.
    by_hand = 2 * params * S + 2 * (2 * S * S * H)
    assert by_hand == 1_665_024
    cost = block_cost("block.0", H, S, HEADS, F)
    assert cost.parameter_count == params
    assert cost.flops("forward", 1) == by_hand
    assert cost.flops("forward", 3) == 3 * by_hand
    assert cost.flops("backward", 2) == 2 * 2 * by_hand  # backward = 2x forward
    assert cost.stashed_elems_per_sample == (8 * H + 2 * F) * S
    assert cost.boundary_elems_per_sample == cost.output_elems_per_sample == H * S


def test_layer_costs_match_the_zoo_parameter_counts() -> None:
    pytest.importorskip("torch")
    from services.zoo import build_model

    spec = model_pb2.ModelSpec(
        name="tiny",
        family=model_pb2.MODEL_FAMILY_GPT,
        dtype=common_pb2.DTYPE_FP32,
        transformer=model_pb2.TransformerConfig(
            num_layers=2,
            hidden_size=H,
            num_heads=HEADS,
            ffn_hidden_size=F,
            vocab_size=100,
            seq_length=S,
            tie_embeddings=True,
        ),
    )
    layers = build_model(spec, device="meta").decompose().layers
    costs = projection.model_costs(spec)
    assert [c.name for c in costs] == [layer.name for layer in layers]
    for cost, layer in zip(costs, layers, strict=True):
        assert cost.parameter_count == sum(p.numel() for p in layer.module.parameters()), cost.name
        assert list(cost.tied_with) == layer.tied_with, cost.name


def test_analytical_profile_says_so_and_follows_the_roofline() -> None:
    costs = transformer_layer_costs(H, S, HEADS, vocab=100, layers=2, ffn=F)
    p = analytical_profile(costs, "H100", "bf16", (1, 4), model_id="mdl-x")
    assert p.projected and p.source_profile_id == "" and p.model_id == "mdl-x"
    assert p.software.startswith("analytical roofline") and f"{ASSUMED_EFFICIENCY:.2f}" in p.software
    assert p.device.kind == "nvidia-h100-sxm-80gb" and p.dtype == common_pb2.DTYPE_BF16
    assert [layer.name for layer in p.layers] == ["embed", "block.0", "block.1", "head"]
    block = p.layers[1]
    assert (block.parameter_bytes, block.gradient_bytes, block.optimizer_state_bytes) == (
        2 * 49_984,
        2 * 49_984,
        12 * 49_984,
    )
    spec = to_proto("H100", "bf16")
    for sample in block.samples:
        mb = sample.micro_batch_size
        assert not sample.measured
        f, b = costs[1].flops("forward", mb), costs[1].bytes_moved("forward", mb, 2)
        expected = max(f / spec.peak_flops, b / spec.memory_bandwidth_bytes_per_s) / ASSUMED_EFFICIENCY
        assert sample.forward_s == pytest.approx(expected) and sample.recompute_s == sample.forward_s
        assert sample.backward_s > sample.forward_s
        assert sample.stashed_activation_bytes == (8 * H + 2 * F) * S * mb * 2
    assert p == analytical_profile(costs, "H100", "bf16", (4, 1), model_id="mdl-x")  # deterministic, sorted


def test_analytical_profile_from_a_gpt_spec_orders_devices_sensibly() -> None:
    pytest.importorskip("yaml")
    from services.specs.model import load_model_spec

    spec = load_model_spec(EXAMPLES / "gpt3-15b.yaml")
    by_device = {name: analytical_profile(spec, name, "fp16", (1,)) for name in ("H100", "A100", "V100")}
    step = {
        n: sum(s.forward_s + s.backward_s for layer in p.layers for s in layer.samples) for n, p in by_device.items()
    }
    assert step["H100"] < step["A100"] < step["V100"]
    layers = by_device["H100"].layers
    head_norm = 2 * spec.transformer.hidden_size  # the tied head's own parameters; its weight is the embedding's
    total = sum(layer.parameter_count for layer in layers[:-1]) + head_norm
    assert total == pytest.approx(15.4e9, rel=0.01)  # Galvatron-BMW Table I
    assert [(layer.tensor_parallel, layer.sequence_parallel) for layer in layers[1:3]] == [(40, 8)] * 2  # 2,048 tokens
    assert all(layer.tensor_parallel for layer in layers[1:-1])
    dropout = type(spec)()
    dropout.CopyFrom(spec)
    dropout.dropout = 0.1  # the workers split no layer with dropout: the profile offers neither TP nor SP
    assert not any(layer.tensor_parallel or layer.sequence_parallel
                   for layer in analytical_profile(dropout, "H100", "fp16", (1,)).layers)


def test_analytical_profile_rejects_what_it_cannot_cost() -> None:
    bert = model_pb2.ModelSpec(name="b", family=model_pb2.MODEL_FAMILY_BERT, transformer=model_pb2.TransformerConfig())
    with pytest.raises(InvalidArgument) as err:
        analytical_profile(bert, "H100")
    assert err.value.field == "spec.transformer.num_layers"  # every family is costed; the spec is checked first
    costs = transformer_layer_costs(H, S, HEADS, vocab=100, layers=1)
    with pytest.raises(InvalidArgument) as err:
        analytical_profile(costs, "H100", efficiency=0)
    assert err.value.field == "efficiency"
    with pytest.raises(InvalidArgument) as err:
        analytical_profile(costs, "GTX 1080 Ti", "fp16")
    assert err.value.field == "dtype"


def test_analytical_then_project_agrees_with_analytical_on_the_target() -> None:
    costs = transformer_layer_costs(H, S, HEADS, vocab=100, layers=2, ffn=F)
    on_a100 = analytical_profile(costs, "A100", "fp16", (1, 2))
    on_a100.id = "prf-analytical"
    projected = project(on_a100, "H100", costs=costs)
    direct = analytical_profile(costs, "H100", "fp16", (1, 2))
    for a, b in zip(times(projected), times(direct), strict=True):
        assert a == pytest.approx(b)
