"""Training with model data in chunks under a device budget (PatrickStar): the hooks that drive the chunk manager.

The model runs its own `forward`; each decomposed layer's module gets a forward pre-hook (access its
parameters: Alg. 1), a forward hook (release them HOLD_AFTER_FWD: Alg. 2, and hang a hook on the layer's
output that accesses them again just before the layer's backward), and every parameter a post-accumulate-grad
hook (its gradient moves into its slot on the last micro-batch). Activations autograd saves for backward are
accounted on the device pool by `ActivationMeter`, so the budget covers non-model data too and a placement that
would exceed it evicts chunks first (or fails).

Data parallelism splits the global batch over `world` processes as the workers do (replica r takes samples
[r*B/world, (r+1)*B/world), split into micro-batches, each micro-batch's dropout seeded by its global index),
and sums gradients; the loss of an iteration is the global summed loss over the global label count, so it equals
`reference.train_single`'s.

`ChunkedTrainer` steps one iteration at a time with its timings split as the stage trainer's (the worker's chunk
mode reports each); `train_chunked` runs it to the end for the benchmark and the tests.

On a CUDA device the model is built on the host (its initial values are the CPU build's, seeded as ever) and
enters the device a chunk at a time, since a model larger than the budget could not be built there; and the
budget is the whole device's: the pool gets what `chunks.pool_budget` leaves after the runtime's own allocations
(`chunks.runtime_reserve`) and the transients it does not see, so `torch.cuda.max_memory_allocated` stays within
the budget (benchmarks/memory_gpu.py measures it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ballast.v1 import common_pb2, model_pb2
from services.data.batches import Data, batch_for, validation_batch_for
from services.executor.train import checkpoint as ckpt
from services.executor.train import weights
from services.executor.train.chunks import ChunkManager, pool_budget, runtime_reserve
from services.executor.train.data import dropout_seed
from services.executor.train.stage import tied_aliases
from services.memory.chunk_policy import TensorState, Traffic
from services.memory.pool import MemoryPool
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import build_model
from services.zoo.graph import parameter_tensors


class _Saved:
    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: ActivationMeter, key: int, tensor: Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter.drop(self.key)


class ActivationMeter:
    """Accounts each storage autograd saves (once, however many views of it are saved) while it is alive."""

    def __init__(self, pool: MemoryPool, manager: ChunkManager) -> None:
        self.pool, self.manager = pool, manager
        self._refs: dict[int, tuple[int, int]] = {}  # storage address -> (saved views alive, bytes)

    def pack(self, t: Tensor) -> Tensor | _Saved:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.manager.resident_storages():
            return t  # model data: accounted as its chunk
        refs, nbytes = self._refs.get(key, (0, storage.nbytes()))
        if refs == 0:
            self.pool.reserve("activation", nbytes)
        self._refs[key] = (refs + 1, nbytes)
        return _Saved(self, key, t)

    @staticmethod
    def unpack(saved: Tensor | _Saved) -> Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def drop(self, key: int) -> None:
        refs, nbytes = self._refs[key]
        if refs == 1:
            del self._refs[key]
            self.pool.release("activation", nbytes)
        else:
            self._refs[key] = (refs - 1, nbytes)

    @contextmanager
    def saving(self):  # noqa: ANN201 - a context manager
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


@dataclass
class ChunkedRun:
    losses: list[float]
    traffic: list[Traffic]  # per iteration
    iteration_s: list[float]  # wall time of each iteration (the first is the warm-up)
    device_peak: int  # bytes, the device pool's high-water mark
    non_model_peak: int  # of which gradients and saved activations, at their own peak
    host_peak: int
    model_bytes: int  # parameters' bytes (every replica's share together)
    chunks: int
    optimizer_chunks_on_device: int
    activation_bytes: list[tuple[int, int]]  # per layer, first micro-batch: (peak above its start, held at its end)
    pool_budget: int | None = None  # the device pool's budget: device_budget less the CUDA reserve (else the same)
    runtime_bytes: int = 0  # CUDA: what the runtime held with no model data when the pool's budget was set


def compute_dtype(spec: model_pb2.ModelSpec, device: torch.device) -> torch.dtype:
    """The chunks' and the compute's precision: the model's own on a GPU when that is bf16 (mixed precision: the
    fp32 master and Adam states live in the chunk manager's optimizer lists), fp32 otherwise and on the CPU."""
    if device.type != "cuda" or spec.dtype in (common_pb2.DTYPE_UNSPECIFIED, common_pb2.DTYPE_FP32):
        return torch.float32
    if spec.dtype == common_pb2.DTYPE_BF16:
        return torch.bfloat16
    raise ValueError(f"ModelSpec.dtype {common_pb2.DType.Name(spec.dtype)}: chunk offload has no loss scaling for "
                     "fp16 yet; use DTYPE_BF16 (mixed precision) or DTYPE_FP32")


def attach(model: nn.Module, manager: ChunkManager, last_micro_batch: list[bool],
           activations: list[tuple[int, int]] | None = None) -> list[Any]:
    """Hooks that make the manager follow the model's layers; `last_micro_batch[0]` is read by the grad hooks.
    `activations`, when given, receives each layer's saved activations in the first forward: (the highest bytes
    they reached above the layer's start, the bytes still held at its end); autograd frees some on the way."""
    handles: list[Any] = []
    layers = model.decompose().layers
    pool = manager.policy.device_pool
    for layer in layers:
        params = list(dict.fromkeys(layer.module.parameters()))
        mark = [0]

        def before(_m: nn.Module, _args: Any, params: list[nn.Parameter] = params, mark: list[int] = mark) -> None:
            mark[0] = pool.by_kind["activation"]
            manager.access(params)
            pool.mark()

        def after(_m: nn.Module, _args: Any, out: Any, params: list[nn.Parameter] = params,
                  mark: list[int] = mark) -> None:
            if activations is not None and len(activations) < len(layers):
                activations.append((pool.window_peak("activation") - mark[0], pool.by_kind["activation"] - mark[0]))
            manager.release(params, TensorState.HOLD_AFTER_FWD)
            if isinstance(out, Tensor) and out.requires_grad:
                out.register_hook(lambda _g: manager.access(params))

        handles += [layer.module.register_forward_pre_hook(before), layer.module.register_forward_hook(after)]
    for p in dict.fromkeys(model.parameters()):
        handles.append(p.register_post_accumulate_grad_hook(
            lambda p: manager.grad_ready(p, last_micro_batch[0])))
    return handles


@dataclass
class ChunkedStep:
    """One iteration: the global loss, this rank's chunk traffic and its timings in seconds. forward_s,
    backward_s, optimizer_s and allreduce_s are disjoint spans (the gathers and reductions the hooks run are taken
    out of forward and backward); the rest of iteration_s is batch building and Python. swap_s is the time inside
    the chunk moves, gathers and reductions, wherever they ran (it overlaps the spans)."""

    loss: float
    traffic: Traffic
    iteration_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    allreduce_s: float  # gathers, reductions and the loss sum
    swap_s: float
    stop: bool  # some rank voted to stop at this boundary
    hold: bool = False  # some rank was asked to hold at this boundary (hold.py)


class ChunkedTrainer:
    """A model whose data lives in chunks under a device budget, stepped one iteration at a time (the worker
    reports each; `train_chunked` collects them)."""

    def __init__(self, spec: model_pb2.ModelSpec, data: Data, seed: int, global_batch_size: int,
                 optimizer: dict[str, Any], *, device_budget: int | None, chunk_bytes: int, micro_batches: int = 1,
                 host_budget: int | None = None, device: str | torch.device = "cpu", rank: int = 0, world: int = 1,
                 group: object = None, user_inputs: UserInputs = NO_USER_INPUTS,
                 initial: dict[str, Tensor] | None = None, resume_from: str = "") -> None:
        if global_batch_size % (world * micro_batches):
            raise ValueError(f"global_batch_size {global_batch_size} must split into {world} replicas x "
                             f"{micro_batches} "
                             "micro-batches")
        self.spec, self.data, self.seed, self.global_batch_size = spec, data, seed, global_batch_size
        self.optimizer, self.micro_batches, self.device = optimizer, micro_batches, torch.device(device)
        self.rank, self.world, self.group, self.user_inputs = rank, world, group, user_inputs
        cuda = self.device.type == "cuda"
        self.dtype = compute_dtype(spec, self.device)
        model = build_model(spec, seed=seed, device="cpu" if cuda else self.device, user_inputs=user_inputs)
        if initial is not None:  # JobSpec.init_from: the whole weights, before they enter chunks
            weights.assign(model, spec, initial)
        resumed = resumed_states(model, resume_from) if resume_from else None
        self.model = model.to(self.dtype)
        self.model.train()
        self.params = parameter_tensors(self.model.decompose())[0]  # the layout the planner's profile lists
        self.model_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.runtime_bytes = runtime_reserve(self.device) if cuda and device_budget is not None else 0
        self.pool_budget = (pool_budget(device_budget, self.runtime_bytes, chunk_bytes)
                            if cuda and device_budget is not None else device_budget)
        self.device_pool, self.host_pool = MemoryPool("device", self.pool_budget), MemoryPool("host", host_budget)
        self.manager = ChunkManager(self.params, chunk_bytes, self.device_pool, self.host_pool,
                                    optimizer=optimizer["name"], rank=rank, world=world, group=group,
                                    device=self.device)
        if resumed is not None:
            self.manager.load_states({self.manager.slot_of[id(p)]: resumed[id(p)] for p in self.params})
        self.model.to(self.device)  # buffers; the parameters are views of device chunks already
        self.last = [False]
        self.activations: list[tuple[int, int]] = []
        self.handles = attach(self.model, self.manager, self.last, self.activations)
        self.meter = ActivationMeter(self.device_pool, self.manager)

    @property
    def mixed(self) -> bool:
        """Mixed precision: bf16 chunks and compute, autocast keeping the loss and norms in fp32, and the step on
        the fp32 master and Adam states (the chunk manager's own lists, as ever)."""
        return self.dtype != torch.float32

    def layer_digests(self) -> dict[str, str]:
        """Each layer's whole weights (the fp32 master), hashed as weights.digest does, on rank 0 ({} on the others):
        what an export of the final checkpoint must reproduce. Every rank calls it."""
        states = self.manager.gather_states(0)
        if states is None:
            return {}
        return {str(layer.index): weights.digest([(f"param/{n}", states[self.manager.slot_of[id(p)]]["master"].view(
            p.shape)) for n, p in layer.module.named_parameters()]) for layer in self.model.decompose().layers}

    def checkpoint_layers(self) -> ckpt.Snapshot | None:
        """The whole model's per-layer checkpoint tensors (the fp32 master as the parameter, Adam's states), in the
        stage trainer's format, on rank 0 (None on the others); every rank calls it at the same boundary."""
        states = self.manager.gather_states(0)
        if states is None:
            return None
        adam, out, seen = self.optimizer["name"] == "adam", {}, set()
        for layer in self.model.decompose().layers:
            tensors: dict[str, Tensor] = {}
            for name, p in layer.module.named_parameters():
                if id(p) in seen:  # a tied weight is stored once, under the lowest layer holding it
                    continue
                seen.add(id(p))
                state = states[self.manager.slot_of[id(p)]]
                tensors[f"param/{name}"] = state["master"].view(p.shape)
                if adam:
                    tensors[f"state/exp_avg/{name}"] = state["momentum"].view(p.shape)
                    tensors[f"state/exp_avg_sq/{name}"] = state["variance"].view(p.shape)
                    tensors[f"state/step/{name}"] = state["step"]
            out[layer.index] = (layer.name, tensors)
        return out

    def evaluate(self, batches: int) -> tuple[float, float]:
        """(summed loss, labels) over `batches` validation batches, every replica its share as in training, forward
        only in eval mode; every rank calls it. The chunk residency after it is a finished forward's."""
        per_replica = self.global_batch_size // self.world
        size = per_replica // self.micro_batches
        total, labels = 0.0, 0.0
        self.model.eval()
        try:
            with torch.no_grad():
                for b in range(batches):
                    for k in range(self.micro_batches):
                        begin = self.rank * per_replica + k * size
                        batch = {key: v.to(self.device) for key, v in validation_batch_for(
                            self.spec, self.data, self.seed, b, begin, begin + size,
                            global_batch_size=self.global_batch_size,
                            user_inputs=self.user_inputs).items()}
                        with torch.autocast(self.device.type, self.dtype, enabled=self.mixed):
                            total += float(self.model(batch).detach())
                        self.manager.policy.forward_done()
                        labels += float(self.model.loss_count(batch))
        finally:
            self.model.train()
            self.manager.policy.moment = 0  # the next iteration's accesses line up with the recorded trace again
            self.manager.policy.traffic.take()  # not the next iteration's traffic
            self.manager.take_swap_s()
        if self.world > 1:
            summed = torch.tensor([total, labels], dtype=torch.float64, device=self.device)
            dist.all_reduce(summed, group=self.group)
            total, labels = summed.tolist()
        return total, labels

    def close(self) -> None:
        """Remove the hooks and free the device buffers; the trainer is done. Why: autograd's C++ side holds the
        parameters' grad hooks, which hold the manager, so the garbage collector never frees a trainer left to it
        and its chunks would stay on the device for the rest of the process."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.manager.close()

    def step(self, iteration: int, vote: Callable[[], bool] | None = None,
             hold: Callable[[], bool] | None = None) -> ChunkedStep:
        """Iteration `iteration` (0-based) of this replica; `vote`, asked at its end, True asks every rank to stop
        after it (the vote rides on the loss sum, so all ranks learn it at the same boundary)."""
        manager, model, per_replica = self.manager, self.model, self.global_batch_size // self.world
        size = per_replica // self.micro_batches
        started = time.perf_counter()
        manager.take_swap_s()
        whole = batch_for(self.spec, self.data, self.seed, iteration, 0, self.global_batch_size,
                          global_batch_size=self.global_batch_size, user_inputs=self.user_inputs)
        count = max(model.loss_count(whole), 1)
        total = 0.0
        forward_s = backward_s = 0.0
        for k in range(self.micro_batches):
            self.last[0] = k == self.micro_batches - 1
            begin = self.rank * per_replica + k * size
            batch = {key: v.to(self.device) for key, v in batch_for(
                self.spec, self.data, self.seed, iteration, begin, begin + size,
                global_batch_size=self.global_batch_size, user_inputs=self.user_inputs).items()}
            torch.manual_seed(dropout_seed(self.seed, iteration, self.rank * self.micro_batches + k))
            t, comm = time.perf_counter(), manager.comm_s
            with self.meter.saving(), torch.autocast(self.device.type, self.dtype, enabled=self.mixed):
                loss = model(batch)
            manager.policy.forward_done()
            forward_s += time.perf_counter() - t - (manager.comm_s - comm)
            t, comm = time.perf_counter(), manager.comm_s
            (loss / count).backward()
            manager.policy.backward_done(self.last[0])
            total += float(loss.detach())
            backward_s += time.perf_counter() - t - (manager.comm_s - comm)
        t, comm = time.perf_counter(), manager.comm_s
        manager.step(self.optimizer)
        manager.policy.end_iteration()
        optimizer_s = time.perf_counter() - t - (manager.comm_s - comm)
        chunk_comm_s = manager.comm_s
        t = time.perf_counter()
        votes, holds = float(vote is not None and vote()), float(hold is not None and hold())
        if self.world > 1:
            summed = torch.tensor([total, votes, holds], dtype=torch.float64, device=self.device)
            dist.all_reduce(summed, group=self.group)
            total, votes, holds = summed.tolist()
        loss_sum_s = time.perf_counter() - t
        if self.device.type == "cuda":  # the iteration's kernels are inside its time (the stage trainer's way)
            torch.cuda.synchronize(self.device)
        return ChunkedStep(total / count, manager.policy.traffic.take(), time.perf_counter() - started, forward_s,
                           backward_s, optimizer_s, chunk_comm_s + loss_sum_s, manager.take_swap_s(), votes > 0,
                           holds > 0)


class _StateHolder:
    """What checkpoint.load_layers fills as it would an optimizer's state (parameter -> its state)."""

    def __init__(self) -> None:
        self.state: dict[Any, dict[str, Tensor]] = {}


TORCH_TO_CHUNK = {"exp_avg": "momentum", "exp_avg_sq": "variance", "step": "step"}


def resumed_states(model: nn.Module, resume_from: str) -> dict[int, dict[str, Tensor]]:
    """Load a checkpoint into the model's parameters (before they enter chunks) and return, by parameter id, the
    fp32 master and the optimizer states the chunk manager takes (`load_states`)."""
    manifest = ckpt.read_manifest(resume_from)
    dec = model.decompose()
    holder = _StateHolder()
    ckpt.load_layers(resume_from, manifest, dec.layers, tied_aliases(model, dec, 0, len(dec)), holder,  # type: ignore[arg-type]
                     state_on_host=True)
    out = {}
    for p in dict.fromkeys(model.parameters()):
        state = holder.state.get(p, {})
        out[id(p)] = {"master": p.detach().float().clone(), "step": state.get("step", torch.tensor(0.0)),
                      **{TORCH_TO_CHUNK[k]: v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")}}
    return out


def train_chunked(spec: model_pb2.ModelSpec, data: Data, seed: int, global_batch_size: int, iterations: int,
                  optimizer: dict[str, Any], *, device_budget: int | None, chunk_bytes: int,
                  micro_batches: int = 1, host_budget: int | None = None, device: str = "cpu", rank: int = 0,
                  world: int = 1, group: object = None) -> ChunkedRun:
    trainer = ChunkedTrainer(spec, data, seed, global_batch_size, optimizer, device_budget=device_budget,
                             chunk_bytes=chunk_bytes, micro_batches=micro_batches, host_budget=host_budget,
                             device=device, rank=rank, world=world, group=group)
    try:
        steps = [trainer.step(iteration) for iteration in range(iterations)]
    finally:
        trainer.close()
    manager = trainer.manager
    return ChunkedRun([s.loss for s in steps], [s.traffic for s in steps], [s.iteration_s for s in steps],
                      trainer.device_pool.peak, trainer.device_pool.peak_non_model, trainer.host_pool.peak,
                      trainer.model_bytes, manager.layout.num_chunks, manager.policy.os_on_device,
                      trainer.activations, trainer.pool_budget, trainer.runtime_bytes)


def run_rank(config: dict[str, Any], rank: int, world: int, init_method: str) -> dict[str, Any]:
    """One data-parallel rank of a chunked run on gloo (the benchmark's and the tests' entry point)."""
    from google.protobuf.json_format import ParseDict

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        run = train_chunked(
            ParseDict(config["model"], model_pb2.ModelSpec()), config.get("data", {}),
            int(config["seed"]), int(config["global_batch_size"]), int(config["iterations"]), config["optimizer"],
            device_budget=config.get("device_budget"), chunk_bytes=int(config["chunk_bytes"]),
            micro_batches=int(config.get("micro_batches", 1)), host_budget=config.get("host_budget"),
            rank=rank, world=world)
    finally:
        if world > 1:
            dist.destroy_process_group()
    return {"rank": rank, "losses": run.losses, "traffic": [vars(t) for t in run.traffic],
            "iteration_s": run.iteration_s,
            "device_peak": run.device_peak, "non_model_peak": run.non_model_peak, "host_peak": run.host_peak,
            "model_bytes": run.model_bytes, "chunks": run.chunks,
            "optimizer_chunks_on_device": run.optimizer_chunks_on_device, "activation_bytes": run.activation_bytes}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="one rank of a chunked (PatrickStar) training run on the CPU")
    parser.add_argument("--config", required=True, help="JSON file: model, seed, global_batch_size, iterations, "
                        "optimizer, device_budget, chunk_bytes, micro_batches, host_budget")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--init", default="", help="torch.distributed init_method (file:// or tcp://)")
    parser.add_argument("--out", required=True, help="where this rank writes its JSON result")
    args = parser.parse_args(argv)
    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    result = run_rank(config, args.rank, args.world, args.init)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()


def tensor_map(model: nn.Module) -> tuple[list[int], list[list[int]]]:
    """(elements of every distinct parameter in layout order, per layer the indices it uses): the shape of the
    model the chunk layout and the planner's chunk simulator see (zoo.graph.parameter_tensors)."""
    params, per_layer = parameter_tensors(model.decompose())
    return [p.numel() for p in params], per_layer
