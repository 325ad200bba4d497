"""Communication of one worker over its Mesh (mesh.py, where every group is made): async p2p between stages
and the gradient reductions.

Activations go forward and gradients backward with isend/irecv (Varuna §3.1, §6) on the mesh's per-direction
p2p groups, tensor by tensor with shapes known from the plan, so only tensors ever cross the wire; sends
complete in the background while the stage computes and are drained at iteration end. Gradients are summed
over the stages holding a tied weight (the mesh's tied groups), then over the stage's replicas (`group("dp")`):
one all_reduce of every plain-DP layer's gradients, one in-place all_reduce per ZeRO-1 layer and one
reduce-scatter per ZeRO-2 layer (sharding.py); after the optimizer step, one all-gather per ZeRO layer brings
the updated chunks to every replica.

Time blocked in communication is split in two (`Counters`): p2p_s, waiting on pipeline receives and send
drains (a stage starved by its neighbour, i.e. the pipeline bubble, waits here), and allreduce_s, every
collective on the tied and replica groups (the gradient sums, ZeRO's reduce-scatters and parameter all-gathers,
and the last stage's two scalar sums of label count and loss). comm_s is their sum, as before the split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from services.executor.train.hybrid import Hybrid
from services.executor.train.mesh import BACKWARD, FORWARD, Mesh
from services.executor.train.sharding import ZERO1, Sharded
from services.executor.train.stage import Boundary, Stage


@dataclass
class Counters:
    p2p_s: float = 0.0  # time blocked on pipeline receives and send drains
    allreduce_s: float = 0.0  # time in collectives (tied and replica gradients, ZeRO, the last stage's scalar sums)
    bytes_sent: int = 0  # p2p payload sent
    bytes_received: int = 0
    allreduce_bytes: int = 0
    replica_allreduces: int = 0
    tied_allreduces: int = 0
    reduce_scatter_bytes: int = 0  # ZeRO-2: the full (padded) gradients put into reduce-scatters
    allgather_bytes: int = 0  # ZeRO: the full (padded) parameters gathered after the step
    replica_reduce_scatters: int = 0
    replica_allgathers: int = 0

    @property
    def comm_s(self) -> float:
        """All time blocked on communication (the single counter before p2p and allreduce were split)."""
        return self.p2p_s + self.allreduce_s


@dataclass
class Pending:
    tensors: list[Tensor]
    works: list = field(default_factory=list)


class Comms:
    def __init__(self, mesh: Mesh, stage: Stage, device: torch.device):
        if stage.index != mesh.index("pp"):
            raise ValueError(f"stage {stage.index} on a rank the mesh places at stage {mesh.index('pp')}")
        self.mesh, self.stage, self.device = mesh, stage, device
        self.counters = Counters()
        self._sends: list[tuple[Tensor, object]] = []
        self.replica_group = mesh.group("dp")
        # Peers along the pipeline: the same replica on the previous / next stage (they never change).
        self.prev = mesh.peer("pp", stage.index - 1) if not stage.is_first else None
        self.next = mesh.peer("pp", stage.index + 1) if not stage.is_last else None

    def take(self) -> Counters:
        """Counters since the last call (one iteration's worth)."""
        out, self.counters = self.counters, Counters()
        return out

    def _tag(self, micro_batch: int, direction: int, slot: int) -> int:
        return (micro_batch * 2 + direction) * self.stage.num_layers + slot

    def post_recv(self, micro_batch: int, direction: int) -> Pending:
        """Post receives for the micro-batch's activations (FORWARD, from the previous stage) or gradients
        (BACKWARD, from the next stage) as early as possible, so they arrive while we compute."""
        index = self.stage.index
        other, peer, bounds = (index - 1, self.prev, self.stage.receives) if direction == FORWARD else (
            index + 1, self.next, self.stage.sends)
        group = self.mesh.p2p_group(other, direction)
        pending = Pending([])
        for slot, b in enumerate(bounds):
            if direction == BACKWARD and not b.has_grad:
                continue
            t = torch.empty(b.shape, dtype=b.dtype, device=self.device)
            pending.tensors.append(t)
            pending.works.append(dist.irecv(t, src=peer, group=group, tag=self._tag(micro_batch, direction, slot)))
            self.counters.bytes_received += b.nbytes
        return pending

    def wait(self, pending: Pending) -> list[Tensor]:
        start = time.perf_counter()
        for work in pending.works:
            work.wait()
        self.counters.p2p_s += time.perf_counter() - start
        return pending.tensors

    def send(self, micro_batch: int, direction: int, tensors: list[Tensor]) -> None:
        """Asynchronous send; the tensor is kept alive until `drain`."""
        index = self.stage.index
        other, peer = (index + 1, self.next) if direction == FORWARD else (index - 1, self.prev)
        group = self.mesh.p2p_group(other, direction)
        bounds: list[Boundary] = self.stage.sends if direction == FORWARD else self.stage.receives
        slots = [i for i, b in enumerate(bounds) if direction == FORWARD or b.has_grad]
        for slot, t in zip(slots, tensors, strict=True):
            t = t.detach().contiguous()
            expected = bounds[slot]
            if tuple(t.shape) != expected.shape or t.dtype != expected.dtype:
                raise RuntimeError(f"layer {expected.index} output is {tuple(t.shape)} {t.dtype}, the plan expected "
                                   f"{expected.shape} {expected.dtype}: the model's shapes depend on the data")
            self._sends.append((t, dist.isend(t, dst=peer, group=group, tag=self._tag(micro_batch, direction, slot))))
            self.counters.bytes_sent += t.numel() * t.element_size()

    def drain(self) -> None:
        start = time.perf_counter()
        for _, work in self._sends:
            work.wait()
        self._sends.clear()
        self.counters.p2p_s += time.perf_counter() - start

    def allreduce_sum(self, flat: Tensor, group: object) -> None:
        start = time.perf_counter()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        self.counters.allreduce_s += time.perf_counter() - start
        self.counters.allreduce_bytes += flat.numel() * flat.element_size()

    def reduce_gradients(self, parameters: list[torch.nn.Parameter], sharded: Sharded | None = None,
                         hybrid: Hybrid | None = None) -> None:
        """Sum tied gradients over the stages holding them, then all gradients over the stage's replicas:
        plain-DP layers' in one all-reduce, then the ZeRO layers' one layer at a time (`reduce_sharded`).

        Gradients are summed, not averaged: each micro-batch loss was already divided by the global loss count.
        Every rank runs the tied groups in one global order (sorted stage sets), so no two ranks wait on each
        other crosswise.
        """
        for stages in self.mesh.tied_sets:
            params = [t.parameter for t in self.stage.tied if t.stages == stages]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._reduce([p.grad for p in params], self.mesh.tied_group(stages))
            self.counters.tied_allreduces += 1
        if self.replica_group is not None:
            sharded_ids = sharded.sharded_ids() if sharded is not None else set()
            if hybrid is not None and hybrid.layers:  # TP layers sum over their own dp ranks, SDP in FSDP
                sharded_ids |= hybrid.parameter_ids(self.stage)
                start = time.perf_counter()
                self.counters.allreduce_bytes += hybrid.reduce(self.stage)
                self.counters.allreduce_s += time.perf_counter() - start
            self._reduce([p.grad for p in parameters if p.grad is not None and id(p) not in sharded_ids],
                         self.replica_group)
            self.counters.replica_allreduces += 1
        if sharded is not None and sharded.active:
            self.reduce_sharded(sharded)

    def reduce_sharded(self, sharded: Sharded) -> None:
        """The ZeRO layers' gradients, one layer at a time in layer order: ZeRO-1 all-reduces the layer's flat
        gradient in place and keeps its chunk; ZeRO-2 reduce-scatters it, receiving its chunk only."""
        for bucket in sharded.ordered():
            if not bucket.has_grad():  # toggled off: no gradient on any replica, nothing to step
                continue
            flat = bucket.flat_grad()
            if bucket.flavour == ZERO1:
                self.allreduce_sum(flat, sharded.group)
                self.counters.replica_allreduces += 1
                bucket.keep_chunk(flat)
                continue
            start = time.perf_counter()
            out = torch.empty_like(bucket.shard)
            dist.reduce_scatter_single(out, flat, group=sharded.group)
            bucket.shard.grad, bucket.grad = out, None
            self.counters.allreduce_s += time.perf_counter() - start
            self.counters.reduce_scatter_bytes += flat.numel() * flat.element_size()
            self.counters.replica_reduce_scatters += 1

    def gather_parameters(self, sharded: Sharded) -> None:
        """After the step: every stepped ZeRO layer's updated chunks, all-gathered in place into its flat buffer
        (this replica's input is its own slot of the output), one layer at a time."""
        for bucket in sharded.ordered():
            if not bucket.stepped:
                continue
            start = time.perf_counter()
            dist.all_gather_single(bucket.flat, bucket.shard.detach(), group=sharded.group)
            self.counters.allreduce_s += time.perf_counter() - start
            self.counters.allgather_bytes += bucket.flat.numel() * bucket.flat.element_size()
            self.counters.replica_allgathers += 1

    def _reduce(self, grads: list[Tensor], group: object) -> None:
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.allreduce_sum(flat, group)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(chunk.view_as(g))

    def replica_sum(self, values: list[float]) -> list[float]:
        """Sum scalars (loss sums, label counts) over this stage's replicas, in float64."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.replica_group is not None:
            self.allreduce_sum(t, self.replica_group)
        return t.tolist()
