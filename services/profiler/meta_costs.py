"""Analytical LayerCost rows for any zoo family, traced on the meta device (nothing is allocated).

The closed forms in projection.py cover the GPT block; BERT, T5, ViT, Swin and custom models have
heads, merges, relative position biases and cross-attention that a formula per family would keep
getting wrong. Instead each decomposed layer runs once, alone, on meta tensors (shapes only, no data,
no memory: a 1B-parameter model is fine), and the dispatched aten ops are counted:

* FLOPs: `torch.utils.flop_counter.FlopCounterMode` over the forward, and over an autograd backward
  (w.r.t. the layer's activation inputs and trainable parameters) run on meta too. It counts matmuls,
  convolutions and attention (2 per multiply-add), not element-wise work, so biases, norms and
  activations are free: closed-form `block_cost` counts biases and norm weights as 2 FLOPs per
  token each, which puts it ~1% above these counts for the same block.
* Memory traffic (roofline bytes): every non-view aten op reads its tensor inputs and writes its
  outputs once; gathers (embedding, index) read only the rows they return.
* Stashed activations: storages saved for backward (`saved_tensors_hooks`), each once, excluding
  parameters and the layer's own inputs, as measure.py accounts them; boundary = the inputs read from
  earlier layers (batch fields are data); output = what the layer returns.

Per sample versus per micro-batch: every layer is traced at micro-batch 2 and 4 (not 1: at 1 autograd
skips the batch reductions of broadcast parameters, so 1 -> 2 is not yet linear). The slope is the
per-sample cost; the intercept is work that does not grow with the batch (weights read, weight
gradients written, T5's heads x s x s position-bias tensor). LayerCost scales `*_per_sample` by the
micro-batch size and adds `weight_elems_*` once, so the traffic intercept goes there. LayerCost has no
per-micro-batch stash field, so a constant stash is dropped: T5 blocks save their bias mask
(4.7M elements, 19 MB fp32 per block), which stashed_elems_per_sample leaves out.

Attention: on meta, `scaled_dot_product_attention` falls back to the math path, which materialises
the heads x s x s scores. With `fused_attention` (the default; what SDPA runs on a GPU: flash, or the
memory-efficient kernel, which also serves fp32 on Turing) it is counted as one fused kernel instead:
reads q, k, v and the mask, writes the output and the log-sum-exp, stashes q, k, v, output and
log-sum-exp; backward does the four score matmuls (2x forward, Galvatron-BMW §V; flash's recompute is
not counted). Without it the math path is counted as traced, like pre-SDPA implementations
(Galvatron-BMW's own). Composite ops (RMSNorm on meta) are counted as their decomposition.

Units: elements at fp32 (the trace's precision): bytes / 4, so int64 indices count as 2 elements.
Structurally identical layers (same module classes, attributes, parameter and buffer shapes, same
input shapes) are traced once and the counts reused.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from ballast.v1 import model_pb2
from services.profiler.layer_cost import LayerCost
from services.runtime.errors import InvalidArgument
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import Decomposition, Layer, build_model, example_input

TRACE_ELEMENT_BYTES = 4  # the zoo builds in fp32
# FlopCounterMode tracks modules with torch's global module hooks, which fire on every thread: two traces at once
# (a profiler serving several analytical profiles) saw each other's modules and failed in autograd.grad
# ("A leaf node was passed to _will_engine_execute_node"). One trace at a time per process.
_TRACING = threading.Lock()
TRACE_SIZES = (2, 4)  # micro-batch sizes traced: slope = per sample, intercept = per micro-batch
aten = torch.ops.aten


def layer_costs_from_meta(
    spec: model_pb2.ModelSpec, *, user_inputs: UserInputs = NO_USER_INPUTS, fused_attention: bool = True
) -> list[LayerCost]:
    """One LayerCost per decomposed layer of the spec's zoo model, in layer order (see module doc).

    Raises InvalidArgument for a spec the zoo rejects (custom factories need the allow-list).
    Results are cached per (spec, user models, attention mode): the planner asks for the same model often.
    """
    key = spec.SerializeToString(deterministic=True)
    return list(_cached_costs(key, user_inputs, fused_attention))


@functools.lru_cache(maxsize=32)
def _cached_costs(spec_bytes: bytes, user_inputs: UserInputs, fused_attention: bool) -> tuple[LayerCost, ...]:
    spec = model_pb2.ModelSpec.FromString(spec_bytes)
    model = build_model(spec, device="meta", user_inputs=user_inputs)
    batches = {m: example_input(spec, m, device="meta", user_inputs=user_inputs) for m in TRACE_SIZES}
    decomposition = model.decompose()
    traces = trace_layers(decomposition, batches, fused_attention=fused_attention)
    return tuple(_layer_cost(layer, traces[layer.index]) for layer in decomposition.layers)


# --- One layer at one micro-batch size -------------------------------------------------------------


@dataclass(frozen=True)
class LayerTrace:
    """Counts of one layer at one micro-batch size, in fp32 elements (bytes / 4) and FLOPs."""

    flops_fwd: float
    flops_bwd: float
    traffic_fwd: float
    traffic_bwd: float
    stashed: float
    boundary: float
    output: float
    outputs: Any  # pytree of TensorShape (and plain values) for the layers that read this one


@dataclass(frozen=True)
class TensorShape:
    """A layer output's shape and dtype: enough to hand later layers a fresh meta tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def trace_layers(
    decomposition: Decomposition, batches: Mapping[int, Mapping[str, Tensor]], *, fused_attention: bool = True
) -> dict[int, dict[int, LayerTrace]]:
    """Layer index -> micro-batch size -> trace; identical layers are traced once.

    Layers are fed meta outputs of the layers they read, as the executor chains them.
    """
    envs: dict[int, dict[int, Any]] = {m: {} for m in batches}
    cache: dict[tuple, dict[int, LayerTrace]] = {}
    found: dict[int, dict[int, LayerTrace]] = {}
    for layer in decomposition.layers:
        args = {m: [envs[m][i] for i in layer.inputs] + [b[k] for k in layer.batch_keys] for m, b in batches.items()}
        key = (_module_signature(layer.module), len(layer.inputs), *(_arg_signature(a) for a in args.values()))
        if key not in cache:
            cache[key] = _trace_sizes(layer, args, fused_attention)
        found[layer.index] = cache[key]
        for m in batches:
            envs[m][layer.index] = tree_map(_meta_like, cache[key][m].outputs)
    return found


def _trace_sizes(layer: Layer, args: Mapping[int, list], fused_attention: bool) -> dict[int, LayerTrace]:
    try:
        return {m: trace_layer(layer.module, a, len(layer.inputs), fused_attention) for m, a in args.items()}
    except (RuntimeError, NotImplementedError) as exc:  # data-dependent shapes, ops without a meta kernel
        raise InvalidArgument(
            f"layer {layer.name!r} cannot run on the meta device: {exc}", field="spec",
            fix="measure the model on a device (ProfilerService.Profile) or pass LayerCost rows",
        ) from exc


def trace_layer(module: nn.Module, args: Sequence[object], n_activations: int, fused_attention: bool) -> LayerTrace:
    """Forward and backward of `module(*args)` on meta; the first `n_activations` args come from earlier layers."""
    args = [_leaf(a, i < n_activations) for i, a in enumerate(args)]
    params = list({id(p): p for p in module.parameters()}.values())
    activations = [a for a in args[:n_activations] if isinstance(a, Tensor)]
    meter = TrafficMeter()
    saved = SavedElems(exclude=[*params, *(a for a in args if isinstance(a, Tensor))])
    attention = FusedAttentionMode(meter) if fused_attention else contextlib.nullcontext()
    with _TRACING:
        with FlopCounterMode(display=False) as fwd_flops, meter, attention, saved.hooks():
            out = module(*args)
        traffic_fwd, meter.elems = meter.elems, 0.0
        leaves = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        differentiable = [t for t in leaves if t.requires_grad]
        wrt = [a for a in activations if a.requires_grad] + [p for p in params if p.requires_grad]
        cotangents = [torch.ones_like(t) for t in differentiable]
        with FlopCounterMode(display=False) as bwd_flops, meter:
            if differentiable and wrt:
                torch.autograd.grad(differentiable, wrt, cotangents, allow_unused=True)
    return LayerTrace(
        flops_fwd=fwd_flops.get_total_flops(), flops_bwd=bwd_flops.get_total_flops(),
        traffic_fwd=traffic_fwd, traffic_bwd=meter.elems, stashed=saved.total,
        boundary=_elems(activations), output=_elems(leaves),
        outputs=tree_map(lambda t: TensorShape(tuple(t.shape), t.dtype) if isinstance(t, Tensor) else t, out),
    )


def _leaf(a: object, activation: bool) -> object:
    """A fresh meta leaf; activations from earlier layers require grad (batch fields are data)."""
    if not isinstance(a, Tensor):
        return a
    a = a.detach()
    return a.requires_grad_(activation and a.is_floating_point())


def _meta_like(spec: object) -> object:
    return torch.empty(spec.shape, dtype=spec.dtype, device="meta") if isinstance(spec, TensorShape) else spec


# --- Per sample from two micro-batch sizes ---------------------------------------------------------


def _layer_cost(layer: Layer, traces: Mapping[int, LayerTrace]) -> LayerCost:
    """Slope (per sample) and intercept (per micro-batch, in weight_elems_*) of the traced counts."""
    small, large = TRACE_SIZES
    lo, hi = traces[small], traces[large]

    def slope(field: str) -> float:
        return max(0.0, (getattr(hi, field) - getattr(lo, field)) / (large - small))

    def intercept(field: str) -> int:
        return max(0, round(getattr(lo, field) - small * slope(field)))

    params = {id(p): p for p in layer.module.parameters()}.values()
    return LayerCost(
        name=layer.name, kind=layer.kind, parameter_count=sum(p.numel() for p in params),
        flops_fwd_per_sample=slope("flops_fwd"), flops_bwd_per_sample=slope("flops_bwd"),
        traffic_elems_fwd_per_sample=slope("traffic_fwd"), traffic_elems_bwd_per_sample=slope("traffic_bwd"),
        weight_elems_fwd=intercept("traffic_fwd"), weight_elems_bwd=intercept("traffic_bwd"),
        boundary_elems_per_sample=round(slope("boundary")), stashed_elems_per_sample=round(slope("stashed")),
        output_elems_per_sample=round(slope("output")),
        extra_inputs=tuple(layer.extra_inputs), tied_with=tuple(layer.tied_with),
        tensor_parallel=layer.tensor_parallel,
        sequence_parallel=layer.sequence_parallel,
    )


# --- Counting --------------------------------------------------------------------------------------


def _elems(tensors: Iterable[object]) -> float:
    """fp32-equivalent elements (bytes / 4) of the tensors among `tensors`."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor)) / TRACE_ELEMENT_BYTES


def _tensors(tree: object) -> list[Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


# Ops that move no data: aliases, metadata, allocation without initialisation.
_FREE = {
    aten._unsafe_view, aten.detach, aten.alias, aten.lift_fresh, aten.empty, aten.empty_like,
    aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten._local_scalar_dense,
}


def _gathered(ins: list[Tensor], outs: list[Tensor]) -> float:
    """A gather reads its indices and one row per output row, not the whole table (its first input)."""
    return _elems(ins[1:]) + _elems(outs)


def _nll_read(ins: list[Tensor], outs: list[Tensor]) -> float:
    """NLL loss reads the targets and one log-probability per target."""
    return 2 * _elems(ins[1:2])


_READS: dict[object, Callable[[list[Tensor], list[Tensor]], float]] = {
    aten.embedding: _gathered, aten.index: _gathered, aten.index_select: _gathered, aten.gather: _gathered,
    aten.nll_loss_forward: _nll_read, aten.nll_loss2d_forward: _nll_read,
}


class TrafficMeter(TorchDispatchMode):
    """Elements read + written by every dispatched aten op: each kernel is one pass over its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.elems = 0.0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if not self.paused and not func.is_view and func.overloadpacket not in _FREE:
            ins, outs = _tensors((args, kwargs)), _tensors(out)
            reads = _READS.get(func.overloadpacket)
            self.elems += (reads(ins, outs) if reads else _elems(ins)) + _elems(outs)
        return out

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Ops inside are not counted (a fused kernel's traffic is added by `add` instead)."""
        before, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = before

    def add(self, *tensors: Tensor | None) -> None:
        self.elems += _elems(tensors)


def _storage_key(t: Tensor) -> int:
    """Identity of a tensor's storage; on meta data_ptr() is 0 for all, the StorageImpl is not."""
    return t.untyped_storage()._cdata


class SavedElems:
    """Storages autograd saves for backward, each once, minus `exclude` (parameters, the layer's inputs)."""

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self.excluded = {_storage_key(t) for t in exclude}
        self.sizes: dict[int, int] = {}

    def _pack(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in self.excluded:
            self.sizes.setdefault(key, t.untyped_storage().nbytes())
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> float:
        return sum(self.sizes.values()) / TRACE_ELEMENT_BYTES


# --- Attention as one fused kernel -----------------------------------------------------------------


def _sdpa_options(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor | None], dict[str, Any]]:
    """F.scaled_dot_product_attention's arguments, normalised to (tensors, options)."""
    return (query, key, value, attn_mask), {
        "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa,
    }


class FusedAttentionMode(TorchFunctionMode):
    """Routes scaled_dot_product_attention through FusedAttention so it is counted as a fused kernel."""

    def __init__(self, meter: TrafficMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        tensors, options = _sdpa_options(*args, **(kwargs or {}))
        if options["enable_gqa"]:  # grouped K/V heads: counted as the traced math path
            return func(*args, **(kwargs or {}))
        return FusedAttention.apply(self.meter, options, *tensors)


class FusedAttention(torch.autograd.Function):
    """Flash / memory-efficient attention's accounting on meta tensors.

    Forward runs the math path for its shapes and FLOPs (the byte meter paused), then adds what the
    fused kernel moves and saves: q, k, v, output and the per-row log-sum-exp. Backward runs the four
    score matmuls for their FLOPs and adds the fused backward's reads and gradient writes.
    """

    @staticmethod
    def forward(ctx, meter, options, q, k, v, mask):  # noqa: ANN001, ANN205 - autograd.Function protocol
        with meter.pause():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options)
            lse = q.new_empty(out.shape[:-1])
        meter.add(q, k, v, mask, out, lse)
        ctx.meter, ctx.options = meter, options
        ctx.save_for_backward(q, k, v, out, lse, mask)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205 - autograd.Function protocol
        q, k, v, out, lse, mask = ctx.saved_tensors
        meter: TrafficMeter = ctx.meter
        with meter.pause():
            dq, dk, dv = _attention_grads(q, k, v, grad_out)
            dmask = torch.empty_like(mask) if mask is not None and ctx.needs_input_grad[5] else None
        meter.add(q, k, v, out, lse, mask, grad_out, dq, dk, dv, dmask)
        needs = ctx.needs_input_grad
        return None, None, dq if needs[2] else None, dk if needs[3] else None, dv if needs[4] else None, dmask


def _attention_grads(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV through the four score-sized matmuls (shapes and FLOPs only: meta tensors)."""
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    probs = q.new_empty((*batch, q.shape[-2], k.shape[-2]))  # softmax output, recomputed by a fused kernel
    dv = probs.transpose(-2, -1) @ grad_out
    dscores = grad_out @ v.transpose(-2, -1)
    dq = (dscores @ k).sum_to_size(q.shape)
    dk = (dscores.transpose(-2, -1) @ q).sum_to_size(k.shape)
    return dq, dk, dv.sum_to_size(v.shape)


# --- Structural identity ---------------------------------------------------------------------------


def _value_signature(v: object) -> object:
    """Plain values by value, tensors by shape, anything else by identity (never wrongly merged)."""
    if v is None or isinstance(v, int | float | str | bool | torch.dtype):
        return v
    if isinstance(v, tuple | list):
        return tuple(_value_signature(x) for x in v)
    if isinstance(v, Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    return ("object", id(v))


def _module_signature(module: nn.Module) -> tuple:
    """What decides a module's counts short of its weights' values: classes, attributes, shapes."""
    rows = []
    for name, m in module.named_modules():
        attrs = tuple(sorted((k, _value_signature(v)) for k, v in vars(m).items() if not k.startswith("_")))
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, _value_signature(b)) for n, b in m._buffers.items())
        rows.append((name, type(m).__module__, type(m).__qualname__, attrs, params, buffers))
    return tuple(rows)


def _arg_signature(args: Sequence[object]) -> tuple:
    return tuple(_value_signature(a) for a in args)


def total_flops(costs: Sequence[LayerCost]) -> float:
    """Forward + backward FLOPs of one sample through every layer (a quick model-size check)."""
    return sum(c.flops("forward", 1) + c.flops("backward", 1) for c in costs)


__all__ = ["LayerTrace", "TensorShape", "layer_costs_from_meta", "total_flops", "trace_layer", "trace_layers"]
