"""How long the iteration simulator takes, per schedule, pipeline depth P and micro-batch count Nm.

Targets (issue 4): 48 stages x 288 micro-batches, 1F1B and GPipe, in under 100 ms on the pricing path
(keep_timeline=False) and under 1 s on the full path (events and memory timelines). Exits 1 if missed.
Run from the repository root: `.venv/bin/python benchmarks/simulator.py [--runs N]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.planner.sim import LinkCost, Pipeline, Schedule, SimOptions, StageCost, simulate  # noqa: E402
from services.planner.sim.harmony import wrap_around_devices  # noqa: E402

DEPTHS = (4, 8, 16, 32, 48)
MICRO_BATCHES = (32, 96, 288)
PRICING_TARGET_S, FULL_TARGET_S = 0.100, 1.0

# A GPT-like stage with activation checkpointing: 4 ms forward, 8 ms backward, recompute, 8 MiB boundary
# activations over 25 Gb/s links, gradient allreduce over 4 replicas.
STAGE = StageCost(forward_s=4e-3, backward_s=8e-3, recompute_s=4e-3, output_bytes=8 << 20, allreduce_s=0.05,
                  model_memory_bytes=6 << 30, activation_bytes=8 << 20, transient_bytes=1 << 30)
LINK = LinkCost(latency_s=20e-6, bandwidth_bytes_per_s=25e9 / 8)


def pipeline(P: int, Nm: int, **stage_changes) -> Pipeline:
    stage = dataclasses.replace(STAGE, **stage_changes)
    return Pipeline(stages=(stage,) * P, num_micro_batches=Nm, replicas=4, boundary_links=(LINK,) * (P - 1),
                    host_link=LinkCost(10e-6, 16e9))


def timed(pipe: Pipeline, options: SimOptions, runs: int) -> tuple[float, float, int]:
    """(median seconds, first-call seconds, events) over `runs` calls."""
    times, events = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        result = simulate(pipe, options)
        times.append(time.perf_counter() - start)
        events = len(result.events)
    return statistics.median(times), times[0], events


def row(name: str, P: int, Nm: int, pipe: Pipeline, options: SimOptions, runs: int) -> tuple[str, float, float]:
    pricing, _, _ = timed(pipe, dataclasses.replace(options, keep_timeline=False), runs)
    full, _, events = timed(pipe, options, max(1, runs // 2 + 1))
    print(f"| {name} | {P} | {Nm} | {pricing * 1e3:.1f} | {full * 1e3:.1f} | {events} |", flush=True)
    return name, pricing, full


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="calls per measurement (median reported)")
    args = parser.parse_args()
    print(f"Python {platform.python_version()}, {platform.machine()}, runs={args.runs} (full path: "
          f"{args.runs // 2 + 1}); times are medians in ms\n")
    print("| schedule | P | Nm | pricing (ms) | full (ms) | events |")
    print("| --- | --- | --- | --- | --- | --- |")
    results: dict[tuple[str, int, int], tuple[float, float]] = {}
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE, Schedule.VARUNA):
        for P in DEPTHS:
            for Nm in MICRO_BATCHES:
                runs = args.runs if schedule is not Schedule.VARUNA else max(1, args.runs // 2)
                _, pricing, full = row(schedule.value, P, Nm, pipeline(P, Nm), SimOptions(schedule=schedule), runs)
                results[(schedule.value, P, Nm)] = pricing, full
    print()
    print("| other 48 x 288 cases | pricing (ms) | full (ms) |")
    print("| --- | --- | --- |")
    extra = [
        ("1f1b, jitter 10 % compute / 20 % comm, 4 replicas simulated", pipeline(48, 288),
         SimOptions(schedule=Schedule.ONE_F_ONE_B, compute_jitter=0.1, comm_jitter=0.2, seed=1)),
        ("1f1b with activation swaps (per-task recurrence engine)", pipeline(48, 288, swap_bytes=8 << 20),
         SimOptions(schedule=Schedule.ONE_F_ONE_B)),
        ("harmony_wrap, 48 packs on 8 GPUs, weight swaps",
         dataclasses.replace(pipeline(48, 288, weight_swap_bytes=1 << 30), device_of_stage=wrap_around_devices(48, 8)),
         SimOptions(schedule=Schedule.HARMONY_WRAP)),
    ]
    for name, pipe, options in extra:
        pricing, _, _ = timed(pipe, dataclasses.replace(options, keep_timeline=False), max(1, args.runs // 2))
        full, _, _ = timed(pipe, options, 1)
        print(f"| {name} | {pricing * 1e3:.1f} | {full * 1e3:.1f} |", flush=True)
    print()
    failed = False
    for schedule in ("1f1b", "gpipe"):
        pricing, full = results[(schedule, 48, 288)]
        ok = pricing < PRICING_TARGET_S and full < FULL_TARGET_S
        failed |= not ok
        print(f"{schedule} 48 x 288: pricing {pricing * 1e3:.1f} ms (target {PRICING_TARGET_S * 1e3:.0f} ms), "
              f"full {full * 1e3:.0f} ms (target {FULL_TARGET_S * 1e3:.0f} ms): {'met' if ok else 'MISSED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
