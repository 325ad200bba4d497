"""An agent's worker processes: launched from an AssignInstruction, watched, stopped.

One process per assigned device (`python -m services.executor.train.worker CONFIG.json`), with the steady
allocator the profiler measures under. Each worker reports JSON lines on stdout; a reader thread per worker
turns them into AgentMessages (StageStats per iteration, CheckpointWritten) and, when the process ends,
a WorkerExit saying whether it finished and, if not, why (its error line, or the signal that killed it).
A stop is SIGTERM (workers end at their next task, at different iterations); a drain is SIGUSR2 (every rank
checkpoints at one agreed iteration boundary and exits: WorkerExit.drained, iteration = that boundary).
Nothing read from a worker is unpickled: JSON only. How a worker starts is the `launch` given to Workers: a
process by default, an in-process emulated rank at fleet scale (services/executor/emulated.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from ballast.v1 import common_pb2, executor_pb2, job_pb2, plan_pb2
from services.executor.telemetry import StatsWindow
from services.executor.train.config import WorkerConfig
from services.executor.train.hold import hold_command
from services.runtime.allocator import STEADY_ALLOCATOR
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs

AGENT_PID_ENV = "BALLAST_AGENT_PID"  # the worker dies with this agent (train/worker.py die_with_agent)

log = logging.getLogger("ballast.workers")
WORKER = (sys.executable, "-m", "services.executor.train.worker")
STOP_GRACE_S = 3.0
DRAIN_GRACE_S = 120.0  # a drain waits for up to two iterations (agreed one boundary late) plus a checkpoint
REMEMBERED_JOBS = 64  # jobs whose worker exits and checkpoint reports are replayed to a planner that (re)connects
MAX_TIMESTAMP_S = 253_402_300_800  # 10000-01-01: past it a protobuf Timestamp is out of range
REMEMBERED_CHECKPOINTS = 2  # per job: the latest checkpoint iterations whose reports are replayed
SCHEDULES = {plan_pb2.SCHEDULE_GPIPE: "gpipe", plan_pb2.SCHEDULE_1F1B: "1f1b"}
SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")  # what a job id may put into a file name
Emit = Callable[[executor_pb2.AgentMessage], None]
# argv and environment in; the worker (a subprocess.Popen, or what looks like one) and its stderr file out
Launch = Callable[[list[str], dict[str, str]], tuple[Any, Any]]


def start_process(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Any]:
    """A worker process in its own session (a stop signals its whole group), stderr to a file: a chatty worker
    never blocks on a full pipe."""
    stderr = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                            start_new_session=True)
    return proc, stderr


def worker_config(assign: executor_pb2.AssignInstruction, worker: executor_pb2.WorkerAssignment, job_id: str,
                  user_inputs: UserInputs = NO_USER_INPUTS) -> WorkerConfig:
    """The WorkerConfig (services/executor/train/config.py) of one assigned worker; `user_inputs` is this agent's
    operator policy (it decides what the worker may import, whatever the planner sent)."""
    plan, spec, placed = assign.plan, assign.spec, assign.placement
    optimizer = spec.optimizer
    harmony_plan = plan.HasField("harmony")  # one pipeline over the whole batch on gloo, CPU tensors (no CUDA path)
    backend = "gloo" if harmony_plan else placed.backend or "gloo"
    return WorkerConfig(
        job_id=job_id,
        model=MessageToDict(spec.model, preserving_proto_field_name=True),
        stage_bounds=[[s.layer_begin, s.layer_end] for s in plan.stages],
        num_replicas=placed.replicas,
        stage_index=worker.stage_index,
        replica_index=worker.replica_index,
        rank=worker.rank,
        world_size=placed.world_size,
        micro_batch_size=placed.micro_batch_size,
        num_micro_batches=placed.num_micro_batches,
        # Varuna's schedule is priced by the simulator; the runtime runs 1F1B in its place.
        schedule=SCHEDULES.get(plan.schedule, "1f1b"),
        **policies(plan),
        **hybrid_layers(plan),
        layer_toggles=[[t.layer_index, t.iteration, int(t.active)] for t in spec.layer_toggles],
        optimizer={"name": optimizer.name or "adam", "learning_rate": optimizer.learning_rate or 1e-3,
                   "weight_decay": optimizer.weight_decay},
        seed=spec.seed,
        iterations=spec.iterations,
        start_iteration=assign.start_iteration,
        data=MessageToDict(spec.data, preserving_proto_field_name=True),
        checkpoint_dir=assign.checkpoint_dir,
        checkpoint_every=spec.checkpoint_every,
        eval_every=spec.eval_every,
        eval_batches=spec.eval_batches or 4,
        resume_from=assign.checkpoint_uri,
        init_from=assign.init_from,
        final_checkpoint=bool(assign.checkpoint_dir),
        init_method=f"tcp://{placed.rendezvous}",
        backend=backend,
        device="cuda:0" if backend == "nccl" else "cpu",  # one visible GPU per worker (CUDA_VISIBLE_DEVICES)
        timeout_s=float(assign.process_group_timeout_s or 60),
        intra_op_threads=1,
        plan_version=plan.version,
        online=spec.online_repartition,
        predicted_iteration_s=plan.prediction.iteration_time_s,
        chunk_bytes=plan.offload.chunk_bytes if plan.HasField("offload") else 0,
        device_budget_bytes=plan.offload.device_budget_bytes if plan.HasField("offload") else 0,
        harmony=harmony(plan, job_id),
        user_inputs=user_inputs,
    )


def unplaced_workers(assign: executor_pb2.AssignInstruction) -> str:
    """Why the workers of an Assign cannot be launched from its placement ("" if they can): each is one of the
    placement's ranks, at that rank's stage, replica and device."""
    placed = {r.rank: r for r in assign.placement.ranks}
    if not placed or len(placed) != assign.placement.world_size:
        return (f"placement: {len(placed)} rank(s) placed for a world of {assign.placement.world_size}; the "
                "planner sends the job's whole placement with every Assign")
    for w in assign.workers:
        r = placed.get(w.rank)
        if r is None or (r.stage_index, r.replica_index, r.device_index) != (w.stage_index, w.replica_index,
                                                                              w.device_index):
            return f"workers: rank {w.rank} is not where the placement puts it"
    return ""


def harmony(plan: plan_pb2.Plan, job_id: str) -> dict:
    """A Harmony plan's schedule as the worker runs it (Harmony mode, train/worker.py); {} otherwise. Its workers
    share the host store of this job and plan version."""
    if not plan.HasField("harmony"):
        return {}
    h = plan.harmony
    return {
        "forward_micro_batch": h.forward_micro_batch,
        "forward_packs": [[p.begin, p.end] for p in h.forward_packs],
        "backward_micro_batch": h.backward_micro_batch,
        "backward_packs": [[p.begin, p.end] for p in h.backward_packs],
        "devices": h.devices, "prefetch": h.prefetch, "device_budget_bytes": h.device_budget_bytes,
        "store_dir": harmony_store_dir(job_id, plan.version)}


def harmony_store_dir(job_id: str, version: int) -> str:
    """The host store of a job's plan version: one path for every rank on the host, another for each job and
    version (a re-planned job never maps the last version's files); shared memory where the host has it."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"ballast-harmony-{SAFE_NAME.sub('_', job_id)}-v{version}")


def policies(plan: plan_pb2.Plan) -> dict[str, list[int]]:
    """Per-layer memory policies of a plan: recomputed layers, layers whose activations go to host memory (a
    layer marked for both is recomputed: nothing of it is stashed to swap), and the layers whose data-parallel
    replicas shard their model states (`dp_sharding`: ZeRO-1, ZeRO-2). The ZeRO lists appear only when a layer
    asks for one (the worker's default, and an absent list in a "plan" command, mean plain DP everywhere)."""
    out = {"checkpoint_layers": [x.layer_index for x in plan.layers if x.checkpoint],
           "swap_layers": [x.layer_index for x in plan.layers if x.swap_activations and not x.checkpoint]}
    for key, flavour in (("zero1_layers", common_pb2.DP_SHARDING_ZERO1),
                         ("zero2_layers", common_pb2.DP_SHARDING_ZERO2)):
        layers = [x.layer_index for x in plan.layers if x.dp_sharding == flavour]
        if layers:
            out[key] = layers
    return out


def hybrid_layers(plan: plan_pb2.Plan) -> dict[str, list]:
    """The plan's tensor-parallel and sharded-data-parallel layers as the worker runs them (train/hybrid.py): TP t
    innermost with plain DP over the rest of the stage's devices (its sequence split too where the plan says), or
    SDP over all of them. A strategy the workers
    cannot run (TP outside DP, TP with SDP, SDP beside DP) is refused, naming the layer."""
    out: dict[str, list] = {}
    for x in plan.layers:
        tp, sdp, dp = max(x.tp, 1), max(x.sdp, 1), max(x.dp, 1)
        if tp == 1 and sdp == 1:
            continue
        inner = [d for d in x.order if d in (common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_SDP,
                                             common_pb2.PARALLEL_DIM_TP)]
        if tp > 1 and sdp == 1 and (dp == 1 or inner[-1:] == [common_pb2.PARALLEL_DIM_TP]):
            out.setdefault("tp_layers", []).append([x.layer_index, tp])
            if x.sequence_parallel:
                out.setdefault("sp_layers", []).append(x.layer_index)
        elif sdp > 1 and tp == 1 and dp == 1:
            out.setdefault("sdp_layers", []).append(x.layer_index)
        else:
            raise ValueError(f"plan layer {x.layer_index}: dp {dp} x sdp {sdp} x tp {tp} (order "
                             f"{[common_pb2.ParallelDim.Name(d) for d in x.order]}) is not a strategy the workers run: "
                             "they run TP innermost with DP outside it, or SDP alone; re-plan with the executors' dims")
    return out


def plan_command(message: executor_pb2.PlannerMessage) -> dict:
    """The worker's "plan" command (services/executor/train/worker.py) for a RepartitionInstruction: the new
    runtime shape, applied by every rank at the first iteration boundary they all reach holding it."""
    rep = message.repartition
    return {"command": "plan", "version": int(message.version), "not_before": int(rep.effective_iteration),
            "stage_bounds": [[s.layer_begin, s.layer_end] for s in rep.plan.stages], **policies(rep.plan)}


def stage_stats(event: dict, job_id: str) -> executor_pb2.StageStats:
    """A worker's "iteration" event as StageStats (train/worker.py lists its keys); missing keys read as 0, and
    `ended_at` is the event's "time" (stamped as the worker reported it), unset without one."""
    stats = executor_pb2.StageStats(
        job_id=job_id, stage_index=int(event.get("stage", 0)), replica_index=int(event.get("replica", 0)),
        iteration=int(event.get("iteration", 0)), plan_version=int(event.get("plan_version", 0)),
        forward_s=float(event.get("forward_s", 0.0)), backward_s=float(event.get("backward_s", 0.0)),
        comm_s=float(event.get("comm_s", 0.0)), idle_s=float(event.get("idle_s", 0.0)),
        peak_memory_bytes=int(event.get("peak_memory_bytes", 0)), loss=float(event.get("loss") or 0.0),
        has_loss=bool(event.get("has_loss")), layers=[int(i) for i in event.get("layers", [])],
        iteration_time_s=float(event.get("iteration_s", 0.0)), recompute_s=float(event.get("recompute_s", 0.0)),
        bytes_sent=int(event.get("bytes_sent", 0)),
        throughput_samples_per_s=float(event.get("samples_per_s", 0.0)), rank=int(event.get("rank", 0)),
        swapped_bytes=int(event.get("swapped_bytes", 0)),
        active_layers=[int(i) for i in event.get("active_layers", event.get("layers", []))],
        p2p_s=float(event.get("p2p_s", 0.0)), allreduce_s=float(event.get("allreduce_s", 0.0)),
        optimizer_s=float(event.get("optimizer_s", 0.0)), overhead_s=float(event.get("overhead_s", 0.0)),
        swap_in_bytes=int(event.get("swap_in_bytes", 0)), swap_out_bytes=int(event.get("swap_out_bytes", 0)),
        swap_s=float(event.get("swap_s", 0.0)), data_s=float(event.get("data_s", 0.0)))
    ended = event.get("time")
    if isinstance(ended, int | float) and not isinstance(ended, bool) and 0 < ended < MAX_TIMESTAMP_S:
        stats.ended_at.FromMicroseconds(round(ended * 1e6))  # a float second holds microseconds, not nanos
    return stats


@dataclass
class Worker:
    job_id: str
    assignment: executor_pb2.WorkerAssignment
    proc: Any  # a subprocess.Popen, or an emulated rank with its surface
    stderr: Any
    iteration: int = 0
    done: bool = False
    error: str = ""
    stopped: str = ""
    infrastructure: bool = False  # its error was a broken collective or transfer, not the model's
    traceback: str = ""
    drained: bool = False  # it reported a drained stop: a complete checkpoint of `iteration` exists
    plan_version: int = 0  # the plan version this worker runs under (bumped by applied repartitions)
    store_dir: str = ""  # Harmony's host store: removed once every worker of the job has exited
    reader: threading.Thread | None = field(default=None, repr=False)
    window: StatsWindow = field(default_factory=lambda: StatsWindow(1), repr=False)  # its stats not sent yet


def _heard(remembered: dict, job_id: str, new: Callable[[], Any]) -> Any:
    """`job_id`'s entry in `remembered`, moved to the newest end (made with `new` if absent); past
    REMEMBERED_JOBS the least recently heard job is forgotten."""
    entry = remembered.pop(job_id) if job_id in remembered else new()
    remembered[job_id] = entry
    while len(remembered) > REMEMBERED_JOBS:
        remembered.pop(next(iter(remembered)))
    return entry


class Workers:
    """Every worker process this agent runs, by job."""

    def __init__(self, emit: Emit, work_dir: Path, command: tuple[str, ...] = WORKER,
                 user_inputs: UserInputs = NO_USER_INPUTS, launch: Launch = start_process):
        self._emit, self._dir, self._command, self._user_inputs = emit, work_dir, command, user_inputs
        self._start = launch
        self._jobs: dict[str, list[Worker]] = {}
        self._exits: dict[str, list[executor_pb2.WorkerExit]] = {}  # insertion-ordered: oldest job first
        # job -> iteration -> its ranks' reports: a report in flight when the stream broke is otherwise lost
        self._written: dict[str, dict[int, list[executor_pb2.CheckpointWritten]]] = {}
        self._pending: dict[tuple[str, int], str] = {}  # (job, plan version) -> repartition instruction id
        self._lock = threading.Lock()

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def assign(self, message: executor_pb2.PlannerMessage) -> executor_pb2.InstructionAck:
        job_id, assign = message.job_id, message.assign
        ack = executor_pb2.InstructionAck(instruction_id=message.instruction_id, version=message.version)
        with self._lock:
            if job_id in self._jobs:  # a redelivered instruction: the workers already run
                ack.ok, ack.message = True, "already running"
                return ack
        unplaced = unplaced_workers(assign)
        if unplaced:
            ack.ok, ack.message = False, unplaced
            return ack
        started: list[Worker] = []
        try:
            for assignment in assign.workers:
                started.append(self._launch(job_id, assign, assignment))
        except (OSError, ValueError) as exc:
            for w in started:
                w.proc.kill()
            ack.ok, ack.message = False, f"could not launch workers: {exc}"
            return ack
        with self._lock:
            self._jobs[job_id] = started
        for w in started:
            w.reader = threading.Thread(target=self._follow, args=(w,), name=f"worker-{w.assignment.rank}",
                                        daemon=True)
            w.reader.start()
        ack.ok, ack.message = True, f"started {len(started)} worker(s)"
        return ack

    def _launch(self, job_id: str, assign: executor_pb2.AssignInstruction,
                assignment: executor_pb2.WorkerAssignment) -> Worker:
        folder = self._dir / job_id
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / f"rank-{assignment.rank}.json"
        settings = worker_config(assign, assignment, job_id, self._user_inputs)
        config.write_text(settings.to_json())
        env = {**STEADY_ALLOCATOR, **os.environ, "OMP_NUM_THREADS": "1", AGENT_PID_ENV: str(os.getpid())}
        if assign.placement.backend == "nccl":
            env["CUDA_VISIBLE_DEVICES"] = str(assignment.device_index)
        proc, stderr = self._start([*self._command, str(config)], env)
        return Worker(job_id, assignment, proc, stderr, plan_version=assign.plan.version,
                      store_dir=settings.harmony.get("store_dir", ""),
                      window=StatsWindow(assign.metrics_window, period=assign.spec.checkpoint_every))

    def repartition(self, message: executor_pb2.PlannerMessage) -> executor_pb2.InstructionAck | None:
        """Hand a new plan version to the job's workers (a JSON line on each one's stdin). The ack comes later,
        from `_report`, once every local worker applied it (None now); an immediate one if it cannot be sent."""
        job_id, version = message.job_id, int(message.version)
        ack = executor_pb2.InstructionAck(instruction_id=message.instruction_id, version=version)
        with self._lock:
            workers = list(self._jobs.get(job_id, []))
        if not workers:
            ack.ok, ack.message = False, f"no worker of job {job_id} runs on this host"
            return ack
        if all(w.plan_version >= version for w in workers):
            ack.ok, ack.message = True, f"plan version {version} already in force"
            return ack
        line = json.dumps(plan_command(message)) + "\n"
        with self._lock:
            self._pending[(job_id, version)] = message.instruction_id
        for w in workers:
            try:
                w.proc.stdin.write(line)
                w.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError) as exc:  # the worker is gone; its exit says why
                with self._lock:
                    self._pending.pop((job_id, version), None)
                ack.ok, ack.message = False, f"worker rank {w.assignment.rank} did not take the plan: {exc}"
                return ack
        return None

    def _applied(self, w: Worker, version: int, iteration: int) -> None:
        """Ack a repartition once every local worker of the job runs its version (or a later one)."""
        with self._lock:
            w.plan_version = max(w.plan_version, version)
            workers = self._jobs.get(w.job_id, [w])
            done = [(v, i) for (job, v), i in self._pending.items()
                    if job == w.job_id and all(x.plan_version >= v for x in workers)]
            for v, _ in done:
                self._pending.pop((w.job_id, v))
        for v, instruction_id in done:
            self._emit(executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(
                instruction_id=instruction_id, version=v, ok=True,
                message=f"plan version {version} applied after iteration {iteration}")))

    def _rejected(self, w: Worker, version: int, why: str) -> None:
        with self._lock:
            instruction_id = self._pending.pop((w.job_id, version), None)
        if instruction_id is not None:
            self._emit(executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(
                instruction_id=instruction_id, version=version, ok=False,
                message=f"worker rank {w.assignment.rank} rejected plan version {version}: {why}")))

    def _follow(self, w: Worker) -> None:
        """Relay the worker's reports, then its exit, whatever the reports were: without the exit the planner
        would wait for this worker forever."""
        try:
            for line in w.proc.stdout:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a stray print is not a report
                if not isinstance(event, dict):
                    continue
                try:
                    self._report(w, event)
                except (KeyError, TypeError, ValueError) as exc:
                    log.warning("bad worker report", extra={"job_id": w.job_id, "rank": w.assignment.rank,
                                                            "event": str(event.get("event")), "error": str(exc)})
        except (OSError, ValueError) as exc:  # unreadable output: the exit still goes out
            log.warning("worker output unreadable", extra={"job_id": w.job_id, "error": str(exc)})
        finally:
            self._exited(w)

    def _exited(self, w: Worker) -> None:
        code = w.proc.wait()
        w.stderr.seek(0)
        tail = w.stderr.read()[-1500:].decode(errors="replace").strip()
        w.stderr.close()
        try:
            w.proc.stdin.close()
        except OSError:
            pass  # its reader is gone with it
        finished = code == 0 and w.done
        # Outside the model: a signal, a crash without a Python error, or an error the worker saw as a lost peer.
        infrastructure = not finished and not w.stopped and (code < 0 or w.infrastructure or not w.error)
        if finished:
            why = ""
        elif w.stopped:
            why = f"stopped: {w.stopped}"
        elif code < 0:
            why = w.error or f"killed by {signal.Signals(-code).name}"
        else:
            why = w.error or (tail.splitlines()[-1] if tail else f"exit status {code}")
        a = w.assignment
        exit_ = executor_pb2.WorkerExit(job_id=w.job_id, rank=a.rank, stage_index=a.stage_index,
                                        replica_index=a.replica_index, exit_code=code, finished=finished,
                                        message=why, iteration=w.iteration, drained=w.drained,
                                        infrastructure=infrastructure, traceback=w.traceback)
        self._send_stats(w.window.flush())  # its last window goes before its exit (and its replay): the planner
        with self._lock:  # stores a job's rows before it settles the job
            _heard(self._exits, w.job_id, list).append(exit_)
        self._emit(executor_pb2.AgentMessage(worker_exit=exit_))
        with self._lock:
            workers = self._jobs.get(w.job_id, [])
            ended = all(x.proc.poll() is not None for x in workers)
            if ended:
                self._jobs.pop(w.job_id, None)
                self._pending = {k: v for k, v in self._pending.items() if k[0] != w.job_id}
        if ended:  # rank 0 removes it as the run ends; not when it was killed or died first
            for store in {x.store_dir for x in workers if x.store_dir}:
                shutil.rmtree(store, ignore_errors=True)

    def _report(self, w: Worker, event: dict) -> None:
        kind = event.get("event")
        if kind == "iteration":  # the worker counts iterations done; metrics number them from 0
            w.iteration = int(event.get("iteration", w.iteration))
            stats = stage_stats({**event, "iteration": w.iteration - 1, "rank": w.assignment.rank}, w.job_id)
            self._send_stats(w.window.add(stats))
        elif kind == "checkpoint":  # rank 0's report lists every layer once the manifest vouches for them
            complete = bool(event.get("every_layer"))
            layers = [job_pb2.LayerCheckpoint(layer_index=int(x["layer_index"]), uri=str(x["uri"]),
                                              bytes=int(x.get("bytes", 0)), sha256=str(x.get("sha256", "")))
                      for x in event.get("every_layer" if complete else "layers", [])]
            written = executor_pb2.CheckpointWritten(
                rank=w.assignment.rank, checkpoint_s=float(event.get("checkpoint_s", 0.0)),
                write_s=float(event.get("write_s", 0.0)), background=event.get("background") is True,
                checkpoint=job_pb2.Checkpoint(
                    job_id=w.job_id, iteration=int(event.get("iteration", 0)),
                    plan_version=int(event.get("plan_version", 0)), layers=layers, complete=complete))
            self._remember_checkpoint(written)
            self._emit(executor_pb2.AgentMessage(checkpoint_written=written))
        elif kind == "evaluation":
            self._emit(executor_pb2.AgentMessage(evaluated=job_pb2.Evaluation(
                job_id=w.job_id, iteration=int(event["iteration"]), plan_version=int(event.get("plan_version", 0)),
                loss=float(event["loss"]), perplexity=float(event.get("perplexity", 0.0)),
                eval_s=float(event.get("eval_s", 0.0)), samples=int(event.get("samples", 0)))))
        elif kind == "checkpoint_failed":
            log.warning("checkpoint failed", extra={"job_id": w.job_id, "rank": w.assignment.rank,
                                                    "iteration": event.get("iteration"), "why": event.get("message")})
            self._emit(executor_pb2.AgentMessage(checkpoint_written=executor_pb2.CheckpointWritten(
                rank=w.assignment.rank, error=str(event.get("message", "the checkpoint could not be written")),
                checkpoint=job_pb2.Checkpoint(job_id=w.job_id, iteration=int(event.get("iteration", 0)),
                                              plan_version=int(event.get("plan_version", 0))))))
        elif kind == "plan_applied":
            self._applied(w, int(event.get("plan_version", 0)), int(event.get("iteration", 0)))
        elif kind == "command_rejected":
            self._rejected(w, int(event.get("version", 0)), str(event.get("message", "rejected")))
        elif kind == "migration":
            self._emit(executor_pb2.AgentMessage(layer_migrated=executor_pb2.LayerMigrated(
                rank=w.assignment.rank, replica_index=w.assignment.replica_index, migration=job_pb2.LayerMigration(
                    job_id=w.job_id, layer_index=int(event["layer_index"]), from_stage=int(event["from_stage"]),
                    to_stage=int(event["to_stage"]), bytes=int(event.get("bytes", 0)),
                    duration_s=float(event.get("duration_s", 0.0)), iteration=int(event.get("iteration", 0)),
                    plan_version=int(event.get("plan_version", 0))))))
        elif kind == "started":
            for warning in event.get("warnings") or []:  # what the worker does not honour (chunk mode's checkpoints)
                log.warning("worker warning", extra={"job_id": w.job_id, "rank": w.assignment.rank,
                                                     "warning": str(warning)})
        elif kind == "done":
            w.done = True
        elif kind in ("error", "stopped"):
            w.error = str(event.get("message", kind))
            w.infrastructure = event.get("infrastructure") is True
            w.traceback = str(event.get("traceback", ""))[-4000:]
            if kind == "stopped" and event.get("drained") is True:
                w.drained, w.iteration = True, int(event["iteration"])

    def _send_stats(self, windows: list[executor_pb2.StageStats]) -> None:
        if windows:
            self._emit(executor_pb2.AgentMessage(heartbeat=executor_pb2.Heartbeat(stages=windows)))

    def applied_versions(self) -> dict[str, int]:
        """Plan version in force per running job (the lowest over its local workers)."""
        with self._lock:
            return {job: min(w.plan_version for w in ws) for job, ws in self._jobs.items() if ws}

    def _remember_checkpoint(self, written: executor_pb2.CheckpointWritten) -> None:
        ck = written.checkpoint
        with self._lock:
            by_iteration = _heard(self._written, ck.job_id, dict)
            by_iteration.setdefault(ck.iteration, []).append(written)
            while len(by_iteration) > REMEMBERED_CHECKPOINTS:
                by_iteration.pop(min(by_iteration))

    def replay(self) -> list[executor_pb2.AgentMessage]:
        """Every remembered exit again, for a planner that may have restarted after receiving them: it counts
        exits by rank, so a repeat changes nothing, and a job it already ended ignores them. They go behind
        what waits in the outbox (agent.py): an exit may end the job."""
        with self._lock:
            return [executor_pb2.AgentMessage(worker_exit=e) for exits in self._exits.values() for e in exits]

    def replay_checkpoints(self) -> list[executor_pb2.AgentMessage]:
        """The latest checkpoints' reports again, oldest first, for a planner that lost them with a broken
        stream or a restart. They go ahead of everything waiting (agent.py), so no exit ends the job before
        them. Repeats change nothing: the planner keeps parts by layer and the store answers a recorded
        checkpoint with its row."""
        with self._lock:
            return [executor_pb2.AgentMessage(checkpoint_written=c) for by_iteration in self._written.values()
                    for iteration in sorted(by_iteration) for c in by_iteration[iteration]]

    def hold(self, job_id: str, held: bool, reason: str) -> int:
        """Hold the job's workers at their next agreed boundary, or release them (a hold command on each one's
        stdin, train/hold.py). Returns how many took it; a worker that is gone reports its own exit."""
        line = hold_command(held, reason)
        with self._lock:
            workers = list(self._jobs.get(job_id, []))
        taken = 0
        for w in workers:
            try:
                w.proc.stdin.write(line)
                w.proc.stdin.flush()
                taken += 1
            except (BrokenPipeError, OSError, ValueError):
                pass
        return taken

    def stop(self, job_id: str, reason: str) -> int:
        """SIGTERM the job's workers, SIGKILL whatever is left after a grace period. Returns how many."""
        return self._end(job_id, reason, signal.SIGTERM, [(STOP_GRACE_S, signal.SIGKILL)])

    def drain(self, job_id: str, reason: str) -> int:
        """SIGUSR2 the job's workers: they checkpoint at one iteration boundary they all agree on and exit
        (WorkerExit.drained). Whatever is left after DRAIN_GRACE_S gets SIGTERM, then SIGKILL. Returns how many."""
        return self._end(job_id, reason, signal.SIGUSR2,
                         [(DRAIN_GRACE_S, signal.SIGTERM), (STOP_GRACE_S, signal.SIGKILL)])

    def _end(self, job_id: str, reason: str, sig: int, escalate: list[tuple[float, int]]) -> int:
        with self._lock:
            workers = list(self._jobs.get(job_id, []))
        for w in workers:
            w.stopped = reason
            _signal(w.proc, sig)
        if workers:
            threading.Thread(target=self._reap, args=(workers, escalate), name=f"stop-{job_id}", daemon=True).start()
        return len(workers)

    def stop_all(self, reason: str) -> None:
        for job_id in self.jobs():
            self.stop(job_id, reason)

    @staticmethod
    def _reap(workers: list[Worker], escalate: list[tuple[float, int]]) -> None:
        """Per (grace, signal): wait up to `grace` for every worker, then signal those still running."""
        for grace, sig in escalate:
            deadline = time.monotonic() + grace
            for w in workers:
                try:
                    w.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    pass
            for w in workers:
                if w.proc.poll() is None:
                    _signal(w.proc, sig)


def _signal(proc: Any, sig: int) -> None:
    """Signal a worker process's whole group (its own session); an emulated rank takes the signal itself."""
    if not isinstance(proc, subprocess.Popen):
        proc.send_signal(sig)
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
