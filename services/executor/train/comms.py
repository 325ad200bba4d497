"""Communication of one worker: process groups made once, async p2p between stages, gradient reductions.

Every group is created up front, by every rank in the same order (Galvatron-BMW §VI; torch requires all
ranks to call `new_group`): one replica group per stage (data-parallel gradient allreduce), and for each set
of stages that holds one tied Parameter, one group per replica index spanning those stages (Varuna §5.1:
the shared weight's gradient is summed over its holders), and two groups per p2p path (stage s replica r <->
stage s+1 replica r), one per direction: activations and gradients never queue behind each other, which
NCCL's in-order streams would otherwise turn into a deadlock under 1F1B. For plan changes (migration.py)
there is also one gloo group of every rank (the per-boundary plan agreement, also beside NCCL) and, for every
pair of NON-adjacent stages, one group per replica index for layer moves that skip stages (adjacent moves
reuse the pair's forward group, idle between iterations): O(stages^2 x replicas) groups in all. Activations
go forward and gradients backward with isend/irecv (Varuna §3.1, §6), tensor by tensor with shapes known
from the plan, so only tensors ever cross the wire; sends complete in the background while the stage
computes and are drained at iteration end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from services.executor.train.config import WorkerConfig
from services.executor.train.stage import Boundary, Stage

FORWARD, BACKWARD = 0, 1


@dataclass
class Counters:
    comm_s: float = 0.0  # time blocked on receives, send drains and allreduces
    bytes_sent: int = 0  # p2p payload sent
    bytes_received: int = 0
    allreduce_bytes: int = 0
    replica_allreduces: int = 0
    tied_allreduces: int = 0


@dataclass
class Pending:
    tensors: list[Tensor]
    works: list = field(default_factory=list)


class Comms:
    def __init__(self, config: WorkerConfig, stage: Stage, device: torch.device):
        self.config, self.stage, self.device = config, stage, device
        self.counters = Counters()
        self._sends: list[tuple[Tensor, object]] = []
        r, nr = config.replica_index, config.num_replicas
        self.replica_group = None
        for s in range(config.num_stages):
            group = dist.new_group([config.rank_of(s, i) for i in range(nr)]) if nr > 1 else None
            if s == stage.index:
                self.replica_group = group
        self.tied_groups: dict[tuple[int, ...], object] = {}
        for stages in stage.tied_sets:
            for i in range(nr):
                group = dist.new_group([config.rank_of(s, i) for s in stages])
                if i == r and stage.index in stages:
                    self.tied_groups[stages] = group
        # p2p paths: stage s replica i <-> stage s+1 replica i, one group per direction.
        self.groups: dict[tuple[str, int], object] = {}  # ("prev" | "next", FORWARD | BACKWARD) -> group
        for s in range(config.num_stages - 1):
            for i in range(nr):
                pair = [config.rank_of(s, i), config.rank_of(s + 1, i)]
                for direction in (FORWARD, BACKWARD):
                    group = dist.new_group(pair)
                    if i == r and s == stage.index:
                        self.groups[("next", direction)] = group
                    if i == r and s + 1 == stage.index:
                        self.groups[("prev", direction)] = group
        # Layer migration between this stage and a non-adjacent one (same replica index), and plan agreement.
        self.migration_groups: dict[int, object] = {}  # other stage -> group
        for s in range(config.num_stages if config.online else 0):
            for t in range(s + 2, config.num_stages):
                for i in range(nr):
                    group = dist.new_group([config.rank_of(s, i), config.rank_of(t, i)])
                    if i == r and stage.index in (s, t):
                        self.migration_groups[t if stage.index == s else s] = group
        self.control_group = dist.new_group(list(range(config.world_size)), backend="gloo") \
            if config.world_size > 1 and config.online else None
        self.prev = config.rank_of(stage.index - 1, r) if not stage.is_first else None
        self.next = config.rank_of(stage.index + 1, r) if not stage.is_last else None

    def pair_group(self, other: int) -> object:
        """The group for layer migration between this stage and stage `other` (same replica index)."""
        if other == self.stage.index + 1:
            return self.groups[("next", FORWARD)]
        if other == self.stage.index - 1:
            return self.groups[("prev", FORWARD)]
        return self.migration_groups[other]

    def take(self) -> Counters:
        """Counters since the last call (one iteration's worth)."""
        out, self.counters = self.counters, Counters()
        return out

    def _tag(self, micro_batch: int, direction: int, slot: int) -> int:
        return (micro_batch * 2 + direction) * self.stage.num_layers + slot

    def post_recv(self, micro_batch: int, direction: int) -> Pending:
        """Post receives for the micro-batch's activations (FORWARD, from the previous stage) or gradients
        (BACKWARD, from the next stage) as early as possible, so they arrive while we compute."""
        side, peer, bounds = ("prev", self.prev, self.stage.receives) if direction == FORWARD else (
            "next", self.next, self.stage.sends)
        group = self.groups[(side, direction)]
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
        self.counters.comm_s += time.perf_counter() - start
        return pending.tensors

    def send(self, micro_batch: int, direction: int, tensors: list[Tensor]) -> None:
        """Asynchronous send; the tensor is kept alive until `drain`."""
        side, peer = ("next", self.next) if direction == FORWARD else ("prev", self.prev)
        group = self.groups[(side, direction)]
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
        self.counters.comm_s += time.perf_counter() - start

    def allreduce_sum(self, flat: Tensor, group: object) -> None:
        start = time.perf_counter()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        self.counters.comm_s += time.perf_counter() - start
        self.counters.allreduce_bytes += flat.numel() * flat.element_size()

    def reduce_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Sum tied gradients over the stages holding them, then all gradients over the stage's replicas.

        Gradients are summed, not averaged: each micro-batch loss was already divided by the global loss count.
        Every rank runs the tied groups in one global order (sorted stage sets), so no two ranks wait on each
        other crosswise.
        """
        for stages in sorted(self.tied_groups):
            params = [t.parameter for t in self.stage.tied if t.stages == stages]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._reduce([p.grad for p in params], self.tied_groups[stages])
            self.counters.tied_allreduces += 1
        if self.replica_group is not None:
            self._reduce([p.grad for p in parameters if p.grad is not None], self.replica_group)
            self.counters.replica_allreduces += 1

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
