"""Harmony's wrap-around pipeline with real tensors (Harmony §3, §4.4): one process per device, one shared host.

The schedule is `services.memory.harmony_schedule.HarmonySchedule` (the planner's search picks it). Every rank
builds the same model, then keeps nothing of it on its device: the weights and optimizer states of every layer live
in the host's shared memory (`HostStore`, files under /dev/shm mapped by every rank of the job, like one server's
DRAM seen by its GPUs), and a task brings its pack's weights to its device, runs its pack on every micro-batch of
the global batch, and lets them go. Backward tasks recompute their pack from the input a forward task stashed on the
host, accumulate gradients over the micro-batches and then update the pack layer by layer (just-in-time update:
weights, gradients and states meet on the device once) and write weights and states back. Activations and their
gradients go device to device between consecutive tasks (`isend`/`recv` on gloo; kept on the device when both tasks
share it). A copy thread prefetches the next task's weights while the current one computes when asked to.

The device is a `MemoryPool`: weights (kind "chunk", model data), gradients, optimizer states and the
activations in flight or saved for backward are placed on it, and a placement over the budget raises. Bytes moved
each way are counted where they are copied, so a test can hold them against `services.memory.harmony_schedule.traffic`.

The global batch is one replica's (Harmony PP, not DP); the loss of an iteration is the global batch's summed loss over
its label count, like `reference.train_single`, so the two agree step by step. Needs a chain of layers without
shared parameters or dropout (the forward pass runs twice, once per pack visit, and must agree with itself).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ballast.v1 import model_pb2
from services.data.batches import Data, batch_for, validation_batch_for
from services.executor.train import checkpoint as ckpt
from services.executor.train import weights
from services.executor.train.chunks import functional_step
from services.executor.train.offload import ActivationMeter
from services.memory.harmony_schedule import FORWARD, FORWARD_BACKWARD, HarmonyLayer, HarmonySchedule, Task
from services.memory.pool import MemoryPool
from services.runtime.errors import InvalidArgument
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import build_model
from services.zoo.graph import Decomposition, Layer

EMPTY = torch.empty(0)


UNTIE = {  # where a model's tie is set, by its spec's config
    "transformer": ("model.transformer.tie_embeddings", "set transformer.tie_embeddings false"),
    "hf": ("model.hf.config.tie_word_embeddings", "set tie_word_embeddings: false in the config"),
    "custom": ("model.custom.factory", "give each layer parameters of its own"),
}


def check_model(spec: model_pb2.ModelSpec, dec: Decomposition) -> None:
    """Refuse what the schedule cannot run, naming the field and the fix."""
    if dec.shared:
        field, untie = UNTIE.get(spec.WhichOneof("config"), UNTIE["transformer"])
        raise InvalidArgument("the Harmony schedule moves each layer's weights on their own; this model shares "
                              f"{dec.shared[0].name} between layers: {untie}", field=field)
    if dec.relay:
        raise InvalidArgument("the Harmony schedule runs a chain of layers; this model has skip edges (layers "
                              f"{dec.relay} are read past their successor): use chunk offload for it", field="model")
    if spec.dropout > 0:
        raise InvalidArgument("the Harmony schedule recomputes each pack from a stashed input, which dropout would "
                              "change: set dropout to 0", field="model.dropout")


def measure_layers(dec: Decomposition, sample: dict[str, Tensor], optimizer: str) -> list[HarmonyLayer]:
    """Each layer on one sample, as the search reads it: weight, state and input bytes, the activations autograd
    saves for its backward (distinct storages, parameters left out) and its forward and backward seconds."""
    out, x = [], None
    for layer in dec.layers:
        params = {p.untyped_storage().data_ptr() for p in layer.module.parameters()}
        weights = sum(p.numel() * p.element_size() for p in layer.module.parameters())
        saved: dict[int, int] = {}

        def pack(t: Tensor, saved: dict[int, int] = saved, params: set[int] = params) -> Tensor:
            key = t.untyped_storage().data_ptr()
            if key not in params:
                saved[key] = t.untyped_storage().nbytes()
            return t

        inp = None if x is None else x.detach().requires_grad_(True)
        began = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = run_layer(layer, inp, sample)
        forward_s = time.perf_counter() - began
        began = time.perf_counter()
        y.backward(torch.ones_like(y))
        backward_s = time.perf_counter() - began
        layer.module.zero_grad(set_to_none=True)
        out.append(HarmonyLayer(weights, 2 * weights if optimizer == "adam" else 0,
                                0 if x is None else x.numel() * x.element_size(), sum(saved.values()),
                                forward_s, backward_s))
        x = y.detach()
    return out


def run_layer(layer: Layer, x: Tensor | None, batch: dict[str, Tensor]) -> Tensor:
    return layer.module(*([] if x is None else [x]), *(batch[k] for k in layer.batch_keys))


class HostStore:
    """Every layer's flat weights and optimizer states, and the stashed pack inputs, in shared memory files."""

    def __init__(self, root: Path, layers: list[Layer], state_kinds: tuple[str, ...], global_batch_size: int) -> None:
        self.root, self.global_batch_size = root, global_batch_size
        self.weights: list[Tensor] = []
        self.states: list[dict[str, Tensor]] = []
        for layer in layers:
            n = sum(p.numel() for p in layer.module.parameters())
            self.weights.append(self._map(f"w{layer.index}", n))
            self.states.append({k: self._map(f"{k}{layer.index}", n) for k in state_kinds})
        self._stash: dict[int, Tensor] = {}

    def _map(self, name: str, numel: int) -> Tensor:
        return torch.from_file(str(self.root / name), shared=True, size=max(numel, 1), dtype=torch.float32)[:numel]

    def write_initial(self, layers: list[Layer]) -> None:
        for layer, flat in zip(layers, self.weights, strict=True):
            params = list(layer.module.parameters())
            if params:
                flat.copy_(torch.cat([p.detach().reshape(-1) for p in params]))
            for state in self.states[layer.index].values():
                state.zero_()

    def write_states(self, layers: list[Layer], state: dict[Any, dict[str, Tensor]]) -> None:
        """A resume's Adam states (a parameter's exp_avg, exp_avg_sq), layer by layer into the flat store."""
        for layer, states in zip(layers, self.states, strict=True):
            params = list(layer.module.parameters())
            for kind, key in (("momentum", "exp_avg"), ("variance", "exp_avg_sq")):
                if kind in states and params:
                    states[kind].copy_(torch.cat([state[p][key].reshape(-1).float() for p in params]))

    def stash(self, layer: int, shape: tuple[int, ...]) -> Tensor:
        """The host buffer of layer `layer`'s input for the whole global batch (`shape` is one sample's)."""
        if layer not in self._stash:
            (self.root / f"a{layer}.json").write_text(json.dumps(list(shape)))
            numel = self.global_batch_size * int(torch.Size(shape).numel())
            self._stash[layer] = self._map(f"a{layer}", numel).view(self.global_batch_size, *shape)
        return self._stash[layer]

    def stashed(self, layer: int) -> Tensor:
        """The buffer another rank wrote: its sample shape is beside it."""
        if layer not in self._stash:
            shape = tuple(json.loads((self.root / f"a{layer}.json").read_text()))
            return self.stash(layer, shape)
        return self._stash[layer]


@dataclass
class Counters:
    """Bytes moved and seconds spent over one iteration. forward_s / backward_s are the forward and backward tasks
    less their peer_s and (backward) their updates' optimizer_s; recompute_s (inside backward_s) is a backward
    task's forward of its pack again; allreduce_s is the loss sum that ends the iteration. Those five are disjoint;
    swap_s lies within them."""

    to_device: int = 0
    to_host: int = 0
    peer: int = 0
    swap_s: float = 0.0
    peer_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    optimizer_s: float = 0.0
    allreduce_s: float = 0.0

    def take(self) -> dict[str, float]:
        out = dict(vars(self))
        for k in vars(self):
            setattr(self, k, type(getattr(self, k))())
        return out


@dataclass
class _Resident:
    buffer: Tensor
    ready: Future | None = None


@dataclass
class HarmonyStep:
    loss: float
    iteration_s: float
    traffic: dict[str, float]  # this rank's counters over the iteration
    stop: bool = False  # some rank voted to stop at this boundary
    hold: bool = False  # some rank was asked to hold at this boundary (hold.py)


@dataclass
class HarmonyRun:
    losses: list[float]
    steps: list[HarmonyStep]
    device_peak: int
    model_bytes: int
    predicted: dict[str, list[int]] = field(default_factory=dict)


class HarmonyRank:
    """One device of a Harmony job: its tasks of the schedule, run in order every iteration."""

    def __init__(self, spec: model_pb2.ModelSpec, data: Data, seed: int, global_batch_size: int,
                 optimizer: dict[str, Any], schedule: HarmonySchedule, store_dir: Path, *,
                 device_budget: int | None, rank: int = 0, prefetch: bool = True,
                 user_inputs: UserInputs = NO_USER_INPUTS, initial: dict[str, Tensor] | None = None,
                 resume_from: str = "") -> None:
        self.spec, self.data, self.seed, self.optimizer = spec, data, seed, optimizer
        self.global_batch_size = global_batch_size
        self.rank, self.schedule, self.user_inputs = rank, schedule, user_inputs
        model = build_model(spec, seed=seed, user_inputs=user_inputs)
        model.train()
        self.dec = model.decompose()
        check_model(spec, self.dec)
        if initial is not None and rank == 0:  # JobSpec.init_from: what rank 0 writes to the store
            weights.assign(model, spec, initial)
        resumed = SimpleNamespace(state={})  # what load_layers fills as an optimizer's state
        if resume_from and rank == 0:  # weights into the modules, states kept for the store (no ties here)
            ckpt.load_layers(resume_from, ckpt.read_manifest(resume_from), self.dec.layers, {}, resumed,  # type: ignore[arg-type]
                             state_on_host=True)
        schedule.check(len(self.dec), global_batch_size)
        self.model_loss_count = model.loss_count
        self.layers = self.dec.layers
        self.params = [list(layer.module.parameters()) for layer in self.layers]
        self.shapes = {id(p): p.shape for ps in self.params for p in ps}  # kept: `.data` is emptied between visits
        self.model_bytes = sum(p.numel() * p.element_size() for ps in self.params for p in ps)
        kinds = ("momentum", "variance") if optimizer["name"] == "adam" else ()
        self.store = HostStore(store_dir, self.layers, kinds, global_batch_size)
        if rank == 0:
            self.store.write_initial(self.layers)
            if resumed.state:
                self.store.write_states(self.layers, resumed.state)
        for ps in self.params:
            for p in ps:
                p.data = EMPTY  # the device holds none of it until a task brings it
        self.pool = MemoryPool("device", device_budget)
        self.meter = ActivationMeter(self.pool, self)  # type: ignore[arg-type] - we answer resident_storages
        self.counters = Counters()
        self.tasks = schedule.tasks()
        self.mine = [t for t in self.tasks if t.device == rank]
        self.resident: dict[int, _Resident] = {}
        self.local: dict[int, deque[Tensor]] = {}  # outputs handed to a task on this device (still held)
        self.partial: dict[int, deque[Tensor]] = {}  # samples received beyond a task's micro-batch
        self.held: dict[int, tuple[int, int]] = {}  # storage address -> (holders, bytes) of activations in flight
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="harmony-prefetch") if prefetch else None

    # -- what the activation meter asks ------------------------------------------------------------------------
    def resident_storages(self) -> set[int]:
        """Storages already on the pool (weights, held activations): autograd saving them adds nothing."""
        return {r.buffer.untyped_storage().data_ptr() for r in self.resident.values()} | set(self.held)

    # -- weights -------------------------------------------------------------------------------------------------
    def _bring(self, layer: int) -> Tensor:
        src = self.store.weights[layer]
        buf = torch.empty_like(src)
        buf.copy_(src)
        return buf

    def load(self, span: tuple[int, int]) -> None:
        """Bring a pack's weights to the device (waiting for a prefetch that already started)."""
        began = time.perf_counter()
        for i in range(*span):
            res = self.resident.get(i)
            if res is None:
                self.pool.reserve("chunk", self.store.weights[i].numel() * 4)
                res = self.resident[i] = _Resident(self._bring(i))
                self.counters.to_device += res.buffer.numel() * 4
            elif res.ready is not None:
                res.ready.result()
                res.ready = None
            self._bind(i, res.buffer)
        self.counters.swap_s += time.perf_counter() - began

    def prefetch(self, span: tuple[int, int]) -> None:
        """Start bringing a later task's weights on the copy thread (the budget must hold both packs)."""
        if self.copier is None:
            return
        for i in range(*span):
            if i in self.resident:
                continue
            self.pool.reserve("chunk", self.store.weights[i].numel() * 4)
            buf = torch.empty_like(self.store.weights[i])
            self.resident[i] = _Resident(buf, self.copier.submit(buf.copy_, self.store.weights[i]))
            self.counters.to_device += buf.numel() * 4

    def _numel(self, layer: int) -> int:
        return sum(self.shapes[id(p)].numel() for p in self.params[layer])

    def _bind(self, layer: int, flat: Tensor) -> None:
        at = 0
        for p in self.params[layer]:
            shape = self.shapes[id(p)]
            p.data = flat[at:at + shape.numel()].view(shape)
            at += shape.numel()

    def drop(self, span: tuple[int, int], write_back: bool) -> None:
        began = time.perf_counter()
        for i in range(*span):
            res = self.resident.pop(i)
            if write_back:
                self.store.weights[i].copy_(res.buffer)
                self.counters.to_host += res.buffer.numel() * 4
            for p in self.params[i]:
                p.data = EMPTY
            self.pool.release("chunk", res.buffer.numel() * 4)
        self.counters.swap_s += time.perf_counter() - began

    # -- activations between tasks -------------------------------------------------------------------------------
    def hold(self, t: Tensor) -> Tensor:
        """Place an activation (or its gradient) on the device pool until `let_go`."""
        key = t.untyped_storage().data_ptr()
        refs, nbytes = self.held.get(key, (0, t.untyped_storage().nbytes()))
        if refs == 0:
            self.pool.reserve("activation", nbytes)
        self.held[key] = (refs + 1, nbytes)
        return t

    def let_go(self, t: Tensor | None) -> None:
        if t is None:
            return
        key = t.untyped_storage().data_ptr()
        refs, nbytes = self.held[key]
        if refs == 1:
            del self.held[key]
            self.pool.release("activation", nbytes)
        else:
            self.held[key] = (refs - 1, nbytes)

    def receive(self, task: Task) -> Tensor:
        """The next input (forward) or output gradient (backward) for `task` from its source task (held)."""
        source = self.tasks[task.source]  # type: ignore[index]
        if source.device == self.rank:
            return self.local[task.index].popleft()
        began = time.perf_counter()
        header = torch.zeros(8, dtype=torch.int64)
        dist.recv(header, src=source.device)
        out = self.hold(torch.empty([int(d) for d in header[1:1 + int(header[0])]]))
        dist.recv(out, src=source.device)
        self.counters.peer_s += time.perf_counter() - began
        return out

    def receive_rows(self, task: Task, size: int) -> Tensor:
        """The next `size` samples of what `task`'s source sends, whatever micro-batch size it sends them in (the
        jit-compute task runs at the forward micro-batch size, the backward tasks after it at their own)."""
        parts = self.partial.setdefault(task.index, deque())
        while sum(t.shape[0] for t in parts) < size:
            parts.append(self.receive(task))
        taken: list[Tensor] = []
        need = size
        while need:
            t = parts.popleft()
            if t.shape[0] > need:
                parts.appendleft(self.hold(t[need:]))
                head = self.hold(t[:need])
                self.let_go(t)
                t = head
            taken.append(t)
            need -= t.shape[0]
        if len(taken) == 1:
            return taken[0]
        out = self.hold(torch.cat(taken))
        for t in taken:
            self.let_go(t)
        return out

    def send(self, task: Task, t: Tensor, pending: deque) -> None:
        """Hand held `t` to the task after `task`; it stays held until the peer has it. Waiting for a send here
        could deadlock (two ranks each sending to the other's next task), so only the task's end waits for them."""
        target = self.tasks[task.index + 1]
        if target.device == self.rank:
            self.local.setdefault(target.index, deque()).append(t)
            return
        header = torch.zeros(8, dtype=torch.int64)
        header[0] = t.dim()
        header[1:1 + t.dim()] = torch.tensor(t.shape)
        began = time.perf_counter()
        pending.append((dist.isend(header, target.device), dist.isend(t, target.device), header, t))
        self.counters.peer += t.numel() * t.element_size()
        while pending and pending[0][1].is_completed():  # never wait here: the peer may be sending to us
            self._settle(pending.popleft())
        self.counters.peer_s += time.perf_counter() - began

    def flush(self, pending: deque) -> None:
        began = time.perf_counter()
        while pending:
            self._settle(pending.popleft())
        self.counters.peer_s += time.perf_counter() - began

    def _settle(self, item: tuple) -> None:
        item[0].wait()
        item[1].wait()
        self.let_go(item[3])

    # -- tasks ---------------------------------------------------------------------------------------------------
    def batch(self, iteration: int, begin: int, end: int) -> dict[str, Tensor]:
        return batch_for(self.spec, self.data, self.seed, iteration, begin, end,
                         global_batch_size=self.global_batch_size,
                         user_inputs=self.user_inputs)

    def forward(self, task: Task, iteration: int) -> None:
        a, b = task.span
        pending: deque = deque()
        for begin in range(0, self.global_batch_size, task.micro_batch):
            rows = slice(begin, begin + task.micro_batch)
            batch = self.batch(iteration, rows.start, rows.stop)
            x = None if task.source is None else self.receive(task)
            with torch.no_grad():
                for i in range(a, b):
                    if i in task.stash:
                        assert x is not None
                        self._stash_out(i, rows, x)
                    y = self.hold(run_layer(self.layers[i], x, batch))
                    self.let_go(x)
                    x = y
            assert x is not None
            self.send(task, x, pending)
        self.flush(pending)

    def _stash_out(self, layer: int, rows: slice, x: Tensor) -> None:
        began = time.perf_counter()
        self.store.stash(layer, tuple(x.shape[1:]))[rows].copy_(x)
        self.counters.to_host += x.numel() * x.element_size()
        self.counters.swap_s += time.perf_counter() - began

    def _stash_in(self, layer: int, rows: slice) -> Tensor:
        began = time.perf_counter()
        x = self.hold(self.store.stashed(layer)[rows].clone())
        self.counters.to_device += x.numel() * x.element_size()
        self.counters.swap_s += time.perf_counter() - began
        return x

    def backward(self, task: Task, iteration: int, count: int) -> float:
        """Forward with autograd, backward and the pack's update; returns the summed loss (jit-compute task)."""
        a, b = task.span
        self.pool.reserve("grad", sum(self._numel(i) for i in range(a, b)) * 4)
        total, pending = 0.0, deque()
        for begin in range(0, self.global_batch_size, task.micro_batch):
            rows = slice(begin, begin + task.micro_batch)
            batch = self.batch(iteration, rows.start, rows.stop)
            if task.kind == FORWARD_BACKWARD:
                x = None if task.source is None else self.receive(task)
            else:
                x = self._stash_in(a, rows) if task.reads_stash else None
            total += self._micro_batch(task, x, batch, count, pending)
        self.flush(pending)
        self.update(task.span, iteration)
        return total

    def _micro_batch(self, task: Task, x: Tensor | None, batch: dict[str, Tensor], count: int,
                     pending: deque) -> float:
        a, b = task.span
        if x is not None:
            x.requires_grad_(True)
        began = time.perf_counter()
        with self.meter.saving():
            y = x
            for i in range(a, b):
                y = run_layer(self.layers[i], y, batch)
        if task.kind != FORWARD_BACKWARD:  # the pack's forward already ran in a forward task
            self.counters.recompute_s += time.perf_counter() - began
        assert y is not None
        loss = 0.0
        if task.kind == FORWARD_BACKWARD:
            loss = float(y.detach())
            (y / count).backward()
        else:
            g = self.receive_rows(task, task.micro_batch)
            y.backward(g)
            self.let_go(g)
        del y
        if x is not None:
            if task.index + 1 < len(self.tasks):
                assert x.grad is not None
                self.send(task, self.hold(x.grad), pending)
            self.let_go(x)
        return loss

    def update(self, span: tuple[int, int], iteration: int) -> None:
        """Just-in-time update, layer by layer: bring its states, step, write weights and states back."""
        updating = time.perf_counter()
        for i in range(*span):
            params = [p for p in self.params[i] if p.grad is not None]
            grads = [p.grad for p in params]
            began = time.perf_counter()
            host = self.store.states[i]
            nbytes = sum(s.numel() * 4 for s in host.values())
            self.pool.reserve("optimizer", nbytes)
            states = {k: s.clone() for k, s in host.items()}
            self.counters.to_device += nbytes
            self.counters.swap_s += time.perf_counter() - began
            with torch.no_grad():
                adam = self.optimizer["name"] == "adam"
                functional_step(self.optimizer, [p.data for p in params], grads,
                                _views(states["momentum"], params) if adam else [],
                                _views(states["variance"], params) if adam else [],
                                [torch.tensor(float(iteration)) for _ in params])
            for p in params:
                p.grad = None
            self.pool.release("grad", self._numel(i) * 4)
            began = time.perf_counter()
            for k, s in states.items():
                host[k].copy_(s)
            self.counters.to_host += nbytes
            self.counters.swap_s += time.perf_counter() - began
            self.pool.release("optimizer", nbytes)
            self.drop((i, i + 1), write_back=True)
        self.counters.optimizer_s += time.perf_counter() - updating

    def step(self, iteration: int, group: Any = None, vote: Callable[[], bool] | None = None,
             hold: Callable[[], bool] | None = None) -> HarmonyStep:
        """Run this rank's tasks of iteration `iteration`; every rank learns the loss (the all-reduce that ends
        the iteration is the pipeline flush: the next forward reads weights the updates wrote). `vote`, asked at
        the end, True asks every rank to stop after this iteration: it rides on the loss sum, so all ranks learn
        it at the same boundary (HarmonyStep.stop)."""
        started = time.perf_counter()
        count = max(self.model_loss_count(self.batch(iteration, 0, self.global_batch_size)), 1)
        total = 0.0
        for k, task in enumerate(self.mine):
            began, waited, updated = time.perf_counter(), self.counters.peer_s, self.counters.optimizer_s
            self.load(task.span)
            if k + 1 < len(self.mine):
                self.prefetch(self.mine[k + 1].span)
            if task.kind == FORWARD:
                self.forward(task, iteration)
                self.drop(task.span, write_back=False)
            else:
                total += self.backward(task, iteration, count)
            spent = (time.perf_counter() - began - (self.counters.peer_s - waited)
                     - (self.counters.optimizer_s - updated))
            if task.kind == FORWARD:
                self.counters.forward_s += spent
            else:
                self.counters.backward_s += spent
        summed = torch.tensor([total, float(vote is not None and vote()), float(hold is not None and hold())],
                              dtype=torch.float64)
        began = time.perf_counter()
        if dist.is_initialized():
            dist.all_reduce(summed, group=group)
        self.counters.allreduce_s += time.perf_counter() - began
        return HarmonyStep(float(summed[0]) / count, time.perf_counter() - started, self.counters.take(),
                           stop=bool(summed[1] > 0), hold=bool(summed[2] > 0))

    # -- checkpoints and evaluation (rank 0, between iterations: every update of the last one is in the store) ------
    def _named(self, layer: int, flat: Tensor) -> Iterator[tuple[str, Tensor]]:
        at = 0
        for name, p in self.layers[layer].module.named_parameters():
            shape = self.shapes[id(p)]
            yield name, flat[at:at + shape.numel()].view(shape)
            at += shape.numel()

    def checkpoint_layers(self, done: int) -> dict[int, tuple[str, dict[str, Tensor]]]:
        """Every layer's weights and Adam states from the host store, copied, in the checkpoint's per-layer form
        (Adam's step is the iterations done: Harmony steps every layer once per iteration)."""
        out = {}
        for i, layer in enumerate(self.layers):
            tensors = {f"param/{name}": t.clone() for name, t in self._named(i, self.store.weights[i])}
            for kind, key in (("momentum", "exp_avg"), ("variance", "exp_avg_sq")):
                if kind in self.store.states[i]:
                    tensors.update({f"state/{key}/{name}": t.clone()
                                    for name, t in self._named(i, self.store.states[i][kind])})
            if self.store.states[i]:
                tensors.update({f"state/step/{name}": torch.tensor(float(done)) for name, _ in self._named(
                    i, self.store.weights[i])})
            out[layer.index] = (layer.name, tensors)
        return out

    def layer_digests(self) -> dict[str, str]:
        """Each layer's weights in the store, hashed as weights.digest does (what an export reproduces)."""
        return {str(layer.index): weights.digest([(f"param/{n}", t) for n, t in self._named(i, self.store.weights[i])])
                for i, layer in enumerate(self.layers)}

    def evaluate(self, batches: int) -> tuple[float, float]:
        """(summed loss, labels) over `batches` validation batches: the whole model forward only, layer by layer
        from the store, in forward micro-batches (one device's work: rank 0 runs it while the others wait)."""
        total, labels = 0.0, 0.0
        size = self.schedule.forward_micro_batch
        try:
            with torch.no_grad():
                for b in range(batches):
                    for begin in range(0, self.global_batch_size, size):
                        batch = validation_batch_for(self.spec, self.data, self.seed, b, begin, begin + size,
                                                     global_batch_size=self.global_batch_size,
                                                     user_inputs=self.user_inputs)
                        x = None
                        for i, layer in enumerate(self.layers):
                            self.load((i, i + 1))
                            layer.module.eval()
                            x = run_layer(layer, x, batch)
                            layer.module.train()
                            self.drop((i, i + 1), write_back=False)
                        assert x is not None
                        total += float(x)
                        labels += float(self.model_loss_count(batch))
        finally:
            self.counters.take()  # not the next iteration's traffic
        return total, labels

    def close(self) -> None:
        if self.copier is not None:
            self.copier.shutdown(wait=True)


def _views(flat: Tensor, params: list[nn.Parameter]) -> list[Tensor]:
    out, at = [], 0
    for p in params:
        out.append(flat[at:at + p.numel()].view(p.shape))
        at += p.numel()
    return out


def schedule_from(config: dict[str, Any]) -> HarmonySchedule:
    s = config["schedule"]
    return HarmonySchedule(int(s["forward_micro_batch"]), tuple(tuple(p) for p in s["forward_packs"]),
                           int(s["backward_micro_batch"]), tuple(tuple(p) for p in s["backward_packs"]),
                           int(s["devices"]))


def train_harmony(config: dict[str, Any], rank: int, store_dir: Path, group: Any = None) -> HarmonyRun:
    from google.protobuf.json_format import ParseDict

    spec = ParseDict(config["model"], model_pb2.ModelSpec())
    runner = HarmonyRank(spec, config.get("data", {}), int(config["seed"]),
                         int(config["global_batch_size"]), config["optimizer"], schedule_from(config), store_dir,
                         device_budget=config.get("device_budget"), rank=rank,
                         prefetch=bool(config.get("prefetch", True)))
    if dist.is_initialized():
        dist.barrier(group=group)  # rank 0 has written the initial weights
    try:
        steps = [runner.step(i, group) for i in range(int(config["iterations"]))]
    finally:
        runner.close()
    return HarmonyRun([s.loss for s in steps], steps, runner.pool.peak, runner.model_bytes)


def run_rank(config: dict[str, Any], rank: int, world: int, init_method: str) -> dict[str, Any]:
    """One device of a Harmony job on gloo (the benchmark's and the tests' entry point); the shared host store
    is `config["store_dir"]` (every rank of the job maps the same files)."""
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        run = train_harmony(config, rank, Path(config["store_dir"]))
    finally:
        if world > 1:
            dist.destroy_process_group()
    return {"rank": rank, "losses": run.losses, "iteration_s": [s.iteration_s for s in run.steps],
            "traffic": [s.traffic for s in run.steps], "device_peak": run.device_peak,
            "model_bytes": run.model_bytes}


def store_root() -> str:
    """Where a job's host store goes: shared memory when the machine has it."""
    return tempfile.mkdtemp(prefix="ballast-harmony-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="one device of a Harmony (wrap-around pipeline) training run")
    parser.add_argument("--config", required=True, help="JSON file: model, seed, global_batch_size, iterations, "
                        "optimizer, "
                        "device_budget, schedule {forward_micro_batch, forward_packs, backward_micro_batch, "
                        "backward_packs, devices}, store_dir, prefetch")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--init", default="", help="torch.distributed init_method (file:// or tcp://)")
    parser.add_argument("--out", required=True, help="where this rank writes its JSON result")
    args = parser.parse_args(argv)
    config = json.loads(Path(args.config).read_text(encoding="utf-8"))
    result = run_rank(config, args.rank, args.world, args.init)
    Path(args.out).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()
