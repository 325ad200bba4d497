"""Predictions hold on the job path once a run has calibrated the estimator (fidelity issue).

Target: after one calibrating run of gpt-tiny per layout on this machine, a second submit of the same layout
predicts its iteration time within 10% of what it measures, in each of 6 layouts (pipeline stages 1/2 x
replicas 1/2 x micro-batches 2/8, where stages x replicas fit the 2 cores: 1x1, 1x2, 2x1), and the mean
absolute error over them is <= 7%. Beside each figure: the uncalibrated prediction of the same plan (the
profile alone, `calibrate.simulated_s` without a calibration) -- the "before" -- and per-stage peak memory,
predicted against measured (target within 15% on CPU).

Plane: the tests' harness (real gRPC servers in this process, a Celery worker, two executor agents on this
machine, real worker processes over gloo). Phase 1 submits every layout once (the calibrating runs); each
success queues the calibration job, which refits the host class of that run (cpu/<cores>c/<workers>w: one
worker alone, or two sharing the machine) from its newest runs. Phase 2 submits every layout again and
compares its plan's prediction with the median iteration time it measured (the first iterations left out).

The floor (issue 45, item 5): phase 2 runs every layout twice, and with the calibrating run that gives three
measurements of the same layout minutes apart. Their spread, (max - min) / min, is the machine's run-to-run
noise; it is printed beside the estimator's error, and where it exceeds 10% an error within it is counted as the
machine's, not the estimator's (the error is taken against the median of the two phase-2 runs).
Run from the repository root: `.venv/bin/python benchmarks/fidelity.py [--iterations 40] [--rounds 1]`.
Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.cli.demo import calibration_outcome  # noqa: E402
from ballast.v1 import job_pb2, store_pb2  # noqa: E402
from services.planner.plans.calibrate import WARMUP, measured_iteration_s, simulated_s  # noqa: E402
from services.specs.model import load_model_spec  # noqa: E402
from tests.harness import ROOT, executor_plane, submit_to_success, wait_for  # noqa: E402

LAYOUTS = [(stages, replicas, nm) for stages, replicas in ((1, 1), (1, 2), (2, 1)) for nm in (2, 8)]
BATCH = 16
TIME_TARGET, MAE_TARGET, MEMORY_TARGET = 0.10, 0.07, 0.15


def run(plane, layout: tuple[int, int, int], iterations: int, tag: str) -> job_pb2.Job:
    """Submit gpt-tiny on exactly this layout and wait for it to succeed."""
    stages, replicas, nm = layout
    spec = job_pb2.JobSpec(name=f"fidelity-{tag}-{stages}x{replicas}-nm{nm}",
                           model=load_model_spec(ROOT / "examples" / "gpt-tiny.yaml"), global_batch_size=BATCH,
                           iterations=iterations, seed=1, pipeline_stages=stages, min_devices=stages * replicas,
                           max_devices=stages * replicas, micro_batches=nm)
    done = submit_to_success(plane, spec)
    return done


def calibrated(plane, job_id: str) -> dict:
    """Wait until the calibration task of this run has finished (the next submit of its host class uses what it
    stored; a fit no better than the one in force is not stored)."""
    return wait_for(lambda: calibration_outcome(plane.client(), job_id), timeout=180,
                    what=f"the calibration task of {job_id}")


def measure(plane, job: job_pb2.Job) -> dict:
    """The plan's prediction (calibrated when the planner had one), the same plan uncalibrated, the measured
    median iteration, and per stage predicted against measured peak memory."""
    client = plane.client()
    plan = client.planner.GetPlan(store_pb2.GetRequest(id=job.plan_id))
    profile = client.store.GetProfile(store_pb2.GetRequest(id=plan.profile_id))
    metrics = list(client.iteration_metrics(job.id))
    measured = measured_iteration_s(metrics, plan.version, WARMUP)
    stages = sorted({m.stage_index for m in metrics})
    memory = [(max(m.predicted_peak_memory_bytes for m in metrics if m.stage_index == s),
               max(m.peak_memory_bytes for m in metrics if m.stage_index == s)) for s in stages]
    note = next((line for line in plan.explanation.splitlines() if "Calibrated from" in line), "")
    return {"predicted": plan.prediction.iteration_time_s, "before": simulated_s(profile, plan, None),
            "measured": measured, "memory": memory, "calibration": note, "nm": plan.num_micro_batches}


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=1, help="calibrating runs of every layout before the test")
    args = parser.parse_args()
    with executor_plane(Path(tempfile.mkdtemp(prefix="ballast-fidelity-")), f"fidelity-{uuid.uuid4().hex[:8]}",
                        calibration_min_iterations=20) as plane:
        first: dict[tuple[int, int, int], dict] = {}
        for r in range(args.rounds):
            for layout in LAYOUTS:
                job = run(plane, layout, args.iterations, f"calibrating{r}")
                outcome = calibrated(plane, job.id)
                first[layout] = measure(plane, job)
                print(f"  calibrating run {layout[0]}x{layout[1]} Nm={layout[2]}: measured "
                      f"{first[layout]['measured'] * 1e3:.1f} ms; "
                      + (f"calibration v{outcome['version']}" if outcome["calibrated"] else outcome["why"]),
                      flush=True)
        second = {layout: measure(plane, run(plane, layout, args.iterations, "second")) for layout in LAYOUTS}
        third = {layout: measure(plane, run(plane, layout, args.iterations, "third")) for layout in LAYOUTS}
        cals = plane.client().store.ListCalibrations(store_pb2.ListCalibrationsRequest()).calibrations
    print(f"fidelity: gpt-tiny, global batch {BATCH}, {args.iterations} iterations per run, {platform.machine()} "
          f"({os.cpu_count()} cores), 2 CPU executor agents; iteration error = (predicted - measured) / measured")
    print(f"  {'layout':<14} {'measured':>9} {'spread':>7} {'before':>9} {'err':>7} {'after':>9} {'err':>7}   peak "
          f"memory per stage, predicted / measured MiB (err)")
    time_errors, memory_errors, spreads, judged, excused = [], [], [], [], 0
    for layout, m in second.items():
        runs = [first[layout]["measured"], m["measured"], third[layout]["measured"]]
        m = {**m, "measured": statistics.median(runs[1:])}
        spread = (max(runs) - min(runs)) / min(runs)
        spreads.append(spread)
        before, after = error(m["before"], m["measured"]), error(m["predicted"], m["measured"])
        time_errors.append(abs(after))
        if abs(after) > TIME_TARGET and spread > TIME_TARGET and abs(after) <= spread:
            excused += 1  # within the machine's own run-to-run spread
        else:
            judged.append(abs(after))
        mem = []
        for predicted, peak in m["memory"]:
            e = error(predicted, peak)
            memory_errors.append(abs(e))
            mem.append(f"{predicted / 2**20:.0f}/{peak / 2**20:.0f} ({e:+.0%})")
        print(f"  {layout[0]}x{layout[1]} Nm={layout[2]:<6} {m['measured'] * 1e3:7.1f}ms {spread:7.1%} "
              f"{m['before'] * 1e3:7.1f}ms {before:+7.1%} {m['predicted'] * 1e3:7.1f}ms {after:+7.1%}   "
              + ", ".join(mem))
    befores = [abs(error(m["before"], m["measured"])) for m in second.values()]
    mae = statistics.fmean(time_errors)
    print(f"  iteration time: MAE {statistics.fmean(befores):.1%} before calibration, {mae:.1%} after (target "
          f"<= {MAE_TARGET:.0%}); worst after {max(time_errors):.1%} (target each <= {TIME_TARGET:.0%})")
    print(f"  the machine's run-to-run spread (3 runs of each layout): median {statistics.median(spreads):.1%}, "
          f"worst {max(spreads):.1%}; {excused} layout(s) missed 10% by less than their own spread")
    print(f"  peak memory: worst {max(memory_errors):.1%}, mean {statistics.fmean(memory_errors):.1%} (target "
          f"each <= {MEMORY_TARGET:.0%})")
    for c in cals:
        if c.version == max(x.version for x in cals if x.host_class == c.host_class):
            print(f"  calibration {c.host_class} v{c.version}: {c.iterations} iterations from {len(c.job_ids)} "
                  f"run(s) spread {c.run_spread:.1%}, residual {c.residual_before:.1%} -> {c.residual:.1%}")
    missed = max(judged, default=0.0) > TIME_TARGET or mae > MAE_TARGET or max(memory_errors) > MEMORY_TARGET
    if any(not m["calibration"] for m in second.values()):
        print("  a second run was planned without a calibration")
        missed = True
    if missed:
        print("  MISSED a target")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
