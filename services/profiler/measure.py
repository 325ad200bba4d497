"""Per-layer measurement (Harmony §4.2): run one layer alone and record its time and memory.

Layer `i` is called as the executor calls it, `module(*(outputs of layer.inputs), *(batch fields))`,
on inputs produced by running layers < i once on a synthetic batch, so it sees realistic values.

What one `LayerMeasurement` means (times are medians of at least `repeats` samples, more for fast
layers (see `_time_layer`), after `warmup` discarded
runs and a median +- 3 scaled-MAD outlier cut, see `measure_timing.robust_median`):

* forward_s: the layer's forward with autograd recording (the training forward).
* backward_s: `torch.autograd.grad` of the output against a fixed random cotangent (seeded; 1 for a
  scalar loss) w.r.t. the layer's floating-point inputs from earlier layers and its parameters.
* recompute_s: under activation checkpointing the forward first runs under no_grad and is run again,
  with grad, just before backward; recompute_s is that second forward, the extra time backward pays.
  The no_grad forward's own time is kept as `no_grad_forward_s`.
* parameter/gradient/optimizer_state_bytes: Adam model data at the training precision
  (`measure_bytes.adam_bytes_per_param`: 16 B/param for fp32 and for fp16/bf16 mixed precision). Every
  parameter the layer uses counts once in that layer, tied ones included (a stage holding the layer
  holds the weight); `shared_parameter_count` and `tied_with` say which are shared, so a caller
  placing tied layers together can count them once.
* boundary_activation_bytes: the inputs read from earlier layers (numel * element size); what
  checkpointing keeps. Batch fields (token ids, labels) are data, reported as `batch_input_bytes`.
* stashed_activation_bytes: storages autograd saved for backward during the forward, each counted
  once, excluding parameters and the layer's own inputs (saved_tensors_hooks).
* output_bytes: the layer's output (numel * element size).
* peak_memory_bytes: resident bytes (parameters at training precision, inputs, output cotangent)
  plus the peak of what forward + backward allocate on top (activations, output, gradients,
  temporaries). CUDA: `max_memory_allocated` minus `memory_allocated` before the pass. CPU: the
  maximum, over operator ends, of live storages created by the pass (`memtrace.LiveTensorTracker`).

Under fp16/bf16 the layer runs on half-precision copies of its weights (swapped into `.data` for the
measurement and restored after), as ZeRO/PatrickStar compute on "param fp16".
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from ballast.v1 import model_pb2, profile_pb2
from services.profiler.measure_bytes import (
    SavedTensorBytes,
    adam_bytes_per_param,
    as_dtype,
    parameters_of,
    proto_dtype,
    tensor_bytes,
)
from services.profiler.measure_timing import MAD_K, Summary, Timer, robust_median
from services.profiler.memtrace import LiveTensorTracker, trace_iteration
from services.profiler.versions import software
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import Decomposition, build_model, example_input

# Timed forward+backward a measurement accumulates before it stops repeating, and the repeat cap.
MIN_TIMED_S = 0.1
MAX_REPEATS = 64


@dataclass(frozen=True)
class LayerMeasurement:
    """One layer at one micro-batch size; field meanings are in the module docstring."""

    index: int
    name: str
    kind: str
    micro_batch_size: int
    forward: Summary
    backward: Summary
    recompute: Summary
    no_grad_forward: Summary
    parameter_count: int
    trainable_parameter_count: int
    shared_parameter_count: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    boundary_activation_bytes: int
    batch_input_bytes: int
    stashed_activation_bytes: int
    output_bytes: int
    peak_memory_bytes: int
    extra_inputs: tuple[int, ...]
    tied_with: tuple[int, ...]
    repeats: int
    warmup: int
    device: str
    dtype: str
    tensor_parallel: int = 0  # TP degrees dividing it are runnable (zoo.graph.Layer.tensor_parallel)
    sequence_parallel: int = 0  # ... and with the sequence split too (zoo.graph.Layer.sequence_parallel)

    @property
    def forward_s(self) -> float:
        return self.forward.median

    @property
    def backward_s(self) -> float:
        return self.backward.median

    @property
    def recompute_s(self) -> float:
        return self.recompute.median

    @property
    def no_grad_forward_s(self) -> float:
        return self.no_grad_forward.median

    def sample(self) -> profile_pb2.LayerSample:
        return profile_pb2.LayerSample(
            micro_batch_size=self.micro_batch_size,
            measured=True,
            forward_s=self.forward_s,
            backward_s=self.backward_s,
            recompute_s=self.recompute_s,
            boundary_activation_bytes=self.boundary_activation_bytes,
            stashed_activation_bytes=self.stashed_activation_bytes,
            output_bytes=self.output_bytes,
            peak_memory_bytes=self.peak_memory_bytes,
            forward_spread=self.forward.spread,
            backward_spread=self.backward.spread,
        )


def iter_layer_args(decomposition: Decomposition, batch: Mapping[str, Tensor]) -> Iterator[tuple[int, tuple]]:
    """Yield `(i, args of layer i)` for every layer, running each once under no_grad after it is yielded.

    Outputs are dropped as soon as no later layer reads them, so memory stays at the live frontier.
    """
    last_read: dict[int, int] = {}
    for layer in decomposition.layers:
        for j in layer.inputs:
            last_read[j] = layer.index
    env: dict[int, Tensor] = {}
    for layer in decomposition.layers:
        args = tuple(env[i] for i in layer.inputs) + tuple(batch[k] for k in layer.batch_keys)
        yield layer.index, args
        if layer.index in last_read:
            with torch.no_grad():
                env[layer.index] = layer.module(*args)
        for j in layer.inputs:
            if last_read[j] == layer.index:
                del env[j]


def layer_args(decomposition: Decomposition, batch: Mapping[str, Tensor], index: int) -> tuple:
    """Arguments of layer `index`, from running layers < index once."""
    for i, args in iter_layer_args(decomposition, batch):
        if i == index:
            return args
    raise IndexError(f"no layer {index} in a {len(decomposition)}-layer decomposition")


@contextlib.contextmanager
def _precision(params: Sequence[nn.Parameter], dtype: torch.dtype) -> Iterator[None]:
    """Run on `dtype` copies of the weights; the originals are put back even on error."""
    saved = [p.data for p in params]
    try:
        for p in params:
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        yield
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data


def _prepare(args: Sequence[object], n_activations: int, device: torch.device, dtype: torch.dtype) -> list:
    """Copy args to the device; float tensors at `dtype`; activations (not batch fields) require grad."""
    out: list = []
    for pos, a in enumerate(args):
        if isinstance(a, Tensor):
            a = a.detach().to(device)
            if a.is_floating_point():
                a = a.to(dtype).requires_grad_(pos < n_activations)
        out.append(a)
    return out


def measure_layer(
    decomposition: Decomposition,
    layer_index: int,
    batch_inputs_for_layer: Sequence[object] | Mapping[str, Tensor],
    *,
    repeats: int = 5,
    warmup: int = 2,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | int | None = None,
    mad_k: float = MAD_K,
    micro_batch_size: int | None = None,
    seed: int = 0,
) -> LayerMeasurement:
    """Time and size one layer (see the module docstring for what each number means).

    `batch_inputs_for_layer` is the layer's call arguments (as `iter_layer_args` yields them), or the
    whole batch, in which case layers < `layer_index` run once to produce them. The layer's modules
    must already be on `device` (default: where its parameters are). `micro_batch_size` defaults to
    the leading dimension of the first argument.
    """
    if repeats < 5 or warmup < 2:
        raise ValueError(f"need repeats >= 5 and warmup >= 2, got {repeats} and {warmup}")
    layer = decomposition.layers[layer_index]
    if isinstance(batch_inputs_for_layer, Mapping):
        batch_inputs_for_layer = layer_args(decomposition, batch_inputs_for_layer, layer_index)
    params = parameters_of(layer.module)
    dev = torch.device(device) if device is not None else (params[0].device if params else torch.device("cpu"))
    dt = as_dtype(dtype)
    args = _prepare(batch_inputs_for_layer, len(layer.inputs), dev, dt)
    activations, batch_fields = args[: len(layer.inputs)], args[len(layer.inputs) :]
    if micro_batch_size is None:
        micro_batch_size = next((a.shape[0] for a in args if isinstance(a, Tensor) and a.dim()), 1)

    trainable = [p for p in params if p.requires_grad]
    shared_ids = {id(p) for j in layer.tied_with for p in parameters_of(decomposition.layers[j].module)}
    per = adam_bytes_per_param(dt)
    count = sum(p.numel() for p in params)
    trainable_count = sum(p.numel() for p in trainable)

    wrt = [a for a in activations if isinstance(a, Tensor) and a.requires_grad] + trainable
    with _precision(params, dt), _gc_paused():
        cotangents = _cotangents(layer.module, args, seed)
        timed = _time_layer(layer.module, args, wrt, cotangents, Timer(dev), repeats, warmup)
        stashed, output_bytes, transient = _memory_pass(layer.module, args, params, wrt, cotangents, dev)
    cotangent_bytes = tensor_bytes(cotangents)
    boundary = tensor_bytes(a for a in activations if isinstance(a, Tensor))
    batch_bytes = tensor_bytes(a for a in batch_fields if isinstance(a, Tensor))
    return LayerMeasurement(
        index=layer.index,
        name=layer.name,
        kind=layer.kind,
        micro_batch_size=int(micro_batch_size),
        forward=robust_median(timed["forward"], mad_k),
        backward=robust_median(timed["backward"], mad_k),
        recompute=robust_median(timed["recompute"], mad_k),
        no_grad_forward=robust_median(timed["no_grad_forward"], mad_k),
        parameter_count=count,
        trainable_parameter_count=trainable_count,
        shared_parameter_count=sum(p.numel() for p in params if id(p) in shared_ids),
        parameter_bytes=count * per.param,
        gradient_bytes=trainable_count * per.grad,
        optimizer_state_bytes=trainable_count * per.optimizer,
        boundary_activation_bytes=boundary,
        batch_input_bytes=batch_bytes,
        stashed_activation_bytes=stashed,
        output_bytes=output_bytes,
        peak_memory_bytes=count * per.param + boundary + batch_bytes + cotangent_bytes + transient,
        extra_inputs=tuple(layer.extra_inputs),
        tied_with=tuple(layer.tied_with),
        repeats=len(timed["forward"]),
        warmup=warmup,
        device=str(dev),
        dtype=str(dt).removeprefix("torch."),
        tensor_parallel=layer.tensor_parallel,
        sequence_parallel=layer.sequence_parallel,
    )


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """A collection in the middle of a timed call is an outlier we need not create.

    (No gc.collect() first: with torch imported a full collection costs ~0.2 s, more than a layer.)
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _cotangents(module: nn.Module, args: list, seed: int) -> list[Tensor]:
    """A fixed seeded cotangent per tensor the layer returns (1 for a scalar loss)."""
    with torch.no_grad():
        leaves = [t for t in tree_leaves(module(*args)) if isinstance(t, Tensor)]
    g = torch.Generator().manual_seed(seed)
    return [
        torch.ones_like(o) if o.dim() == 0 else torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)
        for o in leaves
    ]


def _backward(out: object, wrt: list[Tensor], cotangents: list[Tensor]) -> None:
    """Gradients of the differentiable outputs against their cotangents, w.r.t. `wrt` (then dropped)."""
    pairs = [
        (o, c)
        for o, c in zip([t for t in tree_leaves(out) if isinstance(t, Tensor)], cotangents, strict=False)
        if o.requires_grad
    ]
    if pairs and wrt:
        outs, cots = zip(*pairs, strict=True)
        torch.autograd.grad(outs, wrt, cots, allow_unused=True)


def _time_layer(
    module: nn.Module, args: list, wrt: list[Tensor], cotangents: list[Tensor], timer: Timer, repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Per repeat: forward, backward, then a no_grad forward followed by the recompute forward.

    Sub-millisecond layers are dominated by clock and scheduler noise at 5 repeats, so repeats go on
    (up to MAX_REPEATS) until the timed forward+backward add up to MIN_TIMED_S, as timeit's autorange
    does; layers slower than MIN_TIMED_S / repeats cost nothing extra.
    """
    samples: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "no_grad_forward", "recompute")}
    timer.sync()
    r = 0
    while r < warmup + repeats or (
        r < warmup + MAX_REPEATS and sum(samples["forward"]) + sum(samples["backward"]) < MIN_TIMED_S
    ):
        out, t_fwd = timer(lambda: module(*args))
        _, t_bwd = timer(functools.partial(_backward, out, wrt, cotangents))
        del out
        with torch.no_grad():
            _, t_ng = timer(lambda: module(*args))
        again, t_re = timer(lambda: module(*args))
        del again
        if r >= warmup:
            for key, value in zip(samples, (t_fwd, t_bwd, t_ng, t_re), strict=True):
                samples[key].append(value)
        r += 1
    return samples


def _memory_pass(
    module: nn.Module,
    args: list,
    params: list[nn.Parameter],
    wrt: list[Tensor],
    cotangents: list[Tensor],
    device: torch.device,
) -> tuple[int, int, int]:
    """One untimed forward + backward: (stashed, output, peak allocated on top of what was resident)."""
    saved = SavedTensorBytes(exclude=[*params, *(a for a in args if isinstance(a, Tensor))])
    cuda = device.type == "cuda"
    tracker = contextlib.nullcontext() if cuda else LiveTensorTracker()
    base = 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with tracker:
        with saved.hooks():
            out = module(*args)
        output_bytes = tensor_bytes(t for t in tree_leaves(out) if isinstance(t, Tensor))
        _backward(out, wrt, cotangents)
        del out
    if cuda:
        torch.cuda.synchronize(device)
        transient = torch.cuda.max_memory_allocated(device) - base
    else:
        assert isinstance(tracker, LiveTensorTracker)
        transient = tracker.peak_bytes
    return saved.total, output_bytes, max(0, transient)


def layer_profile(measurements: Iterable[LayerMeasurement]) -> profile_pb2.LayerProfile:
    """Fold one layer's measurements (any micro-batch order) into its LayerProfile proto."""
    rows = sorted(measurements, key=lambda m: m.micro_batch_size)
    if not rows:
        raise ValueError("no measurements")
    m = rows[0]
    return profile_pb2.LayerProfile(
        index=m.index,
        name=m.name,
        kind=m.kind,
        parameter_count=m.parameter_count,
        parameter_bytes=m.parameter_bytes,
        gradient_bytes=m.gradient_bytes,
        optimizer_state_bytes=m.optimizer_state_bytes,
        extra_inputs=list(m.extra_inputs),
        tied_with=list(m.tied_with),
        tensor_parallel=m.tensor_parallel,
        sequence_parallel=m.sequence_parallel,
        samples=[r.sample() for r in rows],
    )


def measure_model(
    decomposition: Decomposition,
    batches: Mapping[int, Mapping[str, Tensor]],
    **options: object,
) -> dict[int, list[LayerMeasurement]]:
    """Measure every layer on each batch (keyed by micro-batch size): layer index -> measurements."""
    found: dict[int, list[LayerMeasurement]] = {layer.index: [] for layer in decomposition.layers}
    for size, batch in sorted(batches.items()):
        for i, args in iter_layer_args(decomposition, batch):
            found[i].append(measure_layer(decomposition, i, args, micro_batch_size=size, **options))  # type: ignore[arg-type]
    return found


def profile_layers(
    spec: model_pb2.ModelSpec,
    micro_batch_sizes: Iterable[int],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    intra_op_threads: int = 1,
    mad_k: float = MAD_K,
    seed: int = 0,
    user_inputs: UserInputs = NO_USER_INPUTS,
) -> list[profile_pb2.LayerProfile]:
    """Build the spec's model once and profile every layer at each micro-batch size.

    Sets `torch.set_num_threads(intra_op_threads)` first and leaves it set (a profiler worker runs
    one profile per process); `Profile.intra_op_threads` must record the same value. `dtype`
    defaults to the spec's training precision.
    """
    torch.set_num_threads(intra_op_threads)
    model = build_model(spec, device=device, user_inputs=user_inputs, seed=seed)
    decomposition = model.decompose()
    sizes = sorted(set(micro_batch_sizes))
    batches = {m: example_input(spec, m, device=device, user_inputs=user_inputs) for m in sizes}
    found = measure_model(
        decomposition,
        batches,
        repeats=repeats,
        warmup=warmup,
        device=device,
        dtype=dtype if dtype is not None else spec.dtype,
        mad_k=mad_k,
        seed=seed,
    )
    return [layer_profile(found[i]) for i in sorted(found)]


def profile_model(
    spec: model_pb2.ModelSpec,
    micro_batch_sizes: Iterable[int],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | int | None = None,
    intra_op_threads: int = 1,
    trace_memory: bool = True,
    user_inputs: UserInputs = NO_USER_INPUTS,
    **options: object,
) -> profile_pb2.Profile:
    """`profile_layers` wrapped in a Profile that records precision, software and intra-op threads.

    With `trace_memory`, `non_model_memory_bytes` is the peak of a warm-up iteration
    (`memtrace.trace_iteration`) at the largest micro-batch size, run in fp32 on a fresh build.
    Id, tenant, model, signature and device are the caller's to fill.
    """
    sizes = sorted(set(micro_batch_sizes))
    dt = as_dtype(dtype if dtype is not None else spec.dtype)
    layers = profile_layers(
        spec, sizes, device=device, dtype=dt, intra_op_threads=intra_op_threads, user_inputs=user_inputs, **options
    )
    profile = profile_pb2.Profile(
        dtype=proto_dtype(dt), software=software(spec, user_inputs), intra_op_threads=intra_op_threads, layers=layers
    )
    if trace_memory and sizes:
        model = build_model(spec, device=device, user_inputs=user_inputs, seed=0)
        batch = example_input(spec, sizes[-1], device=device, user_inputs=user_inputs)
        profile.non_model_memory_bytes = trace_iteration(model.decompose(), batch).peak_non_model_bytes
    return profile
