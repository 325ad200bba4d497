"""PatrickStar's chunk manager (§6–§8): model data in fixed-size chunks that move between device and host.

Each parameter's `.data` is a view into its chunk's device buffer for good. A chunk that is not on the device
has that buffer's storage resized to 0 (the views stay valid, autograd's saved views included) and its payload
in a host buffer; moving it is one copy and a resize on each side, accounted on both `MemoryPool`s. So a
schedule that keeps too much on the device fails with `BudgetExceeded` instead of passing silently.

Tensor states follow Table 1 (FREE, COMPUTE, HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD). `access` makes a layer's
chunks resident and COMPUTE (Alg. 1); `release` sets HOLD_AFTER_FWD/BWD (Alg. 2); a chunk may be evicted only
when none of its tensors is COMPUTE. Gradients reuse parameter chunks (Fig. 6): when a parameter's gradient
is final (after the iteration's last micro-batch), it is copied into the parameter's own slot and the
temporary freed; the fp32 parameter list (the master copy) keeps the values for the step. The step runs
chunk by chunk where that chunk's optimizer states are, then copies the updated master into the slots.

The first iteration is the warm-up (§8.1): it evicts in chunk-list order and records the order of chunk
accesses (moments) and the peak of non-model memory. From then on eviction is Belady's (§8.3): the resident
chunk whose next use in the recorded (cyclic) order is farthest goes first; and optimizer-state chunks move to
the device's margin (§8.2), the budget minus the traced non-model peak and the parameter chunks' peak, as many
as fit.

Data parallelism (§7, Alg. 3–4): with `world` > 1 each process keeps only its local chunks (and their
optimizer states). The first access to a communication group whose remote chunks are FREE all-gathers the
group onto the device; when every tensor of the group is HOLD_AFTER_FWD (or _BWD) the remote chunks are freed,
after the backward of the last micro-batch by way of a reduction that sums each chunk's gradients into its
owner's copy (`dist.reduce` per chunk: the reduce-scatter's volume, and gloo has it).

Precision: the compute list has the model's dtype (fp32 on CPU). A GPU run would keep it in half precision
with the fp32 master list; this module is written for both but only the CPU path is tested here.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import adam as adam_fn
from torch.optim import sgd as sgd_fn

from services.executor.train.chunk_layout import ChunkLayout, plan_chunks
from services.executor.train.device_pool import MemoryPool


class TensorState(enum.Enum):
    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"


OS_KINDS = ("master", "momentum", "variance")


def _resize(t: Tensor, numel: int) -> None:
    t.untyped_storage().resize_(numel * t.element_size())


@dataclass
class Chunk:
    key: int  # unique over every list: the name in the access trace
    kind: str  # "param" or one of OS_KINDS
    index: int  # position in the chunk list (the layout's chunk number)
    device: Tensor
    host: Tensor
    where: str | None  # "device", "host", or None (a remote chunk not gathered)
    local: bool
    pinned: int = 0

    @property
    def nbytes(self) -> int:
        return self.device.numel() * self.device.element_size()

    def buffer(self) -> Tensor:
        if self.where is None:
            raise RuntimeError(f"chunk {self.kind}/{self.index} has no payload (FREE)")
        return self.device if self.where == "device" else self.host


@dataclass
class Traffic:
    to_device: int = 0
    to_host: int = 0
    gathered: int = 0  # bytes received by all-gathers (remote chunks)
    reduced: int = 0  # bytes put into gradient reductions
    evictions: int = 0

    def take(self) -> Traffic:
        out = Traffic(**vars(self))
        for k in vars(self):
            setattr(self, k, 0)
        return out


@dataclass
class _Trace:
    order: list[int] = field(default_factory=list)  # chunk key per moment, one iteration
    positions: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, order: list[int]) -> _Trace:
        positions: dict[int, list[int]] = {}
        for t, key in enumerate(order):
            positions.setdefault(key, []).append(t)
        return cls(list(order), positions)

    def next_use(self, key: int, now: int) -> float:
        pos = self.positions.get(key)
        if not pos:
            return float("inf")
        i = bisect.bisect_left(pos, now)
        return pos[i] if i < len(pos) else pos[0] + len(self.order)


class ChunkManager:
    def __init__(self, params: Sequence[nn.Parameter], chunk_bytes: int, device_pool: MemoryPool,
                 host_pool: MemoryPool, *, optimizer: str = "adam", rank: int = 0, world: int = 1,
                 group: object = None, group_ranks: Sequence[int] | None = None) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"chunks need parameters of one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        self.params = list(params)
        self.layout: ChunkLayout = plan_chunks([p.numel() for p in self.params],
                                               chunk_bytes // torch.empty((), dtype=dtype).element_size(), world)
        self.device_pool, self.host_pool = device_pool, host_pool
        self.rank, self.world, self.group = rank, world, group
        self.group_ranks = list(group_ranks) if group_ranks is not None else list(range(world))
        self.slot_of = {id(p): i for i, p in enumerate(self.params)}
        self.state = {}
        self.traffic = Traffic()
        self.moment = 0
        self.trace: _Trace | None = None
        self._recording: list[int] = []
        self._held_grads: dict[int, int] = {}  # slot -> bytes of a gradient temporary accounted on the device
        self._has_grad: set[int] = set()
        n = self.layout.chunk_numel
        self.chunks: list[Chunk] = []
        for c in range(self.layout.num_chunks):
            local = self.layout.owner(c) == rank
            device = torch.empty(n, dtype=dtype, device=self._device_of())  # emptied once the views exist
            host = torch.zeros(n, dtype=dtype) if local else torch.empty(0, dtype=dtype)
            chunk = Chunk(c, "param", c, device, host, "host" if local else None, local)
            if local:
                host_pool.reserve("chunk", chunk.nbytes)
            self.chunks.append(chunk)
        for i, (p, slot) in enumerate(zip(self.params, self.layout.slots, strict=True)):
            chunk = self.chunks[slot.chunk]
            if chunk.local:
                chunk.host[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            p.data = chunk.device[slot.offset:slot.offset + slot.numel].view(p.shape)
            self.state[i] = TensorState.HOLD if chunk.local else TensorState.FREE
        for chunk in self.chunks:
            _resize(chunk.device, 0)
        kinds = OS_KINDS if optimizer == "adam" else OS_KINDS[:1]
        self.os: dict[int, dict[str, Chunk]] = {}
        for c in self.layout.local_chunks(rank):
            self.os[c] = {}
            for j, kind in enumerate(kinds):
                device = torch.empty(n, dtype=torch.float32, device=self._device_of())
                _resize(device, 0)
                source = self.chunks[c].host
                host = source.float().clone() if kind == "master" else torch.zeros(n, dtype=torch.float32)
                chunk = Chunk(len(self.chunks) + len(OS_KINDS) * c + j, kind, c, device, host, "host", True)
                host_pool.reserve("optimizer", chunk.nbytes)
                self.os[c][kind] = chunk
        self.steps = {i: torch.tensor(0.0) for i, s in enumerate(self.layout.slots)
                      if self.layout.owner(s.chunk) == rank}
        device_pool.on_pressure = self._evict

    # -- placement ---------------------------------------------------------------------------------------------
    def _device_of(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _pool(self, where: str) -> MemoryPool:
        return self.device_pool if where == "device" else self.host_pool

    @staticmethod
    def _kind(chunk: Chunk) -> str:
        return "chunk" if chunk.kind == "param" else "optimizer"

    def _move(self, chunk: Chunk, to: str) -> None:
        if chunk.where == to:
            return
        assert chunk.where is not None and chunk.local
        chunk.pinned += 1
        try:
            self._pool(to).reserve(self._kind(chunk), chunk.nbytes)
        finally:
            chunk.pinned -= 1
        src, dst = chunk.buffer(), (chunk.device if to == "device" else chunk.host)
        _resize(dst, src.numel())
        with torch.no_grad():
            dst.copy_(src)
        _resize(src, 0)
        self._pool(chunk.where).release(self._kind(chunk), chunk.nbytes)
        chunk.where = to
        if to == "device":
            self.traffic.to_device += chunk.nbytes
        else:
            self.traffic.to_host += chunk.nbytes

    def _evictable(self, chunk: Chunk) -> bool:
        if chunk.where != "device" or chunk.pinned or not chunk.local:
            return False
        if chunk.kind != "param":
            return True
        return all(self.state[i] != TensorState.COMPUTE for i in self.layout.slots_of(chunk.index))

    def _evict(self, need: int) -> None:
        """Make `need` bytes of device room: Belady's choice once traced, chunk-list order in the warm-up."""
        freed = 0
        while freed < need:
            candidates = [c for c in self._all_chunks() if self._evictable(c)]
            if not candidates:
                return
            if self.trace is None:
                victim = min(candidates, key=lambda c: c.key)
            else:
                trace = self.trace
                victim = max(candidates, key=lambda c: (trace.next_use(c.key, self.moment), c.key))
            self._move(victim, "host")
            self.traffic.evictions += 1
            freed += victim.nbytes

    def _all_chunks(self) -> Iterable[Chunk]:
        yield from self.chunks
        for triple in self.os.values():
            yield from triple.values()

    def resident_storages(self) -> set[int]:
        """Addresses of the device buffers now holding chunks (saved views of them are model data)."""
        return {c.device.untyped_storage().data_ptr() for c in self._all_chunks() if c.where == "device"}

    def _touch(self, chunk: Chunk) -> None:
        self._recording.append(chunk.key)
        self.moment += 1

    # -- Algorithms 1 and 2 ------------------------------------------------------------------------------------
    def access(self, params: Iterable[nn.Parameter]) -> None:
        slots = [self.slot_of[id(p)] for p in params]
        wanted = [self.chunks[c] for c in dict.fromkeys(self.layout.slots[i].chunk for i in slots)]
        pinned: list[Chunk] = []
        try:
            for chunk in wanted:
                self._touch(chunk)
                if chunk.where is None or (self.world > 1 and any(self.chunks[g].where is None
                                                                   for g in self.layout.group(chunk.index))):
                    self._gather(chunk.index)
                else:
                    self._move(chunk, "device")
                chunk.pinned += 1  # bringing the layer's next chunk must not evict this one
                pinned.append(chunk)
            for i in slots:
                self.state[i] = TensorState.COMPUTE
        finally:
            for chunk in pinned:
                chunk.pinned -= 1

    def release(self, params: Iterable[nn.Parameter], state: TensorState) -> None:
        chunks = set()
        for p in params:
            i = self.slot_of[id(p)]
            self.state[i] = state
            chunks.add(self.layout.slots[i].chunk)
        if self.world > 1:
            for c in sorted(chunks):
                self._release_group(c, state, reduce=False)

    def forward_done(self) -> None:
        """FWD reset: HOLD_AFTER_FWD becomes HOLD, so a backward's HOLD_AFTER_BWD is told apart (§6.2)."""
        for i, s in self.state.items():
            if s == TensorState.HOLD_AFTER_FWD:
                self.state[i] = TensorState.HOLD
        if self.world > 1:
            for g in range(0, self.layout.num_chunks, self.world):
                self._free_remote(g)

    def grad_ready(self, p: nn.Parameter, last_micro_batch: bool) -> None:
        """After `p`'s gradient accumulated: on the last micro-batch it moves into `p`'s own slot (Fig. 6)."""
        i = self.slot_of[id(p)]
        grad = p.grad
        assert grad is not None
        self._has_grad.add(i)
        if not last_micro_batch:
            if i not in self._held_grads:
                self._held_grads[i] = grad.numel() * grad.element_size()
                self.device_pool.reserve("grad", self._held_grads[i])
            self.state[i] = TensorState.HOLD_AFTER_BWD
            if self.world > 1:
                self._release_group(self.layout.slots[i].chunk, TensorState.HOLD_AFTER_BWD, reduce=False)
            return
        with torch.no_grad():
            p.data.copy_(grad)
        p.grad = None
        held = self._held_grads.pop(i, 0)
        if held:
            self.device_pool.release("grad", held)
        self.state[i] = TensorState.HOLD_AFTER_BWD
        if self.world > 1:
            self._release_group(self.layout.slots[i].chunk, TensorState.HOLD_AFTER_BWD, reduce=True)

    def backward_done(self, last_micro_batch: bool) -> None:
        if self.world > 1 and last_micro_batch:
            missing = [i for i in range(len(self.params)) if i not in self._has_grad]
            if missing:
                raise RuntimeError(f"chunks: parameters {missing} got no gradient; data-parallel chunks reduce each "
                                   "communication group once, so every parameter must take part in the loss")
        if self.world > 1 and not last_micro_batch:
            for g in range(0, self.layout.num_chunks, self.world):
                self._free_remote(g)

    # -- Algorithms 3 and 4 ------------------------------------------------------------------------------------
    def _gather(self, c: int) -> None:
        members = [self.chunks[g] for g in self.layout.group(c)]
        for m in members:
            m.pinned += 1
        try:
            for m in members:
                if m.local:
                    self._move(m, "device")
                elif m.where is None:
                    self.device_pool.reserve("chunk", m.nbytes)
                    _resize(m.device, self.layout.chunk_numel)
                    m.where = "device"
            local = next(m for m in members if m.local)
            dist.all_gather([m.device for m in members], local.device, group=self.group)
            self.traffic.gathered += sum(m.nbytes for m in members if not m.local)
            for m in members:
                for i in self.layout.slots_of(m.index):
                    if self.state[i] == TensorState.FREE:
                        self.state[i] = TensorState.HOLD
        finally:
            for m in members:
                m.pinned -= 1

    def _release_group(self, c: int, state: TensorState, *, reduce: bool) -> None:
        members = list(self.layout.group(c))
        if any(self.chunks[g].where is None for g in members):
            return
        if not all(self.state[i] == state for g in members for i in self.layout.slots_of(g)):
            return
        if reduce:
            for g in members:
                chunk = self.chunks[g]
                chunk.pinned += 1
            try:
                for g in members:
                    chunk = self.chunks[g]
                    if chunk.local:
                        self._move(chunk, "device")
                    dst = self.group_ranks[self.layout.owner(g)]
                    dist.reduce(chunk.device, dst, op=dist.ReduceOp.SUM, group=self.group)
                    self.traffic.reduced += chunk.nbytes
            finally:
                for g in members:
                    self.chunks[g].pinned -= 1
        self._free_remote(members[0])

    def _free_remote(self, first: int) -> None:
        for g in self.layout.group(first):
            chunk = self.chunks[g]
            if chunk.local or chunk.where is None:
                continue
            _resize(chunk.device, 0)
            self.device_pool.release("chunk", chunk.nbytes)
            chunk.where = None
            for i in self.layout.slots_of(g):
                self.state[i] = TensorState.FREE

    # -- the step (ADAM stage) ---------------------------------------------------------------------------------
    def step(self, optimizer: dict[str, Any]) -> None:
        """Update every local chunk where its optimizer states are, then copy the fp32 master into the slots."""
        lr, wd = float(optimizer["learning_rate"]), float(optimizer.get("weight_decay", 0.0))
        for c, states in self.os.items():
            master = states["master"]
            where = master.where
            assert where is not None
            for chunk in (self.chunks[c], *states.values()):
                self._touch(chunk)
                chunk.pinned += 1
                self._move(chunk, where)
            try:
                slots = [i for i in self.layout.slots_of(c) if i in self._has_grad]
                views = {k: self._views(ch, slots) for k, ch in states.items()}
                grads = self._views(self.chunks[c], slots)
                with torch.no_grad():
                    if optimizer["name"] == "adam":
                        adam_fn.adam(
                            views["master"], [g.float() for g in grads], views["momentum"], views["variance"], [],
                            [self.steps[i] for i in slots], foreach=False, amsgrad=False, beta1=0.9, beta2=0.999,
                            lr=lr, weight_decay=wd, eps=1e-8, maximize=False)
                    else:
                        sgd_fn.sgd(views["master"], [g.float() for g in grads], [None] * len(slots),
                                            foreach=False, weight_decay=wd, momentum=0.0, lr=lr, dampening=0.0,
                                            nesterov=False, maximize=False)
                    for param, new in zip(grads, views["master"], strict=True):
                        param.copy_(new)
            finally:
                for chunk in (self.chunks[c], *states.values()):
                    chunk.pinned -= 1
            for i in self.layout.slots_of(c):
                self.state[i] = TensorState.HOLD
        self._has_grad.clear()

    def _views(self, chunk: Chunk, slots: list[int]) -> list[Tensor]:
        buf = chunk.buffer()
        return [buf[s.offset:s.offset + s.numel] for s in (self.layout.slots[i] for i in slots)]

    # -- iterations --------------------------------------------------------------------------------------------
    def end_iteration(self) -> None:
        """After the step: the first call ends the warm-up (trace, margin placement); every call resets moments."""
        if self.trace is None:
            self.trace = _Trace.of(self._recording)
            self._place_optimizer_states()
        self._recording = []
        self.moment = 0

    def margin_bytes(self) -> int | None:
        pool = self.device_pool
        if pool.budget is None:
            return None
        return max(pool.budget - pool.peak_non_model - pool.peak_by_kind["chunk"], 0)

    def _place_optimizer_states(self) -> None:
        margin = self.margin_bytes()
        for states in self.os.values():
            size = sum(ch.nbytes for ch in states.values())
            if margin is not None and size > margin:
                break
            for ch in states.values():
                self._move(ch, "device")
            if margin is not None:
                margin -= size
        self.os_on_device = sum(1 for s in self.os.values() if s["master"].where == "device")

    os_on_device = 0
