"""Training worker: one process = one (stage, replica) of a plan; reports JSON lines on stdout.

Launch: `python -m services.executor.train.worker CONFIG.json` (a WorkerConfig as JSON). Nothing but events
goes to stdout, one JSON object per line; every event carries "event", "job_id", "rank", "stage", "replica"
(and "time", unix seconds, added by this CLI):
- "started": world_size, num_stages, num_replicas, layers (held layer indices), parameters (distinct
  parameters held), start_iteration, iterations, schedule, global_batch_size, plan_version,
  predicted_iteration_s, device, pid, hybrid (per held TP/SDP layer: strategy, degree, mesh axis sizes, this
  rank's parameter elements and the layer's whole count; {} when the stage has none).
- "iteration" (after each): iteration (completed count), plan_version, iteration_s, forward_s, backward_s (includes
  recompute_s), recompute_s, p2p_s (blocked on pipeline receives and send drains), allreduce_s (tied and replica
  gradient allreduces, ZeRO's reduce-scatters and parameter all-gathers, the last stage's loss sums), comm_s (p2p_s
  + allreduce_s), optimizer_s, data_s (drawing the samples), overhead_s (the rest: forward_s + backward_s + p2p_s +
  allreduce_s + optimizer_s + data_s + overhead_s = iteration_s), idle_s (= overhead_s, its older name),
  memory_bytes, peak_memory_bytes (CUDA allocator, or process RSS on the CPU), heap_peak_bytes (the CPU's analogue
  of CUDA's peak: glibc's heap in use at its peak during the iteration, the first one's including the worker's
  setup; sampled by a thread when the environment sets BALLAST_HEAP_PEAK=1, heap.py; else 0), bytes_sent /
  bytes_received (p2p), allreduce_bytes, replica_allreduces, tied_allreduces, loss and has_loss (the iteration's
  global mean loss, on the last stage only), samples_per_s (global batch / s), swapped_bytes (activation bytes moved
  to host memory this iteration; in chunk mode the chunk bytes moved out, = swap_out_bytes), swap_in_bytes /
  swap_out_bytes (chunk mode: chunk bytes moved host -> device / device -> host this iteration, optimizer states
  included; else 0 or absent), swap_s (chunk mode: seconds inside the chunk moves, gathers and reductions; they lie
  within the other parts), active_layers (held layers that computed: layer_toggles can make one the identity),
  layers (held during this iteration; plan_version is the version in force during it). With more than one replica
  also zero1_layers / zero2_layers (held layers under ZeRO-1 / ZeRO-2), optimizer_state_bytes (optimizer state this
  rank holds after the step: ZeRO layers' chunks only), gradient_bytes (gradients held after the reduction, before
  the step: ZeRO layers' chunks only), reduce_scatter_bytes / allgather_bytes (ZeRO's padded full gradient and
  parameter sizes put through the replica group's reduce-scatters and all-gathers), replica_reduce_scatters,
  replica_allgathers.
- "command_rejected" (a warning; training goes on): iteration (completed count when reported), version (the
  command's, 0 if it had none), message
  (names the bad field of a stdin command).
- "migration" (on the receiving rank, one per received layer, at the boundary where a plan applies):
  layer_index, from_stage, to_stage, bytes (received by this replica: header, parameters, buffers,
  optimizer state), duration_s (from the boundary decision to the layer ready), iteration (completed count
  at the boundary), plan_version.
- "plan_applied" (every rank, after its migrations): plan_version, iteration, stage_bounds, layers (held
  now), checkpoint_layers, swap_layers, zero1_layers, zero2_layers, apply_s.
- "checkpoint": iteration, plan_version, dir, manifest (URI on rank 0, else ""), layers
  [{layer_index, uri, bytes, sha256}] written by this rank, checkpoint_s (the boundary's stall: the host
  copy, plus the write when not in the background), write_s, background. Each rank reports once its files
  are on disk; rank 0 reports last, once the manifest exists, with every_layer (the manifest's entries).
- "done": iteration, parameters, param_sha256 / param_sum (this rank's parameters), tied_sha256, layer_sha256
  (each held layer's whole weights, TP/SDP gathered, as weights.digest hashes them: what an export reproduces).
- "checkpoint_failed": iteration, plan_version, dir, message. A rank could not write its part of a checkpoint
  (the disk full, over quota, an I/O error): its files of it are removed, the checkpoint stays incomplete (never
  resumed from), and training goes on from the previous complete one.
- "evaluation" (the last stage's first replica, with eval_every): iteration, plan_version, loss, perplexity,
  eval_s, samples, labels.
- "stopped" (exit 143): iteration, message, drained. SIGTERM stops at the next micro-batch task (drained
  false: ranks may stop at different iterations). SIGUSR2 drains: the ranks agree (with the plan version) on
  the next iteration boundary, every rank writes its part of a checkpoint there ("checkpoint" events, unless
  the cadence just wrote one) and stops with drained true and the same iteration. Needs checkpoint_dir. A
  drain reaching a worker before its handler is installed (while it imports torch) kills it, as SIGTERM does.
- "held" / "released": iteration, reason / held_s and outcome (release, stop or drain). A {"command": "hold",
  "held": true} line on stdin (every mode) holds every rank at the next boundary they agree on (hold.py);
  "held": false trains on from there.
- "error" (exit 1): message, infrastructure (true when a collective or transfer broke: a peer or the network
  was lost, not the model), traceback (the last few KiB).
Chunk mode (`chunk_bytes` > 0, PatrickStar, offload.py): one stage holds every layer, every rank is a
data-parallel replica of the whole model (rank = replica), its model data in chunks of `chunk_bytes` under
`device_budget_bytes` of device memory, host memory unlimited. The events are those above, with: "started" adds
offload (chunk_bytes, device_budget_bytes, chunks, model_bytes) and warnings (a checkpoint_every that is not
honoured: chunk mode writes no checkpoints yet); "iteration" has recompute_s = p2p_s = 0, allreduce_s = comm_s
(the chunk all-gathers and reductions, taken out of forward_s and backward_s, and the loss sum), loss on every
rank, plus gathered_bytes, reduced_bytes, evictions and device_budget_peak_bytes (the budget's high-water mark);
no ZeRO fields; "done" hashes and sums this rank's own chunks. Stdin plan commands each get a "command_rejected"
(training goes on). SIGTERM and SIGUSR2 both stop every rank at one agreed iteration boundary, drained false (no
checkpoint to drain to). resume_from, per-layer policies and layer toggles are refused (WorkerConfig.validate).
Harmony mode (`harmony` set, train/harmony.py): one stage holds every layer, every rank is one device of one
wrap-around pipeline over the whole global batch (rank = replica = device; global_batch_size is not multiplied by the
ranks), running its tasks of the schedule under `harmony.device_budget_bytes`; every layer's weights and optimizer
states live in the host store `harmony.store_dir` (shared memory files every rank of the job maps; rank 0 writes
the initial weights before the first barrier and removes the directory when the run ends, after a last barrier
when it ends cleanly). The events are chunk mode's, with: "started" adds harmony (schedule, devices, prefetch,
device_budget_bytes, model_bytes, tasks: this rank's) and the same warnings; "iteration" has p2p_s (blocked on
activation and gradient transfers between ranks), bytes_sent (those bytes), allreduce_s = the loss sum,
comm_s = p2p_s + allreduce_s, recompute_s (inside backward_s: backward tasks running their pack's forward
again), swap_in_bytes / swap_out_bytes (weights, states and stashed activations host -> device / device -> host),
swapped_bytes = swap_out_bytes, swap_s (within forward_s, backward_s and optimizer_s), loss on every rank and
device_budget_peak_bytes (the pool's high-water mark); "done" hashes and sums the host store's weights (the same
on every rank). Commands, stops and refusals are chunk mode's.
`kill -USR1 PID` writes every thread's stack to CONFIG.stacks (beside CONFIG.json) and training goes on.
`resume_from` may be a directory path, a file:// URI, or the manifest itself.

Commands: JSON lines on stdin, read by a daemon thread ("plan" commands, migration.py); EOF or /dev/null means
none. The plan in force changes only at an iteration boundary that every rank agrees on.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from services.data.evaluation import evaluation, evaluation_due
from services.executor.train import checkpoint as ckpt
from services.executor.train import heap, hybrid, weights
from services.executor.train.comms import Comms
from services.executor.train.config import WorkerConfig, is_int
from services.executor.train.harmony import HarmonyRank, HarmonyStep, check_model, schedule_from
from services.executor.train.hold import Hold
from services.executor.train.mesh import Mesh
from services.executor.train.migration import Plan, PlanInbox, read_commands
from services.executor.train.offload import ChunkedTrainer
from services.executor.train.stage import build_stage, check_layers, make_optimizer, model_info
from services.executor.train.trainer import Report, Stopped, Trainer, memory
from services.zoo import build_model

STOPPED_EXIT = 143
AGENT_PID_ENV = "BALLAST_AGENT_PID"  # set by the agent: the worker dies with it (no orphan left training)
PR_SET_PDEATHSIG = 1
TRACEBACK_CHARS = 4000
# What a broken collective or p2p transfer says, whatever the backend: a lost peer, not the model's fault.
BROKEN_LINK = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out", "timeout",
               "socket", "peer")
# The host's storage failing under a checkpoint or a log: no space, over quota, an I/O error.
HOST_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
__all__ = ["Stopped", "main", "run"]


def is_infrastructure(exc: BaseException) -> bool:
    """Whether an exception reports lost infrastructure (a dead peer, the network, a collective's timeout, the
    host's disk full or failing) rather than an error in the model's code; the planner morphs the job for the
    first (it resumes from the last complete checkpoint, within its retry budget), fails it for the other."""
    if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__.startswith("Dist"):
        return True
    if isinstance(exc, OSError) and exc.errno in HOST_DISK_ERRNOS:
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc).lower() for word in BROKEN_LINK)


def die_with_agent() -> None:
    """Ask Linux to SIGKILL this worker when its agent dies (kill -9 of the agent, the host's processes), so no
    orphan keeps a device busy or blocks its peers; exit now if the agent is already gone."""
    agent = os.environ.get(AGENT_PID_ENV)
    if not agent or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(agent):
        os._exit(1)


def run(config: WorkerConfig, report: Report, should_stop: Callable[[], bool] | None = None,
        commands: TextIO | None = None, should_drain: Callable[[], bool] | None = None) -> None:
    """Train this worker's stage from `start_iteration` (or the resumed checkpoint) until `iterations`;
    `commands` (stdin under the CLI) is read for plan commands; `should_drain` (default never) asks every rank
    to checkpoint and stop at an agreed boundary (Stopped.drained). With `chunk_bytes` > 0 the whole model
    trains with its data in chunks instead (chunk mode above); with `harmony` set, on Harmony's schedule."""
    config.validate()
    config.user_inputs.importable()  # the operator's model directories: a user's module file is found there
    head = {"job_id": config.job_id, "rank": config.rank, "stage": config.stage_index,
            "replica": config.replica_index}
    torch.set_num_threads(config.intra_op_threads)
    if os.environ.get(heap.ENV) == "1":  # opt-in: iteration events' heap_peak_bytes (CPU live-heap peak)
        heap.start()
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    stop, drain = should_stop or (lambda: False), should_drain or (lambda: False)
    # Everything that can fail on the configuration or the model happens before the rendezvous: every rank
    # refuses alike and fast.
    if config.harmony:
        train = prepare_harmony(config, head, report, stop, commands, drain)
    elif config.chunk_bytes > 0:
        train = prepare_chunks(config, device, head, report, stop, commands, drain)
    else:
        train = prepare_stage(config, device, head, report, stop, commands, drain)
    dist.init_process_group(config.backend, init_method=config.init_method, rank=config.rank,
                            world_size=config.world_size, timeout=timedelta(seconds=config.timeout_s))
    try:
        train()
    except Stopped as e:
        if e.between_iterations:  # nothing in flight on our side
            dist.destroy_process_group()
        raise
    dist.destroy_process_group()  # other failures leave it: a peer may be stuck mid-collective with us


def checked_resume(config: WorkerConfig, mode: str) -> str:
    """An offloaded mode's resume_from, checked against the run (model, optimizer, position in the data)."""
    if not config.resume_from:
        return ""
    manifest = ckpt.read_manifest(config.resume_from)
    num_layers = len(build_model(config.spec(), device="meta", user_inputs=config.user_inputs).decompose())
    ckpt.check_compatible(manifest, config.model, config.optimizer["name"], num_layers)
    ckpt.check_position(manifest, config.data, config.global_batch_size, config.seed)
    after = manifest["next_iteration"]
    if config.start_iteration not in (0, after):
        raise ValueError(f"WorkerConfig.start_iteration {config.start_iteration} disagrees with the checkpoint's next "
                         f"iteration {after} ({mode}); set it to 0 or {after}")
    return config.resume_from


def start_of(config: WorkerConfig) -> int:
    """The first iteration: the resumed checkpoint's next one, else start_iteration."""
    return ckpt.read_manifest(config.resume_from)["next_iteration"] if config.resume_from else config.start_iteration


def offloaded_checkpoint(config: WorkerConfig, done: int, snapshot: ckpt.Snapshot | None, num_layers: int,
                         head: dict[str, Any], report: Report, started: float) -> None:
    """Rank 0 writes an offloaded mode's whole checkpoint (it holds every layer's tensors) and reports it once the
    manifest vouches for it; the other ranks sent their part and go on."""
    if snapshot is None:
        return
    directory = ckpt.checkpoint_path(config.checkpoint_dir, done)
    began = time.perf_counter()
    meta = {"iterations_done": done, "next_iteration": done, "seed": config.seed, "plan_version": config.plan_version,
            "job_id": config.job_id, "model": config.model, "optimizer": config.optimizer["name"],
            "data": config.data, "global_batch_size": config.global_batch_size,
            "samples_seen": done * config.global_batch_size}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        ckpt.clear_stale(directory)
        entries = ckpt.write_snapshot(directory, snapshot)
        path = ckpt.write_manifest(directory, num_layers, meta)
    except OSError as exc:
        if not ckpt.is_disk_full(exc):
            raise
        ckpt.fail(directory, config.rank, snapshot)  # this checkpoint fails alone: training goes on
        report({"event": "checkpoint_failed", **head, "iteration": done, "plan_version": config.plan_version,
                "dir": str(directory), "message": str(exc)})
        return
    keys = ("layer_index", "uri", "bytes", "sha256")
    layers = [{k: e[k] for k in keys} for e in entries]
    report({"event": "checkpoint", **head, "iteration": done, "plan_version": config.plan_version,
            "dir": str(directory), "manifest": path.resolve().as_uri(), "layers": layers, "every_layer": layers,
            "checkpoint_s": time.perf_counter() - started, "write_s": time.perf_counter() - began,
            "background": False})


def checkpoint_due(config: WorkerConfig, done: int) -> bool:
    return bool(config.checkpoint_dir) and ((bool(config.checkpoint_every) and done % config.checkpoint_every == 0)
                                            or (config.final_checkpoint and done == config.iterations))


def initial_weights(config: WorkerConfig) -> dict[str, torch.Tensor] | None:
    """JobSpec.init_from's weights under the model's own names (None: the seed initialises the model)."""
    if not config.init_from:
        return None
    return weights.initial_weights(config.init_from, config.spec(), config.user_inputs)


def prepare_stage(config: WorkerConfig, device: torch.device, head: dict[str, Any], report: Report,
                  should_stop: Callable[[], bool], commands: TextIO | None,
                  should_drain: Callable[[], bool]) -> Callable[[], None]:
    """Build the stage (and load the resumed checkpoint); returns what trains it once the group exists."""
    stage = build_stage(config.spec(), config.stage_bounds, config.stage_index, seed=config.seed,
                        micro_batch_size=config.micro_batch_size, checkpoint_layers=config.checkpoint_layers,
                        swap_layers=config.swap_layers, layer_toggles=config.layer_toggles, device=device,
                        user_inputs=config.user_inputs)
    check_layers("zero1_layers", config.zero1_layers, stage.num_layers)
    check_layers("zero2_layers", config.zero2_layers, stage.num_layers)
    check_layers("tp_layers", [t[0] for t in config.tp_layers], stage.num_layers)
    check_layers("sdp_layers", config.sdp_layers, stage.num_layers)
    layer_strategies = hybrid.strategies(config.tp_layers, config.sdp_layers, config.num_replicas, config.sp_layers)
    # over the whole model: every rank of every stage refuses alike
    info = model_info(config.spec(), config.micro_batch_size, config.user_inputs)
    hybrid.check_model(info, layer_strategies)
    inbox = PlanInbox(info, config.num_stages, Plan.initial(config), hybrid=frozenset(layer_strategies))
    hold = Hold()
    # plan commands only online (otherwise every rank stays on the initial plan); hold commands always
    read_commands(commands, inbox if config.online else None, hold)
    initial = initial_weights(config)
    if initial is not None:  # before any layer is split or sharded: every strategy starts from the whole weights
        weights.load_into(stage.layers, weights.layer_names(info.model, info.dec, config.spec()), initial)
    optimizer = make_optimizer(stage.parameters(), config.optimizer)
    start = config.start_iteration
    if config.resume_from:  # a bad checkpoint fails fast on every rank
        manifest = ckpt.read_manifest(config.resume_from)
        ckpt.check_compatible(manifest, config.model, config.optimizer["name"], stage.num_layers)
        ckpt.check_position(manifest, config.data, config.global_batch_size, config.seed)
        if start not in (0, manifest["next_iteration"]):
            raise ValueError(f"WorkerConfig.start_iteration {start} disagrees with the checkpoint's next iteration "
                             f"{manifest['next_iteration']}; set it to 0 or {manifest['next_iteration']}")
        zero = config.num_replicas > 1 and bool(config.zero1_layers or config.zero2_layers)  # sliced on the host
        ckpt.load_layers(config.resume_from, manifest, stage.layers, stage.aliases, optimizer, state_on_host=zero)
        start = manifest["next_iteration"]

    def train() -> None:
        mesh = Mesh(config.dims, config.rank, device.type, tied_sets=stage.tied_sets, online=config.online,
                    tp_degrees=hybrid.tp_degrees(config.tp_layers))
        applied, stage_optimizer = None, optimizer
        if layer_strategies:  # parameters become DTensors: the optimizer is made over the new ones
            applied = hybrid.Hybrid.for_job(layer_strategies, {t: mesh.tp_mesh(t) for t in mesh.tp_degrees},
                                            mesh.device_mesh["dp"] if config.num_replicas > 1 else None)
            stage_optimizer = applied.reapply(stage, optimizer, config.optimizer)
        comms = Comms(mesh, stage, device)
        trainer = Trainer(config, stage, stage_optimizer, comms, device, should_stop, inbox, should_drain,
                          hybrid=applied, hold=hold)
        trainer.train(start, head, report)

    return train


CHUNKS_TAKE_NO_PLANS = ("plan command field 'command': chunk offload takes no plan commands (its plan is one stage "
                        "of every layer, data parallel, with the model data in chunks); training goes on unchanged")


HARMONY_TAKES_NO_PLANS = ("plan command field 'command': Harmony's swap schedule takes no plan commands (its plan "
                          "is one wrap-around pipeline of layer packs over every device); training goes on unchanged")


class Refusals:
    """Chunk and Harmony modes' stdin: every plan command is refused (a "command_rejected" at the next boundary),
    none applied; hold commands go to `hold`."""

    def __init__(self, stream: TextIO | None, message: str = CHUNKS_TAKE_NO_PLANS) -> None:
        self._message = message
        self._lock = threading.Lock()
        self._rejected: list[tuple[int, str]] = []
        self.hold = Hold()
        read_commands(stream, self, self.hold)

    def submit(self, line: str) -> None:
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            raw = None
        version = raw.get("version") if isinstance(raw, dict) and is_int(raw.get("version")) else 0
        with self._lock:
            self._rejected.append((version, self._message))  # the version lets the agent fail that instruction

    def take(self) -> list[tuple[int, str]]:
        with self._lock:
            out, self._rejected = self._rejected, []
        return out


def prepare_chunks(config: WorkerConfig, device: torch.device, head: dict[str, Any], report: Report,
                   should_stop: Callable[[], bool], commands: TextIO | None,
                   should_drain: Callable[[], bool]) -> Callable[[], None]:
    """Chunk mode: the whole model, this rank a data-parallel replica (rank = replica), its model data in chunks
    under the device budget (offload.py). Built here, before the rendezvous (the chunk layout needs no group)."""
    trainer = ChunkedTrainer(config.spec(), config.data_spec(), config.seed, config.global_batch_size, config.optimizer,
                             device_budget=config.device_budget_bytes or None, chunk_bytes=config.chunk_bytes,
                             micro_batches=config.num_micro_batches, device=device, rank=config.replica_index,
                             world=config.num_replicas, user_inputs=config.user_inputs,
                             initial=initial_weights(config), resume_from=checked_resume(config, "chunk offload"))
    layers = list(range(len(trainer.model.decompose().layers)))
    if config.bounds != (0, len(layers)):
        raise ValueError(f"WorkerConfig.stage_bounds: chunk offload's one stage holds every layer, [0, {len(layers)}), "
                         f"got {list(config.bounds)}")
    refusals = Refusals(commands)
    return lambda: train_chunks(config, trainer, layers, head, report, refusals,
                                lambda: should_stop() or should_drain())


def train_chunks(config: WorkerConfig, trainer: ChunkedTrainer, layers: list[int], head: dict[str, Any],
                 report: Report, refusals: Refusals, should_stop: Callable[[], bool]) -> None:
    """The chunk-mode loop: one "iteration" event per iteration; a stop (or a drain: nothing to checkpoint)
    takes effect at the first boundary every rank agreed on, voted with the loss sum."""
    start, device = start_of(config), trainer.device
    parameters = sum(p.numel() for p in trainer.params)
    manager = trainer.manager
    warnings: list[str] = []
    report({"event": "started", **head, "world_size": config.world_size, "num_stages": 1,
            "num_replicas": config.num_replicas, "layers": layers, "parameters": parameters, "start_iteration": start,
            "iterations": config.iterations, "schedule": config.schedule, "global_batch_size": config.global_batch_size,
            "plan_version": config.plan_version, "predicted_iteration_s": config.predicted_iteration_s,
            "device": str(device), "pid": os.getpid(), "hybrid": {},
            "offload": {"chunk_bytes": config.chunk_bytes, "device_budget_bytes": config.device_budget_bytes,
                        "chunks": manager.layout.num_chunks, "model_bytes": trainer.model_bytes},
            "warnings": warnings})

    def refused(done: int) -> None:
        for version, message in refusals.take():
            report({"event": "command_rejected", **head, "iteration": done, "version": version, "message": message})

    for iteration in range(start, config.iterations):
        done = iteration + 1
        step = trainer.step(iteration, vote=should_stop, hold=refusals.hold.asked)
        iteration_s = step.iteration_s
        parts = step.forward_s + step.backward_s + step.allreduce_s + step.optimizer_s
        overhead = max(iteration_s - parts, 0.0)  # disjoint spans: the rest is batch building and Python
        current, peak = memory(device)
        moved = step.traffic
        report({"event": "iteration", **head, "iteration": done, "plan_version": config.plan_version,
                "iteration_s": iteration_s, "forward_s": step.forward_s, "backward_s": step.backward_s,
                "recompute_s": 0.0, "p2p_s": 0.0, "allreduce_s": step.allreduce_s, "comm_s": step.allreduce_s,
                "optimizer_s": step.optimizer_s, "overhead_s": overhead, "idle_s": overhead, "memory_bytes": current,
                "peak_memory_bytes": peak, "heap_peak_bytes": heap.take_peak(), "loss": step.loss, "has_loss": True,
                "samples_per_s": config.global_batch_size / iteration_s if iteration_s > 0 else 0.0,
                "swapped_bytes": moved.to_host, "swap_in_bytes": moved.to_device, "swap_out_bytes": moved.to_host,
                "swap_s": step.swap_s, "gathered_bytes": moved.gathered, "reduced_bytes": moved.reduced,
                "evictions": moved.evictions, "device_budget_peak_bytes": trainer.device_pool.peak,
                "active_layers": layers, "layers": layers})
        refused(done)
        if evaluation_due(config, done):
            began = time.perf_counter()
            total, labels = trainer.evaluate(config.eval_batches)
            if config.rank == 0:
                report({"event": "evaluation", **head, "iteration": done, "plan_version": config.plan_version,
                        **evaluation(total, labels, time.perf_counter() - began,
                                     config.eval_batches * config.global_batch_size, config.spec(),
                                     config.user_inputs)})
        if checkpoint_due(config, done):
            began = time.perf_counter()
            offloaded_checkpoint(config, done, trainer.checkpoint_layers(), len(layers), head, report, began)
        if step.stop or (step.hold and refusals.hold.wait(done, config.num_replicas, trainer.group, device, head,
                                                          report, should_stop) != "release"):
            raise Stopped(done, between_iterations=True)
    refused(config.iterations)
    payloads = manager.local_payloads()
    digest = hashlib.sha256()
    for payload in payloads:
        digest.update(payload.detach().cpu().contiguous().numpy().tobytes())
    report({"event": "done", **head, "iteration": config.iterations, "parameters": parameters,
            "param_sha256": digest.hexdigest(), "param_sum": sum(float(p.double().sum()) for p in payloads),
            "layer_sha256": trainer.layer_digests()})


def prepare_harmony(config: WorkerConfig, head: dict[str, Any], report: Report, should_stop: Callable[[], bool],
                    commands: TextIO | None, should_drain: Callable[[], bool]) -> Callable[[], None]:
    """Harmony mode: refuse what the schedule cannot run from the model's shape alone (no weights, no store: every
    rank alike), then build this device's HarmonyRank over the host store; rank 0 writes the initial weights there."""
    spec, h = config.spec(), config.harmony
    dec = build_model(spec, device="meta", user_inputs=config.user_inputs).decompose()
    check_model(spec, dec)
    if config.bounds != (0, len(dec.layers)):
        raise ValueError(f"WorkerConfig.stage_bounds: Harmony's one stage holds every layer, [0, {len(dec.layers)}), "
                         f"got {list(config.bounds)}")
    schedule = schedule_from({"schedule": h})
    try:
        schedule.check(len(dec.layers), config.global_batch_size)
    except ValueError as e:
        raise ValueError(f"WorkerConfig.harmony: {e}") from None
    store = Path(h["store_dir"])
    store.mkdir(parents=True, exist_ok=True)  # every rank maps its files in the constructor, rank 0 or not
    try:
        resume = checked_resume(config, "Harmony")
        runner = HarmonyRank(spec, config.data_spec(), config.seed, config.global_batch_size, config.optimizer,
                             schedule, store, device_budget=h["device_budget_bytes"] or None, rank=config.rank,
                             prefetch=h["prefetch"], user_inputs=config.user_inputs,
                             initial=initial_weights(config) if config.rank == 0 else None,
                             resume_from=resume if config.rank == 0 else "")
    except BaseException:
        remove_store(config)
        raise
    refusals = Refusals(commands, HARMONY_TAKES_NO_PLANS)
    return lambda: train_harmony(config, runner, head, report, refusals, lambda: should_stop() or should_drain())


def remove_store(config: WorkerConfig) -> None:
    """Rank 0 removes the job's host store (a peer still mapping its files keeps them until it lets go)."""
    if config.rank == 0:
        shutil.rmtree(config.harmony["store_dir"], ignore_errors=True)


def train_harmony(config: WorkerConfig, runner: HarmonyRank, head: dict[str, Any], report: Report,
                  refusals: Refusals, should_stop: Callable[[], bool]) -> None:
    """The Harmony loop, once the group exists: the first barrier orders rank 0's initial weights before every
    rank's first read; the store goes when the run ends, however it ends."""
    try:
        dist.barrier()
        harmony_iterations(config, runner, head, report, refusals, should_stop)
    finally:
        runner.close()
        remove_store(config)


def harmony_iterations(config: WorkerConfig, runner: HarmonyRank, head: dict[str, Any], report: Report,
                       refusals: Refusals, should_stop: Callable[[], bool]) -> None:
    """One "iteration" event per iteration; a stop (or a drain: nothing to checkpoint) takes effect at the first
    boundary every rank agreed on, voted with the loss sum; a last barrier lets rank 0 remove the store."""
    start, h, device = start_of(config), config.harmony, torch.device("cpu")
    layers = list(range(len(runner.layers)))
    parameters = sum(w.numel() for w in runner.store.weights)
    warnings: list[str] = []
    schedule = {k: h[k] for k in ("forward_micro_batch", "forward_packs", "backward_micro_batch", "backward_packs",
                                  "devices")}
    report({"event": "started", **head, "world_size": config.world_size, "num_stages": 1,
            "num_replicas": config.num_replicas, "layers": layers, "parameters": parameters, "start_iteration": start,
            "iterations": config.iterations, "schedule": "harmony", "global_batch_size": config.global_batch_size,
            "plan_version": config.plan_version, "predicted_iteration_s": config.predicted_iteration_s,
            "device": str(device), "pid": os.getpid(), "hybrid": {},
            "harmony": {"schedule": schedule, "devices": h["devices"], "prefetch": h["prefetch"],
                        "device_budget_bytes": h["device_budget_bytes"], "model_bytes": runner.model_bytes,
                        "tasks": len(runner.mine)},
            "warnings": warnings})

    def refused(done: int) -> None:
        for version, message in refusals.take():
            report({"event": "command_rejected", **head, "iteration": done, "version": version, "message": message})

    stopped = None
    for iteration in range(start, config.iterations):
        done = iteration + 1
        step = runner.step(iteration, vote=should_stop, hold=refusals.hold.asked)
        current, peak = memory(device)
        report({"event": "iteration", **head, "iteration": done, "plan_version": config.plan_version,
                **harmony_split(step), "memory_bytes": current, "peak_memory_bytes": peak,
                "heap_peak_bytes": heap.take_peak(), "loss": step.loss, "has_loss": True,
                "samples_per_s": config.global_batch_size / step.iteration_s if step.iteration_s > 0 else 0.0,
                "swapped_bytes": step.traffic["to_host"], "swap_in_bytes": step.traffic["to_device"],
                "swap_out_bytes": step.traffic["to_host"], "swap_s": step.traffic["swap_s"],
                "bytes_sent": step.traffic["peer"], "device_budget_peak_bytes": runner.pool.peak,
                "active_layers": layers, "layers": layers})
        refused(done)
        harmony_boundary(config, runner, done, len(layers), head, report)
        if step.stop or (step.hold and refusals.hold.wait(done, config.world_size, None, device, head, report,
                                                          should_stop) != "release"):
            stopped = Stopped(done, between_iterations=True)
            break
    digest, total = hashlib.sha256(), 0.0
    for flat in runner.store.weights if stopped is None else []:  # the same files on every rank
        digest.update(flat.numpy().tobytes())
        total += float(flat.double().sum())
    dist.barrier()  # every rank is done with the host store: rank 0 may remove it
    if stopped is not None:
        raise stopped
    refused(config.iterations)
    report({"event": "done", **head, "iteration": config.iterations, "parameters": parameters,
            "param_sha256": digest.hexdigest(), "param_sum": total,
            "layer_sha256": runner.layer_digests() if config.rank == 0 else {}})


def harmony_boundary(config: WorkerConfig, runner: HarmonyRank, done: int, num_layers: int, head: dict[str, Any],
                     report: Report) -> None:
    """Evaluation and checkpoints between Harmony iterations: rank 0 reads the host store (every update of
    iteration `done` is in it: the loss sum that ended it waited for every rank); the others wait at a barrier, so
    no update of the next iteration writes the store meanwhile."""
    if evaluation_due(config, done):
        began = time.perf_counter()
        if config.rank == 0:
            total, labels = runner.evaluate(config.eval_batches)
            report({"event": "evaluation", **head, "iteration": done, "plan_version": config.plan_version,
                    **evaluation(total, labels, time.perf_counter() - began,
                                 config.eval_batches * config.global_batch_size, config.spec(), config.user_inputs)})
        dist.barrier()
    if checkpoint_due(config, done):
        began = time.perf_counter()
        snapshot = runner.checkpoint_layers(done) if config.rank == 0 else None  # host copies
        dist.barrier()
        offloaded_checkpoint(config, done, snapshot, num_layers, head, report, began)


def harmony_split(step: HarmonyStep) -> dict[str, float]:
    """An iteration's time in the event's disjoint parts (they add up to iteration_s; swap_s lies within them)."""
    t = step.traffic
    parts = t["forward_s"] + t["backward_s"] + t["optimizer_s"] + t["peer_s"] + t["allreduce_s"]
    overhead = max(step.iteration_s - parts, 0.0)  # batch building, the loss count, Python
    return {"iteration_s": step.iteration_s, "forward_s": t["forward_s"], "backward_s": t["backward_s"],
            "recompute_s": t["recompute_s"], "p2p_s": t["peer_s"], "allreduce_s": t["allreduce_s"],
            "comm_s": t["peer_s"] + t["allreduce_s"], "optimizer_s": t["optimizer_s"], "overhead_s": overhead,
            "idle_s": overhead}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m services.executor.train.worker CONFIG.json", file=sys.stderr)
        return 2
    die_with_agent()
    stop, drain = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGUSR2, lambda signum, frame: drain.set())
    stacks = Path(args[0]).with_suffix(".stacks").open("w")  # `kill -USR1 PID`: where is a stuck worker?
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    head: dict[str, Any] = {}

    lock = threading.Lock()

    def report(event: dict[str, Any]) -> None:
        with lock:
            sys.stdout.write(json.dumps({**event, "time": time.time()}) + "\n")
            sys.stdout.flush()

    try:
        config = WorkerConfig.from_json(Path(args[0]).read_text())
        head = {"job_id": config.job_id, "rank": config.rank, "stage": config.stage_index,
                "replica": config.replica_index}
        run(config, report, stop.is_set, commands=sys.stdin, should_drain=drain.is_set)
        code = 0
    except Stopped as e:
        report({"event": "stopped", **head, "iteration": e.iteration, "message": str(e), "drained": e.drained})
        code = STOPPED_EXIT
    except Exception as e:  # every failure becomes one "error" line the agent relays
        with contextlib.suppress(OSError):  # a full disk under the log must not keep the report from the agent
            traceback.print_exc(file=sys.stderr)
        report({"event": "error", **head, "message": f"{type(e).__name__}: {e}",
                "infrastructure": is_infrastructure(e), "traceback": traceback.format_exc()[-TRACEBACK_CHARS:]})
        code = 1
    sys.stdout.flush()
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: slow with torch loaded, and a dead peer's group can block it


if __name__ == "__main__":
    sys.exit(main())
