"""Per-rank peak memory of plain DP, ZeRO-1 and ZeRO-2: the cost model's prediction beside a real run (issue 24).

Why: the planner only picks a ZeRO flavour where it thinks plain DP does not fit, so its memory price decides
whether a plan is runnable. This checks that price against real training on this CPU. Target: per-rank peak
memory of plain DP, ZeRO-1 and ZeRO-2 predicted within 15% of the measured live-heap peak, on every rank.

Method, for one zoo GPT (1 pipeline stage x `--replicas` replicas, every layer under the flavour):
1. Profile it once with the profiler driver, in this process, under the workers' allocator settings.
2. Train it under plain DP, ZeRO-1 and ZeRO-2 with one seed, as local gloo worker processes
   (`services.executor.train.launch`, the executor's environment) with BALLAST_HEAP_PEAK=1. Each rank reports
   two peaks, and the largest over its iterations is taken for each: `heap_peak_bytes`, glibc's heap in use at
   its high-water mark (heap.py: `mallinfo2` read by a thread every 0.5 ms; the first iteration's includes the
   worker's setup), and `peak_memory_bytes`, the process RSS high-water mark (ru_maxrss).
3. Price each as jobs' plans are priced: `build_pipeline` with `LayerStrategy(dp=replicas, dp_sharding=...)`
   and `CostOptions(overlap_grad_sync=False, zero2_reduce_scatter_per_layer=False)` (the executor
   reduce-scatters after the stage's whole backward), then the simulator's per-stage peak.
The target is checked on the live heap, the CPU's analogue of what a GPU worker reports
(`torch.cuda.max_memory_allocated`: live bytes, not the allocator's reserve). It is compared with the price as
is -- states + activations + transient, no runtime offset -- so all three flavours are out-of-sample
predictions: the live heap holds what the cost model prices plus the runtime's own live allocations
(interpreter, torch, gloo), which count against the prediction. The RSS is shown beside it, not checked: glibc
keeps freed heap (the workers run with `MALLOC_MMAP_MAX_=0` and never trim), and ZeRO's allocation pattern
leaves far more of it behind its peak than plain DP (BENCHMARKS.md, issue 24). Its prediction adds the runtime's
own RSS (interpreter, torch, gloo, allocator pools, the free heap), which calibration learns as
`memory_fixed_bytes` (cost/calibration.py); here it is learnt from plain DP's RSS alone (measured minus
predicted, over plain's ranks, through `calibration.line` as `fit` does) and applied to all three, so plain's
RSS row is fitted and ZeRO's are out-of-sample. The losses of the three runs must also agree (rtol 1e-5, fp32),
since ZeRO changes where state is kept and not the math.

Run from the repository root (the defaults: ~109M parameters, plain DP ~2.5 GB RSS per rank):

    .venv/bin/python benchmarks/zero_memory.py [--hidden 1024] [--layers 8] [--heads 16] [--vocab 8192]
        [--seq 64] [--micro-batch 2] [--micro-batches 2] [--iterations 3] [--replicas 2]

This takes a few minutes at the defaults on a 2-core VM: one profile, then three 2-process runs. It exits 1 if
a flavour's live-heap peak misses 15% on a rank, or the losses differ.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from google.protobuf.json_format import MessageToDict  # noqa: E402

from ballast.v1 import common_pb2, fleet_pb2, model_pb2, profile_pb2, services_pb2  # noqa: E402
from services.executor.train import heap  # noqa: E402
from services.executor.train.config import WorkerConfig  # noqa: E402
from services.executor.train.launch import plan_configs, run_local  # noqa: E402
from services.executor.train.sharding import PLAIN, ZERO1, ZERO2  # noqa: E402
from services.planner.cost import (  # noqa: E402
    CostOptions,
    DpSharding,
    LayerStrategy,
    ModelView,
    build_pipeline,
    from_profile,
)
from services.planner.cost.calibration import Calibration, line  # noqa: E402
from services.planner.sim import Schedule, SimOptions, StageCost, simulate  # noqa: E402
from services.profiler import driver  # noqa: E402
from services.runtime.allocator import STEADY_ALLOCATOR  # noqa: E402
from services.specs.fleet import load_fleet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLAVOURS = (PLAIN, ZERO1, ZERO2)
SHARDING = {PLAIN: DpSharding.PLAIN, ZERO1: DpSharding.ZERO1, ZERO2: DpSharding.ZERO2}
TARGET = 0.15
LOSS_RTOL = 1e-5
SEED = 7
ADAM = {"name": "adam", "learning_rate": 1e-3, "weight_decay": 0.01}
MiB = 1 << 20


@dataclass(frozen=True)
class Measured:
    peaks: tuple[int, ...]  # per rank, bytes: the RSS high-water mark
    heap_peaks: tuple[int, ...]  # per rank, bytes: the live heap's high-water mark
    heap_per_iteration: tuple[tuple[int, ...], ...]  # per rank, per iteration
    iteration_s: float  # mean over ranks and iterations
    optimizer_state_bytes: tuple[int, ...]  # per rank, after the last step
    gradient_bytes: tuple[int, ...]  # per rank, held after the last reduction
    losses: tuple[float, ...]
    seconds: float


def steady_allocator() -> None:
    """Re-exec under the workers' allocator settings, so profile and training agree (glibc reads them at start)."""
    if any(key not in os.environ for key in STEADY_ALLOCATOR):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**STEADY_ALLOCATOR, **os.environ})


def model_spec(args: argparse.Namespace) -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(
        name="gpt-zero-memory", family=model_pb2.MODEL_FAMILY_GPT, dtype=common_pb2.DTYPE_FP32, dropout=0.0,
        transformer=model_pb2.TransformerConfig(
            num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads, vocab_size=args.vocab,
            seq_length=args.seq, tie_embeddings=True))


def measure_profile(spec: model_pb2.ModelSpec, micro_batch: int) -> profile_pb2.Profile:
    """Measured on this CPU at the per-replica micro-batch (and 1, for the regression); memory needs no timing
    precision, link calibration nor the non-model trace (the cost model leaves that trace out by default)."""
    request = services_pb2.ProfileRequest(options=services_pb2.ProfileOptions(
        micro_batch_sizes=sorted({1, micro_batch}), intra_op_threads=1, skip_memory_trace=True))
    profile = driver.profile(spec, request)
    gc.collect()  # the profiled model is garbage now: keep this process small beside the workers
    return profile


def train(spec: model_pb2.ModelSpec, num_layers: int, flavour: str, args: argparse.Namespace) -> Measured:
    """One run of `flavour` on every layer, 1 stage x replicas, as the executor starts its workers."""
    n = num_layers
    layers = list(range(n))
    bounds = [[0, n]]
    template = WorkerConfig(
        job_id=f"bench-zero-{flavour}", model=MessageToDict(spec, preserving_proto_field_name=True),
        stage_bounds=bounds, num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1,
        micro_batch_size=args.micro_batch, num_micro_batches=args.micro_batches, iterations=args.iterations,
        init_method="", optimizer=ADAM, seed=SEED, data={}, timeout_s=300, online=False,
        zero1_layers=layers if flavour == ZERO1 else [], zero2_layers=layers if flavour == ZERO2 else [])
    t0 = time.perf_counter()
    events = run_local(plan_configs(template, bounds, args.replicas), env={**STEADY_ALLOCATOR, heap.ENV: "1"},
                       timeout_s=args.timeout)
    seconds = time.perf_counter() - t0
    per_rank = [[e for e in rank_events if e["event"] == "iteration"] for rank_events in events]
    if any(len(its) != args.iterations for its in per_rank):
        raise SystemExit(f"{flavour}: iterations per rank {[len(its) for its in per_rank]}, "
                         f"expected {args.iterations}")
    heaps = tuple(tuple(e["heap_peak_bytes"] for e in its) for its in per_rank)
    if not all(h for hs in heaps for h in hs):
        raise SystemExit(f"{flavour}: no live-heap peak reported (needs Linux with glibc >= 2.33): {heaps}")
    return Measured(
        peaks=tuple(max(e["peak_memory_bytes"] for e in its) for its in per_rank),
        heap_peaks=tuple(max(h) for h in heaps), heap_per_iteration=heaps,
        iteration_s=sum(e["iteration_s"] for its in per_rank for e in its) / sum(len(its) for its in per_rank),
        optimizer_state_bytes=tuple(its[-1].get("optimizer_state_bytes", 0) for its in per_rank),
        gradient_bytes=tuple(its[-1].get("gradient_bytes", 0) for its in per_rank),
        losses=tuple(e["loss"] for e in per_rank[0]),
        seconds=seconds)


def price(view: ModelView, fleet: fleet_pb2.Fleet, flavour: str, args: argparse.Namespace,
          calibration: Calibration | None = None) -> tuple[int, StageCost]:
    """The simulator's per-device peak of the one stage, priced as jobs' plans are (module docstring)."""
    options = CostOptions(overlap_grad_sync=False, zero2_reduce_scatter_per_layer=False, calibration=calibration)
    strategy = LayerStrategy(dp=args.replicas, dp_sharding=SHARDING[flavour])
    pipe = build_pipeline(view, fleet, [(0, len(view))], strategy, args.micro_batch * args.replicas,
                          args.micro_batches, options=options)
    result = simulate(pipe, SimOptions(schedule=Schedule.ONE_F_ONE_B, keep_timeline=False))
    return int(result.peak_memory_bytes[0]), pipe.stages[0]


def predicted_optimizer_bytes(view: ModelView, flavour: str, replicas: int) -> int:
    """The profile's optimizer-state bytes per rank (what the cost model holds; a tied weight counts per layer)."""
    total = sum(layer.optimizer_state_bytes for layer in view.layers)
    return int(total / replicas) if flavour != PLAIN else int(total)


def max_rel_diff(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)


def mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def main(argv: list[str] | None = None) -> int:
    steady_allocator()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch per replica")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per iteration")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per training run")
    args = ap.parse_args(argv)
    if args.replicas < 2:
        ap.error("--replicas must be >= 2 (with one replica every flavour is plain DP)")
    print(f"command: .venv/bin/python benchmarks/zero_memory.py {shlex.join(argv or sys.argv[1:])}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    spec = model_spec(args)

    t0 = time.perf_counter()
    profile = measure_profile(spec, args.micro_batch)
    view = from_profile(profile)
    params = sum(layer.parameter_count for layer in view.layers)
    print(f"profile: {len(view)} layers ({params / 1e6:.1f}M parameters counted per layer, a tied weight in each "
          f"layer using it) at micro-batch sizes {list(profile.measured_micro_batch_sizes)} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)

    fleet = load_fleet(ROOT / "examples" / "fleet-local-cpu.yaml", dtype="fp32")
    fleet.devices_per_node = max(fleet.devices_per_node, args.replicas)

    runs: dict[str, Measured] = {}
    for flavour in FLAVOURS:
        runs[flavour] = m = train(spec, len(view), flavour, args)
        per_iteration = "; ".join(", ".join(mib(h) for h in hs) for hs in m.heap_per_iteration)
        print(f"  {flavour:<5} trained {args.iterations} iterations in {m.seconds:.0f} s (mean iteration "
              f"{m.iteration_s:.2f} s); live-heap peak per rank {', '.join(mib(p) for p in m.heap_peaks)} MiB "
              f"(per iteration, rank by rank: {per_iteration}); RSS peak per rank "
              f"{', '.join(mib(p) for p in m.peaks)} MiB", flush=True)

    # The runtime's own RSS: learnt from plain DP only, as calibration learns memory_fixed_bytes.
    uncalibrated = {f: price(view, fleet, f, args) for f in FLAVOURS}
    plain_pred = float(uncalibrated[PLAIN][0])
    _, fixed = line([plain_pred] * args.replicas, [float(p) for p in runs[PLAIN].peaks], offset=True)
    cal = Calibration(host_class=f"{fleet.device.kind}/{os.cpu_count()}c/{args.replicas}w",
                      memory_fixed_bytes=int(fixed))
    predicted = {f: price(view, fleet, f, args, cal)[0] for f in FLAVOURS}
    print(f"RSS runtime offset learnt from plain DP: {mib(fixed)} MiB (measured RSS mean minus the profile's "
          "prediction; added to the RSS predictions only)")

    def worst_error(pred: float, peaks: tuple[int, ...]) -> tuple[float, bool]:
        errors = [(pred - p) / p for p in peaks]
        return max(errors, key=abs), all(abs(e) <= TARGET for e in errors)

    print()
    print("Target checked on the live heap (glibc's bytes in use, the CPU analogue of CUDA's max_memory_allocated) "
          "against the prediction with no runtime offset; the RSS is shown beside it, not checked.")
    print("| flavour | live-heap peak MiB per rank | predicted MiB: states / activations / transient | "
          "error, worst rank | within 15% | RSS peak MiB per rank | RSS predicted MiB (+ offset) | "
          "RSS error, worst rank | optimizer state MiB per rank, measured | optimizer state MiB, profile | "
          "gradients held after the reduction MiB per rank |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    missed = []
    for f in FLAVOURS:
        m, (alone, stage) = runs[f], uncalibrated[f]
        heap_worst, ok = worst_error(alone, m.heap_peaks)
        if not ok:
            missed.append(f)
        rss_worst, rss_ok = worst_error(predicted[f], m.peaks)
        rss_verdict = "fitted" if f == PLAIN else f"{rss_worst:+.1%}{'' if rss_ok else ' (over 15%)'}"
        parts = f"{mib(stage.model_memory_bytes)} / {mib(stage.activation_bytes)} / {mib(stage.transient_bytes)}"
        print(f"| {f} | {' / '.join(mib(p) for p in m.heap_peaks)} | {mib(alone)}: {parts} | {heap_worst:+.1%} | "
              f"{'yes' if ok else 'NO'} | {' / '.join(mib(p) for p in m.peaks)} | {mib(predicted[f])} | "
              f"{rss_verdict} | {' / '.join(mib(b) for b in m.optimizer_state_bytes)} | "
              f"{mib(predicted_optimizer_bytes(view, f, args.replicas))} | "
              f"{' / '.join(mib(b) for b in m.gradient_bytes)} |")

    diffs = {f: max_rel_diff(runs[f].losses, runs[PLAIN].losses) for f in (ZERO1, ZERO2)}
    same = all(d <= LOSS_RTOL for d in diffs.values())
    print(f"\nlosses per iteration (plain): {', '.join(f'{x:.6f}' for x in runs[PLAIN].losses)}; largest relative "
          f"difference from plain: zero1 {diffs[ZERO1]:.1e}, zero2 {diffs[ZERO2]:.1e} (rtol {LOSS_RTOL:.0e}): "
          f"{'equal' if same else 'DIFFERENT'}")
    verdict = "met" if not missed else "missed by " + ", ".join(missed)
    print(f"live-heap peak of plain DP, ZeRO-1 and ZeRO-2 predicted within {TARGET:.0%} on every rank: {verdict}; "
          f"total {time.perf_counter() - t0:.0f} s")
    return 0 if same and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
