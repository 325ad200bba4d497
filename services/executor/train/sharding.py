"""ZeRO-1 and ZeRO-2 data parallelism per layer over a stage's replica group (issue 24).

A layer under ZeRO keeps its parameters replicated, as plain DP does, but its d replicas (the stage's replica
group, `Mesh.group("dp")`) split the optimizer state (ZeRO-1), or the optimizer state and the reduced gradient
(ZeRO-2), among themselves. With one replica every flavour is plain DP (nothing to split).

Granularity: flat and element-wise, per layer. A `Bucket` lays the layer's distinct parameters end to end in
one flat buffer, zero-padded to a multiple of d, and re-points every parameter's storage into it (`p.data =
view`: the Parameter objects, their sharing between layers, autograd and the per-layer checkpoint keep working
unchanged). Replica r owns elements [r*c, (r+1)*c), c = padded / d, as `Bucket.shard`, a Parameter viewing
that slice: the shard optimizer steps it in place, i.e. steps the owned elements of the real parameters. Adam
and SGD are element-wise, so a chunk's step is the whole-parameter step's math (bit for bit on CPU). A rank's
optimizer state for the layer is thus exactly 1/d of plain DP's, plus at most d - 1 padded elements per state
tensor, with Adam's scalar step once per layer instead of once per parameter. A Parameter shared by several
layers of the stage belongs to the first of them (the flavour of that layer decides its sharding).

The collectives are torch.distributed's own (`reduce_scatter_single`, `all_gather_single`, `all_reduce`; gloo
on CPU, NCCL on GPU) and run in comms.py once per iteration, after the last micro-batch's backward and the
tied-weight sums: gradients accumulate over the micro-batches as under plain DP, but in one flat buffer per
layer (`prepare` makes the parameters' grads views of it before the iteration's first backward), so the
reduction needs no packing copy:
- ZeRO-1: per layer, the flat gradient is all-reduced in place (plain DP's volume); each replica then copies
  its chunk (`keep_chunk`) and frees the whole before the step.
- ZeRO-2: per layer, the flat gradient is reduce-scattered: each replica receives only its chunk of the sum,
  and the flat buffer is freed.
- Both, after the step: per layer one in-place all-gather of the updated chunks into the parameters' flat
  buffer (each replica's input is its own slot of the output), so every replica holds the whole layer again.
Each collective is waited before the next layer's starts: gloo's reduce-scatter clones its input and
all-reduces it, and its all-gather gathers into a temporary of the output's size, so this bounds those
temporaries to one layer (NCCL needs none; waiting on its work only orders the streams).
A layer whose parameters got no gradient this iteration (toggled off) is neither reduced, stepped nor gathered,
as plain DP's optimizer skips it. A layer whose parameters partly lack a gradient steps them with zeros.

Memory per rank for a layer of P parameters (fp32, Adam: 2 state tensors): parameters 4P in every flavour;
gradients 4P from the first backward to the reduction in every flavour, then 4P/d for ZeRO (plain keeps 4P
until the step, plus its all-reduce bucket's 4P copy during the reduction); optimizer state 8P (plain) or 8P/d.

Checkpoints and plan changes see unsharded state: `gather_state` all-gathers a layer's state chunks (every
replica of the stage calls it for every bucket, in layer order) and splits them back per parameter;
`Sharded.adopt` slices full state (from a checkpoint or a migrated layer) into chunks, so files never depend on
the flavour, replica count or stage layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from services.executor.train.stage import Stage, make_optimizer

PLAIN, ZERO1, ZERO2 = "plain", "zero1", "zero2"
State = dict[str, Any]  # one parameter's optimizer state, e.g. {"step": Tensor(), "exp_avg": ..., ...}


def flavours(zero1_layers: Iterable[int], zero2_layers: Iterable[int]) -> dict[int, str]:
    """Layer index -> ZERO1 / ZERO2 (layers in neither list are plain DP)."""
    out = {int(i): ZERO1 for i in zero1_layers}
    overlap = sorted(set(out) & {int(i) for i in zero2_layers})
    if overlap:
        raise ValueError(f"layers {overlap} are in both zero1_layers and zero2_layers; give each layer one flavour")
    out.update({int(i): ZERO2 for i in zero2_layers})
    return out


def local_bytes(t: Tensor) -> int:
    """Bytes this rank holds of `t` (a DTensor's local shard, as TP and SDP parameters and their state are)."""
    return (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()


def state_bytes(state: Mapping[Any, State]) -> int:
    return sum(local_bytes(v) for s in state.values() for v in s.values() if isinstance(v, Tensor))


@dataclass(eq=False)
class Bucket:
    """One ZeRO layer of this stage: its parameters viewed in `flat`, this replica's chunk as `shard`."""

    layer: int
    flavour: str
    params: list[nn.Parameter]
    flat: Tensor  # every parameter's storage; `numel` real elements, then zero padding to `degree * chunk`
    shard: nn.Parameter  # flat[rank * chunk : (rank + 1) * chunk]: what this replica's optimizer steps
    numel: int
    rank: int
    degree: int
    grad: Tensor | None = field(default=None)  # this iteration's flat gradient (the parameters' grads view it)
    stepped: bool = field(default=False)  # its shard had a gradient at the last step: gather it

    @property
    def chunk(self) -> int:
        return self.shard.numel()

    @classmethod
    def create(cls, layer: int, flavour: str, params: list[nn.Parameter], rank: int, degree: int) -> Bucket:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"layer {layer}: ZeRO needs one dtype and device for a layer's parameters, got {kinds}")
        numel = sum(p.numel() for p in params)
        chunk = -(-numel // degree)
        flat = torch.zeros(chunk * degree, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        with torch.no_grad():
            for p in params:
                view = flat[offset : offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                offset += p.numel()
        shard = nn.Parameter(flat[rank * chunk : (rank + 1) * chunk])  # shares flat's storage
        return cls(layer, flavour, params, flat, shard, numel, rank, degree)

    def prepare(self) -> None:
        """Before the iteration's first backward: the parameters' gradients become views of one zeroed flat
        buffer (allocated now, when autograd would allocate them), which autograd accumulates into in place, so
        the reduction needs no packing copy."""
        self.grad = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            view = self.grad[offset : offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            offset += p.numel()

    def has_grad(self) -> bool:
        """Whether this iteration gave the layer a gradient (every replica agrees: same layers, same toggles)."""
        return self.grad is not None or any(p.grad is not None for p in self.params)

    def flat_grad(self) -> Tensor:
        """The layer's whole gradient as one padded flat tensor: the prepared buffer (a parameter whose gradient
        was replaced rather than accumulated is copied back in), or a packed copy when none was prepared. A
        parameter without gradient contributes zeros."""
        if self.grad is None:
            self.grad = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            view = self.grad[offset : offset + p.numel()]
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            p.grad = None  # the flat buffer is the gradient from here on
            offset += p.numel()
        return self.grad

    def keep_chunk(self, reduced: Tensor) -> None:
        """ZeRO-1, after the all-reduce of `flat_grad`: keep this replica's chunk of it, free the whole."""
        self.shard.grad = reduced[self.rank * self.chunk : (self.rank + 1) * self.chunk].clone()
        self.grad = None

    def chunk_state(self, states: Mapping[nn.Parameter, State]) -> State:
        """This replica's chunk of the layer's full per-parameter state (a checkpoint's or a migrated layer's)."""
        have = [p for p in self.params if states.get(p)]
        if not have:
            return {}
        if len(have) != len(self.params):
            raise ValueError(f"layer {self.layer}: only {len(have)} of its {len(self.params)} parameters have "
                             "optimizer state; ZeRO steps a layer's parameters together, keep this layer plain DP")
        keys = list(states[have[0]])
        out: State = {}
        for key in keys:
            values = [states[p].get(key) for p in self.params]
            if not all(isinstance(v, Tensor) for v in values):
                raise ValueError(f"layer {self.layer}: optimizer state {key!r} is missing or not a tensor for some "
                                 "parameter; keep this layer plain DP")
            if all(v.dim() == 0 for v in values):  # a per-parameter scalar (Adam's step): one per layer
                if len({float(v) for v in values}) != 1:
                    raise ValueError(f"layer {self.layer}: its parameters' optimizer {key!r} differ "
                                     f"({sorted({float(v) for v in values})}); ZeRO steps them together, keep "
                                     "this layer plain DP")
                out[key] = values[0].detach().clone()
                continue
            if any(v.shape != p.shape for v, p in zip(values, self.params, strict=True)):
                raise ValueError(f"layer {self.layer}: optimizer state {key!r} is neither per element nor a scalar")
            # Assembled where the state lies (the host, for a checkpoint's): only the chunk goes to the device.
            full = torch.zeros(self.flat.numel(), dtype=values[0].dtype, device=values[0].device)
            offset = 0
            for v, p in zip(values, self.params, strict=True):
                full[offset : offset + p.numel()].copy_(v.detach().reshape(-1))
                offset += p.numel()
            out[key] = full[self.rank * self.chunk : (self.rank + 1) * self.chunk].to(self.flat.device, copy=True)
        return out


def gather_state(bucket: Bucket, state: State, group: object, keep: bool,
                 to: torch.device | str | None = None) -> dict[nn.Parameter, State]:
    """Full per-parameter state of `bucket`'s layer from every replica's chunk (`state`): one all-gather over
    the replica group, called by every replica; returns {} unless `keep` (only the writer needs it), placed
    on device `to` (default: the state's own)."""
    elements = [k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0]
    full: dict[str, Tensor] = {}
    if elements:
        local = torch.stack([state[k].detach() for k in elements])  # [keys, chunk]
        out = torch.empty((bucket.degree * len(elements), bucket.chunk), dtype=local.dtype, device=local.device)
        dist.all_gather_single(out, local, group=group)  # concatenated along dim 0 (gloo takes no stacked form)
        joined = out.view(bucket.degree, len(elements), -1).transpose(0, 1).reshape(len(elements), -1)
        full = {k: joined[i] for i, k in enumerate(elements)}
    if not keep or not state:
        return {}
    result: dict[nn.Parameter, State] = {}
    offset = 0
    for p in bucket.params:
        one: State = {}
        for key, value in state.items():
            if key in full:
                one[key] = full[key][offset : offset + p.numel()].view_as(p).to(to or p.device, copy=True)
            else:
                one[key] = value.detach().clone() if isinstance(value, Tensor) else value
        result[p] = one
        offset += p.numel()
    return result


class Sharded:
    """The optimizers of one stage replica: `plain` over the parameters of plain-DP layers (None when there is
    none), `shards` over the ZeRO buckets' chunks (None when there is no bucket)."""

    def __init__(self, stage: Stage, optimizer: torch.optim.Optimizer, layer_flavours: Mapping[int, str], *,
                 group: object | None, rank: int, degree: int, optimizer_config: Mapping[str, Any]) -> None:
        if degree > 1 and group is not None and dist.get_group_rank(group, dist.get_rank()) != rank:
            raise RuntimeError(f"replica {rank} is rank {dist.get_group_rank(group, dist.get_rank())} of its "
                               "replica group; ZeRO chunks are owned by replica index")
        self.group, self.rank, self.degree, self.config = group, rank, degree, dict(optimizer_config)
        self.buckets: dict[int, Bucket] = {}
        self.plain: torch.optim.Optimizer | None = optimizer
        self.shards: torch.optim.Optimizer | None = None
        self.adopt(stage, optimizer, layer_flavours)

    @property
    def active(self) -> bool:
        return bool(self.buckets)

    def flavour(self, layer: int) -> str:
        bucket = self.buckets.get(layer)
        return bucket.flavour if bucket is not None else PLAIN

    def ordered(self, flavour: str | None = None) -> list[Bucket]:
        """Buckets in layer order (the order every replica runs their collectives in)."""
        return [b for _, b in sorted(self.buckets.items()) if flavour is None or b.flavour == flavour]

    def sharded_ids(self) -> set[int]:
        """ids of the ZeRO layers' parameters: their gradients are reduced per layer, not in plain DP's bucket."""
        return {id(p) for b in self.buckets.values() for p in b.params}

    def prepare(self, inactive: Iterable[int]) -> None:
        """Before the iteration's first backward: flat gradient buffers for the ZeRO layers that compute."""
        skip = set(inactive)
        for bucket in self.ordered():
            if bucket.layer not in skip:
                bucket.prepare()

    def adopt(self, stage: Stage, optimizer: torch.optim.Optimizer, layer_flavours: Mapping[int, str]) -> None:
        """Shard every held layer `layer_flavours` puts under ZeRO that is not sharded yet, its state sliced
        from `optimizer` (full per-parameter state, e.g. a checkpoint's or a migrated layer's); a layer already
        sharded only takes its (possibly new) flavour. The plain optimizer is rebuilt over the other parameters,
        state carried by identity. Every layer sharded now and plain in `layer_flavours` must be released first."""
        if self.degree == 1 or not (self.buckets or any(f != PLAIN for f in layer_flavours.values())):
            self.plain = optimizer  # one replica (nothing to split: every flavour is plain DP) or no ZeRO layer
            return
        held = {layer.index for layer in stage.layers}
        stale = sorted(i for i in self.buckets if i not in held or layer_flavours.get(i, PLAIN) == PLAIN)
        if stale:
            raise RuntimeError(f"layers {stale} are still sharded; release them before they leave or turn plain")
        owner: dict[int, int] = {}
        for layer in stage.layers:
            for p in layer.module.parameters():
                owner.setdefault(id(p), layer.index)
        created: dict[nn.Parameter, State] = {}
        for layer in stage.layers:
            wanted = layer_flavours.get(layer.index, PLAIN)
            if wanted == PLAIN:
                continue
            if layer.index in self.buckets:
                self.buckets[layer.index].flavour = wanted
                continue
            params = [p for p in layer.module.parameters() if owner[id(p)] == layer.index]
            if not params:  # nothing of its own to shard (parameterless, or its weight belongs to an earlier layer)
                continue
            bucket = Bucket.create(layer.index, wanted, params, self.rank, self.degree)
            created[bucket.shard] = bucket.chunk_state(optimizer.state)
            self.buckets[layer.index] = bucket
        sharded = {id(p) for b in self.buckets.values() for p in b.params}
        plain = [p for p in stage.parameters() if id(p) not in sharded]
        self.plain = _rebuilt(plain, optimizer.state, self.config)
        shards = [b.shard for b in self.ordered()]
        states = {**(self.shards.state if self.shards is not None else {}), **created}
        self.shards = _rebuilt(shards, states, self.config)

    def release(self, layers: Sequence[int], stage: Stage) -> torch.optim.Optimizer:
        """Unshard `layers` (collective over the replica group: every replica passes the same list) and return
        an optimizer over all of `stage`'s parameters holding the full state of every plain and released
        parameter (what migration and a re-plan read; the still-sharded ones have none there)."""
        if not self.buckets and self.plain is not None:
            return self.plain  # nothing sharded: the plain optimizer already holds everything
        released: dict[nn.Parameter, State] = {}
        for index in sorted(i for i in set(layers) if i in self.buckets):
            bucket = self.buckets.pop(index)
            state = self.shards.state.get(bucket.shard, {}) if self.shards is not None else {}
            released.update(gather_state(bucket, state, self.group, keep=True))
        shards = [b.shard for b in self.ordered()]
        self.shards = _rebuilt(shards, self.shards.state if self.shards is not None else {}, self.config)
        states = {**(self.plain.state if self.plain is not None else {}), **released}
        optimizer = make_optimizer(stage.parameters(), self.config)
        _carry(optimizer, stage.parameters(), states)
        return optimizer

    def full_state(self, layers: Iterable[int]) -> dict[nn.Parameter, State]:
        """Unsharded state of the sharded parameters of `layers` (a checkpoint writer's share); collective:
        every replica calls it (with its own `layers`) and gathers every bucket, in layer order."""
        wanted, out = set(layers), {}
        for bucket in self.ordered():
            state = self.shards.state.get(bucket.shard, {}) if self.shards is not None else {}
            # to the host at once: a checkpoint never holds more than one layer's full state on the device
            out.update(gather_state(bucket, state, self.group, keep=bucket.layer in wanted, to="cpu"))
        return out

    def state(self, layers: Iterable[int]) -> dict[nn.Parameter, State]:
        """Per-parameter optimizer state of the stage for a checkpoint: plain state as is, plus the gathered
        state of `layers`' sharded parameters (collective, see `full_state`)."""
        plain = dict(self.plain.state) if self.plain is not None else {}
        return {**plain, **self.full_state(layers)}

    def step(self) -> None:
        for bucket in self.buckets.values():
            bucket.stepped, bucket.grad = bucket.shard.grad is not None, None
        for optimizer in (self.plain, self.shards):
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (plain layers' in full, ZeRO layers' chunks)."""
        return sum(state_bytes(o.state) for o in (self.plain, self.shards) if o is not None)

    def gradient_bytes(self, parameters: Iterable[nn.Parameter]) -> int:
        """Bytes of gradients this rank holds now: parameters' gradients plus the ZeRO chunks' gradients."""
        grads = [p.grad for p in parameters] + [b.shard.grad for b in self.buckets.values()]
        return sum(local_bytes(g) for g in grads if g is not None)


def _rebuilt(params: list[nn.Parameter], states: Mapping[Any, State],
             config: Mapping[str, Any]) -> torch.optim.Optimizer | None:
    """A fresh optimizer over `params` (None when empty) holding their state from `states`, by identity."""
    if not params:
        return None
    optimizer = make_optimizer(params, dict(config))
    _carry(optimizer, params, states)
    return optimizer


def _carry(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter], states: Mapping[Any, State]) -> None:
    """Install each parameter's state by identity; state left on the host (a ZeRO resume) moves to its device."""
    for p in params:
        if states.get(p):
            optimizer.state[p] = {k: v.to(p.device) if isinstance(v, Tensor) and v.dim() > 0 else v
                                  for k, v in states[p].items()}
