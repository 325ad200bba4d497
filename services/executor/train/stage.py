"""Stage builder: this stage's layers of the zoo model, run one micro-batch at a time through an explicit env.

The whole model is built with the job's seed (so initial weights equal a single-process run bit for bit),
decomposed, and every layer outside [begin, end) is dropped so its memory can go. Tensors crossing the
stage boundaries follow `Decomposition.crossing`: the stage receives every earlier output a layer at or
after `begin` reads (including relayed skip edges, e.g. T5's encoder output) and sends every output a
layer after `end` reads. Their shapes and dtypes come from a meta-device dry run at the micro-batch size,
so peers exchange bare tensors and never metadata. The dry run happens once per (model, micro-batch size)
(`model_info`, cached with the meta-device model and its decomposition), so a plan change at run time
(`restage`, used by migration.py) recomputes boundaries, aliases and tied sets without touching the device.

Per-layer policies: `checkpoint_layers` keep no activations and are recomputed before their backward, early
enough for the schedule to do it while the gradient is in flight (recompute.py); `swap_layers`
move their saved activations to host memory between forward and backward (swap.py); a layer in both is
recomputed only (checkpoint wins). `layer_toggles` make a layer the identity on its first input from a given
iteration on (dynamic workloads, vPipe §4.4's NAS switch): `set_iteration` decides which held layers compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ballast.v1 import model_pb2
from services.executor.train.recompute import Segment
from services.executor.train.swap import SwapPool
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import IGNORE_INDEX, ZooModel, build_model, example_input
from services.zoo.graph import Decomposition, Layer


@dataclass(frozen=True)
class Boundary:
    """One tensor crossing a stage boundary: the output of layer `index`."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def has_grad(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Tied:
    """A Parameter shared by layers on several stages (Varuna §5.1): its gradient is summed over `stages`."""

    stages: tuple[int, ...]
    parameter: nn.Parameter


@dataclass(eq=False)
class Stage:
    """Layers [begin, end) of the model, what crosses their boundaries, and their tied-weight bookkeeping."""

    index: int
    begin: int
    end: int
    num_layers: int
    layers: list[Layer]
    receives: list[Boundary]
    sends: list[Boundary]
    label_keys: tuple[str, ...]
    checkpoint_layers: frozenset[int]
    aliases: dict[tuple[int, str], tuple[int, str]]  # (layer, local name) -> (owner layer, owner's local name)
    tied: list[Tied]
    tied_sets: list[tuple[int, ...]]  # every stage set holding one tied Parameter, model-wide (for group creation)
    swap_layers: frozenset[int] = frozenset()  # held layers whose saved activations are swapped (not checkpointed)
    toggles: dict[int, list[tuple[int, bool]]] = field(default_factory=dict)  # layer -> [(from iteration, active)]
    swap: SwapPool | None = None
    inactive: frozenset[int] = frozenset()  # held layers that are the identity this iteration
    recompute_s: float = 0.0
    segments: dict[int, list[Segment]] = field(default_factory=dict)  # micro-batch -> checkpointed runs to redo

    @property
    def batch_keys(self) -> set[str]:
        """Batch fields this stage reads (each stage draws them itself: batch fields are never relayed)."""
        keys = {k for layer in self.layers for k in layer.batch_keys}
        return keys | set(self.label_keys) if self.is_last else keys

    @property
    def is_first(self) -> bool:
        return self.begin == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    def parameters(self) -> list[nn.Parameter]:
        """Distinct parameters of the held layers (a tied weight held twice counts once)."""
        seen: dict[int, nn.Parameter] = {}
        for layer in self.layers:
            for p in layer.module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def loss_count(self, batch: dict[str, Tensor]) -> int:
        return int(sum(int((batch[k] != IGNORE_INDEX).sum()) for k in self.label_keys))

    @property
    def layer_indices(self) -> list[int]:
        return [layer.index for layer in self.layers]

    @property
    def active_layers(self) -> list[int]:
        return [layer.index for layer in self.layers if layer.index not in self.inactive]

    def set_iteration(self, iteration: int) -> None:
        """Decide, from `toggles`, which held layers are the identity in 0-based iteration `iteration`."""
        self.inactive = frozenset(layer.index for layer in self.layers
                                  if not layer_active(self.toggles, layer.index, iteration))

    def forward(self, received: list[Tensor], batch: dict[str, Tensor], recompute: bool = True,
                micro_batch: int = 0) -> list[Tensor]:
        """Outputs to send (in `sends` order); on the last stage a one-element list with the summed loss.

        `recompute=False` keeps this micro-batch's activations even in checkpointed layers: its backward comes
        right after (the cost model and simulator skip that recompute too, sim/orders.py). A checkpointed layer
        is never swapped, even then."""
        env = {b.index: t for b, t in zip(self.receives, received, strict=True)}
        for layer in self.layers:
            if layer.index in self.inactive:
                env[layer.index] = env[layer.inputs[0]]
                continue
            args = [env[i] for i in layer.inputs] + [batch[k] for k in layer.batch_keys]
            if layer.index in self.checkpoint_layers and recompute:
                segment = Segment(layer.module, args, self._clock)
                self.segments.setdefault(micro_batch, []).append(segment)
                env[layer.index] = segment.run()
            elif layer.index in self.swap_layers and self.swap is not None:
                with self.swap.saving(micro_batch):
                    env[layer.index] = layer.module(*args)
            else:
                env[layer.index] = layer.module(*args)
        if self.is_last:
            return [env[self.end - 1]]
        return [env[b.index] for b in self.sends]

    def recompute(self, micro_batch: int) -> None:
        """Recompute the checkpointed layers of `micro_batch` now (before its gradient is waited for)."""
        for segment in self.segments.pop(micro_batch, []):
            segment.rerun()

    def backward(self, outputs: list[Tensor], grads: list[Tensor | None], received: list[Tensor]) -> list[Tensor]:
        """Backpropagate `grads` from the outputs; returns gradients of the received float tensors."""
        roots = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        if roots:
            torch.autograd.backward([o for o, _ in roots], [g for _, g in roots])
        return [
            x.grad if x.grad is not None else torch.zeros_like(x)
            for b, x in zip(self.receives, received, strict=True)
            if b.has_grad
        ]

    def _clock(self, seconds: float) -> None:
        self.recompute_s += seconds


def stage_of(stage_bounds: Sequence[Sequence[int]], layer: int) -> int:
    return next(s for s, (b, e) in enumerate(stage_bounds) if b <= layer < e)


def layer_active(toggles: dict[int, list[tuple[int, bool]]], index: int, iteration: int) -> bool:
    """The last toggle of `index` at or before `iteration` decides; a layer never toggled is active."""
    active = True
    for start, on in toggles.get(index, []):
        if start <= iteration:
            active = on
    return active


@dataclass(eq=False)
class ModelInfo:
    """What a plan change needs without the real model: the meta-device model, its decomposition, and every
    layer output's shape and dtype at the micro-batch size (one dry run)."""

    model: ZooModel
    dec: Decomposition
    outputs: dict[int, Boundary]  # every layer but the last (which returns the loss)

    @property
    def num_layers(self) -> int:
        return len(self.dec)

    def boundaries(self, indices: Sequence[int]) -> list[Boundary]:
        return [self.outputs[i] for i in indices]

    def tied_stage_sets(self, stage_bounds: Sequence[Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """Shared parameter name -> the stages holding it under `stage_bounds`."""
        return {s.name: tuple(sorted({stage_of(stage_bounds, i) for i in s.layers})) for s in self.dec.shared}


_INFO: dict[tuple[bytes, int, UserInputs], ModelInfo] = {}


def model_info(spec: model_pb2.ModelSpec, micro_batch_size: int,
               user_inputs: UserInputs = NO_USER_INPUTS) -> ModelInfo:
    key = (spec.SerializeToString(deterministic=True), micro_batch_size, user_inputs)
    if key not in _INFO:
        model = build_model(spec, device="meta", user_inputs=user_inputs)
        dec = model.decompose()
        batch = example_input(spec, micro_batch_size, device="meta", user_inputs=user_inputs)
        env: dict[int, Tensor] = {}
        with torch.no_grad():
            for layer in dec.layers[:-1]:
                env[layer.index] = layer.module(*[env[i] for i in layer.inputs],
                                                *[batch[k] for k in layer.batch_keys])
        outputs = {i: Boundary(i, tuple(t.shape), t.dtype) for i, t in env.items()}
        _INFO[key] = ModelInfo(model, dec, outputs)
    return _INFO[key]


def parse_toggles(info: ModelInfo, layer_toggles: Sequence[Sequence[int]]) -> dict[int, list[tuple[int, bool]]]:
    """Validate `WorkerConfig.layer_toggles` against the model; layer -> [(from iteration, active)] sorted."""
    n, out = info.num_layers, {}
    for entry in layer_toggles:
        index, start, active = (int(v) for v in entry)
        if not 0 <= index < n:
            raise ValueError(f"WorkerConfig.layer_toggles: {index} is not a layer index of this {n}-layer model")
        layer = info.dec.layers[index]
        if index == n - 1 or not layer.inputs:
            raise ValueError(f"WorkerConfig.layer_toggles: layer {index} ({layer.name}) cannot be toggled: an "
                             "inactive layer returns its first input, and this layer has no earlier-layer input "
                             "or computes the loss")
        first, output = info.outputs[layer.inputs[0]], info.outputs[index]
        if (first.shape, first.dtype) != (output.shape, output.dtype):
            raise ValueError(f"WorkerConfig.layer_toggles: layer {index} ({layer.name}) maps {first.shape} "
                             f"{first.dtype} to {output.shape} {output.dtype}; only shape-preserving layers may be "
                             "toggled")
        out.setdefault(index, []).append((start, bool(active)))
    return {i: sorted(entries, key=lambda e: e[0]) for i, entries in out.items()}


def local_name(layer: Layer, parameter: nn.Parameter) -> str:
    return next(n for n, p in layer.module.named_parameters() if p is parameter)


def tied_aliases(model: nn.Module, dec: Decomposition, begin: int, end: int) -> dict[tuple[int, str], tuple[int, str]]:
    """For each tied Parameter in layers [begin, end) other than its lowest holder: (layer, name) -> (owner, name).

    Checkpoints store a tied weight once, under its owner, and load it into every holder through this map.
    """
    named = dict(model.named_parameters())
    aliases = {}
    for shared in dec.shared:
        p, owner = named[shared.name], min(shared.layers)
        for i in shared.layers:
            if i != owner and begin <= i < end:
                aliases[(i, local_name(dec.layers[i], p))] = (owner, local_name(dec.layers[owner], p))
    return aliases


def boundary_shapes(spec: model_pb2.ModelSpec, micro_batch_size: int, wanted: set[int],
                    user_inputs: UserInputs = NO_USER_INPUTS) -> dict[int, Boundary]:
    """Shapes and dtypes of the wanted layer outputs at this micro-batch size, from a (cached) meta dry run."""
    if not wanted:
        return {}
    outputs = model_info(spec, micro_batch_size, user_inputs).outputs
    return {i: outputs[i] for i in sorted(wanted)}


def check_layers(name: str, indices: Sequence[int], n: int) -> None:
    bad = [i for i in indices if not 0 <= i < n]
    if bad:
        raise ValueError(f"WorkerConfig.{name}: {bad} are not layer indices of this {n}-layer model")


def restage(stage: Stage, info: ModelInfo, stage_bounds: Sequence[Sequence[int]], layers: list[Layer],
            checkpoint_layers: Sequence[int], swap_layers: Sequence[int]) -> Stage:
    """The stage under new bounds and policies, holding `layers` (already on the device, in index order).

    Tied-weight bookkeeping (`tied`, `tied_sets`) is kept: migration.py only accepts plans that leave every
    shared parameter on the same set of stages. Boundaries and aliases come from `info`, not the device."""
    begin, end = stage_bounds[stage.index]
    n = info.num_layers
    assert [layer.index for layer in layers] == list(range(begin, end))
    ckpt = frozenset(i for i in checkpoint_layers if begin <= i < end)
    return Stage(
        index=stage.index, begin=begin, end=end, num_layers=n, layers=layers,
        receives=info.boundaries(info.dec.crossing(begin - 1) if begin > 0 else []),
        sends=info.boundaries(info.dec.crossing(end - 1) if end < n else []),
        label_keys=stage.label_keys, checkpoint_layers=ckpt,
        aliases=tied_aliases(info.model, info.dec, begin, end), tied=stage.tied, tied_sets=stage.tied_sets,
        swap_layers=frozenset(i for i in swap_layers if begin <= i < end) - ckpt, toggles=stage.toggles,
        swap=stage.swap)


def build_stage(
    spec: model_pb2.ModelSpec,
    stage_bounds: list[list[int]],
    stage_index: int,
    *,
    seed: int,
    micro_batch_size: int,
    checkpoint_layers: Sequence[int] = (),
    swap_layers: Sequence[int] = (),
    layer_toggles: Sequence[Sequence[int]] = (),
    device: str | torch.device = "cpu",
    user_inputs: UserInputs = NO_USER_INPUTS,
) -> Stage:
    info = model_info(spec, micro_batch_size, user_inputs)
    toggles = parse_toggles(info, layer_toggles)
    model = build_model(spec, seed=seed, device=device, user_inputs=user_inputs)
    model.train()
    dec: Decomposition = model.decompose()
    n = len(dec)
    if stage_bounds[-1][1] != n:
        raise ValueError(f"WorkerConfig.stage_bounds: the last stage ends at {stage_bounds[-1][1]} but the model "
                         f"has {n} layers (end the last stage at {n})")
    check_layers("checkpoint_layers", checkpoint_layers, n)
    check_layers("swap_layers", swap_layers, n)
    begin, end = stage_bounds[stage_index]
    named = dict(model.named_parameters())
    tied: list[Tied] = []
    tied_sets: set[tuple[int, ...]] = set()
    for shared in dec.shared:
        p = named[shared.name]
        stages = tuple(sorted({stage_of(stage_bounds, i) for i in shared.layers}))
        if len(stages) > 1:
            tied_sets.add(stages)
            if stage_index in stages:
                tied.append(Tied(stages, p))
    receives = dec.crossing(begin - 1) if begin > 0 else []
    sends = dec.crossing(end - 1) if end < n else []
    shapes = info.outputs
    ckpt = frozenset(i for i in checkpoint_layers if begin <= i < end)
    stage = Stage(
        index=stage_index,
        begin=begin,
        end=end,
        num_layers=n,
        layers=dec.layers[begin:end],
        receives=[shapes[i] for i in receives],
        sends=[shapes[i] for i in sends],
        label_keys=type(model).label_keys,
        checkpoint_layers=ckpt,
        aliases=tied_aliases(model, dec, begin, end),
        tied=tied,
        tied_sets=sorted(tied_sets),
        swap_layers=frozenset(i for i in swap_layers if begin <= i < end) - ckpt,
        toggles=toggles,
        swap=SwapPool(device),
    )
    del model, dec, named  # the other stages' layers go with the last references to them
    return stage


def make_optimizer(parameters: list[nn.Parameter], optimizer: dict[str, Any]) -> torch.optim.Optimizer:
    """The one optimizer factory shared by workers and the reference, so their updates are the same math."""
    lr, wd = float(optimizer["learning_rate"]), float(optimizer.get("weight_decay", 0.0))
    # TP/SDP parameters are DTensors: a foreach kernel (CUDA's default) refuses a list mixing them with plain
    # tensors, so such a stage steps parameter by parameter (the math CPU runs by default anyway).
    foreach = False if any(isinstance(p, DTensor) for p in parameters) else None
    if optimizer["name"] == "adam":
        return torch.optim.Adam(parameters, lr=lr, weight_decay=wd, foreach=foreach)
    if optimizer["name"] == "sgd":
        return torch.optim.SGD(parameters, lr=lr, weight_decay=wd, foreach=foreach)
    raise ValueError(f"WorkerConfig.optimizer.name {optimizer['name']!r}: use 'adam' or 'sgd'")
