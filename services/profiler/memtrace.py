"""Non-model memory of one warm-up training iteration, sampled at operator boundaries.

PatrickStar §8.1: non-model data (activations, their gradients, temporaries) cannot be estimated
from tensor shapes alone, so it is measured in a warm-up iteration, and since "the computing pattern
is the same for different iterations" that trace holds for the others. At each moment (here: the end
of every aten operator) non-model bytes = R - C, where R is memory in use and C is model data
(parameters, gradients, optimizer state).

* CUDA: R is `torch.cuda.max_memory_allocated()` since the previous moment (the peak stats are reset
  at each moment, so workspace freed inside an operator still shows), C the distinct storages of
  parameters, `.grad`s and optimizer state.
* CPU (no allocator statistics): tensor accounting. A TorchDispatchMode records every storage an
  operator creates (an output whose storage is none of its inputs'; views and in-place results are
  not new) and weakly watches it; R - C is then the live bytes of those storages that are not
  currently a gradient or optimizer state, plus the batch's bytes. Buffers internal to a kernel and
  allocator slack are invisible here.

The timeline is bounded by `max_points`: when it would grow past that, neighbouring points are merged
pairwise keeping the larger one (max-pooling), and later operators are pooled in groups of the new
stride. The peak is tracked over every operator, so downsampling never lowers it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from services.profiler.measure_bytes import parameters_of, storage_key, tensor_bytes
from services.zoo.graph import Decomposition

MAX_POINTS = 4096


class LiveTensorTracker(TorchDispatchMode):
    """Live bytes of the storages created by operators while the mode is active.

    After every operator it either updates `peak_bytes` (the maximum of `live_bytes()` over operator
    ends) or, if given, calls `on_op(op_name)` instead, e.g. to sample a timeline.
    """

    def __init__(self, on_op: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak_bytes = 0
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type == "meta":
                continue
            key = storage_key(t)
            if not key or key in inputs:
                continue
            known = self.live.get(key)
            if known is None or known[0].expired():
                storage = t.untyped_storage()
                self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        if self.on_op is not None:
            self.on_op(str(func.overloadpacket.__name__))
        else:
            self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out

    def live_bytes(self, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """Bytes still alive (dead storages are forgotten), except storages keyed in `exclude`."""
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(size for key, (_, size) in self.live.items() if key not in exclude)


@dataclass(frozen=True)
class TracePoint:
    op_index: int  # operator count since the iteration started (the last op of a pooled group)
    op: str  # aten operator, e.g. "mm"
    layer: str  # layer being run ("block.3"), or "optimizer"
    phase: str  # "forward", "backward" or "step"
    non_model_bytes: int


@dataclass
class MemoryTrace:
    """Timeline of non-model bytes, its peak, and the model data held at the end of the step."""

    timeline: list[TracePoint] = field(default_factory=list)
    peak_non_model_bytes: int = 0
    peak: TracePoint | None = None
    ops: int = 0  # operators observed
    stride: int = 1  # operators per timeline point after downsampling
    model_bytes: int = 0  # parameters + gradients + optimizer state after the step
    device: str = "cpu"


class _Recorder:
    """Turns operator moments into a bounded, max-pooled timeline."""

    def __init__(self, max_points: int) -> None:
        self.max_points = max(2, max_points)
        self.trace = MemoryTrace()
        self.pending: TracePoint | None = None
        self.in_group = 0

    def add(self, point: TracePoint) -> None:
        trace = self.trace
        trace.ops += 1
        if trace.peak is None or point.non_model_bytes > trace.peak.non_model_bytes:
            trace.peak, trace.peak_non_model_bytes = point, point.non_model_bytes
        if self.pending is None or point.non_model_bytes >= self.pending.non_model_bytes:
            self.pending = point
        self.in_group += 1
        if self.in_group >= trace.stride:
            self.flush()

    def flush(self) -> None:
        trace = self.trace
        if self.pending is not None:
            trace.timeline.append(self.pending)
        self.pending, self.in_group = None, 0
        if len(trace.timeline) > self.max_points:
            pairs = zip(trace.timeline[::2], trace.timeline[1::2], strict=False)
            merged = [a if a.non_model_bytes > b.non_model_bytes else b for a, b in pairs]
            if len(trace.timeline) % 2:
                merged.append(trace.timeline[-1])
            trace.timeline, trace.stride = merged, trace.stride * 2


def _model_storages(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Storage key -> bytes of the model data alive now: parameters, gradients, optimizer state."""
    found: dict[int, int] = {}
    tensors: list[Tensor] = list(params) + [p.grad for p in params if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]
    for t in tensors:
        key = storage_key(t)
        if key:
            found[key] = t.untyped_storage().nbytes()
    return found


def trace_iteration(
    decomposition: Decomposition,
    batch: Mapping[str, Tensor],
    *,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    max_points: int = MAX_POINTS,
) -> MemoryTrace:
    """Run forward + backward + optimizer step once, layer by layer, and trace non-model memory.

    The default optimizer is Adam with lr=0: its state and temporaries are real, but the weights are
    left as they were. Gradients are reset to None afterwards, so the model is unchanged.
    The device is that of the model's parameters; the batch is moved there.
    """
    params = [p for layer in decomposition.layers for p in parameters_of(layer.module)]
    params = list({id(p): p for p in params}.values())
    device = params[0].device if params else torch.device("cpu")
    trainable = [p for p in params if p.requires_grad]
    if any(p.grad is not None for p in trainable):
        raise ValueError("trace_iteration needs a model without gradients (call zero_grad(set_to_none=True))")
    opt = optimizer(trainable) if optimizer is not None else torch.optim.Adam(trainable, lr=0.0)
    batch = {k: v.to(device) for k, v in batch.items()}
    cuda = device.type == "cuda"
    recorder = _Recorder(max_points)
    where = {"layer": decomposition.layers[0].name, "phase": "forward"}
    batch_bytes = tensor_bytes(batch.values())
    tracker: LiveTensorTracker | None = None

    def moment(op: str) -> None:
        model = _model_storages(params, opt)
        if cuda:
            used = torch.cuda.max_memory_allocated(device) - sum(model.values())
            torch.cuda.reset_peak_memory_stats(device)
        else:
            assert tracker is not None
            used = tracker.live_bytes(exclude=model.keys()) + batch_bytes
        point = TracePoint(recorder.trace.ops, op, where["layer"], where["phase"], max(0, used))
        recorder.add(point)

    handles = []
    for layer in decomposition.layers:

        def enter(_m: nn.Module, _args: object, name: str = layer.name) -> None:
            where["layer"] = name

        def leave(_m: nn.Module, _args: object, out: object, name: str = layer.name) -> None:
            if isinstance(out, Tensor) and out.requires_grad:  # its gradient arriving = this layer's backward
                out.register_hook(lambda _grad: where.__setitem__("layer", name))

        handles.append(layer.module.register_forward_pre_hook(enter))
        handles.append(layer.module.register_forward_hook(leave))
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        mode: TorchDispatchMode = _CudaMoments(moment)
    else:
        tracker = mode = LiveTensorTracker(on_op=moment)
    try:
        with mode:
            env: dict[int, Tensor] = {}
            for layer in decomposition.layers:
                args = [env[i] for i in layer.inputs] + [batch[k] for k in layer.batch_keys]
                env[layer.index] = layer.module(*args)
            loss = env[len(decomposition.layers) - 1]
            del env
            where.update(phase="backward", layer=decomposition.layers[-1].name)
            loss.backward()
            del loss
            where.update(phase="step", layer="optimizer")
            opt.step()
        recorder.flush()
        recorder.trace.model_bytes = sum(_model_storages(params, opt).values())
    finally:
        for h in handles:
            h.remove()
        for p in trainable:
            p.grad = None
    recorder.trace.device = str(device)
    return recorder.trace


class _CudaMoments(TorchDispatchMode):
    """Calls `moment(op)` after every operator (CUDA: memory comes from the allocator's stats)."""

    def __init__(self, moment: Callable[[str], None]) -> None:
        super().__init__()
        self.moment = moment

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.moment(str(func.overloadpacket.__name__))
        return out
