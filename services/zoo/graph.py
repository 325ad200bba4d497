"""Layer decomposition: the unit the profiler times and the executor places on pipeline stages.

A zoo model is an ordered list of layers that can run one at a time (Harmony §3). Layer `i` reads
the outputs of the earlier layers listed in `inputs` (usually just `i - 1`) plus named fields of
the batch; the last layer returns the summed loss. Edges that skip layers (T5 decoder blocks read
the encoder output) are explicit so a pipeline knows which tensors to relay past a stage boundary,
and parameters used by several layers (tied embeddings) are found by identity and declared, so
their gradients can be synchronised (Varuna §5.1) instead of silently diverging.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torch import Tensor, nn

from services.runtime.errors import InvalidArgument

Inputs = Mapping[str, Tensor]


def sequence_regions(module: nn.Module) -> dict[str, str | int]:
    """A module's sequence-parallel TP regions -> the argument holding their hidden states: its
    `sequence_parallel_regions()` gives a list of paths (their one positional argument) or a mapping to a keyword
    name or a position; {} when it declares none."""
    declared = getattr(module, "sequence_parallel_regions", None)
    if not callable(declared):
        return {}
    regions = declared()
    return dict(regions) if isinstance(regions, Mapping) else dict.fromkeys(regions, 0)


@dataclass(eq=False)
class Layer:
    """One schedulable layer: `module(*(outputs[i] for i in inputs), *(batch[k] for k in batch_keys))`."""

    index: int
    name: str  # stable: "embed", "block.3", "encoder.block.2", "decoder.block.0", "head"
    kind: str  # "embed", "block", "decoder_block", "norm", "merge", "head", "segment"
    module: nn.Module
    inputs: tuple[int, ...]  # earlier layers whose outputs this one reads, in call order
    batch_keys: tuple[str, ...] = ()  # batch fields read directly (tokens, labels): never relayed
    tied_with: list[int] = field(default_factory=list)  # layers sharing a Parameter with this one

    @property
    def tensor_parallel(self) -> int:
        """TP degrees the executors can split this layer into divide this; 0 none (a module declares it through
        `tensor_parallel_ways`, as zoo.base.Block does)."""
        ways = getattr(self.module, "tensor_parallel_ways", None)
        return int(ways()) if callable(ways) else 0

    @property
    def sequence_parallel(self) -> int:
        """TP degrees dividing this can also split the layer along the sequence (sequence parallelism); 0 none. A
        module declares it through `sequence_parallel_ways` and its TP regions (`sequence_parallel_regions`)."""
        ways = getattr(self.module, "sequence_parallel_ways", None)
        if not (callable(ways) and sequence_regions(self.module) and self.tensor_parallel):
            return 0
        return math.gcd(int(ways()), self.tensor_parallel)

    @property
    def extra_inputs(self) -> list[int]:
        """Layers read besides the predecessor: the skip edges a plain chain would lose."""
        return [i for i in self.inputs if i != self.index - 1]


@dataclass(frozen=True)
class SharedParameter:
    """A Parameter object used by several layers; its gradient must be summed across them."""

    name: str  # qualified name in the model (first registration)
    layers: tuple[int, ...]


@dataclass(eq=False)
class Decomposition:
    """Ordered layers plus the facts a pipeline needs: relayed outputs and shared parameters."""

    layers: list[Layer]
    relay: list[int]  # outputs read by some layer other than their immediate successor
    shared: list[SharedParameter]

    def __len__(self) -> int:
        return len(self.layers)

    def crossing(self, after: int) -> list[int]:
        """Outputs that must be sent from the stage ending at layer `after` to later stages.

        This is the boundary activation (if the next layer reads it) plus relayed outputs.
        """
        return sorted({i for layer in self.layers[after + 1 :] for i in layer.inputs if i <= after})


class LayerList:
    """Builder that numbers layers and defaults each layer's input to its predecessor."""

    def __init__(self) -> None:
        self.layers: list[Layer] = []

    def add(
        self,
        name: str,
        kind: str,
        module: nn.Module,
        inputs: Iterable[int] | None = None,
        batch_keys: tuple[str, ...] = (),
    ) -> int:
        index = len(self.layers)
        reads = tuple(inputs) if inputs is not None else ((index - 1,) if index else ())
        self.layers.append(Layer(index, name, kind, module, reads, batch_keys))
        return index


def decompose(model: nn.Module, layers: list[Layer]) -> Decomposition:
    """Check the layer graph against `model` and derive relay and shared-parameter facts."""
    names = [layer.name for layer in layers]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"duplicate layer names in {names}", field="spec")
    for i, layer in enumerate(layers):
        if layer.index != i or any(not 0 <= j < i for j in layer.inputs):
            raise InvalidArgument(f"layer {layer.name} reads a later layer or is misnumbered", field="spec")
    relay = sorted({j for layer in layers for j in layer.inputs if j != layer.index - 1})

    qualified = {id(p): n for n, p in model.named_parameters()}
    users: dict[int, list[int]] = {}
    for layer in layers:
        for p in layer.module.parameters():
            users.setdefault(id(p), []).append(layer.index)
    hidden = [n for key, n in qualified.items() if key not in users]
    if hidden:
        raise InvalidArgument(f"parameters outside every layer: {hidden[:3]}", field="spec")
    shared = [SharedParameter(qualified[key], tuple(idx)) for key, idx in users.items() if len(idx) > 1]
    for layer in layers:
        layer.tied_with = sorted({j for s in shared if layer.index in s.layers for j in s.layers} - {layer.index})
    return Decomposition(layers, relay, shared)


def parameter_tensors(decomposition: Decomposition) -> tuple[list[nn.Parameter], list[list[int]]]:
    """The model's distinct parameters ordered by the first layer using each (module order within it), and per
    layer the indices of those it uses. The chunk layout (executor) and the chunk simulator (planner, through
    the profile's LayerProfile.parameter_numels / parameter_tensors) both see the model this way."""
    ordered: dict[int, nn.Parameter] = {}
    for layer in decomposition.layers:
        for p in layer.module.parameters():
            ordered.setdefault(id(p), p)
    index = {key: i for i, key in enumerate(ordered)}
    return list(ordered.values()), [[index[id(p)] for p in dict.fromkeys(layer.module.parameters())]
                                    for layer in decomposition.layers]


def run_layers(decomposition: Decomposition, inputs: Inputs) -> Tensor:
    """Run the model one layer at a time through an explicit env of outputs; returns the loss."""
    env: dict[int, Tensor] = {}
    for layer in decomposition.layers:
        args = [env[i] for i in layer.inputs] + [inputs[k] for k in layer.batch_keys]
        env[layer.index] = layer.module(*args)
    return env[len(decomposition.layers) - 1]
