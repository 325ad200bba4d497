"""PatrickStar's chunk manager (§6–§8) with real tensors: model data in fixed-size chunks under a device budget.

The residency policy (states, eviction, gathers, margin) is `services.runtime.chunk_policy`, shared with the
planner's simulator; this module is its `Mover` and the tensors behind it.

Each parameter's `.data` is a view into its chunk's device buffer for good. A chunk that is not on the device
has that buffer's storage resized to 0 (the views stay valid, autograd's saved views included) and its payload
in a host buffer; a move is one copy and a resize on each side. Gradients reuse parameter chunks (Fig. 6): a
gradient is copied into its parameter's own slot once final (the iteration's last micro-batch) and the
temporary dropped; the fp32 master list keeps the values for the step, which runs chunk by chunk where that
chunk's optimizer states are and then copies the updated master into the slots. With `world` > 1 remote chunks
are gathered with `dist.all_gather` and gradients summed into their owner with `dist.reduce` per chunk (the
reduce-scatter's volume; gloo has it).

Every `Mover` method is timed (`seconds`, by kind) so a worker can report its swap time and tell the gathers and
reductions apart from the compute around them; on a GPU each timed call ends with a device sync, so the copies and
collectives it launched are inside its span.

Precision: the compute list has the model's dtype (fp32 on CPU). A GPU run would keep it in half precision with
the fp32 master list; the code is written for both but only the CPU path is tested here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import adam as adam_fn
from torch.optim import sgd as sgd_fn

from services.runtime.chunk_layout import plan_chunks
from services.runtime.chunk_policy import OS_KINDS, Chunk, ChunkPolicy, Mover, TensorState
from services.runtime.memory_pool import MemoryPool

MOVER_KINDS = ("move", "gather", "reduce")


def _resize(t: Tensor, numel: int) -> None:
    t.untyped_storage().resize_(numel * t.element_size())


class ChunkManager(Mover):
    def __init__(self, params: Sequence[nn.Parameter], chunk_bytes: int, device_pool: MemoryPool,
                 host_pool: MemoryPool, *, optimizer: str = "adam", rank: int = 0, world: int = 1,
                 group: object = None, group_ranks: Sequence[int] | None = None) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"chunks need parameters of one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        size = torch.empty((), dtype=dtype).element_size()
        self.params = list(params)
        self.layout = plan_chunks([p.numel() for p in self.params], chunk_bytes // size, world)
        self.group = group
        self.group_ranks = list(group_ranks) if group_ranks is not None else list(range(world))
        self.slot_of = {id(p): i for i, p in enumerate(self.params)}
        device = self.params[0].device if self.params else torch.device("cpu")
        self.device_type = device.type
        self.seconds = dict.fromkeys(MOVER_KINDS, 0.0)  # inside the Mover's methods since the last take_swap_s
        n = self.layout.chunk_numel
        kinds = OS_KINDS if optimizer == "adam" else OS_KINDS[:1]
        self.policy = ChunkPolicy(self.layout, size, device_pool, host_pool, os_kinds=kinds, rank=rank, mover=self)
        self.device: dict[int, Tensor] = {}  # chunk key -> flat device buffer (storage 0 while away)
        self.host: dict[int, Tensor] = {}
        for chunk in self.policy.chunks:
            self.device[chunk.key] = torch.empty(n, dtype=dtype, device=device)  # emptied once the views exist
            self.host[chunk.key] = torch.zeros(n, dtype=dtype) if chunk.local else torch.empty(0, dtype=dtype)
        for p, slot in zip(self.params, self.layout.slots, strict=True):
            chunk = self.policy.chunks[slot.chunk]
            if chunk.local:
                self.host[chunk.key][slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            p.data = self.device[chunk.key][slot.offset:slot.offset + slot.numel].view(p.shape)
        for chunk in self.policy.chunks:
            _resize(self.device[chunk.key], 0)
        for c, states in self.policy.os.items():
            for kind, chunk in states.items():
                self.device[chunk.key] = torch.empty(n, dtype=torch.float32, device=device)
                _resize(self.device[chunk.key], 0)
                source = self.host[self.policy.chunks[c].key]
                self.host[chunk.key] = source.float().clone() if kind == "master" else torch.zeros(n)
        self.steps = {i: torch.tensor(0.0) for i, s in enumerate(self.layout.slots)
                      if self.layout.owner(s.chunk) == rank}

    @property
    def comm_s(self) -> float:
        """Seconds in gathers and reductions since the last `take_swap_s` (collectives, not host copies)."""
        return self.seconds["gather"] + self.seconds["reduce"]

    def take_swap_s(self) -> float:
        """Seconds moving, gathering and reducing chunks since the last call (a worker calls it per iteration)."""
        total = sum(self.seconds.values())
        self.seconds = dict.fromkeys(MOVER_KINDS, 0.0)
        return total

    @contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            if self.device_type == "cuda":
                torch.cuda.synchronize()
            self.seconds[kind] += time.perf_counter() - began

    # -- Mover: what the policy's decisions do to the tensors ----------------------------------------------------
    def move(self, chunk: Chunk, to: str) -> None:
        src, dst = (self.host, self.device) if to == "device" else (self.device, self.host)
        source, target = src[chunk.key], dst[chunk.key]
        with self._timed("move"):
            _resize(target, self.layout.chunk_numel)
            with torch.no_grad():
                target.copy_(source)
            _resize(source, 0)

    def gather(self, members: list[Chunk]) -> None:
        with self._timed("gather"):
            for m in members:
                if not m.local:
                    _resize(self.device[m.key], self.layout.chunk_numel)
            local = next(m for m in members if m.local)
            dist.all_gather([self.device[m.key] for m in members], self.device[local.key], group=self.group)

    def reduce(self, chunk: Chunk, owner: int) -> None:
        with self._timed("reduce"):
            dist.reduce(self.device[chunk.key], self.group_ranks[owner], op=dist.ReduceOp.SUM, group=self.group)

    def free(self, chunk: Chunk) -> None:
        _resize(self.device[chunk.key], 0)

    # -- what the training hooks call ----------------------------------------------------------------------------
    def slots(self, params: Iterable[nn.Parameter]) -> list[int]:
        return [self.slot_of[id(p)] for p in params]

    def access(self, params: Iterable[nn.Parameter]) -> None:
        self.policy.access(self.slots(params))

    def release(self, params: Iterable[nn.Parameter], state: TensorState) -> None:
        self.policy.release(self.slots(params), state)

    def resident_storages(self) -> set[int]:
        """Addresses of the device buffers now holding chunks (saved views of them are model data)."""
        return {self.device[c.key].untyped_storage().data_ptr() for c in self.policy.all_chunks()
                if c.where == "device"}

    def grad_ready(self, p: nn.Parameter, last_micro_batch: bool) -> None:
        """After `p`'s gradient accumulated: on the last micro-batch it moves into `p`'s own slot (Fig. 6)."""
        i = self.slot_of[id(p)]
        grad = p.grad
        assert grad is not None
        if not last_micro_batch:
            self.policy.hold_grad(i, grad.numel() * grad.element_size())
            return
        with torch.no_grad():
            p.data.copy_(grad)
        p.grad = None
        self.policy.grad_final(i)

    def step(self, optimizer: dict[str, Any]) -> None:
        """Update every local chunk where its optimizer states are, then copy the fp32 master into the slots."""
        lr, wd = float(optimizer["learning_rate"]), float(optimizer.get("weight_decay", 0.0))
        for c, _where in self.policy.step_chunks():
            members = self.policy.prepare_step(c)
            try:
                slots = [i for i in self.policy.slots_of(c) if i in self.policy.has_grad]
                views = {kind: self._views(chunk, slots) for kind, chunk in self.policy.os[c].items()}
                grads = self._views(self.policy.chunks[c], slots)
                with torch.no_grad():
                    if optimizer["name"] == "adam":
                        adam_fn.adam(views["master"], [g.float() for g in grads], views["momentum"], views["variance"],
                                     [], [self.steps[i] for i in slots], foreach=False, amsgrad=False, beta1=0.9,
                                     beta2=0.999, lr=lr, weight_decay=wd, eps=1e-8, maximize=False)
                    else:
                        sgd_fn.sgd(views["master"], [g.float() for g in grads], [None] * len(slots), foreach=False,
                                   weight_decay=wd, momentum=0.0, lr=lr, dampening=0.0, nesterov=False,
                                   maximize=False)
                    for param, new in zip(grads, views["master"], strict=True):
                        param.copy_(new)
            finally:
                self.policy.finish_step(c, members)

    def local_payloads(self) -> list[Tensor]:
        """This process's own parameter chunks, wherever each is now (what its fingerprint covers)."""
        return [self.device[c.key] if c.where == "device" else self.host[c.key]
                for c in self.policy.chunks if c.local]

    def _views(self, chunk: Chunk, slots: list[int]) -> list[Tensor]:
        buf = self.device[chunk.key] if chunk.where == "device" else self.host[chunk.key]
        return [buf[s.offset:s.offset + s.numel] for s in (self.layout.slots[i] for i in slots)]
