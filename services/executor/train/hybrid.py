"""Per-layer tensor parallelism (TP) and sharded data parallelism (SDP) inside a pipeline stage (Galvatron-BMW
§III, issue 18), built from torch.distributed's own parts: DTensor and `parallelize_module` for TP, FSDP2's
`fully_shard` (ZeRO-3) for SDP, DeviceMeshes made by mesh.py. No collective here is home-made.

A stage has W ranks (its replicas, `dims.dp`). Between layers the stage's activations are in one canonical
layout: the micro-batch split W ways, rank r of the stage holding the samples of replica r (plain DP's layout,
so the data, the p2p peers and the loss are unchanged). Per layer:
- plain DP (no entry): as before; its gradients join the stage's one all-reduce over the W ranks.
- SDP: the layer's parameters are sharded over the W ranks (`fully_shard` on the stage's "dp" mesh): gathered
  for its forward and again for its backward, gradients reduce-scattered (summed, not averaged: the loss is
  already divided by the global label count) after the iteration's last micro-batch. Same canonical layout.
- TP t (t divides W, and the layer's `tensor_parallel_ways`): the stage's W ranks form a (W/t) x t mesh, tp
  innermost (consecutive ranks, the fastest links). Layout transition (Galvatron's slice/gather): a forward
  pre-hook all-gathers the input over the layer's tp group, so each tp rank sees the same t x micro-batch
  samples; a forward hook slices its own samples back out (both left out between consecutive TP layers of one
  degree, `transitions`: the cost model prices a transformation only where the layout changes). Autograd runs
  both backwards: the gradient of the output is all-gathered, the input's is sliced, so every TP layer sees a
  replicated gradient as Megatron's column/row-parallel pair needs. Which linears split column-wise and which
  row-wise the layer's module declares (`tensor_parallel_plan`, the TP protocol below); the row-parallel ones
  all-reduce their output once each. Norms stay replicated. The layer's gradients (local shards, and the
  norms') are summed over its W/t data-parallel ranks, the ranks with the same tp index, not over the whole
  stage.

Sequence parallelism (Megatron-style, per TP layer, `sp_layers`): outside its TP regions the layer's activations
are split along the sequence (dim 1) over the tp ranks as well: the layer's input arrives as (its dp group's
samples) x (this rank's part of the sequence) instead of the whole gathered micro-batch, its norms and residuals
run on that part, each TP region's input is all-gathered along the sequence (`PrepareModuleInput`: Shard(1) to
Replicate, whose backward reduce-scatters the region's partial input gradients), and each row-parallel linear
reduce-scatters its output along the sequence (Shard(1)) instead of all-reducing it. The norms' parameters stay
plain, so their gradients (partial: each rank saw its part of the tokens) are summed over the tp group too
(`reduce`). A layer's module declares its regions (`sequence_parallel_regions()`: submodules called with the
hidden states as their one positional argument, or a mapping to the keyword that holds them), optionally
`prepare_sequence_parallel(parts)` (told its number of sequence parts), and the degrees that split its sequence
(`sequence_parallel_ways()`: the zoo's Block gives gcd(its TP ways, its tokens)). Gloo has no all-to-all, so the
re-layout between a sequence-parallel layer and its plain neighbours is an all-gather and a local slice there.

The TP protocol a layer's module keeps to (the zoo's Block, the Hugging Face blocks of zoo/hf/adapters.py, or a
user's own module): `tensor_parallel_plan()` -> {submodule path: "colwise" | "rowwise"} over nn.Linear
submodules; `tensor_parallel_ways()` -> the degrees it splits at divide this (its heads, key-value heads and MLP
width; 0 when it cannot be split, e.g. with dropout, whose masks the tp ranks would draw apart); optionally
`prepare_tensor_parallel()` (the zoo's Block reorders its fused qkv rows head-major, [head][q|k|v], so a row shard
is whole heads) and `tensor_parallel_rows(name, value, sharded)` (a parameter's rows between the model's own
order and the split's, for checkpoints).

Limits, each refused with an error naming the layer before the rendezvous (`check_model`, config.py, plan
commands in migration.py): a TP or SDP layer holds no parameter shared with another layer (tied embeddings stay
DP); TP applies to modules keeping the protocol, at degrees dividing their ways; ZeRO-1/2 and activation swap do
not combine with TP or SDP. Activation checkpointing does.

Live migration: a TP/SDP layer that a plan change moves is gathered whole on its stage (`release`: every rank of
the stage takes part), travels as any layer (migration.py), and is split again on the target (`reapply`), where
every TP layer's gather and slice are rewired for its new neighbours. Its strategy is the job's: plan commands
move layers, they do not change a layer's TP or SDP.

Checkpoints stay unsharded and in the model's own parameter order (`full_layers`: every DTensor gathered, rows
put back in the model's order), so a resume may change strategy; a resume into TP/SDP loads the full tensors
first and then shards them (`capture` / `adopt` carry the loaded optimizer state onto the new Parameters).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from services.executor.train.stage import ModelInfo, Stage, make_optimizer
from services.zoo.graph import Layer, sequence_regions

TP, SDP = "tp", "sdp"


@dataclass(frozen=True)
class Strategy:
    kind: str  # TP or SDP
    degree: int  # TP: ranks per tp group; SDP: the stage's width (every rank of the stage holds a shard)
    sequence: bool = False  # TP only: sequence parallelism over the tp ranks


def strategies(tp_layers: Iterable[Sequence[int]], sdp_layers: Iterable[int], width: int,
               sp_layers: Iterable[int] = ()) -> dict[int, Strategy]:
    """Layer index -> its TP or SDP strategy (`WorkerConfig.tp_layers` as [layer, degree] pairs, `sdp_layers`;
    `sp_layers`: TP layers whose sequence splits too)."""
    out: dict[int, Strategy] = {}
    sequence = {int(i) for i in sp_layers}
    for layer, degree in tp_layers:
        if degree < 2 or width % degree:
            raise ValueError(f"WorkerConfig.tp_layers: layer {layer} has tp degree {degree}; it must be >= 2 and "
                             f"divide the stage's {width} ranks (num_replicas)")
        out[int(layer)] = Strategy(TP, int(degree), int(layer) in sequence)
    loose = sorted(sequence - set(out))
    if loose:
        raise ValueError(f"WorkerConfig.sp_layers: layers {loose} are not in tp_layers; sequence parallelism splits a "
                         "tensor-parallel layer's sequence: add them to tp_layers or drop them")
    both = sorted(set(out) & {int(i) for i in sdp_layers})
    if both:
        raise ValueError(f"WorkerConfig.sdp_layers: layers {both} are also in tp_layers; give each layer one strategy")
    if width < 2 and list(sdp_layers):
        raise ValueError("WorkerConfig.sdp_layers: sharded data parallelism needs num_replicas >= 2 (the stage's "
                         "ranks share the shards); plan the layers as plain DP")
    out.update({int(i): Strategy(SDP, width) for i in sdp_layers})
    return out


def tp_degrees(tp_layers: Iterable[Sequence[int]]) -> list[int]:
    """The distinct TP degrees of the whole model (every rank makes one mesh per degree, in this order)."""
    return sorted({int(degree) for _, degree in tp_layers})


STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


SEQUENCE_DIM = 1  # hidden states are (batch, sequence, hidden)


def tensor_parallel_block(module: nn.Module, mesh: DeviceMesh, sequence: bool = False) -> None:
    """Megatron-style TP of a block over `mesh["tp"]`, as its `tensor_parallel_plan` says (the batch gather and
    slice around it are `layout_hooks`); with `sequence`, its regions gather the sequence and its row-parallel
    linears reduce-scatter it (the module docstring)."""
    prepare = getattr(module, "prepare_tensor_parallel", None)  # check_model vetted the block and the degree
    if callable(prepare):
        prepare()
    split = Shard(SEQUENCE_DIM)
    plan: dict[str, Any] = {
        path: RowwiseParallel(output_layouts=split) if sequence and style == "rowwise" else STYLES[style]()
        for path, style in module.tensor_parallel_plan().items()}
    if sequence:  # a region's input, split by sequence, is gathered whole (a DTensor: its backward reduce-scatters)
        plan.update({path: gather_region(arg) for path, arg in sequence_regions(module).items()})
        split_sequence = getattr(module, "prepare_sequence_parallel", None)
        if callable(split_sequence):  # e.g. a wrapper that builds masks and positions from the sequence's length
            split_sequence(mesh["tp"].size())
    parallelize_module(module, mesh["tp"], plan)


def gather_region(arg: str | int) -> PrepareModuleInput:
    split, whole = Shard(SEQUENCE_DIM), Replicate()
    if isinstance(arg, str):
        return PrepareModuleInput(input_kwarg_layouts={arg: split}, desired_input_kwarg_layouts={arg: whole})
    if arg != 0:
        raise ValueError(f"a sequence-parallel region's hidden states must be its first positional argument or a "
                         f"keyword, got position {arg}")
    return PrepareModuleInput(input_layouts=(split,), desired_input_layouts=(whole,))


def rows(module: nn.Module, name: str, value: Tensor, sharded: bool) -> Tensor:
    """A TP layer's parameter (or its optimizer state) with its rows in the split's order (`sharded`) or the
    model's own (checkpoints); most modules need no reorder."""
    reorder = getattr(module, "tensor_parallel_rows", None)
    return reorder(name, value, sharded) if callable(reorder) else value


def held_layout(sequence: bool) -> tuple[Shard | Replicate, Shard | Replicate]:
    """A TP layer's samples over its (dp, tp) mesh: the group's samples whole, or split by sequence."""
    return (Shard(0), Shard(SEQUENCE_DIM)) if sequence else (Shard(0), Replicate())


def layout_hooks(module: nn.Module, mesh: DeviceMesh, gather_input: bool, slice_output: bool,
                 sequence: bool = False, arrives: bool | None = None) -> list[Any]:
    """The gather of the tp group's samples before a TP block and the slice of its own after it, each left out
    where the neighbour in the chain is TP over the same mesh (`transitions`); the hooks' handles. With `sequence`
    the block holds the group's samples split by sequence instead of whole. `arrives`: the input comes from a
    joined TP neighbour holding them split by sequence (True) or whole (False), and is turned into this block's
    layout directly (whole -> split is a local slice; split -> whole an all-gather), as the cost model prices it."""
    canonical = (Shard(0), Shard(0))
    gathered = held_layout(sequence)
    source = canonical if gather_input or arrives is None else held_layout(arrives)

    def gather(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = DTensor.from_local(args[0], mesh, source, run_check=False)
        return (x.redistribute(mesh, gathered).to_local(), *args[1:])

    def slice_back(_: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        y = DTensor.from_local(output, mesh, gathered, run_check=False)
        return y.redistribute(mesh, canonical).to_local()

    handles = []
    if gather_input or (arrives is not None and arrives != sequence):
        handles.append(module.register_forward_pre_hook(gather))
    if slice_output:
        handles.append(module.register_forward_hook(slice_back))
    return handles


def transitions(stage: Stage, plan: Mapping[int, Strategy]) -> dict[int, tuple[bool, bool]]:
    """Per held TP layer: (gather its input, slice its output). Consecutive TP layers of one degree keep the
    gathered samples between them, as the cost model prices it (Galvatron-BMW Eq. 4: a transformation only where
    the sample layout changes): layer b skips the gather and its predecessor a the slice when b reads only a's
    output, nothing else reads it, it does not cross to the next stage, and neither layer is ever toggled off (an
    inactive layer passes its input through, whatever its layout). Joined layers that differ in sequence
    parallelism re-lay the samples between them directly (`arrivals`)."""
    readers: dict[int, list[int]] = {}
    for layer in stage.layers:
        for i in layer.inputs:
            readers.setdefault(i, []).append(layer.index)
    sent, held = {b.index for b in stage.sends}, {layer.index: layer for layer in stage.layers}

    def joined(a: int, b: int) -> bool:
        first, second = plan.get(a), plan.get(b)
        return (first is not None and second is not None and first.kind == second.kind == TP
                and first.degree == second.degree and a in held
                and held[b].inputs == (a,) and readers.get(a) == [b] and a not in sent
                and not ({a, b} & set(stage.toggles)))

    out = {}
    for layer in stage.layers:
        strategy = plan.get(layer.index)
        if strategy is None or strategy.kind != TP:
            continue
        gather_input = not (len(layer.inputs) == 1 and joined(layer.inputs[0], layer.index))
        slice_output = not any(joined(layer.index, r) for r in readers.get(layer.index, []))
        out[layer.index] = (gather_input, slice_output)
    return out


def check_layer(layer: Layer, strategy: Strategy, tied: bool) -> None:
    """ValueError naming the layer when it cannot run `strategy`: a shared (tied) parameter under TP or SDP, TP
    of a layer that does not keep the TP protocol, or at a degree its `tensor_parallel_ways` (heads, key-value
    heads and MLP width; 0 with dropout) does not allow."""
    if tied:
        raise ValueError(f"layer {layer.index} ({layer.name}) shares a parameter with another layer; a shared "
                         f"(tied) parameter stays data-parallel: plan layer {layer.index} as DP")
    if strategy.kind != TP:
        return
    module, ways = layer.module, layer.tensor_parallel
    if not callable(getattr(module, "tensor_parallel_plan", None)) or not module.tensor_parallel_plan():
        raise ValueError(f"layer {layer.index} ({layer.name}): tensor parallelism applies to blocks that declare "
                         f"their column- and row-parallel linears; {type(module).__name__} declares none: plan it as "
                         "DP or SDP")
    if not ways:
        raise ValueError(f"layer {layer.index} ({layer.name}): tensor-parallel layers need dropout 0 for now (the "
                         "tp ranks would draw different masks); set the model's dropout to 0 or plan it as DP")
    if ways % strategy.degree:
        raise ValueError(f"layer {layer.index} ({layer.name}): tp degree {strategy.degree} must divide {ways} (the "
                         "gcd of its heads, key-value heads and MLP width)")
    sequence = layer.sequence_parallel
    if strategy.sequence and (not sequence or sequence % strategy.degree):
        why = (f"tp degree {strategy.degree} must divide {sequence} (its TP ways and its sequence length)" if sequence
               else f"{type(module).__name__} declares no sequence-parallel regions or sequence length")
        raise ValueError(f"layer {layer.index} ({layer.name}): sequence parallelism: {why}; plan it TP without "
                         "sequence parallelism")


def check_model(info: ModelInfo, plan: Mapping[int, Strategy]) -> None:
    """`check_layer` over every layer of the model (its meta copy), so every rank of every stage refuses alike
    before the rendezvous, not only the stage holding the layer."""
    tied = {i for shared in info.dec.shared for i in shared.layers}
    for index, strategy in sorted(plan.items()):
        if not 0 <= index < info.num_layers:
            raise ValueError(f"WorkerConfig.tp_layers / sdp_layers: {index} is not a layer of this "
                             f"{info.num_layers}-layer model")
        check_layer(info.dec.layers[index], strategy, index in tied)


def local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def sum_over(groups: Mapping[int, tuple[dist.ProcessGroup, list[Tensor]]]) -> int:
    """Sum each group's gradients in place over its ranks, one flat all-reduce per group; the bytes reduced."""
    total = 0
    for group, grads in groups.values():
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(chunk.view_as(g))
        total += flat.numel() * flat.element_size()
    return total


@dataclass(eq=False)
class Hybrid:
    """This stage's TP and SDP layers, applied in place to its layer modules (parameters become DTensors)."""

    layers: dict[int, Strategy]  # held layers only
    meshes: dict[int, DeviceMesh]  # layer -> its (dp, tp) mesh (TP) or the stage's 1-D "dp" mesh (SDP)
    edges: dict[int, tuple[bool, bool]] = field(default_factory=dict)  # TP layer -> (gathers input, slices output)
    plan: dict[int, Strategy] = field(default_factory=dict)  # every layer's strategy, held or not (the job's)
    tp_meshes: dict[int, DeviceMesh] = field(default_factory=dict)  # degree -> this rank's (dp, tp) mesh
    sdp_mesh: DeviceMesh | None = None
    hooks: dict[int, list[Any]] = field(default_factory=dict)  # TP layer -> its layout hooks' handles

    @classmethod
    def for_job(cls, plan: Mapping[int, Strategy], tp_meshes: Mapping[int, DeviceMesh],
                sdp_mesh: DeviceMesh | None) -> Hybrid:
        """The job's strategies with nothing split yet: `reapply` splits the held layers (at start, after a move).
        `check_model` vetted every layer of `plan` before the rendezvous; the strategies never change."""
        return cls({}, {}, plan=dict(plan), tp_meshes=dict(tp_meshes), sdp_mesh=sdp_mesh)

    def _split(self, stage: Stage, indices: Sequence[int]) -> None:
        """Apply each layer's TP or SDP in place (its parameters become DTensors), then wire the layout hooks."""
        held = {layer.index: layer for layer in stage.layers}
        for index in indices:
            strategy, module = self.plan[index], held[index].module
            if strategy.kind == TP:
                mesh = self.tp_meshes[strategy.degree]
                tensor_parallel_block(module, mesh, strategy.sequence)
            else:
                assert self.sdp_mesh is not None, "SDP needs the stage's dp mesh (num_replicas >= 2)"
                mesh = self.sdp_mesh
                fully_shard(module, mesh=mesh, reshard_after_forward=True)
                module.set_gradient_divide_factor(1.0)  # gradients are sums: the loss is divided once, globally
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            self.layers[index], self.meshes[index] = strategy, mesh
        self.rewire(stage)

    def rewire(self, stage: Stage) -> None:
        """(Re)place every held TP layer's gather and slice for its current neighbours (after a plan change)."""
        for handles in self.hooks.values():
            for handle in handles:
                handle.remove()
        self.hooks.clear()
        self.edges = transitions(stage, self.layers)
        held = {layer.index: layer for layer in stage.layers}
        for index, (gather_input, slice_output) in self.edges.items():
            # joined to its TP predecessor: the input arrives in that layer's layout (whole or split by sequence)
            arrives = None if gather_input else self.layers[held[index].inputs[0]].sequence
            self.hooks[index] = layout_hooks(held[index].module, self.meshes[index], gather_input, slice_output,
                                             self.layers[index].sequence, arrives)

    def release(self, stage: Stage, leaving: Iterable[int], optimizer: torch.optim.Optimizer, info: ModelInfo,
                device: torch.device) -> None:
        """Turn the held TP/SDP layers in `leaving` back into plain modules holding the whole layer (from the meta
        model, like an arriving layer), their full optimizer state put in `optimizer`, so live migration moves
        them as any layer and the target splits them again (`reapply`). Collective over the stage's ranks:
        every rank of the stage passes the same layers."""
        going = sorted(set(leaving) & set(self.layers))
        if not going:
            return
        full = self.full_layers(stage, optimizer.state, going, only=going)
        for k, layer in enumerate(stage.layers):
            if layer.index not in full:
                continue
            tensors = full[layer.index][1]
            module = copy.deepcopy(info.dec.layers[layer.index].module).to_empty(device=device)
            module.train(layer.module.training)
            with torch.no_grad():  # buffers (a rotary table) are never split: the live module's are whole
                for (_, b), (_, live) in zip(module.named_buffers(), layer.module.named_buffers(), strict=True):
                    b.copy_(live)
            for name, p in module.named_parameters():
                with torch.no_grad():
                    p.copy_(tensors[f"param/{name}"])
                state = {key.split("/", 2)[1]: value for key, value in tensors.items()
                         if key.startswith("state/") and key.split("/", 2)[2] == name}
                if state:
                    optimizer.state[p] = {key: value if value.dim() == 0 else value.to(device)
                                          for key, value in state.items()}
            stage.layers[k] = replace(layer, module=module)
            for table in (self.layers, self.meshes, self.edges):
                table.pop(layer.index, None)
            for handle in self.hooks.pop(layer.index, []):
                handle.remove()

    def reapply(self, stage: Stage, optimizer: torch.optim.Optimizer,
                optimizer_config: Mapping[str, Any]) -> torch.optim.Optimizer:
        """At start, and after a plan change: split the held layers the job makes TP/SDP that are still whole (all
        of them at start, the arrived ones after a move), rewire every TP layer's gather and slice for its
        neighbours; the optimizer over the resulting parameters (state carried by identity, the split layers'
        sliced from their full state: a resumed checkpoint's or a migrated layer's)."""
        arrived = [layer.index for layer in stage.layers if layer.index in self.plan and layer.index not in self.layers]
        if not arrived:
            self.rewire(stage)
            return optimizer
        captured = self.capture(stage, {i: self.plan[i] for i in arrived}, optimizer.state)
        self._split(stage, arrived)
        out = make_optimizer(stage.parameters(), dict(optimizer_config))
        out.state.update({p: optimizer.state[p] for p in stage.parameters() if p in optimizer.state})
        self.adopt(stage, captured, out)
        return out

    def parameter_ids(self, stage: Stage) -> set[int]:
        """ids of every parameter of a TP or SDP layer: they never join the stage's plain all-reduce."""
        return {id(p) for layer in stage.layers if layer.index in self.layers for p in layer.module.parameters()}

    def sync_gradients(self, stage: Stage, last_micro_batch: bool) -> None:
        """SDP layers reduce-scatter only after the iteration's last micro-batch (accumulating unsharded before)."""
        for layer in stage.layers:
            if self.layers.get(layer.index, Strategy("", 0)).kind == SDP:
                module = layer.module
                assert isinstance(module, FSDPModule)
                module.set_requires_gradient_sync(last_micro_batch)

    def reduce(self, stage: Stage) -> int:
        """Sum each TP layer's gradients over its data-parallel ranks (same tp index): one flat all-reduce per
        (dp group); a sequence-parallel layer's plain parameters (its norms, each rank's sum over its part of the
        tokens) are first summed over the tp group. Returns the bytes reduced. SDP layers were reduced by FSDP in
        their backward."""
        over_tp: dict[int, tuple[dist.ProcessGroup, list[Tensor]]] = {}
        over_dp: dict[int, tuple[dist.ProcessGroup, list[Tensor]]] = {}
        for layer in stage.layers:
            strategy = self.layers.get(layer.index)
            if strategy is None or strategy.kind != TP:
                continue
            mesh = self.meshes[layer.index]
            if strategy.sequence:
                group = mesh["tp"].get_group()
                over_tp.setdefault(id(group), (group, []))[1].extend(
                    p.grad for p in layer.module.parameters() if p.grad is not None and not isinstance(p.grad, DTensor))
            if mesh["dp"].size() > 1:
                group = mesh["dp"].get_group()
                over_dp.setdefault(id(group), (group, []))[1].extend(
                    local(p.grad) for p in layer.module.parameters() if p.grad is not None)
        return sum_over(over_tp) + sum_over(over_dp)

    def full_layers(self, stage: Stage, state: Mapping[nn.Parameter, Mapping[str, Any]], keep: Iterable[int],
                    only: Iterable[int] | None = None) -> dict[int, tuple[str, dict[str, Tensor]]]:
        """Unsharded parameters and optimizer state of the held TP/SDP layers in `keep`, in a checkpoint's
        per-layer form (`checkpoint.snapshot`'s), host copies. Collective: every rank of the stage calls it, and
        gathers every hybrid layer (or those in `only`, the same on every rank) in layer order; the layers it
        does not keep are dropped."""
        wanted, out = set(keep), {}
        among = set(self.layers) if only is None else set(only) & set(self.layers)
        for layer in stage.layers:
            if layer.index not in among:
                continue
            tp = self.layers[layer.index].kind == TP  # only TP may reorder rows
            tensors: dict[str, Tensor] = {}
            for name, p in layer.module.named_parameters():
                tensors[f"param/{name}"] = self._full(layer.module, name, p.detach(), tp)
                for key, value in state.get(p, {}).items():
                    if isinstance(value, Tensor):
                        tensors[f"state/{key}/{name}"] = self._full(layer.module, name, value.detach(), tp)
            if layer.index in wanted:
                out[layer.index] = (layer.name, tensors)
        return out

    @staticmethod
    def _full(module: nn.Module, name: str, value: Tensor, tp: bool) -> Tensor:
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if tp and full.dim():  # Adam's scalar step has no rows
            full = rows(module, name, full, sharded=False)
        return full.to("cpu", copy=True)

    @staticmethod
    def capture(stage: Stage, plan: Mapping[int, Strategy],
                state: Mapping[nn.Parameter, Mapping[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
        """Before `apply`: the optimizer state (e.g. loaded from a checkpoint) of the layers about to become TP or
        SDP, by (layer, parameter name): their Parameter objects are replaced by `apply`."""
        return {(layer.index, name): dict(state[p]) for layer in stage.layers if layer.index in plan
                for name, p in layer.module.named_parameters() if p in state}

    def adopt(self, stage: Stage, captured: Mapping[tuple[int, str], Mapping[str, Any]],
              optimizer: torch.optim.Optimizer) -> None:
        """After `apply`: give each TP/SDP parameter its captured full state, laid out as the parameter is
        (rows in the split's order under TP, then this rank's shard of every DTensor)."""
        for layer in stage.layers:
            strategy = self.layers.get(layer.index)
            if strategy is None:
                continue
            for name, p in layer.module.named_parameters():
                full = captured.get((layer.index, name))
                if full is None:
                    continue
                optimizer.state[p] = {key: self._shard(layer.module, name, value, p, strategy)
                                      for key, value in full.items()}

    @staticmethod
    def _shard(module: nn.Module, name: str, value: Any, p: Tensor, strategy: Strategy) -> Any:
        if not isinstance(value, Tensor) or value.dim() == 0:
            return value  # Adam's scalar step
        if strategy.kind == TP:
            value = rows(module, name, value, sharded=True)
        if isinstance(p, DTensor):
            return distribute_tensor(value.to(p.device), p.device_mesh, p.placements)
        return value.to(p.device)

    def describe(self, stage: Stage) -> dict[str, Any]:
        """Per held TP/SDP layer: strategy, mesh shape, and this rank's parameter elements against the layer's
        whole (the proof the layer is distributed, in the worker's "started" event)."""
        out = {}
        for layer in stage.layers:
            strategy = self.layers.get(layer.index)
            if strategy is None:
                continue
            params = list(layer.module.parameters())
            out[str(layer.index)] = {
                "strategy": strategy.kind, "degree": strategy.degree,
                "mesh": {name: self.meshes[layer.index][name].size()
                         for name in self.meshes[layer.index].mesh_dim_names or ()},
                "local_elements": sum(local(p).numel() for p in params),
                "elements": sum(p.numel() for p in params),
                **({"sequence_parallel": True} if strategy.sequence else {}),
                **({"gathers_input": self.edges[layer.index][0], "slices_output": self.edges[layer.index][1]}
                   if layer.index in self.edges else {}),
                **({"relays_input": True} if layer.index in self.edges and not self.edges[layer.index][0]
                   and self.layers[layer.inputs[0]].sequence != strategy.sequence else {})}
        return out
