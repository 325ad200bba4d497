"""Profiles for devices that are not at hand: roofline projection and purely analytical profiles.

Roofline: a kernel sequence doing F FLOPs and moving B bytes of device memory takes at least
max(F / peak, B / bandwidth). A measured layer achieved some fraction of that bound on its source
device, eff = roofline_source / measured. Projection assumes the layer reaches the same fraction on
the target, so

    time_target = roofline_target / eff = measured * roofline_target / roofline_source.

A compute-bound layer thus scales by the FLOP/s ratio, a bandwidth-bound one by the bandwidth ratio,
and a layer that changes regime on the way gets the max of the two. F and B come from LayerCost rows
(analytical counts) when given; otherwise B is read off the profile's own byte fields and F is what
the measured time would be worth at ASSUMED_EFFICIENCY of the source peak (only the regime test
depends on that guess: in the compute-bound case it cancels out).

Analytical profiles use the same bound with no measurement: time = roofline / ASSUMED_EFFICIENCY.
Both kinds are marked in the data (projected=True, software says how). Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ballast.v1 import common_pb2, fleet_pb2, model_pb2, profile_pb2
from services.profiler.layer_cost import LayerCost
from services.runtime.errors import InvalidArgument
from services.specs import catalog
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs

# Achieved fraction of peak FLOP/s and bandwidth assumed where nothing was measured. Large
# transformer GEMMs reach 50-70% of dense peak and streaming kernels 70-90% of bandwidth; 0.5 is
# the conservative end for both (it also absorbs launch and non-GEMM overheads).
ASSUMED_EFFICIENCY = 0.5
# Compute slows by ~1.3x when it overlaps NCCL communication (Galvatron-BMW §V).
OVERLAP_SLOWDOWN = 1.3
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
MASTER_COPY_BYTES = 4  # fp32 master weights kept in optimizer state under mixed precision


def roofline_s(flops: float, bytes_moved: float, spec: fleet_pb2.DeviceSpec) -> float:
    """Lower bound on time: the slower of doing the math and moving the bytes."""
    return max(flops / spec.peak_flops, bytes_moved / spec.memory_bandwidth_bytes_per_s)


# --- Projection ------------------------------------------------------------------------------------

# Sample time field -> kernels it runs; recompute is the forward run again before backward.
_PHASES = (("forward_s", "forward"), ("backward_s", "backward"), ("recompute_s", "forward"))


def project(
    profile: profile_pb2.Profile,
    target: fleet_pb2.DeviceSpec | str,
    dtype: int | str | None = None,
    *,
    costs: Sequence[LayerCost] | None = None,
    source: fleet_pb2.DeviceSpec | str | None = None,
    tf32: bool = False,
) -> profile_pb2.Profile:
    """The measured `profile` rescaled to `target` (a DeviceSpec at `dtype`, or a catalog name).

    `source` overrides the profile's device (agents may report only a kind without peaks). Byte
    fields stay as measured: they depend on the model, not the device, except that a precision change
    rescales element sizes and adds or drops the fp32 master copy.
    """
    src_dtype = _dtype_enum(profile.dtype, "profile.dtype")
    tgt_dtype = src_dtype if dtype is None else _dtype_enum(dtype, "dtype")
    src = _source_spec(profile, source, tf32)
    tgt = catalog.to_proto(target, tgt_dtype, tf32=tf32) if isinstance(target, str) else target
    _check_spec(tgt, "target")
    if costs is not None and len(costs) != len(profile.layers):
        raise InvalidArgument(
            f"{len(costs)} cost rows for {len(profile.layers)} layers", field="costs",
            fix="pass one LayerCost per profiled layer, in layer order",
        )
    src_el, tgt_el = _element_bytes(src_dtype), _element_bytes(tgt_dtype)

    out = profile_pb2.Profile()
    out.CopyFrom(profile)
    out.ClearField("id")
    out.ClearField("created_at")
    out.ClearField("comm")  # link samples describe the source fleet's wires; keep only the device-side slowdown
    out.comm.overlap_slowdown = profile.comm.overlap_slowdown
    out.device.CopyFrom(tgt)
    out.dtype = tgt_dtype
    out.projected = True
    out.source_profile_id = profile.id
    how = "analytical FLOP/byte counts" if costs is not None else f"profile bytes, assumed {ASSUMED_EFFICIENCY:.2f}"
    out.software = f"projected by roofline from {src.kind} ({how}); source software: {profile.software or 'unknown'}"

    for i, (source_layer, layer) in enumerate(zip(profile.layers, out.layers, strict=True)):
        _rescale_memory(layer, src_dtype, tgt_dtype)
        for source_sample, sample in zip(source_layer.samples, layer.samples, strict=True):
            mb = sample.micro_batch_size
            for field, phase in _PHASES:
                measured = getattr(source_sample, field)
                if costs is not None:
                    flops = costs[i].flops(phase, mb)
                    b_src, b_tgt = costs[i].bytes_moved(phase, mb, src_el), costs[i].bytes_moved(phase, mb, tgt_el)
                else:
                    flops = measured * src.peak_flops * ASSUMED_EFFICIENCY
                    b_src = _profile_bytes(source_layer, source_sample, phase)
                    b_tgt = b_src * tgt_el / src_el
                setattr(sample, field, _scale(measured, roofline_s(flops, b_src, src), roofline_s(flops, b_tgt, tgt)))
            sample.measured = False  # not measured on the target device
    return out


def _scale(measured: float, roofline_src: float, roofline_tgt: float) -> float:
    """measured / eff with eff = roofline_src / measured, the achieved fraction on the source."""
    if measured <= 0 or roofline_src <= 0:
        return 0.0 if measured <= 0 else measured
    return measured * roofline_tgt / roofline_src


def _profile_bytes(layer: profile_pb2.LayerProfile, s: profile_pb2.LayerSample, phase: str) -> float:
    """Device-memory traffic lower bound from the profile's byte fields.

    Forward reads weights and input, writes the stash and output; backward reads weights, stash and
    output gradient, writes weight gradients and the input gradient.
    """
    if phase == "forward":
        return layer.parameter_bytes + s.boundary_activation_bytes + s.stashed_activation_bytes + s.output_bytes
    return (layer.parameter_bytes + layer.gradient_bytes + s.stashed_activation_bytes
            + s.output_bytes + 2 * s.boundary_activation_bytes)


def _rescale_memory(layer: profile_pb2.LayerProfile, src_dtype: int, tgt_dtype: int) -> None:
    """Element-size change fp32 <-> fp16/bf16; the master copy appears or disappears with mixed precision."""
    src_el, tgt_el = _element_bytes(src_dtype), _element_bytes(tgt_dtype)
    if src_el == tgt_el:
        return
    before = layer.parameter_bytes + layer.gradient_bytes
    layer.parameter_bytes = layer.parameter_bytes * tgt_el // src_el
    layer.gradient_bytes = layer.gradient_bytes * tgt_el // src_el
    master = MASTER_COPY_BYTES * layer.parameter_count
    if tgt_el < src_el:
        layer.optimizer_state_bytes += master
    else:
        layer.optimizer_state_bytes = max(0, layer.optimizer_state_bytes - master)
    delta_weights = layer.parameter_bytes + layer.gradient_bytes - before
    for s in layer.samples:
        acts = s.boundary_activation_bytes + s.stashed_activation_bytes + s.output_bytes
        s.boundary_activation_bytes = s.boundary_activation_bytes * tgt_el // src_el
        s.stashed_activation_bytes = s.stashed_activation_bytes * tgt_el // src_el
        s.output_bytes = s.output_bytes * tgt_el // src_el
        delta = delta_weights + s.boundary_activation_bytes + s.stashed_activation_bytes + s.output_bytes - acts
        s.peak_memory_bytes = max(0, s.peak_memory_bytes + delta)


def _source_spec(
    profile: profile_pb2.Profile, source: fleet_pb2.DeviceSpec | str | None, tf32: bool
) -> fleet_pb2.DeviceSpec:
    if isinstance(source, fleet_pb2.DeviceSpec):
        spec = source
    elif isinstance(source, str):
        spec = catalog.to_proto(source, profile.dtype, tf32=tf32)
    elif profile.device.peak_flops > 0 and profile.device.memory_bandwidth_bytes_per_s > 0:
        spec = profile.device
    else:  # agents may report only the kind; fill the peaks from the catalog
        try:
            spec = catalog.to_proto(profile.device.kind, profile.dtype, tf32=tf32)
        except InvalidArgument as err:
            raise InvalidArgument(
                f"device {profile.device.kind!r} has no peaks and is not in the catalog", field="profile.device",
                fix="pass source= a catalog name or a DeviceSpec with peak_flops and memory bandwidth",
            ) from err
    _check_spec(spec, "source")
    return spec


def _check_spec(spec: fleet_pb2.DeviceSpec, name: str) -> None:
    if spec.peak_flops <= 0 or spec.memory_bandwidth_bytes_per_s <= 0:
        raise InvalidArgument(
            "needs peak_flops and memory_bandwidth_bytes_per_s", field=name, fix="use a catalog name or fill both"
        )


_DTYPES = {"fp32": common_pb2.DTYPE_FP32, "fp16": common_pb2.DTYPE_FP16, "bf16": common_pb2.DTYPE_BF16}


def _dtype_enum(dtype: int | str, name: str) -> int:
    value = _DTYPES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if value not in _DTYPES.values():
        raise InvalidArgument(f"unsupported precision {dtype!r}", field=name, fix="one of fp32, fp16, bf16")
    return value


def _element_bytes(dtype: int) -> int:
    return ELEMENT_BYTES[catalog.precision_name(dtype)]


# --- Analytical profiles ---------------------------------------------------------------------------


def analytical_software(efficiency: float = ASSUMED_EFFICIENCY) -> str:
    """What priced an analytical profile (its `software`, part of the profiler's cache key)."""
    return f"analytical roofline (assumed efficiency {efficiency:.2f} of peak FLOP/s and bandwidth)"


def analytical_profile(
    model: model_pb2.ModelSpec | Sequence[LayerCost],
    target: fleet_pb2.DeviceSpec | str,
    dtype: int | str | None = None,
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
    *,
    efficiency: float = ASSUMED_EFFICIENCY,
    tf32: bool = False,
    model_id: str = "",
    model_signature: str = "",
    user_inputs: UserInputs = NO_USER_INPUTS,
) -> profile_pb2.Profile:
    """A profile from FLOP and byte counts alone: time = roofline / efficiency, nothing measured.

    `model` is a ModelSpec (GPT family for now) or LayerCost rows from the zoo. dtype defaults to the
    spec's, else the target's fastest. Memory follows the measured profiles' Adam accounting
    (measure_bytes.adam_bytes_per_param): 16-bit weights and gradients plus 12 B/param of optimizer
    state (fp32 master, two moments) under mixed precision, 4 + 4 + 8 in fp32. peak_memory_bytes is
    weights + gradients + the layer's activations (optimizer state lives outside the layer's pass).
    """
    if not 0 < efficiency <= 1:
        raise InvalidArgument(f"efficiency {efficiency} outside (0, 1]", field="efficiency", fix="e.g. 0.5")
    if not micro_batch_sizes or min(micro_batch_sizes) < 1:
        raise InvalidArgument("needs positive sizes", field="micro_batch_sizes", fix="e.g. (1, 2, 4, 8)")
    costs = model_costs(model, user_inputs=user_inputs) if isinstance(model, model_pb2.ModelSpec) else list(model)
    if dtype is None and isinstance(model, model_pb2.ModelSpec) and model.dtype:
        dtype = model.dtype
    if dtype is None:
        dtype = catalog.device(target).default_dtype if isinstance(target, str) else common_pb2.DTYPE_FP32
    dtype = _dtype_enum(dtype, "dtype")
    spec = catalog.to_proto(target, dtype, tf32=tf32) if isinstance(target, str) else target
    _check_spec(spec, "target")
    el = _element_bytes(dtype)
    mixed = el < 4
    # the workers split no layer with dropout tensor-parallel (the tp ranks would draw different masks)
    splits = not (isinstance(model, model_pb2.ModelSpec) and model.dropout > 0)

    out = profile_pb2.Profile(
        model_id=model_id, model_signature=model_signature, device=spec, dtype=dtype, projected=True,
        source_profile_id="",
        software=analytical_software(efficiency),
        comm=profile_pb2.CommCalibration(overlap_slowdown=OVERLAP_SLOWDOWN),
    )
    for index, cost in enumerate(costs):
        layer = out.layers.add(
            index=index, name=cost.name, kind=cost.kind, parameter_count=cost.parameter_count,
            parameter_bytes=cost.parameter_count * el, gradient_bytes=cost.parameter_count * el,
            optimizer_state_bytes=cost.parameter_count * (12 if mixed else 8),
            extra_inputs=cost.extra_inputs, tied_with=cost.tied_with,
            tensor_parallel=cost.tensor_parallel if splits else 0,
            sequence_parallel=cost.sequence_parallel if splits else 0,
        )
        for mb in sorted(set(micro_batch_sizes)):
            fwd = roofline_s(cost.flops("forward", mb), cost.bytes_moved("forward", mb, el), spec) / efficiency
            bwd = roofline_s(cost.flops("backward", mb), cost.bytes_moved("backward", mb, el), spec) / efficiency
            boundary = cost.boundary_elems_per_sample * mb * el
            stashed = cost.stashed_elems_per_sample * mb * el
            output = cost.output_elems_per_sample * mb * el
            layer.samples.add(
                micro_batch_size=mb, measured=False, forward_s=fwd, backward_s=bwd, recompute_s=fwd,
                boundary_activation_bytes=boundary, stashed_activation_bytes=stashed, output_bytes=output,
                peak_memory_bytes=layer.parameter_bytes + layer.gradient_bytes + boundary + stashed + output,
            )
    return out


# --- Closed-form transformer costs -----------------------------------------------------------------


def block_cost(
    name: str, hidden: int, seq: int, heads: int, ffn: int | None = None, *, flash_attention: bool = True
) -> LayerCost:
    """One pre-LN transformer block (GPT/ViT; BERT's post-LN has the same counts).

    Parameters: qkv 3h^2+3h, proj h^2+h, fc1 hf+f, fc2 fh+h, two LayerNorms 4h.
    Forward FLOPs per sample: 2 * params * tokens (every weight in one multiply-add per token) plus
    attention's QK^T and AV, 2*s*s*h each (full square counted, as Megatron does, causal or not).
    Traffic per token: LN 2h, qkv 4h, attention 4h, proj 2h, residuals 2x3h, LN 2h, fc1 h+f, GELU 2f,
    fc2 f+h = 22h + 4f; materialised scores (no flash attention) add 4*heads*s.
    Stash per token: LN/qkv/proj/LN/fc1 inputs and q, k, v = 8h, GELU and fc2 inputs 2f (Megatron-style
    count without dropout masks); materialised softmax adds heads*s.
    """
    h, s, f = hidden, seq, ffn or 4 * hidden
    if h % heads:
        raise InvalidArgument(f"{heads} heads do not divide hidden {h}", field="heads", fix="a divisor of hidden")
    params = 4 * h * h + 2 * h * f + 9 * h + f
    scores = 0 if flash_attention else heads * s
    return LayerCost(
        name=name, kind="block", parameter_count=params,
        flops_fwd_per_sample=2 * params * s + 4 * s * s * h,
        traffic_elems_fwd_per_sample=(22 * h + 4 * f + 4 * scores) * s,
        boundary_elems_per_sample=h * s, stashed_elems_per_sample=(8 * h + 2 * f + scores) * s,
        output_elems_per_sample=h * s, tensor_parallel=math.gcd(heads, f),  # the zoo's Block, dropout 0
        sequence_parallel=math.gcd(heads, f, s),
    )


def embedding_cost(hidden: int, seq: int, vocab: int, positions: int | None = None) -> LayerCost:
    """Token + learned position embedding: a gather and an add, memory-bound by nature.

    FLOPs are the add (h per token); backward scatters into dense (V+P) x h weight gradients.
    Token ids (int64) are the input and are not counted as activations.
    """
    h, s = hidden, seq
    params = (vocab + (positions or seq)) * h
    return LayerCost(
        name="embed", kind="embed", parameter_count=params,
        flops_fwd_per_sample=h * s, flops_bwd_per_sample=2 * h * s,
        traffic_elems_fwd_per_sample=3 * h * s,  # two rows read, their sum written
        boundary_elems_per_sample=0, stashed_elems_per_sample=0, output_elems_per_sample=h * s,
        weight_elems_fwd=0, weight_elems_bwd=params,
    )


def lm_head_cost(hidden: int, seq: int, vocab: int) -> LayerCost:
    """Final LayerNorm, vocabulary projection and summed cross-entropy.

    A tied projection uses the embedding's weight: counted here too (the stage holding the head holds
    it), declared through tied_with by transformer_layer_costs.
    """
    h, s, v = hidden, seq, vocab
    weights = v * h + 2 * h
    return LayerCost(
        name="head", kind="head", parameter_count=weights,
        flops_fwd_per_sample=2 * weights * s,
        traffic_elems_fwd_per_sample=(3 * h + 2 * v) * s,  # LN 2h, projection h in / V logits out, loss reads V
        boundary_elems_per_sample=h * s, stashed_elems_per_sample=(2 * h + v) * s, output_elems_per_sample=0,
        weight_elems_fwd=weights,
    )


def transformer_layer_costs(
    hidden: int,
    seq: int,
    heads: int,
    vocab: int,
    layers: int,
    ffn: int | None = None,
    *,
    positions: int | None = None,
    tie_embeddings: bool = False,
    flash_attention: bool = True,
) -> list[LayerCost]:
    """GPT-style decomposition matching the zoo's layer names: embed, block.0..n-1, head."""
    rows = [embedding_cost(hidden, seq, vocab, positions)]
    rows += [block_cost(f"block.{i}", hidden, seq, heads, ffn, flash_attention=flash_attention) for i in range(layers)]
    head = lm_head_cost(hidden, seq, vocab)
    if tie_embeddings:
        last = len(rows)
        rows[0] = replace(rows[0], tied_with=(last,))
        head = replace(head, tied_with=(0,))
    return [*rows, head]


def model_costs(spec: model_pb2.ModelSpec, *, user_inputs: UserInputs = NO_USER_INPUTS) -> list[LayerCost]:
    """LayerCost rows for a zoo ModelSpec, one per decomposed layer.

    GPT keeps the closed form above (what the GPT tests and benchmarks were written against); every
    other family (BERT, T5, ViT, Swin, allow-listed custom models) is traced op by op on the meta
    device by meta_costs, imported here only then so this module stays torch-free for GPT.
    """
    if spec.family == model_pb2.MODEL_FAMILY_GPT and spec.WhichOneof("config") == "transformer":
        cfg = spec.transformer
        return transformer_layer_costs(
            cfg.hidden_size, cfg.seq_length, cfg.num_heads, cfg.vocab_size, cfg.num_layers,
            cfg.ffn_hidden_size or None, positions=cfg.max_positions or None, tie_embeddings=cfg.tie_embeddings,
        )
    from services.profiler.meta_costs import layer_costs_from_meta

    return layer_costs_from_meta(spec, user_inputs=user_inputs)
