"""PatrickStar's chunk manager (§6–§8) with real tensors: model data in fixed-size chunks under a device budget.

The residency policy (states, eviction, gathers, margin) is `services.memory.chunk_policy`, shared with the
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
reductions apart from the compute around them; on a GPU a gather or reduction ends with a device sync, so the
collective it launched is inside its span, and a move counts its copy's own time, read from CUDA events.

CUDA path (the CPU path is as above, unchanged): host buffers are pinned and never resized, so a copy can run on
the copy engine while compute goes on (the caching host allocator keeps freed pinned blocks anyway, so resizing
them would save no memory, only re-pinning time). Moves run on one copy stream with `non_blocking=True`:
- to the device: the buffer is allocated on the compute stream, whose earlier kernels may have used that block,
  so the copy stream waits for compute first; compute then waits on the copy's event before any kernel reads it;
- to the host: the copy stream waits for compute (which wrote the gradients or the step), and the host waits on
  the copy's event before the device buffer's storage is resized to 0: that hands the block back to the caching
  allocator, which could give it to a compute kernel while the copy still reads it, and the host side is read
  next (the step on the host). So an eviction is synchronous; a move in is not.

Precision: the compute list has the model's dtype: fp32 on the CPU, bf16 on a GPU for a bf16 model (mixed
precision: `offload.compute_dtype`), beside the fp32 master, momentum and variance lists, which the step updates
from the gradients cast to fp32 before it copies the master back into the compute slots (rounded to their
dtype). benchmarks/memory_gpu.py runs both precisions on the GPU.
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

from services.memory.chunk_layout import plan_chunks
from services.memory.chunk_policy import OS_KINDS, Chunk, ChunkPolicy, Mover, TensorState
from services.memory.pool import MemoryPool

MOVER_KINDS = ("move", "gather", "reduce")
MIB = 2**20


def _resize(t: Tensor, numel: int) -> None:
    t.untyped_storage().resize_(numel * t.element_size())


class ChunkManager(Mover):
    def __init__(self, params: Sequence[nn.Parameter], chunk_bytes: int, device_pool: MemoryPool,
                 host_pool: MemoryPool, *, optimizer: str = "adam", rank: int = 0, world: int = 1,
                 group: object = None, group_ranks: Sequence[int] | None = None,
                 device: str | torch.device | None = None) -> None:
        """`device` is where chunks compute (default: the parameters'); parameters built on the host for a CUDA
        device never take the whole model's room there, one chunk at a time passes through it."""
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"chunks need parameters of one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        size = torch.empty((), dtype=dtype).element_size()
        self.params = list(params)
        self.rank, self.kinds = rank, OS_KINDS if optimizer == "adam" else OS_KINDS[:1]
        self.layout = plan_chunks([p.numel() for p in self.params], chunk_bytes // size, world)
        self.group = group
        self.group_ranks = list(group_ranks) if group_ranks is not None else list(range(world))
        self.slot_of = {id(p): i for i, p in enumerate(self.params)}
        if device is None:
            device = self.params[0].device if self.params else torch.device("cpu")
        device = torch.device(device)
        self.device_type = device.type
        self.streams = CopyStreams.for_device(device)
        self.seconds = dict.fromkeys(MOVER_KINDS, 0.0)  # inside the Mover's methods since the last take_swap_s
        n = self.layout.chunk_numel
        kinds = OS_KINDS if optimizer == "adam" else OS_KINDS[:1]
        self.policy = ChunkPolicy(self.layout, size, device_pool, host_pool, os_kinds=kinds, rank=rank, mover=self)
        self.device: dict[int, Tensor] = {}  # chunk key -> flat device buffer (storage 0 while away)
        self.host: dict[int, Tensor] = {}
        pin = self.streams is not None
        for chunk in self.policy.chunks:  # one chunk's device buffer at a time: emptied once its views exist
            buffer = self.device[chunk.key] = torch.empty(n, dtype=dtype, device=device)
            host = self.host[chunk.key] = _host_buffer(n if chunk.local else 0, dtype, pin)
            for i in self.layout.slots_of(chunk.index):
                p, slot = self.params[i], self.layout.slots[i]
                if chunk.local:
                    host[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
                p.data = buffer[slot.offset:slot.offset + slot.numel].view(p.shape)
            _resize(buffer, 0)
        for c, states in self.policy.os.items():
            for kind, chunk in states.items():
                self.device[chunk.key] = torch.empty(n, dtype=torch.float32, device=device)
                _resize(self.device[chunk.key], 0)
                host = self.host[chunk.key] = _host_buffer(n, torch.float32, pin)
                if kind == "master":
                    host.copy_(self.host[self.policy.chunks[c].key])
        self.steps = {i: torch.tensor(0.0) for i, s in enumerate(self.layout.slots)
                      if self.layout.owner(s.chunk) == rank}

    @property
    def comm_s(self) -> float:
        """Seconds in gathers and reductions since the last `take_swap_s` (collectives, not host copies)."""
        return self.seconds["gather"] + self.seconds["reduce"]

    def take_swap_s(self) -> float:
        """Seconds moving, gathering and reducing chunks since the last call (a worker calls it per iteration).
        On CUDA the moves' seconds are their copies' event times, read here (this waits for pending copies)."""
        if self.streams is not None:
            self.seconds["move"] += self.streams.take_seconds()
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
        if self.streams is not None:
            self._move_cuda(chunk, to, self.streams)
            return
        src, dst = (self.host, self.device) if to == "device" else (self.device, self.host)
        source, target = src[chunk.key], dst[chunk.key]
        with self._timed("move"):
            _resize(target, self.layout.chunk_numel)
            with torch.no_grad():
                target.copy_(source)
            _resize(source, 0)

    def _move_cuda(self, chunk: Chunk, to: str, streams: CopyStreams) -> None:
        """The CUDA move: pinned host buffers stay allocated; see the module's docstring for the ordering."""
        device, host = self.device[chunk.key], self.host[chunk.key]
        if to == "device":
            _resize(device, self.layout.chunk_numel)  # on the compute stream: the copy waits for it (in `copy`)
            streams.copy(device, host, blocking=False)
        else:
            streams.copy(host, device, blocking=True)  # done before the block is freed and the host reads it
            _resize(device, 0)

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

    def close(self) -> None:
        """Free every device buffer once the pending copies are done (the manager is not used after this)."""
        if self.streams is not None:
            self.streams.take_seconds()
        for buffer in self.device.values():
            _resize(buffer, 0)

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
        for c, _where in self.policy.step_chunks():
            members = self.policy.prepare_step(c)
            try:
                slots = [i for i in self.policy.slots_of(c) if i in self.policy.has_grad]
                views = {kind: self._views(chunk, slots) for kind, chunk in self.policy.os[c].items()}
                grads = self._views(self.policy.chunks[c], slots)
                with torch.no_grad():
                    functional_step(optimizer, views["master"], [g.float() for g in grads], views.get("momentum", []),
                                    views.get("variance", []), [self.steps[i] for i in slots])
                    for param, new in zip(grads, views["master"], strict=True):
                        param.copy_(new)
            finally:
                self.policy.finish_step(c, members)

    def gather_states(self, dst: int = 0) -> dict[int, dict[str, Tensor]] | None:
        """Every slot's fp32 master (and Adam's momentum, variance and step) on rank `dst`, host copies, None on the
        other ranks: each chunk's owner sends its states there. Every rank calls it at the same boundary."""
        comm = torch.device(self.device_type) if dist.is_initialized() and dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")
        n, out = self.layout.chunk_numel, {} if self.rank == dst else None
        for c in range(self.layout.num_chunks):
            owner, slots = self.layout.owner(c), self.layout.slots_of(c)
            if self.rank not in (owner, dst):
                continue
            if self.rank == owner:
                flat = torch.cat([self._buffer(self.policy.os[c][kind]).float().cpu() for kind in self.kinds]
                                 + [torch.stack([self.steps[i] for i in slots]).float() if slots else torch.empty(0)])
                if owner != dst:
                    dist.send(flat.to(comm), self.group_ranks[dst], group=self.group)
                    continue
            else:
                flat = torch.empty(n * len(self.kinds) + len(slots), dtype=torch.float32, device=comm)
                dist.recv(flat, self.group_ranks[owner], group=self.group)
                flat = flat.cpu()
            assert out is not None
            for j, i in enumerate(slots):
                s = self.layout.slots[i]
                out[i] = {kind: flat[k * n + s.offset:k * n + s.offset + s.numel].clone()
                          for k, kind in enumerate(self.kinds)}
                out[i]["step"] = flat[len(self.kinds) * n + j].clone()
        return out

    def load_states(self, states: dict[int, dict[str, Tensor]]) -> None:
        """A resume, before the first iteration (every local chunk still on the host): the local slots' fp32
        master, momentum, variance and step from `states` (slot -> {kind: tensor, "step": scalar})."""
        for c, kinds in self.policy.os.items():
            for i in self.layout.slots_of(c):
                s = self.layout.slots[i]
                for kind, chunk in kinds.items():
                    self.host[chunk.key][s.offset:s.offset + s.numel].copy_(states[i][kind].reshape(-1))
                self.steps[i] = states[i]["step"].detach().float().clone().reshape(())

    def _buffer(self, chunk: Chunk) -> Tensor:
        return self.device[chunk.key] if chunk.where == "device" else self.host[chunk.key]

    def local_payloads(self) -> list[Tensor]:
        """This process's own parameter chunks, wherever each is now (what its fingerprint covers)."""
        return [self.device[c.key] if c.where == "device" else self.host[c.key]
                for c in self.policy.chunks if c.local]

    def _views(self, chunk: Chunk, slots: list[int]) -> list[Tensor]:
        buf = self.device[chunk.key] if chunk.where == "device" else self.host[chunk.key]
        return [buf[s.offset:s.offset + s.numel] for s in (self.layout.slots[i] for i in slots)]


def functional_step(optimizer: dict[str, Any], params: list[Tensor], grads: list[Tensor], momentum: list[Tensor],
                    variance: list[Tensor], steps: list[Tensor]) -> None:
    """One Adam (or plain SGD) step on tensors the caller placed, with the math `stage.make_optimizer`'s
    optimizers run (so offloaded training equals the in-memory reference): the chunk manager steps its fp32
    master lists with it, Harmony each layer right after its backward. Adam's `steps` are incremented."""
    lr, wd = float(optimizer["learning_rate"]), float(optimizer.get("weight_decay", 0.0))
    if optimizer["name"] == "adam":
        adam_fn.adam(params, grads, momentum, variance, [], steps, foreach=False, amsgrad=False, beta1=0.9,
                     beta2=0.999, lr=lr, weight_decay=wd, eps=1e-8, maximize=False)
    else:
        sgd_fn.sgd(params, grads, [None] * len(params), foreach=False, weight_decay=wd, momentum=0.0, lr=lr,
                   dampening=0.0, nesterov=False, maximize=False)


def _host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
    """A zeroed host buffer; pinned for a CUDA device, so copies from and to it can be asynchronous."""
    return torch.zeros(numel, dtype=dtype, pin_memory=pin)


class CopyStreams:
    """A CUDA device's compute stream and one copy stream, with the events that order them and time the copies."""

    def __init__(self, device: torch.device) -> None:
        self.compute = torch.cuda.current_stream(device)
        self.copier = torch.cuda.Stream(device)
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @classmethod
    def for_device(cls, device: torch.device) -> CopyStreams | None:
        """Streams for a CUDA device; None elsewhere (the CPU moves synchronously, nothing to overlap)."""
        return cls(device) if device.type == "cuda" else None

    def copy(self, target: Tensor, source: Tensor, *, blocking: bool) -> None:
        """`target.copy_(source)` on the copy stream, after the compute stream's work so far (it may have written
        `source` or used `target`'s block); compute waits for the copy before its next kernel. With `blocking`
        the host waits too (the caller frees or reads a side next)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.copier.wait_stream(self.compute)
        with torch.cuda.stream(self.copier), torch.no_grad():
            start.record(self.copier)
            target.copy_(source, non_blocking=True)
            end.record(self.copier)
        self.compute.wait_event(end)
        self._pending.append((start, end))
        if blocking:
            end.synchronize()

    def take_seconds(self) -> float:
        """Seconds the copies since the last call took on the copy stream (waits for the last of them)."""
        seconds = 0.0
        for start, end in self._pending:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000
        self._pending = []
        return seconds


def pool_budget(budget: int, runtime_bytes: int, chunk_bytes: int) -> int:
    """The device pool's share of a CUDA budget `budget`: what the pool does not see must fit in the rest.

    The pool accounts chunks, held gradients and saved activations. Besides them the allocator holds
    `runtime_bytes` (measured by `runtime_reserve`: cuBLAS/cuBLASLt workspaces and whatever else stays allocated
    with no model data), transients the pool never sees -- a gradient between autograd and its slot (the tied
    embedding's sums over the whole backward, beside one layer's), an on-device step's temporaries, each at most
    a chunk: two chunks -- and the caching allocator's rounding: a large block up to 1 MiB over its request, one
    per chunk that fits (plus one)."""
    rounding = (budget // chunk_bytes + 1) * MIB
    share = budget - runtime_bytes - 2 * chunk_bytes - rounding
    if share <= 0:
        raise ValueError(f"device budget {budget / MIB:.0f} MiB leaves nothing for the chunks: the runtime holds "
                         f"{runtime_bytes / MIB:.1f} MiB and transients take {(2 * chunk_bytes + rounding) / MIB:.0f} "
                         "MiB; raise the budget or lower chunk_bytes")
    return share


def runtime_reserve(device: torch.device) -> int:
    """Bytes allocated on a CUDA device with no model data, after a warm-up linear layer's forward and backward:
    the cuBLAS and cuBLASLt workspaces, allocated on first use, stay allocated for good and count in
    `max_memory_allocated`. Whatever this process already holds there counts too (it is not the pool's)."""
    x = torch.ones(8, 64, device=device, requires_grad=True)
    w = torch.ones(64, 64, device=device, requires_grad=True)
    torch.nn.functional.linear(x, w, torch.zeros(64, device=device)).sum().backward()
    del x, w
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)
