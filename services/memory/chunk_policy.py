"""PatrickStar's chunk residency policy (§6–§8), pure: which chunk is where, in which state, and what moves.

Why pure: the executor's chunk manager (services/executor/train/chunks.py) and the planner's simulator
(services/planner/sim/chunks.py) run this same policy, one with real tensors behind a `Mover`, the other with
none. So the simulator's swap bytes are the runtime's, given the same layout, order of accesses and
activation sizes, and the two cannot drift apart.

Tensor states follow Table 1 (FREE, COMPUTE, HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD). `access` makes the chunks
of some tensors resident on the device and the tensors COMPUTE (Alg. 1); `release` sets HOLD_AFTER_FWD/BWD
(Alg. 2). A chunk may leave the device only when none of its tensors is COMPUTE and it is not pinned. Every byte
is accounted on two `MemoryPool`s (device, host), whose pressure callback is this policy's eviction.

The first iteration is the warm-up (§8.1): evictions go in chunk-list order and the order of chunk accesses
(moments) is recorded, with the non-model and chunk peaks. From then on eviction is Belady's (§8.3): the
evictable chunk whose next use in the recorded, cyclic order is farthest goes first; and optimizer-state
chunks move into the device's margin (§8.2) -- the budget minus the traced non-model peak and the parameter
chunks' peak -- as many as fit.

Data parallelism (§7, Alg. 3–4): with `world` > 1 a process keeps only its local chunks and their optimizer
states; the first access to a communication group with a FREE member gathers the group onto the device; once
every tensor of the group is HOLD_AFTER_FWD (or _BWD) its remote chunks are freed, after the last micro-batch's
backward by way of a reduction of each chunk's gradients into its owner.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.memory.chunk_layout import ChunkLayout
from services.memory.pool import MemoryPool


class TensorState(enum.Enum):
    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"


OS_KINDS = ("master", "momentum", "variance")  # Adam's; SGD without momentum keeps the master only


@dataclass
class Chunk:
    key: int  # unique over every list: the name in the access trace
    kind: str  # "param" or one of OS_KINDS
    index: int  # the layout's chunk number
    nbytes: int
    where: str | None  # "device", "host", or None (a remote chunk not gathered)
    local: bool
    pinned: int = 0


@contextmanager
def _pinned(chunks: Sequence[Chunk]) -> Iterator[None]:
    """Keep `chunks` where they are (not evicted) while a group operation places its members."""
    for chunk in chunks:
        chunk.pinned += 1
    try:
        yield
    finally:
        for chunk in chunks:
            chunk.pinned -= 1


class Mover:
    """What a policy decision does to data. The base class does nothing (the simulator's)."""

    def move(self, chunk: Chunk, to: str) -> None:
        """Copy `chunk`'s payload to `to` and drop it where it was."""

    def gather(self, members: list[Chunk]) -> None:
        """All-gather a communication group onto the device (its remote members' buffers are allocated here)."""

    def reduce(self, chunk: Chunk, owner: int) -> None:
        """Sum `chunk`'s gradients over the group into process `owner`'s copy."""

    def free(self, chunk: Chunk) -> None:
        """Drop a remote chunk's device payload."""


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
class Trace:
    order: list[int] = field(default_factory=list)  # chunk key per moment, one iteration
    positions: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, order: list[int]) -> Trace:
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


class ChunkPolicy:
    def __init__(self, layout: ChunkLayout, element_size: int, device_pool: MemoryPool, host_pool: MemoryPool,
                 *, os_kinds: Sequence[str] = OS_KINDS, os_element_size: int = 4, rank: int = 0,
                 mover: Mover | None = None) -> None:
        self.layout, self.rank = layout, rank
        self.device_pool, self.host_pool = device_pool, host_pool
        self.mover = mover or Mover()
        self.traffic = Traffic()
        self.moment = 0
        self.trace: Trace | None = None
        self._recording: list[int] = []
        self._slots_of = [layout.slots_of(c) for c in range(layout.num_chunks)]
        self.chunks: list[Chunk] = []
        for c in range(layout.num_chunks):
            local = layout.owner(c) == rank
            chunk = Chunk(c, "param", c, layout.chunk_numel * element_size, "host" if local else None, local)
            if local:
                host_pool.reserve("chunk", chunk.nbytes)
            self.chunks.append(chunk)
        self.state = {i: TensorState.HOLD if self.chunks[s.chunk].local else TensorState.FREE
                      for i, s in enumerate(layout.slots)}
        self.os: dict[int, dict[str, Chunk]] = {}
        for c in layout.local_chunks(rank):
            self.os[c] = {}
            for j, kind in enumerate(os_kinds):
                chunk = Chunk(layout.num_chunks + len(OS_KINDS) * c + j, kind, c,
                              layout.chunk_numel * os_element_size, "host", True)
                host_pool.reserve("optimizer", chunk.nbytes)
                self.os[c][kind] = chunk
        self.has_grad: set[int] = set()
        self.held_grads: dict[int, int] = {}  # slot -> bytes of a gradient kept across micro-batches
        self.os_on_device = 0
        device_pool.on_pressure = self._evict

    # -- placement ---------------------------------------------------------------------------------------------
    def slots_of(self, chunk: int) -> list[int]:
        return self._slots_of[chunk]

    def all_chunks(self) -> Iterable[Chunk]:
        yield from self.chunks
        for states in self.os.values():
            yield from states.values()

    def _pool(self, where: str) -> MemoryPool:
        return self.device_pool if where == "device" else self.host_pool

    @staticmethod
    def _kind(chunk: Chunk) -> str:
        return "chunk" if chunk.kind == "param" else "optimizer"

    def move(self, chunk: Chunk, to: str) -> None:
        if chunk.where == to:
            return
        if chunk.where is None or not chunk.local:
            raise RuntimeError(f"chunk {chunk.kind}/{chunk.index} has no local payload to move")
        chunk.pinned += 1
        try:
            self._pool(to).reserve(self._kind(chunk), chunk.nbytes)
        finally:
            chunk.pinned -= 1
        self.mover.move(chunk, to)
        self._pool(chunk.where).release(self._kind(chunk), chunk.nbytes)
        chunk.where = to
        if to == "device":
            self.traffic.to_device += chunk.nbytes
        else:
            self.traffic.to_host += chunk.nbytes

    def _evictable(self, chunk: Chunk) -> bool:
        if chunk.where != "device" or chunk.pinned or not chunk.local:
            return False
        return chunk.kind != "param" or all(self.state[i] != TensorState.COMPUTE for i in self._slots_of[chunk.index])

    def _evict(self, need: int) -> None:
        """Make `need` bytes of device room: Belady's choice once traced, chunk-list order in the warm-up."""
        freed = 0
        while freed < need:
            candidates = [c for c in self.all_chunks() if self._evictable(c)]
            if not candidates:
                return
            if self.trace is None:
                victim = min(candidates, key=lambda c: c.key)
            else:
                trace = self.trace
                victim = max(candidates, key=lambda c: (trace.next_use(c.key, self.moment), c.key))
            self.move(victim, "host")
            self.traffic.evictions += 1
            freed += victim.nbytes

    def touch(self, chunk: Chunk) -> None:
        self._recording.append(chunk.key)
        self.moment += 1

    # -- Algorithms 1 and 2 ------------------------------------------------------------------------------------
    def access(self, slots: Sequence[int]) -> None:
        wanted = [self.chunks[c] for c in dict.fromkeys(self.layout.slots[i].chunk for i in slots)]
        pinned: list[Chunk] = []
        try:
            for chunk in wanted:
                self.touch(chunk)
                if any(self.chunks[g].where is None for g in self.layout.group(chunk.index)):
                    self._gather(chunk.index)
                else:
                    self.move(chunk, "device")
                chunk.pinned += 1  # bringing the next chunk must not evict this one
                pinned.append(chunk)
            for i in slots:
                self.state[i] = TensorState.COMPUTE
        finally:
            for chunk in pinned:
                chunk.pinned -= 1

    def release(self, slots: Iterable[int], state: TensorState) -> None:
        chunks = set()
        for i in slots:
            self.state[i] = state
            chunks.add(self.layout.slots[i].chunk)
        if self.layout.world > 1:
            for c in sorted(chunks):
                self._release_group(c, state, reduce=False)

    def forward_done(self) -> None:
        """FWD reset: HOLD_AFTER_FWD becomes HOLD, so a backward's HOLD_AFTER_BWD is told apart (§6.2)."""
        for i, s in self.state.items():
            if s == TensorState.HOLD_AFTER_FWD:
                self.state[i] = TensorState.HOLD
        self._free_all_remote()

    def hold_grad(self, slot: int, nbytes: int) -> None:
        """A gradient kept on the device until the last micro-batch (accounted once per iteration)."""
        self.has_grad.add(slot)
        if slot not in self.held_grads:
            self.held_grads[slot] = nbytes
            self.device_pool.reserve("grad", nbytes)
        self.state[slot] = TensorState.HOLD_AFTER_BWD
        if self.layout.world > 1:
            self._release_group(self.layout.slots[slot].chunk, TensorState.HOLD_AFTER_BWD, reduce=False)

    def grad_final(self, slot: int) -> None:
        """The slot now holds its final gradient (Fig. 6): the held temporary is gone."""
        self.has_grad.add(slot)
        held = self.held_grads.pop(slot, 0)
        if held:
            self.device_pool.release("grad", held)
        self.state[slot] = TensorState.HOLD_AFTER_BWD
        if self.layout.world > 1:
            self._release_group(self.layout.slots[slot].chunk, TensorState.HOLD_AFTER_BWD, reduce=True)

    def backward_done(self, last_micro_batch: bool) -> None:
        if self.layout.world == 1:
            return
        if last_micro_batch:
            missing = [i for i in range(len(self.layout.slots)) if i not in self.has_grad]
            if missing:
                raise RuntimeError(f"chunks: parameters {missing} got no gradient; data-parallel chunks reduce each "
                                   "communication group once, so every parameter must take part in the loss")
        else:
            self._free_all_remote()

    # -- Algorithms 3 and 4 ------------------------------------------------------------------------------------
    def _gather(self, c: int) -> None:
        members = [self.chunks[g] for g in self.layout.group(c)]
        with _pinned(members):
            for m in members:
                if m.local:
                    self.move(m, "device")
                elif m.where is None:
                    self.device_pool.reserve("chunk", m.nbytes)
                    m.where = "device"
            self.mover.gather(members)
            self.traffic.gathered += sum(m.nbytes for m in members if not m.local)
            for m in members:
                for i in self._slots_of[m.index]:
                    if self.state[i] == TensorState.FREE:
                        self.state[i] = TensorState.HOLD

    def _release_group(self, c: int, state: TensorState, *, reduce: bool) -> None:
        members = [self.chunks[g] for g in self.layout.group(c)]
        if any(m.where is None for m in members):
            return
        if not all(self.state[i] == state for m in members for i in self._slots_of[m.index]):
            return
        if reduce:
            with _pinned(members):
                for m in members:
                    if m.local:
                        self.move(m, "device")
                    self.mover.reduce(m, self.layout.owner(m.index))
                    self.traffic.reduced += m.nbytes
        self._free_remote(members)

    def _free_remote(self, members: Iterable[Chunk]) -> None:
        for m in members:
            if m.local or m.where is None:
                continue
            self.mover.free(m)
            self.device_pool.release("chunk", m.nbytes)
            m.where = None
            for i in self._slots_of[m.index]:
                self.state[i] = TensorState.FREE

    def _free_all_remote(self) -> None:
        if self.layout.world > 1:
            self._free_remote(self.chunks)

    # -- the step (ADAM stage) ---------------------------------------------------------------------------------
    def step_chunks(self) -> list[tuple[int, str]]:
        """(chunk, where its step runs) for every local chunk, in order."""
        return [(c, states["master"].where or "host") for c, states in self.os.items()]

    def prepare_step(self, c: int) -> list[Chunk]:
        """Bring chunk `c`'s gradients and optimizer states to where its master is; pinned until `finish_step`."""
        where = self.os[c]["master"].where
        assert where is not None
        members = [self.chunks[c], *self.os[c].values()]
        for chunk in members:
            self.touch(chunk)
            chunk.pinned += 1
            self.move(chunk, where)
        return members

    def finish_step(self, c: int, members: list[Chunk]) -> None:
        for chunk in members:
            chunk.pinned -= 1
        for i in self._slots_of[c]:
            self.state[i] = TensorState.HOLD

    def end_iteration(self) -> None:
        """After the step: the first call ends the warm-up (trace, margin placement); every call resets moments."""
        self.has_grad.clear()
        if self.trace is None:
            self.trace = Trace.of(self._recording)
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
                self.move(ch, "device")
            if margin is not None:
                margin -= size
        self.os_on_device = sum(1 for s in self.os.values() if s["master"].where == "device")
