"""What a job's per-iteration stats cost the store, a row per iteration against a row per window (issue 43, item 3).

    .venv/bin/python benchmarks/telemetry.py [--hosts 32] [--iterations 400]

Starts the whole plane (store, profiler, planner, a Celery worker) with `--hosts` emulated hosts of 8 H100s in
this process, then runs one job on every device twice: with a row per iteration (`raw_metrics`) and with the
product's windows (BALLAST_METRICS_WINDOW_S, 10 s). The emulated workers advance at the plan's predicted time per
iteration, so both runs train at the same rate. Printed per run: the rows stored, rows per second of training and
per rank-iteration, the store's WriteIterationMetrics calls per second, and whether every rank's iterations were
each stored exactly once. A window is about 10 s of predicted iterations (a divisor of the checkpoint cadence), so
windows cut the rows about W-fold, W the window's iterations, less the 3 warm-up iterations each rank sends
alone. Exits 1 when a run lost or repeated an iteration, or when the windowed run stored more than
ranks x (iterations / W + 3 + 1) rows.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import REGISTRY  # noqa: E402

from ballast.config import Settings  # noqa: E402
from ballast.v1 import job_pb2, model_pb2, services_pb2, store_pb2  # noqa: E402
from services.executor.telemetry import WARMUP  # noqa: E402
from tests.harness import covered, emulated_plane, wait_for  # noqa: E402

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
PER_HOST = 8


def spec(name: str, devices: int, iterations: int, raw: bool) -> job_pb2.JobSpec:
    model = model_pb2.ModelSpec(
        name="telemetry-gpt", family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=24, hidden_size=2048, num_heads=16, vocab_size=32000,
                                                seq_length=2048))
    return job_pb2.JobSpec(name=name, model=model, global_batch_size=4 * devices, iterations=iterations, seed=1,
                           min_devices=devices, max_devices=devices, raw_metrics=raw)


def write_calls() -> float:
    """WriteIterationMetrics calls the store has answered (its RPC histogram: the store serves in this process)."""
    return sum(sample.value for metric in REGISTRY.collect() if metric.name == "ballast_rpc_duration_seconds"
               for sample in metric.samples
               if sample.name.endswith("_count") and sample.labels.get("method") == "WriteIterationMetrics")


def run(client, devices: int, iterations: int, raw: bool) -> dict:
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("raw" if raw else "windows", devices,
                                                                      iterations, raw)))
    wait_for(lambda: client.jobs.Get(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_RUNNING, timeout=600,
             what="the job to start")
    started, calls = time.monotonic(), write_calls()
    done = wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job.id))).state in ENDED and j,
                    timeout=3600, interval=0.5, what="the job to end")
    took = time.monotonic() - started
    if done.state != S.JOB_STATE_SUCCEEDED:
        raise SystemExit(f"the job ended {S.Name(done.state)}: {done.message}")
    rows = client.iteration_metrics(job.id)
    ranks = covered(rows)
    plan = client.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
    return {"rows": len(rows), "ranks": len(ranks), "seconds": took, "predicted_s": plan.prediction.iteration_time_s,
            "calls": write_calls() - calls,
            "once": all(its == list(range(iterations)) for its in ranks.values()),
            "window": max(r.iterations for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=400)
    args = parser.parse_args()
    devices = args.hosts * PER_HOST
    failed = False
    with tempfile.TemporaryDirectory() as tmp, emulated_plane(Path(tmp), f"tel-{uuid.uuid4().hex[:8]}", args.hosts,
                                                              PER_HOST, host_lost_s=30.0) as (plane, _):
        client = plane.client()
        results = {}
        for raw in (True, False):
            results[raw] = got = run(client, devices, args.iterations, raw)
            rank_iterations = got["ranks"] * args.iterations
            print(f"{'a row per iteration' if raw else f'windows ({Settings.metrics_window_s:g} s)':>22}: "
                  f"{got['rows']:6d} rows for {rank_iterations} rank-iterations "
                  f"({got['rows'] / rank_iterations:.3f} per rank-iteration), {got['rows'] / got['seconds']:7.1f} "
                  f"rows/s in {got['calls'] / got['seconds']:.1f} store calls/s "
                  f"over {got['seconds']:.1f} s of training (predicted {got['predicted_s'] * 1e3:.1f} ms per "
                  f"iteration, {got['ranks']} ranks, longest window {got['window']} iterations); every iteration of "
                  f"every rank stored once: {got['once']}")
            failed |= not got["once"]
        windowed = results[False]
        bound = windowed["ranks"] * (math.ceil(args.iterations / windowed["window"]) + WARMUP + 1)
        cut = results[True]["rows"] / max(windowed["rows"], 1)
        print(f"windows cut the rows {cut:.1f}x with windows of {windowed['window']} iterations "
              f"({windowed['rows']} rows; bound {bound})")
        failed |= windowed["rows"] > bound
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
