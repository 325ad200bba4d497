"""Live layer migration (vPipe): the online planner rebalances a deliberately unbalanced pipeline while it trains.

Two local CPU workers (2 stages x 1 replica, one process per core, one intra-op thread each, gloo, steady
allocator) train a GPT from the zoo whose 8 decomposed layers (embed, 6 blocks, head) start split 1 | 7.
A controller in this process plays the planner's part (services/planner/jobs/rebalance.py): every worker
"iteration" event becomes a StageStats (services/executor/workers.py `stage_stats`, iteration = count - 1)
fed to a `TrainingMonitor`; once it is ready, `propose()` prices a repartition on a profile measured here
(services.profiler.driver, as benchmarks/estimator.py does) and an accepted decision goes to both workers'
stdin as a "plan" command (version + 1, not_before = iterations done + 1; `workers.plan_command`). The
monitor is told the new version once both workers report plan_applied. One proposal is priced per plan
version (its first full window); the run goes on until one is rejected, then `--after` more iterations,
then the workers are stopped (SIGTERM).

Iteration wall time = interval between consecutive "iteration" events of the last stage ("time" fields):
it includes the boundary work where a migration happens (an event's own iteration_s does not). A migration
applied at boundary K (after K iterations) lands in the interval ending at event K + 1.

Then the same move by stop-checkpoint-restart: the same start trains to the first migration's boundary K with
a checkpoint at K (WorkerConfig checkpoint_every), the workers exit, and new workers with the final bounds
resume from that checkpoint; the gap between the last iteration event before the stop and the first after
the restart (checkpoint write, process exit and start, rendezvous, model build, checkpoint load, one
iteration) is compared with the live figures.

Targets (CPU here): throughput after rebalancing >= 1.3x before; the iteration in which a migration happens
takes <= 1.5x the median iteration after rebalancing. Default shape: hidden 256, sequence 128, vocabulary
2048, 8 micro-batches of 1 sample (1F1B's bubble with 2 stages is 1/9 of the balanced iteration; with 4
micro-batches of 2 it is 1/5, which caps the gain near 1.6x before any co-location slowdown). Also printed:
other processes' CPU use and the stages' summed forward+backward after / before, both per window, since on a
2-core VM the balanced pipeline keeps both cores busy and the unbalanced one only one.

    .venv/bin/python benchmarks/migration.py [--micro-batch 1 --micro-batches 8] [--after 10] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from google.protobuf.json_format import MessageToDict, ParseDict  # noqa: E402

from ballast.v1 import executor_pb2, model_pb2, plan_pb2, services_pb2  # noqa: E402
from services.executor.train.checkpoint import checkpoint_path  # noqa: E402
from services.executor.train.config import WorkerConfig  # noqa: E402
from services.executor.train.launch import plan_configs, run_local  # noqa: E402
from services.executor.workers import plan_command, stage_stats  # noqa: E402
from services.planner.cost import CostContext, CostOptions, LayerStrategy, from_profile  # noqa: E402
from services.planner.online import Decision, MonitorOptions, OnlineOptions, TrainingMonitor, propose  # noqa: E402
from services.planner.search.problem import price  # noqa: E402
from services.planner.sim import Schedule  # noqa: E402
from services.profiler import driver  # noqa: E402
from services.runtime.allocator import STEADY_ALLOCATOR  # noqa: E402
from services.specs.fleet import load_fleet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = "bench-migration"
START = ((0, 1), (1, 8))  # embed | 6 blocks + head
WARM_UP = 2  # iterations skipped before the "before" median, and after the last rebalance for the "after" one
SPEEDUP_TARGET = 1.3
STALL_TARGET = 1.5
SECTION = "## Live layer migration (vPipe)"
NOTES = "### Notes"
WIDTH = 116  # BENCHMARKS.md prose line width


def spec_of(hidden: int, seq: int, vocab: int) -> model_pb2.ModelSpec:
    return ParseDict({"name": "gpt-migration", "family": "MODEL_FAMILY_GPT", "dtype": "DTYPE_FP32", "transformer": {
        "num_layers": 6, "hidden_size": hidden, "num_heads": max(hidden // 64, 1), "vocab_size": vocab,
        "seq_length": seq, "tie_embeddings": True}}, model_pb2.ModelSpec())


def steady_allocator() -> None:
    """Re-exec under the workers' allocator settings, so profile and training agree (glibc reads them at start)."""
    if any(key not in os.environ for key in STEADY_ALLOCATOR):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**STEADY_ALLOCATOR, **os.environ})


def measure_profile(spec: model_pb2.ModelSpec, micro_batch: int, repeats: int):
    sizes = sorted({1, max(micro_batch // 2, 1), micro_batch, micro_batch * 2})
    request = services_pb2.ProfileRequest(max_micro_batch_size=sizes[-1], options=services_pb2.ProfileOptions(
        repeats=repeats, micro_batch_sizes=sizes, intra_op_threads=1, calibrate=True, calibrate_group_sizes=[2]))
    t0 = time.perf_counter()
    profile = driver.profile(spec, request)
    return profile, time.perf_counter() - t0


def make_plan(profile, fleet, bounds, micro_batch: int, micro_batches: int, version: int) -> plan_pb2.Plan:
    """The running configuration as a Plan (1 replica per stage, 1F1B), priced as the planner prices plans."""
    plan = plan_pb2.Plan(id=f"pln-bench-v{version}", job_id=JOB, version=version,
                         engine=plan_pb2.PLAN_ENGINE_VARUNA, micro_batch_size=micro_batch,
                         num_micro_batches=micro_batches, schedule=plan_pb2.SCHEDULE_1F1B,
                         global_batch_size=micro_batch * micro_batches)
    plan.fleet.CopyFrom(fleet)
    for s, (b, e) in enumerate(bounds):
        plan.stages.append(plan_pb2.Stage(index=s, layer_begin=b, layer_end=e, devices=1))
        for i in range(b, e):
            plan.layers.append(plan_pb2.LayerStrategy(layer_index=i, stage_index=s, dp=1))
    ctx = CostContext(from_profile(profile), fleet, CostOptions(overlap_grad_sync=False))
    priced = price(ctx, bounds, [LayerStrategy() for _ in range(len(ctx.view))], micro_batch, micro_batches,
                   Schedule.ONE_F_ONE_B, 1 << 40, engine="benchmark", name="start")
    plan.prediction.CopyFrom(plan_pb2.Prediction(
        iteration_time_s=priced.iteration_s, throughput_samples_per_s=plan.global_batch_size / priced.iteration_s))
    return plan


def cpu_snapshot(pids: list[int]) -> tuple[float, float, float]:
    """(wall, busy CPU seconds of the whole machine incl. steal, CPU seconds of `pids` and this process)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7) if i < len(fields)) / tick  # user nice system irq softirq steal
    mine = os.times().user + os.times().system
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            mine += (int(stat[11]) + int(stat[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return time.monotonic(), busy, mine


def others(a: tuple[float, float, float] | None, b: tuple[float, float, float] | None) -> float:
    """Cores used on average by processes other than this benchmark's between two snapshots."""
    if a is None or b is None or b[0] <= a[0]:
        return float("nan")
    return max((b[1] - a[1]) - (b[2] - a[2]), 0.0) / (b[0] - a[0])


def worker_env() -> dict[str, str]:
    return {**STEADY_ALLOCATOR, **os.environ, "OMP_NUM_THREADS": "1"}


@dataclass
class Applied:
    """One accepted decision and what the workers did with it."""

    decision: Decision
    version: int
    sent_after: int  # iterations done (last stage) when the command was written
    boundary: int = 0  # iterations done at the boundary where it applied
    apply_s: dict[int, float] = field(default_factory=dict)  # rank -> plan_applied apply_s
    migrations: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class LiveRun:
    times: dict[int, float]  # last stage: iteration count -> event time
    versions: dict[int, int]  # last stage: iteration count -> plan version in force during it
    compute: dict[int, tuple[float, ...]]  # iteration count -> per-stage forward + backward
    losses: dict[int, float]  # last stage: iteration count -> global mean loss
    own: dict[int, float]  # last stage: iteration count -> the event's own iteration_s (no boundary work)
    snapshots: dict[int, tuple[float, float, float]]  # last stage's iteration count -> cpu_snapshot after it
    applied: list[Applied]
    decisions: list[tuple[int, Decision, float, str]]  # (iterations done, decision, propose() s, observation)
    settled_at: int  # iterations done when a proposal was rejected (0: never)
    start_wall_s: float


class Workers:
    """Local worker processes with live stdin/stdout (the agent's way: services/executor/workers.py)."""

    def __init__(self, configs: list[WorkerConfig], folder: Path) -> None:
        self.events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        self.procs: list[subprocess.Popen] = []
        self.stderr: list[Path] = []
        for c in configs:
            path = folder / f"rank-{c.rank}.json"
            path.write_text(c.to_json())
            err = path.with_suffix(".err")
            self.stderr.append(err)
            with open(err, "w") as stderr:
                proc = subprocess.Popen([sys.executable, "-m", "services.executor.train.worker", str(path)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                        env=worker_env(), cwd=ROOT)
            self.procs.append(proc)
            threading.Thread(target=self._follow, args=(c.rank, proc), daemon=True).start()

    def _follow(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                self.events.put((rank, json.loads(line)))
            except json.JSONDecodeError:
                continue
        self.events.put((rank, None))

    def send(self, command: dict[str, Any]) -> None:
        line = json.dumps(command) + "\n"
        for proc in self.procs:
            proc.stdin.write(line)
            proc.stdin.flush()

    def stop(self, grace_s: float = 5.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:  # a rank blocked on a peer that already stopped
                proc.kill()
                proc.wait()

    def tail(self) -> str:
        return "\n".join(f"rank {i}: {p.read_text()[-1500:]}" for i, p in enumerate(self.stderr))


def live_run(args, spec, profile, fleet) -> LiveRun:
    last_rank = 1
    plan = make_plan(profile, fleet, START, args.micro_batch, args.micro_batches, version=1)
    template = WorkerConfig(
        job_id=JOB, model=MessageToDict(spec, preserving_proto_field_name=True),
        stage_bounds=[list(b) for b in START], num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1,
        micro_batch_size=args.micro_batch, num_micro_batches=args.micro_batches, iterations=args.max_iterations,
        init_method="", schedule="1f1b", seed=5, timeout_s=120, plan_version=plan.version,
        predicted_iteration_s=plan.prediction.iteration_time_s)
    monitor = TrainingMonitor(MonitorOptions())
    monitor.expect(JOB, plan.version, len(plan.stages), 1)
    times: dict[int, float] = {}
    versions: dict[int, int] = {}
    losses: dict[int, float] = {}
    own: dict[int, float] = {}
    snapshots: dict[int, tuple[float, float, float]] = {}
    compute: dict[int, dict[int, float]] = {}
    applied: list[Applied] = []
    decisions: list[tuple[int, Decision, float, str]] = []
    pending: tuple[Applied, plan_pb2.Plan] | None = None
    considered: set[int] = set()
    settled_at = 0
    done = 0
    finished = 0
    with tempfile.TemporaryDirectory(prefix="ballast-migration-") as tmp:
        t0 = time.perf_counter()
        workers = Workers(plan_configs(template, [list(b) for b in START], 1), Path(tmp))
        try:
            while finished < 2:
                try:
                    rank, event = workers.events.get(timeout=180)
                except queue.Empty:
                    raise RuntimeError(f"no worker event for 180 s\n{workers.tail()}") from None
                if event is None:
                    finished += 1
                    continue
                kind = event["event"]
                if kind in ("error", "command_rejected"):
                    raise RuntimeError(f"rank {rank} {kind}: {event.get('message')}\n{workers.tail()}")
                if kind == "migration" and pending is not None:
                    pending[0].migrations.append(event)
                elif kind == "plan_applied" and pending is not None:
                    record, new = pending
                    record.boundary = int(event["iteration"])
                    record.apply_s[rank] = float(event["apply_s"])
                    if len(record.apply_s) == 2:  # both ranks run the new version: the monitor expects it
                        monitor.expect(JOB, new.version, len(new.stages), 1)
                        plan, pending = new, None
                        applied.append(record)
                elif kind == "iteration":
                    count = int(event["iteration"])
                    monitor.observe(stage_stats({**event, "iteration": count - 1, "rank": rank}, JOB))
                    compute.setdefault(count, {})[rank] = event["forward_s"] + event["backward_s"]
                    if rank == last_rank:
                        times[count], versions[count], done = event["time"], int(event["plan_version"]), count
                        losses[count], own[count] = float(event["loss"]), float(event["iteration_s"])
                        snapshots[count] = cpu_snapshot([p.pid for p in workers.procs])
                    if settled_at:
                        if done >= settled_at + args.after:
                            break
                        continue
                    if pending is None and plan.version not in considered and monitor.ready(JOB):
                        observation = monitor.observation(JOB, plan.version)
                        if observation is None:
                            continue
                        considered.add(plan.version)
                        t = time.perf_counter()
                        decision = propose(profile, fleet, plan, observation, OnlineOptions())
                        seen = (f"window: iterations {[i + 1 for i in observation.iterations]} (counts), imbalance "
                                f"{observation.imbalance:.1%}, workload change: "
                                + ("; ".join(c.describe() for c in observation.workload_changes) or "none"))
                        decisions.append((done, decision, time.perf_counter() - t, seen))
                        print(f"  after {done} iterations, plan v{plan.version}: "
                              f"{'ACCEPTED' if decision.accepted else 'rejected'}: {decision.reason}", flush=True)
                        if not decision.accepted:
                            settled_at = done
                            continue
                        new = decision.new_plan
                        record = Applied(decision, new.version, done)
                        message = executor_pb2.PlannerMessage(
                            version=new.version, job_id=JOB,
                            repartition=executor_pb2.RepartitionInstruction(plan=new, effective_iteration=done + 1))
                        workers.send(plan_command(message))
                        pending = (record, new)
        finally:
            workers.stop()
        elapsed = time.perf_counter() - t0
    if pending is not None:
        raise RuntimeError(f"plan version {pending[1].version} was sent but never applied by both ranks")
    per_stage = {k: tuple(v[s] for s in sorted(v)) for k, v in compute.items() if len(v) == 2}
    return LiveRun(times, versions, per_stage, losses, own, snapshots, applied, decisions, settled_at, elapsed)


def intervals(times: dict[int, float]) -> dict[int, float]:
    """Iteration count k -> wall time of iteration k (event k - event k-1), for every k with both events."""
    return {k: times[k] - times[k - 1] for k in sorted(times) if k - 1 in times}


def restart_run(args, spec, boundary: int, final_bounds) -> dict[str, Any]:
    """The same move by stop-checkpoint-restart: train the start bounds to `boundary` with a checkpoint there,
    let the workers exit, resume the final bounds from it."""
    model = MessageToDict(spec, preserving_proto_field_name=True)
    with tempfile.TemporaryDirectory(prefix="ballast-migration-ckpt-") as tmp:
        template = WorkerConfig(
            job_id=JOB + "-restart", model=model, stage_bounds=[list(b) for b in START], num_replicas=1,
            stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=args.micro_batch,
            num_micro_batches=args.micro_batches, iterations=boundary, init_method="", schedule="1f1b", seed=5,
            timeout_s=120, checkpoint_dir=tmp, checkpoint_every=boundary)
        first = run_local(plan_configs(template, [list(b) for b in START], 1), env=worker_env(), timeout_s=600)
        exited = time.time()
        resume = str(checkpoint_path(tmp, boundary))
        second_template = WorkerConfig(**{**json.loads(template.to_json()), "resume_from": resume,
                                          "iterations": boundary + args.restart_after, "checkpoint_every": 0})
        second = run_local(plan_configs(second_template, [list(b) for b in final_bounds], 1), env=worker_env(),
                           timeout_s=600)
    before = {e["iteration"]: e["time"] for e in first[-1] if e["event"] == "iteration"}
    after = {e["iteration"]: e["time"] for e in second[-1] if e["event"] == "iteration"}
    checkpoint = [e for events in first for e in events if e["event"] == "checkpoint"]
    started = [e for events in second for e in events if e["event"] == "started"]
    last = before[boundary]
    return {
        "boundary": boundary, "bounds": final_bounds,
        "gap_s": after[boundary + 1] - last,
        "checkpoint_s": max(e["checkpoint_s"] for e in checkpoint),
        "checkpoint_bytes": sum(x["bytes"] for e in checkpoint for x in e["layers"]),
        "exit_s": exited - last,  # checkpoint written, "done", processes gone (as run_local saw it)
        "started_s": max(e["time"] for e in started) - last,  # + new processes up, model built, checkpoint loaded
        "first_iteration_s": second[-1][[e["event"] for e in second[-1]].index("iteration")]["iteration_s"],
        "compute": {e["iteration"]: e["forward_s"] + e["backward_s"] for e in second[0] if e["event"] == "iteration"},
        "before": intervals(before), "after": intervals(after),
        "losses": {e["iteration"]: float(e["loss"]) for e in second[-1] if e["event"] == "iteration"},
    }


def fmt_bounds(bounds) -> str:
    return " | ".join(f"{b}-{e - 1}" for b, e in bounds)


def summarise(args, live: LiveRun, restart: dict[str, Any] | None) -> dict[str, Any]:
    walls = intervals(live.times)
    first = live.applied[0].boundary if live.applied else 0
    last = live.applied[-1].boundary if live.applied else 0
    end = max(walls) if walls else 0
    before = [walls[k] for k in walls if WARM_UP < k <= (first or end)]
    after = [walls[k] for k in walls if k > last + 1 + WARM_UP] if live.applied else []
    med_before = statistics.median(before) if before else float("nan")
    med_after = statistics.median(after) if after else float("nan")
    migrations = []
    for a in live.applied:
        k = a.boundary + 1  # the interval ending at event K + 1 holds the boundary work
        migrations.append({
            "version": a.version, "boundary": a.boundary, "sent_after": a.sent_after,
            "wall_s": walls.get(k, float("nan")), "own_s": live.own.get(k, float("nan")),
            "compute": live.compute.get(k, ()), "next_s": [walls.get(k + j, float("nan")) for j in (1, 2)],
            "apply_s": max(a.apply_s.values()), "bytes": sum(m["bytes"] for m in a.migrations),
            "duration_s": max((m["duration_s"] for m in a.migrations), default=0.0),
            "layers": [(m["layer_index"], m["from_stage"], m["to_stage"]) for m in a.migrations],
            "decision": a.decision})
    out = {"median_before_s": med_before, "median_after_s": med_after, "n_before": len(before),
           "n_after": len(after), "speedup": med_before / med_after, "migrations": migrations,
           "balanced_after": last, "settled_at": live.settled_at, "iterations": end,
           "final_bounds": live.applied[-1].decision.stage_bounds if live.applied else START,
           "decisions": live.decisions, "walls": walls, "losses": live.losses, "versions": live.versions,
           "compute": live.compute,
           "restart": restart}
    snap = live.snapshots
    out["others_before"] = others(snap.get(WARM_UP), snap.get(first or end))
    out["others_after"] = others(snap.get(last + 1 + WARM_UP), snap.get(end))
    work_before = [sum(live.compute[k]) for k in live.compute if WARM_UP < k <= (first or end)]
    work_after = [sum(live.compute[k]) for k in live.compute if k > last + 1 + WARM_UP]
    out["work_ratio"] = (statistics.median(work_after) / statistics.median(work_before)
                         if work_before and work_after else float("nan"))
    out["worst_stall"] = max((m["wall_s"] / med_after for m in migrations), default=float("nan"))
    return out


def report(s: dict[str, Any], machine: str, command: str, when: str, args) -> list[str]:
    """The figures as markdown lines (printed, and recorded with --record)."""
    lines = [f"Run {when} UTC, {machine}, `{command}` (model: GPT, 6 blocks, hidden {args.hidden}, sequence "
             f"{args.seq}, vocabulary {args.vocab}, tied embeddings, fp32, Adam; micro-batch {args.micro_batch} x "
             f"{args.micro_batches}, 1F1B, 2 stages x 1 replica, start bounds {fmt_bounds(START)}; "
             f"load average at start {s['load']:.2f}):", ""]
    lines += ["| figure | value |", "| --- | --- |"]
    ok_speed = s["speedup"] >= SPEEDUP_TARGET
    ok_stall = s["worst_stall"] <= STALL_TARGET
    lines.append(f"| median iteration before the first migration (iterations {WARM_UP + 1}.."
                 f"{s['migrations'][0]['boundary'] if s['migrations'] else s['iterations']}, n={s['n_before']}) | "
                 f"{s['median_before_s'] * 1e3:.1f} ms |")
    lines.append(f"| median iteration after the last rebalance (skipping {WARM_UP} after it, n={s['n_after']}) | "
                 f"{s['median_after_s'] * 1e3:.1f} ms |")
    lines.append(f"| other processes' CPU use during the before / after windows (cores, of {os.cpu_count()}) | "
                 f"{s['others_before']:.2f} / {s['others_after']:.2f} |")
    lines.append(f"| forward+backward summed over stages, median after / before (co-location: both cores busy "
                 f"after, one before; the profile measured {s['colocated']:.3f}) | {s['work_ratio']:.2f}x |")
    lines.append(f"| throughput after / before (target >= {SPEEDUP_TARGET}) | **{s['speedup']:.2f}x** "
                 f"({'met' if ok_speed else 'missed'}) |")
    for m in s["migrations"]:
        lines.append(f"| iteration {m['boundary'] + 1} (migration to v{m['version']} at boundary {m['boundary']}; "
                     f"planned after {m['sent_after']}) | {m['wall_s'] * 1e3:.1f} ms = "
                     f"**{m['wall_s'] / s['median_after_s']:.2f}x** the median after (target <= {STALL_TARGET}); "
                     f"its own iteration_s {m['own_s'] * 1e3:.0f} ms, so {(m['wall_s'] - m['own_s']) * 1e3:.0f} ms "
                     f"of boundary work; stage fwd+bwd {'/'.join(f'{c * 1e3:.0f}' for c in m['compute'])} ms; "
                     f"next two {', '.join(f'{t * 1e3:.0f}' for t in m['next_s'])} ms |")
        moved = ", ".join(f"{i}: {a}->{b}" for i, a, b in m["layers"])
        lines.append(f"| migration v{m['version']}: layers (stage -> stage) | {moved}; {m['bytes'] / 2**20:.1f} MiB "
                     f"received; slowest layer ready {m['duration_s'] * 1e3:.1f} ms after the boundary decision; "
                     f"apply_s {m['apply_s'] * 1e3:.1f} ms |")
    lines.append(f"| no stall (every migration iteration <= {STALL_TARGET}x the median after) | "
                 f"{'met' if ok_stall else 'missed'} (worst {s['worst_stall']:.2f}x) |")
    lines.append(f"| iterations from start to balanced | {s['balanced_after']} (final bounds "
                 f"{fmt_bounds(s['final_bounds'])}; proposal rejected after {s['settled_at']}; "
                 f"{s['iterations']} iterations in all) |")
    for done, d, seconds, seen in s["decisions"]:
        moves = ", ".join(f"{m.layer}: {m.from_stage}->{m.to_stage}" for m in d.moves) or "none"
        lines.append(f"| decision after {done} iterations | {'accepted' if d.accepted else 'rejected'}; moves "
                     f"{moves}; predicted {d.predicted_before_s * 1e3:.0f} -> {d.predicted_after_s * 1e3:.0f} ms, "
                     f"measured {d.measured_s * 1e3:.0f} ms; propose() took {seconds * 1e3:.0f} ms; monitor {seen}; "
                     f"\"{d.reason}\" |")
    r = s["restart"]
    if r is not None:
        after = [t for k, t in r["after"].items() if k > r["boundary"] + 1 + WARM_UP]
        med = statistics.median(after) if after else float("nan")
        lines.append(f"| stop-checkpoint-restart of the same move (checkpoint at {r['boundary']}, resume as "
                     f"{fmt_bounds(r['bounds'])}): gap between the last iteration event before the stop and the first "
                     f"after | **{r['gap_s']:.2f} s** = {r['gap_s'] / s['median_after_s']:.1f}x the live median after "
                     f"({r['gap_s'] / med:.1f}x the restarted run's own median {med * 1e3:.0f} ms) |")
        common = sorted(set(r["losses"]) & set(s["losses"]))
        if common:
            worst = max(abs(r["losses"][k] - s["losses"][k]) / abs(r["losses"][k]) for k in common)
            lines.append(f"| training semantics: loss of the live-migrated run against the restarted run, iterations "
                         f"{common[0]}..{common[-1]} | max relative difference {worst:.1e} |")
        lines.append(f"| restart gap, split | checkpoint write {r['checkpoint_s']:.2f} s "
                     f"({r['checkpoint_bytes'] / 2**20:.1f} MiB), until both old processes exited "
                     f"{r['exit_s']:.2f} s, until both new workers started (rendezvous, model built, checkpoint "
                     f"loaded) {r['started_s']:.2f} s, first iteration {r['first_iteration_s'] * 1e3:.0f} ms |")
    walls = s["walls"]
    if r is not None:
        first = r["boundary"] + 1
        cells = [f"{k}: {(r['gap_s'] if k == first else r['after'][k]) * 1e3:.0f} "
                 f"({r['compute'].get(k, 0) * 1e3:.0f})" for k in range(first, max(r["after"]) + 1)]
        lines += ["", "Restarted run, per-iteration wall times from the gap on (ms; stage 0 forward+backward ms): "
                  + "; ".join(cells)]
    lines += ["", "Per-iteration wall times of the live run (ms; plan version; per-stage forward+backward ms):", ""]
    cells = []
    for k in sorted(walls):
        comp = "/".join(f"{c * 1e3:.0f}" for c in s["compute"].get(k, ()))
        cells.append(f"{k}: {walls[k] * 1e3:.0f} v{s['versions'].get(k, 0)} ({comp})")
    lines.append("; ".join(cells))
    return lines


def record(lines: list[str], summary_row: str) -> None:
    """Append this run to the section in BENCHMARKS.md (rows kept), replace its latest-run details, keep notes."""
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text()
    rows: list[str] = []
    notes = ""
    match = re.search(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", text, flags=re.S | re.M)
    if match:
        old = match.group(0)
        rows = [line for line in old.splitlines() if line.startswith("| 20")]  # previous runs' rows (dated)
        if NOTES in old:
            notes = old[old.index(NOTES):].rstrip() + "\n"
    rows.append(summary_row)
    body = [SECTION, "",
            f"Targets (CPU here): from a 1 | 7 layer split over 2 stages, the online planner rebalances within a few "
            f"iterations and throughput afterwards is >= {SPEEDUP_TARGET}x before; no stall: the iteration in which "
            f"a migration happens takes <= {STALL_TARGET}x the median iteration after rebalancing. The same "
            "benchmark measures a stop-checkpoint-restart repartition of the same move for comparison.", "",
            "Command: `.venv/bin/python benchmarks/migration.py` (about 1 minute here: profile 12-20 s, the live run, "
            "the restart run; exits 1 if a target is missed; `--record` adds a row to the table below and replaces "
            "the latest run's details, keeping the notes). See the script's docstring for what is measured; "
            "iteration wall time is the interval between the last stage's consecutive iteration events, so boundary "
            "work is included. \"other processes' cores\" is the machine's busy CPU time (/proc/stat, steal "
            "included) minus this benchmark's processes, per window; \"fwd+bwd after / before\" compares the "
            "stages' summed compute (the same work) with both cores busy against one.", "",
            "| date (UTC) | configuration | machine | load at start | other processes' cores before / after | "
            "fwd+bwd after / before | before ms | after ms | speedup (>= 1.3) | migration iteration(s) / median "
            "after (<= 1.5) | balanced after | restart gap s (x median after) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
            "Latest run:", "", *lines, ""]
    if notes:
        body.append(notes)
    wrapped = [line if line.startswith(("|", "#")) or len(line) <= WIDTH else textwrap.fill(line, WIDTH,
               break_on_hyphens=False) for line in body]
    new = "\n".join(wrapped).rstrip() + "\n"
    if match:
        text = text[:match.start()] + new + ("\n" if text[match.end():] else "") + text[match.end():]
    else:
        text = text.rstrip() + "\n\n\n" + new
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    steady_allocator()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="profiler repeats per measurement")
    ap.add_argument("--after", type=int, default=10, help="iterations run after a proposal is rejected")
    ap.add_argument("--max-iterations", type=int, default=80, help="the workers' iteration cap")
    ap.add_argument("--restart-after", type=int, default=8, help="iterations the restarted run trains")
    ap.add_argument("--skip-restart", action="store_true")
    ap.add_argument("--record", action="store_true", help="append this run to BENCHMARKS.md")
    args = ap.parse_args(argv)
    command = ".venv/bin/python benchmarks/migration.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    command = command.strip()
    when = f"{datetime.now(UTC):%Y-%m-%d %H:%M}"
    load = os.getloadavg()[0]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    machine = f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.machine()}, Python " \
              f"{platform.python_version()}"
    print(f"command: {command}\nmachine: {machine}; {when} UTC; load average {load:.2f}", flush=True)
    spec = spec_of(args.hidden, args.seq, args.vocab)
    profile, seconds = measure_profile(spec, args.micro_batch, args.repeats)
    fleet = load_fleet(ROOT / "examples" / "fleet-local-cpu.yaml", dtype="fp32")
    fleet.devices_per_node = 2
    print(f"profile: {len(profile.layers)} layers measured in {seconds:.0f} s", flush=True)
    live = live_run(args, spec, profile, fleet)
    if not live.applied:
        print("no repartition was accepted; nothing to compare")
        return 1
    final = live.applied[-1].decision.stage_bounds
    restart = None if args.skip_restart else restart_run(args, spec, live.applied[0].boundary, final)
    s = summarise(args, live, restart)
    s["load"] = load
    s["colocated"] = profile.comm.colocated_slowdown
    lines = report(s, machine, command, when, args)
    print()
    print("\n".join(lines))
    fast, smooth = s["speedup"] >= SPEEDUP_TARGET, s["worst_stall"] <= STALL_TARGET
    print(f"\nthroughput {s['speedup']:.2f}x (target {SPEEDUP_TARGET}): {'met' if fast else 'missed'}; worst "
          f"migration iteration {s['worst_stall']:.2f}x the median after (target {STALL_TARGET}): "
          f"{'met' if smooth else 'missed'}")
    ok = fast and smooth
    if args.record:
        stalls = ", ".join(f"{m['wall_s'] * 1e3:.0f} ms / {m['wall_s'] / s['median_after_s']:.2f}x"
                           for m in s["migrations"])
        gap = (f"{restart['gap_s']:.2f} ({restart['gap_s'] / s['median_after_s']:.1f}x)" if restart else "-")
        row = (f"| {when} | m{args.micro_batch} x {args.micro_batches}, seq {args.seq} | {os.cpu_count()} cores | "
               f"{load:.2f} | {s['others_before']:.2f} / {s['others_after']:.2f} | {s['work_ratio']:.2f} | "
               f"{s['median_before_s'] * 1e3:.0f} | {s['median_after_s'] * 1e3:.0f} | {s['speedup']:.2f}x | "
               f"{stalls} | {s['balanced_after']} | {gap} |")
        record(lines, row)
        print("recorded in BENCHMARKS.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
