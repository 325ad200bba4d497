"""Elastic fleet (issue 20): fifo, backfill and elastic side by side on the fleet simulator.

A seeded 160-job trace over 64 devices (Poisson arrivals over about eight hours, log-normal iteration
counts, power-of-two device requests; written to benchmarks/traces/elastic-160.csv and read back through
the trace parser) is replayed through the three policies; then a 1,000-job trace at the same arrival rate,
timed. Scaling curves are synthetic (Amdahl's law with a per-doubling communication cost, one shape per
zoo model, serial share shrinking with the global batch); `--planner-curves` prices gpt-tiny with the real
planner instead (an analytical A100 profile, whole 8-device nodes). Targets: elastic's average JCT >= 40%
below fifo's and >= 20% below backfill's, no job's finish-time fairness worse than 2x its own under fifo, and
the 1,000-job replay (all three policies) in <= 60 s. Exits 1 if one is missed.
Run from the repository root: `.venv/bin/python benchmarks/fleet_sim.py [--seed 20] [--morph-cost 60]`.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.planner.elastic import (  # noqa: E402
    BACKFILL,
    ELASTIC,
    FIFO,
    SYNTHETIC_SHAPES,
    PolicyResult,
    ScalingCurve,
    TraceJob,
    generate_trace,
    parse_trace,
    planner_curve,
    simulate,
    synthetic_curve,
    write_trace,
)

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "benchmarks" / "traces" / "elastic-160.csv"
DEVICES = 64
MODELS = SYNTHETIC_SHAPES  # the zoo models the trace draws from, and their synthetic curves' shapes
MEAN_INTERARRIVAL_S = 180.0  # 160 jobs in about eight hours, as in Pollux's evaluation trace
TARGET_VS_FIFO, TARGET_VS_BACKFILL, TARGET_FAIRNESS, TARGET_REPLAY_S = 0.40, 0.20, 2.0, 60.0


def trace_of(jobs: int, seed: int) -> list[TraceJob]:
    return generate_trace(jobs, seed, list(MODELS), fleet_devices=DEVICES, mean_interarrival_s=MEAN_INTERARRIVAL_S)


def synthetic_curves(trace: list[TraceJob]) -> dict[tuple[str, int], ScalingCurve]:
    return {(j.model, j.global_batch_size): synthetic_curve(j.model, j.global_batch_size, DEVICES) for j in trace}


def planner_curves(trace: list[TraceJob]) -> dict[tuple[str, int], ScalingCurve]:
    """gpt-tiny's curves from make_plan on an analytical A100 profile (the profiler builds it, as a caller of
    the pure planner would): 1-8 devices on one node, then whole nodes."""
    import yaml
    from google.protobuf.json_format import ParseDict

    from ballast.v1 import model_pb2
    from services.profiler.projection import analytical_profile
    from services.specs.fleet import load_fleet

    spec = ParseDict(yaml.safe_load((ROOT / "examples" / "gpt-tiny.yaml").read_text()), model_pb2.ModelSpec())
    profile = analytical_profile(spec, "nvidia-a100-80gb", "fp32")
    template = load_fleet(ROOT / "examples" / "fleet-2x8xA100.yaml", dtype="fp32")
    counts = [*range(1, 9), *range(16, DEVICES + 1, 8)]
    batches = sorted({j.global_batch_size for j in trace if j.model == "gpt-tiny"})
    return {("gpt-tiny", b): planner_curve(profile, template, b, counts, model="gpt-tiny") for b in batches}


def table(results: dict[str, PolicyResult]) -> str:
    rows = [f"  {'policy':<9} {'avg JCT s':>10} {'p99 JCT s':>10} {'makespan s':>11} {'util':>6} {'avg wait s':>11} "
            f"{'morphs':>7} {'worst fairness':>15}"]
    for name, r in results.items():
        rows.append(f"  {name:<9} {r.average_jct_s:>10.0f} {r.p99_jct_s:>10.0f} {r.makespan_s:>11.0f} "
                    f"{r.utilisation:>6.1%} {r.average_wait_s:>11.0f} {r.morphs:>7d} {r.worst_fairness:>15.2f}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--morph-cost", type=float, default=60.0, help="seconds a resize pauses a job")
    parser.add_argument("--large", type=int, default=1000, help="jobs in the timed trace (0: skip it)")
    parser.add_argument("--planner-curves", action="store_true", help="price gpt-tiny with the real planner")
    args = parser.parse_args()
    print(f"fleet_sim: Python {platform.python_version()}, {platform.machine()}; {DEVICES} devices, seed {args.seed}, "
          f"morph cost {args.morph_cost:.0f} s, curves: {'planner (gpt-tiny) + ' if args.planner_curves else ''}"
          f"synthetic")
    write_trace(trace_of(160, args.seed), TRACE)
    trace = parse_trace(TRACE.read_text(), MODELS, DEVICES)
    curves = synthetic_curves(trace)
    if args.planner_curves:
        start = time.perf_counter()
        curves.update(planner_curves(trace))
        print(f"  planner curves for gpt-tiny: {time.perf_counter() - start:.1f} s")
    results = simulate(trace, DEVICES, curves=curves, morph_cost_s=args.morph_cost)
    print(f"  {len(trace)} jobs from {TRACE.relative_to(ROOT)}:")
    print(table(results))
    el, fifo, bf = results[ELASTIC], results[FIFO], results[BACKFILL]
    vs_fifo = 1 - el.average_jct_s / fifo.average_jct_s
    vs_backfill = 1 - el.average_jct_s / bf.average_jct_s
    print(f"  elastic average JCT {vs_fifo:.1%} below fifo (target >= {TARGET_VS_FIFO:.0%}), {vs_backfill:.1%} below "
          f"backfill (target >= {TARGET_VS_BACKFILL:.0%}); worst fairness {el.worst_fairness:.2f} against fifo's "
          f"{fifo.worst_fairness:.2f}")
    per_job = {n: el.fairness[n] / fifo.fairness[n] for n in el.fairness}
    worst = max(per_job, key=per_job.__getitem__)
    print(f"  per job: elastic's fairness / fifo's is at most {per_job[worst]:.2f} ({worst}; target <= "
          f"{TARGET_FAIRNESS:.0f}x); {sum(1 for r in per_job.values() if r > TARGET_FAIRNESS)} of {len(per_job)} jobs "
          f"above {TARGET_FAIRNESS:.0f}x, {sum(1 for r in per_job.values() if r < 1)} better off under elastic")
    ok = vs_fifo >= TARGET_VS_FIFO and vs_backfill >= TARGET_VS_BACKFILL and per_job[worst] <= TARGET_FAIRNESS
    if args.large:
        large = trace_of(args.large, args.seed + 1)
        start = time.perf_counter()
        big = simulate(large, DEVICES, curves=synthetic_curves(large), morph_cost_s=args.morph_cost)
        took = time.perf_counter() - start
        print(f"  {args.large} jobs (seed {args.seed + 1}), replayed through all three policies in {took:.1f} s "
              f"(target <= {TARGET_REPLAY_S:.0f} s):")
        print(table(big))
        ok &= took <= TARGET_REPLAY_S
    print(f"fleet_sim: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
