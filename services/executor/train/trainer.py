"""The training loop of one stage replica: the micro-batch schedule, its sends and receives, the gradient
reductions, the optimizer step and per-layer checkpoints, with the timings each iteration reports.

The timings split the iteration's wall time into disjoint parts: forward_s + backward_s (recompute_s is
inside backward_s) + p2p_s + allreduce_s + optimizer_s + data_s (drawing the samples) + overhead_s = iteration_s,
where overhead_s is the rest (swap prefetches, the end-of-iteration device sync, Python); idle_s is the same rest
under its older name. The pipeline bubble is in p2p_s: a stage waiting for its neighbour is blocked on a receive. On
a GPU kernels run asynchronously, so each span holds the device work the host waited for inside it.

Sync-SGD semantics: every micro-batch's summed loss is divided by the GLOBAL label count of the iteration
before backward, and gradients are SUMMED over replicas (and over the stages holding a tied weight), so the
update equals the single-process step on the whole global batch whatever the split.

Plan changes (migration.py): at every iteration boundary the ranks agree on the plan version in force and, when
it rises, migrate layers and switch recompute/swap policies before the next iteration's first micro-batch.
Swapped layers' activations are prefetched back when the schedule's next task is their micro-batch's backward.
Layer toggles (dynamic workloads) are re-evaluated at each iteration start.

ZeRO (sharding.py): layers in the plan's zero1/zero2 lists keep 1/d of their optimizer state per replica; the
gradient reduction (comms.py) runs once per iteration after the last micro-batch, the shard step after it and
the parameter all-gather last. Checkpoints gather a sharded layer's state so files are unsharded; a plan change
unshards the layers that move or turn plain before migrating, and shards what the new plan puts under ZeRO.

Drain (preemption): the same per-boundary agreement carries a drain flag, so when any rank is asked to drain,
every rank applies the agreed plan, writes one complete checkpoint at that boundary and stops there
(`Stopped.drained`): a consistent resume point, where a plain stop leaves ranks at different iterations.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.data.batches import batch_for, job_data, validation_batch_for
from services.data.evaluation import evaluation, evaluation_due
from services.executor.train import checkpoint as ckpt
from services.executor.train import heap, weights
from services.executor.train.background import BackgroundWriter
from services.executor.train.comms import Comms, Counters, Pending
from services.executor.train.config import WorkerConfig
from services.executor.train.data import dropout_seed, sample_range
from services.executor.train.faults import Faults
from services.executor.train.hold import Hold
from services.executor.train.hybrid import Hybrid, local
from services.executor.train.mesh import BACKWARD, FORWARD
from services.executor.train.migration import Agreement, Plan, PlanInbox, apply_plan, plan_moves
from services.executor.train.schedule import tasks
from services.executor.train.sharding import PLAIN, ZERO1, ZERO2, Sharded
from services.executor.train.stage import Stage

LOOKAHEAD = 2  # receives are posted this many tasks ahead of the task that consumes them
ABANDON_S = 30.0  # on a stop, how long this rank's own checkpoint files may take to finish
# On a stop, how long rank 0 still waits for its peers' layers of the checkpoint in flight: a peer killed after
# writing them leaves a complete checkpoint, so a morph trains at most the checkpoint interval again.
PEER_GRACE_S = 1.0
Report = Callable[[dict[str, Any]], None]


class Stopped(Exception):
    """A stop request honoured at a task boundary; `between_iterations` when no receive was left posted;
    `drained` when every rank agreed to stop at this boundary after a complete checkpoint of `iteration`."""

    def __init__(self, iteration: int, between_iterations: bool, drained: bool = False) -> None:
        what = "drained (checkpoint written)" if drained else "stopped on request"
        super().__init__(f"{what} after {iteration} completed iterations")
        self.iteration, self.between_iterations, self.drained = iteration, between_iterations, drained


def memory(device: torch.device) -> tuple[int, int]:
    """(current, peak) bytes: CUDA allocator on a GPU, process RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    try:
        current = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        current = 0
    return current, peak


class Trainer:
    def __init__(self, config: WorkerConfig, stage: Stage, optimizer: torch.optim.Optimizer, comms: Comms,
                 device: torch.device, should_stop: Callable[[], bool], inbox: PlanInbox,
                 should_drain: Callable[[], bool] = lambda: False, hybrid: Hybrid | None = None,
                 hold: Hold | None = None) -> None:
        self.config, self.stage, self.comms, self.device = config, stage, comms, device
        self.hybrid = hybrid if hybrid is not None else Hybrid({}, {})  # TP / SDP layers (hybrid.py)
        self.spec, self.data = config.spec(), config.data_spec()
        self.inbox = inbox  # plan commands (none arrive unless the worker reads them)
        self.info = inbox.info  # the meta model and its shapes, built once per worker
        self.parameters = stage.parameters()
        self.order = tasks(config.schedule, config.num_stages, stage.index, config.num_micro_batches)
        self.first_backward = next(i for i, (kind, _) in enumerate(self.order) if kind == "B")
        self.last_backward = max(i for i, (kind, _) in enumerate(self.order) if kind == "B")
        self.should_stop, self.should_drain = should_stop, should_drain
        self.hold = hold if hold is not None else Hold()  # held while the planner cannot record the job
        self.plan: Plan = inbox.initial
        # Plain and ZeRO optimizers (every flavour is plain with one replica); `optimizer` holds any loaded state.
        self.sharded = Sharded(stage, optimizer, self.plan.flavours(), group=comms.replica_group,
                               rank=comms.mesh.index("dp"), degree=config.num_replicas,
                               optimizer_config=config.optimizer)
        self.agreement = Agreement(comms.mesh.control)
        self.faults = Faults.from_env(str(config.model.get("name", "")), config.rank, config.world_size)
        self.writer = BackgroundWriter()
        self.in_flight: Path | None = None  # the checkpoint being written in the background, until settled
        self.data_s = 0.0  # the iteration's time drawing samples

    @property
    def plan_version(self) -> int:
        return self.plan.version

    @property
    def stage_bounds(self) -> tuple[tuple[int, int], ...]:
        return self.plan.stage_bounds

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer of the plain-DP layers' parameters (None when every parameter is under ZeRO)."""
        return self.sharded.plain

    def install(self, stage: Stage, plan: Plan) -> None:
        """Switch to a re-planned stage (what migration.apply_plan returns, sharded): layers, the comms' view."""
        self.stage, self.plan = stage, plan
        self.parameters = stage.parameters()
        self.comms.stage = stage

    def batch(self, iteration: int, micro_batch: int) -> dict[str, torch.Tensor]:
        c = self.config
        started = time.perf_counter()
        begin, end = sample_range(c.replica_index, micro_batch, c.micro_batch_size, c.num_micro_batches)
        full = batch_for(self.spec, self.data, c.seed, iteration, begin, end, global_batch_size=c.global_batch_size,
                         user_inputs=c.user_inputs)
        out = {k: full[k].to(self.device) for k in self.stage.batch_keys}
        self.data_s += time.perf_counter() - started
        return out

    def step(self, iteration: int, on_start: Callable[[], None] | None = None) -> dict[str, Any]:
        """One iteration (0-based index) of the schedule; returns the timing/loss fields of its report.

        `on_start` runs once the first task passed its stop check (the plan agreement is launched there, so a
        stop between iterations never leaves a collective posted)."""
        c, stage, comms = self.config, self.stage, self.comms
        start = time.perf_counter()
        stage.recompute_s = self.data_s = 0.0
        stage.segments.clear()  # a stopped iteration's leftovers
        stage.set_iteration(iteration)
        swap = stage.swap
        if swap is not None:
            swap.take_bytes()
        batches: dict[int, dict[str, torch.Tensor]] = {}
        count = 1.0
        if stage.is_last:  # the label count of the whole global batch scales every micro-batch loss
            batches = {j: self.batch(iteration, j) for j in range(c.num_micro_batches)}
            count = max(comms.replica_sum([float(sum(stage.loss_count(b) for b in batches.values()))])[0], 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        receives: dict[tuple[str, int], Pending] = {}
        saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        forward_s = backward_s = 0.0
        for position, (kind, j) in enumerate(self.order):
            if self.should_stop():
                raise Stopped(iteration, between_iterations=position == 0)
            if position == 0 and on_start is not None:
                on_start()
            if swap is not None and stage.swap_layers:  # bring activations back ahead of their backward
                if kind == "B":
                    swap.prefetch(j)
                if position + 1 < len(self.order) and self.order[position + 1][0] == "B":
                    swap.prefetch(self.order[position + 1][1])
            self._post_receives(position, receives)
            if kind == "F":
                received = comms.wait(receives.pop((kind, j))) if not stage.is_first else []
                for b, x in zip(stage.receives, received, strict=True):
                    x.requires_grad_(b.has_grad)
                batch = batches.pop(j) if j in batches else self.batch(iteration, j)
                torch.manual_seed(dropout_seed(c.seed, iteration, c.replica_index * c.num_micro_batches + j))
                t = time.perf_counter()
                # The last stage runs a backward right after its forward (every one under 1F1B, the newest under
                # GPipe): that micro-batch is not recomputed, as the simulator prices it.
                follows = stage.is_last and (c.schedule == "1f1b" or j == c.num_micro_batches - 1)
                self.faults.before_forward(iteration)
                outputs = stage.forward(received, batch, recompute=not follows, micro_batch=j)
                if stage.is_last:
                    loss_sum += outputs[0].detach().double()
                    outputs = [outputs[0] / count]
                else:
                    comms.send(j, FORWARD, outputs)
                saved[j] = (received, outputs)
                forward_s += time.perf_counter() - t
            else:
                if position == self.first_backward:  # ZeRO layers' gradients accumulate in flat buffers
                    self.sharded.prepare(stage.inactive)
                received, outputs = saved.pop(j)
                if self.hybrid.layers:
                    self.hybrid.sync_gradients(stage, last_micro_batch=position == self.last_backward)
                t = time.perf_counter()
                stage.recompute(j)  # while the gradient is still in flight (Varuna §3.2), not after it arrived
                backward_s += time.perf_counter() - t
                grads: list[torch.Tensor | None] = [None]
                if not stage.is_last:
                    arrived = iter(comms.wait(receives.pop((kind, j))))
                    grads = [next(arrived) if b.has_grad else None for b in stage.sends]
                t = time.perf_counter()
                input_grads = stage.backward(outputs, grads, received)
                if swap is not None:
                    swap.finish(j)
                if not stage.is_first:
                    comms.send(j, BACKWARD, input_grads)
                backward_s += time.perf_counter() - t
        comms.drain()
        if swap is not None:
            swap.clear()
        t = time.perf_counter()
        self.faults.after_iteration(forward_s + backward_s)  # a fail-stutter worker (test hook; none in production)
        backward_s += time.perf_counter() - t
        comms.reduce_gradients(self.parameters, self.sharded, self.hybrid)
        gradient_bytes = self.sharded.gradient_bytes(self.parameters)
        t = time.perf_counter()
        self.sharded.step()
        optimizer_s = time.perf_counter() - t
        comms.gather_parameters(self.sharded)
        loss = comms.replica_sum([float(loss_sum)])[0] / count if stage.is_last else 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._stats(time.perf_counter() - start, forward_s, backward_s, optimizer_s, loss, gradient_bytes)

    def _post_receives(self, position: int, receives: dict[tuple[str, int], Pending]) -> None:
        """Post the receives of the next LOOKAHEAD tasks, so their tensors arrive while this one computes."""
        stage = self.stage
        for kind, j in self.order[position : position + 1 + LOOKAHEAD]:
            if (kind, j) in receives:
                continue
            if kind == "F" and not stage.is_first:
                receives[(kind, j)] = self.comms.post_recv(j, FORWARD)
            elif kind == "B" and not stage.is_last:
                receives[(kind, j)] = self.comms.post_recv(j, BACKWARD)

    def _stats(self, iteration_s: float, forward_s: float, backward_s: float, optimizer_s: float,
               loss: float, gradient_bytes: int) -> dict[str, Any]:
        counters = self.comms.take()
        current, peak = memory(self.device)
        parts = forward_s + backward_s + counters.p2p_s + counters.allreduce_s + optimizer_s + self.data_s
        overhead = max(iteration_s - parts, 0.0)  # the timed parts are disjoint spans of the iteration
        return {
            "iteration_s": iteration_s, "forward_s": forward_s, "backward_s": backward_s,
            "recompute_s": self.stage.recompute_s, "comm_s": counters.comm_s, "p2p_s": counters.p2p_s,
            "allreduce_s": counters.allreduce_s, "optimizer_s": optimizer_s, "data_s": self.data_s,
            "overhead_s": overhead,
            "idle_s": overhead, "memory_bytes": current, "peak_memory_bytes": peak, "heap_peak_bytes": heap.take_peak(),
            "bytes_sent": counters.bytes_sent, "bytes_received": counters.bytes_received,
            "allreduce_bytes": counters.allreduce_bytes, "replica_allreduces": counters.replica_allreduces,
            "tied_allreduces": counters.tied_allreduces, "loss": loss, "has_loss": self.stage.is_last,
            "samples_per_s": self.config.global_batch_size / iteration_s if iteration_s > 0 else 0.0,
            "swapped_bytes": self.stage.swap.take_bytes() if self.stage.swap is not None else 0,
            "active_layers": self.stage.active_layers,
            **self._data_parallel(counters, gradient_bytes),
        }

    def _data_parallel(self, counters: Counters, gradient_bytes: int) -> dict[str, Any]:
        """With more than one replica: the layers under each ZeRO flavour, this rank's model-state bytes
        (`gradient_bytes` held after the reduction) and ZeRO's collectives. Nothing with one replica."""
        if self.config.num_replicas == 1:
            return {}
        held = self.stage.layer_indices
        return {"zero1_layers": [i for i in held if self.sharded.flavour(i) == ZERO1],
                "zero2_layers": [i for i in held if self.sharded.flavour(i) == ZERO2],
                "optimizer_state_bytes": self.sharded.optimizer_state_bytes(), "gradient_bytes": gradient_bytes,
                "reduce_scatter_bytes": counters.reduce_scatter_bytes, "allgather_bytes": counters.allgather_bytes,
                "replica_reduce_scatters": counters.replica_reduce_scatters,
                "replica_allgathers": counters.replica_allgathers}

    def save(self, done: int, head: dict[str, Any], report: Report, background: bool) -> None:
        """Per-layer checkpoint: layers round-robin over the stage's replicas, manifest by rank 0 last. Only the
        host copy stalls the boundary; with `background` the files are written while training goes on."""
        c, stage = self.config, self.stage
        self.writer.wait()  # one write in flight at most; its failure surfaces here, between iterations
        start = time.perf_counter()
        directory = ckpt.checkpoint_path(c.checkpoint_dir, done)
        if c.rank == 0:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                ckpt.clear_stale(directory)
            except OSError as exc:  # a full disk fails the write below, which reports it
                if not ckpt.is_disk_full(exc):
                    raise
        dist.barrier()  # no rank writes a sidecar before rank 0 cleared the stale ones
        mine = [layer for layer in stage.layers if (layer.index - stage.begin) % c.num_replicas == c.replica_index]
        # ZeRO layers' state is gathered (every replica takes part; the writer keeps it): files stay unsharded.
        state = self.sharded.state([layer.index for layer in mine])
        # TP / SDP layers are gathered whole (every rank of the stage takes part), the writer keeps its own.
        full = self.hybrid.full_layers(stage, state, [layer.index for layer in mine]) if self.hybrid.layers else {}
        snapshot = {**ckpt.snapshot([x for x in mine if x.index not in self.hybrid.layers], stage.aliases, state),
                    **full}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        meta = {"iterations_done": done, "next_iteration": done, "seed": c.seed, "plan_version": self.plan_version,
                "job_id": c.job_id, "model": c.model, "optimizer": c.optimizer["name"], "data": c.data,
                "global_batch_size": c.global_batch_size, "samples_seen": done * c.global_batch_size,
                "epoch": self.data_epoch(done)}
        event = {"event": "checkpoint", **head, "iteration": done, "plan_version": self.plan_version,
                 "dir": str(directory), "manifest": "", "checkpoint_s": time.perf_counter() - start,
                 "background": background}

        def write() -> None:
            began = time.perf_counter()
            try:
                entries = ckpt.write_snapshot(directory, snapshot)
                keys = ("layer_index", "uri", "bytes", "sha256")
                event["layers"] = [{k: e[k] for k in keys} for e in entries]
                if c.rank == 0:  # rank 0 vouches for the whole checkpoint: a lost peer's report is not needed
                    if not ckpt.await_layers(directory, stage.num_layers, self.writer.cancelled, c.timeout_s):
                        return
                    path = ckpt.write_manifest(directory, stage.num_layers, meta)
                    event["manifest"] = path.resolve().as_uri()
                    every = json.loads(path.read_text())["layers"].values()
                    event["every_layer"] = [{k: e[k] for k in keys} for e in every]
            except (OSError, ckpt.CheckpointFailed) as exc:
                if isinstance(exc, OSError) and not ckpt.is_disk_full(exc):
                    raise
                ckpt.fail(directory, c.rank, snapshot)  # this checkpoint fails alone: training goes on
                report({"event": "checkpoint_failed", **head, "iteration": done, "plan_version": self.plan_version,
                        "dir": str(directory), "message": str(exc)})
                return
            event["write_s"] = time.perf_counter() - began
            if not background:  # the boundary waited for the write too
                event["checkpoint_s"] = time.perf_counter() - start
            report(event)

        self.writer.start(write)
        if background:
            self.in_flight = directory
        else:
            self.writer.wait()

    def settle(self, done: int) -> None:
        """Before iteration `done` is reported, the checkpoint written during it is complete (rank 0 wrote its
        manifest): no stored iteration is ever more than the checkpoint interval past a complete checkpoint.
        Rank 0's write waits for every rank's layers; the others wait for its manifest."""
        directory, self.in_flight = self.in_flight, None
        if directory is None:
            return
        self.writer.hurry()
        self.writer.wait()
        try:
            if self.config.rank != 0 and not ckpt.await_manifest(directory, self.should_stop, self.config.timeout_s):
                raise Stopped(done, between_iterations=True)  # stopped meanwhile: this iteration is not reported
        except ckpt.CheckpointFailed:
            pass  # the rank that met the disk error reported it; the previous checkpoint stays the newest

    def train(self, start: int, head: dict[str, Any], report: Report) -> None:
        try:
            self._train(start, head, report)
        finally:  # a stop or error: a peer may be gone, so rank 0 stops waiting for its layers
            self.writer.abandon(ABANDON_S, PEER_GRACE_S)

    def _train(self, start: int, head: dict[str, Any], report: Report) -> None:
        config, layers = self.config, self.stage.layer_indices
        parameters = sum(p.numel() for p in self.parameters)
        report({"event": "started", **head, "world_size": config.world_size, "num_stages": config.num_stages,
                "num_replicas": config.num_replicas, "layers": layers, "parameters": parameters,
                "start_iteration": start, "iterations": config.iterations, "schedule": config.schedule,
                "global_batch_size": config.global_batch_size, "plan_version": config.plan_version,
                "predicted_iteration_s": config.predicted_iteration_s,
                "device": str(self.device), "pid": os.getpid(), "hybrid": self.hybrid.describe(self.stage)})
        for iteration in range(start, config.iterations):
            done = iteration + 1
            pending: list[Any] = []

            def launch(done: int = done, pending: list[Any] = pending) -> None:
                # every rank contributes its ready version as of the END of this iteration, and its drain flag
                ready = self.inbox.ready(done, self.plan_version)
                pending.append(self.agreement.launch(ready, self.should_drain(), self.hold.asked()))

            stats = self.step(iteration, on_start=launch if done < config.iterations else None)
            self.settle(done)
            report({"event": "iteration", **head, "iteration": done, "plan_version": self.plan_version,
                    **stats, "layers": self.stage.layer_indices})
            for version, message in self.inbox.take_rejections():
                report({"event": "command_rejected", **head, "iteration": done, "version": version,
                        "message": message})
            drain = held = False
            if pending:  # the new plan first, so a drain's checkpoint holds it
                version, drain, held = Agreement.result(pending[0])
                self.boundary(version, done, head, report)
            if evaluation_due(config, done):
                self.evaluate(done, head, report)
            saved = ((bool(config.checkpoint_every) and done % config.checkpoint_every == 0)
                     or (config.final_checkpoint and done == config.iterations))
            if saved:
                self.save(done, head, report, background=config.checkpoint_background and not drain)
            if held and not drain:  # after the cadence's checkpoint: a drain from the hold needs no second one
                outcome = self.hold.wait(done, config.world_size, self.agreement.group, torch.device("cpu"), head,
                                         report, self.should_stop, self.should_drain)
                drain = outcome == "drain"
                if outcome == "stop":
                    raise Stopped(done, between_iterations=True)
            if drain:
                self.drain(done, saved, head, report)
            if self.should_stop():
                raise Stopped(iteration + 1, between_iterations=True)
        self.writer.wait()  # the last checkpoint is on disk (and vouched for) before "done"
        report({"event": "done", **head, "iteration": config.iterations,
                "parameters": sum(p.numel() for p in self.parameters), **self.fingerprint()})

    def data_epoch(self, done: int) -> int:
        """The epoch the next training sample falls in (0 for synthetic data)."""
        return job_data(self.spec, self.data, self.config.user_inputs).epoch(done * self.config.global_batch_size)

    def evaluate(self, done: int, head: dict[str, Any], report: Report) -> None:
        """Validation loss after iteration `done`: `eval_batches` validation batches, forward only through the
        pipeline (each replica its share of every batch, as in training), in eval mode (no dropout). The last
        stage's first replica reports it; the time is the evaluation's own, outside every iteration's."""
        c, stage, comms = self.config, self.stage, self.comms
        started = time.perf_counter()
        loss_sum, count = torch.zeros((), dtype=torch.float64, device=self.device), 0
        modes = [(layer.module, layer.module.training) for layer in stage.layers]
        for module, _ in modes:
            module.eval()
        try:
            with torch.no_grad():
                for b in range(c.eval_batches):
                    for j in range(c.num_micro_batches):
                        received = comms.wait(comms.post_recv(j, FORWARD)) if not stage.is_first else []
                        begin, end = sample_range(c.replica_index, j, c.micro_batch_size, c.num_micro_batches)
                        full = validation_batch_for(self.spec, self.data, c.seed, b, begin, end,
                                                    global_batch_size=c.global_batch_size, user_inputs=c.user_inputs)
                        batch = {k: full[k].to(self.device) for k in stage.batch_keys}
                        outputs = stage.forward(received, batch, recompute=False, micro_batch=j)
                        if stage.is_last:
                            loss_sum += outputs[0].double()
                            count += stage.loss_count(batch)
                        else:
                            comms.send(j, FORWARD, outputs)
                    comms.drain()
        finally:
            for module, training in modes:
                module.train(training)
            stage.segments.clear()
            if stage.swap is not None:
                stage.swap.clear()
        if stage.is_last:
            total, labels = comms.replica_sum([float(loss_sum), float(count)])
            if c.replica_index == 0:
                fields = evaluation(total, labels, time.perf_counter() - started, c.eval_batches * c.global_batch_size,
                                    self.spec, c.user_inputs)
                report({"event": "evaluation", **head, "iteration": done, "plan_version": self.plan_version,
                        **fields})
        comms.take()  # the evaluation's traffic is not the next iteration's

    def drain(self, done: int, saved: bool, head: dict[str, Any], report: Report) -> None:
        """Every rank agreed to drain at this boundary: checkpoint `done` (unless the cadence just did), stop."""
        if not saved:
            if not self.config.checkpoint_dir:  # every rank raises alike, before any collective
                raise RuntimeError("a drain needs WorkerConfig.checkpoint_dir to write its checkpoint to; it is "
                                   "empty (stop without checkpoint instead, or set checkpoint_dir)")
            self.save(done, head, report, background=False)
        raise Stopped(done, between_iterations=True, drained=True)

    def boundary(self, agreed: int, done: int, head: dict[str, Any], report: Report) -> None:
        """Apply the agreed plan version if it is newer than the one in force (every rank decides alike)."""
        if agreed <= self.plan_version:
            return
        decided = time.perf_counter()
        plan = self.inbox.get(agreed)
        # Layers leaving this stage or turning plain are unsharded first (their full state travels or stays as
        # plain DP's); layers staying under ZeRO keep their chunks through the change.
        moving = {i for i, _, _ in plan_moves(self.plan.stage_bounds, plan.stage_bounds, self.info.num_layers)}
        flavours = plan.flavours()
        release = [i for i in self.stage.layer_indices if i in moving or flavours.get(i, PLAIN) == PLAIN]
        # TP / SDP layers that move travel whole: gathered here (every rank of the stage), split again there.
        if self.hybrid.layers and self.sharded.plain is not None:
            self.hybrid.release(self.stage, moving, self.sharded.plain, self.info, self.device)
        optimizer = self.sharded.release(release, self.stage)
        applied = apply_plan(self.stage, optimizer, self.plan, plan, mesh=self.comms.mesh, info=self.info,
                             optimizer_config=self.config.optimizer, device=self.device, done=done, decided=decided)
        optimizer = self.hybrid.reapply(applied.stage, applied.optimizer, self.config.optimizer)
        self.sharded.adopt(applied.stage, optimizer, flavours)
        self.install(applied.stage, plan)
        for event in applied.events:
            report({**event, **head})
        report({"event": "plan_applied", **head, **plan.describe(), "iteration": done,
                "layers": self.stage.layer_indices, "apply_s": time.perf_counter() - decided})

    def fingerprint(self) -> dict[str, Any]:
        """Hashes of this rank's parameters: replicas of a stage, and the copies of a tied weight on different
        stages (`tied_sha256`, in model order), must end bit-identical."""

        def digest(params: list[torch.Tensor]) -> str:
            h = hashlib.sha256()
            for p in params:
                h.update(local(p.detach()).cpu().contiguous().numpy().tobytes())
            return h.hexdigest()

        total = sum(float(local(p.detach()).double().sum()) for p in self.parameters)  # TP/SDP: this rank's shard
        # Each held layer's whole weights (TP/SDP gathered: every rank of the stage takes part), what an export of
        # the job's last checkpoint must reproduce bit for bit.
        full = self.hybrid.full_layers(self.stage, {}, self.hybrid.layers) if self.hybrid.layers else {}
        layers = {str(layer.index): weights.digest([(n, t) for n, t in full[layer.index][1].items()])
                  if layer.index in full else
                  weights.digest([(f"param/{n}", p.detach()) for n, p in layer.module.named_parameters()])
                  for layer in self.stage.layers}
        return {"param_sha256": digest(self.parameters), "param_sum": total,
                "tied_sha256": digest([t.parameter for t in self.stage.tied]), "layer_sha256": layers}
