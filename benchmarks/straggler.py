"""A fail-stutter worker is left out, and the job is faster for it (Varuna §4.6).

Target (morphing issue): a worker slowed 2x by a test hook (its agent runs with BALLAST_FAULTS slow 2.0) is
excluded within 20 iterations, and the job's throughput afterwards is >= 1.3x its throughput while the worker
was slow. Plane: the tests' harness with 3 executor agents, the third one slow; a data-parallel GPT job (4
layers, hidden 128, sequence 64, global batch 48, one pipeline stage) over the three devices. Throughput is
the median samples/s of the iterations under each plan version (stage 0, replica 0), the first 3 of each left
out as warm-up. Run from the repository root: `.venv/bin/python benchmarks/straggler.py [--runs 3]`.
Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.v1 import job_pb2, model_pb2, services_pb2, store_pb2  # noqa: E402
from tests.harness import STRAGGLERS, executor_plane, restart_agent, wait_for  # noqa: E402

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
SLOW = "stutter-gpt"
MODEL = model_pb2.ModelSpec(name=SLOW, family=model_pb2.MODEL_FAMILY_GPT,
                            transformer=model_pb2.TransformerConfig(num_layers=4, hidden_size=128, num_heads=4,
                                                                    vocab_size=512, seq_length=64))


def run_once(plane, number: int) -> dict:
    client = plane.client()
    spec = job_pb2.JobSpec(name=f"stutter-{number}", model=MODEL, global_batch_size=48, iterations=400, seed=number,
                           checkpoint_every=50, pipeline_stages=1)
    job_id = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec)).id
    wait_for(lambda: client.jobs.Get(store_pb2.GetRequest(id=job_id)).state in ENDED, timeout=600,
             what=f"job {job_id} to end")
    state = S.Name(client.jobs.Get(store_pb2.GetRequest(id=job_id)).state)
    morphs = [m for m in client.store.ListMorphs(store_pb2.ListMorphsRequest(job_id=job_id)).morphs
              if m.cause == "straggler"]
    metrics = [m for m in client.iteration_metrics(job_id) if m.stage_index == 0 and m.replica_index == 0]

    def throughput(version: int) -> float:
        rows = sorted((m.iteration, m.throughput_samples_per_s) for m in metrics if m.plan_version == version)[3:]
        return statistics.median(t for _, t in rows) if rows else 0.0

    out = {"state": state, "left_out": bool(morphs), "at": morphs[0].failed_iteration if morphs else None}
    if morphs:
        out["slow"], out["after"] = throughput(morphs[0].from_plan_version), throughput(morphs[0].to_plan_version)
        host = morphs[0].detail.split(" on host ")[1].split(" ")[0]
        client.store.ClearHostDegraded(store_pb2.ClearHostDegradedRequest(id=host, reason="benchmark run over"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = []
    with executor_plane(Path(tempfile.mkdtemp(prefix="ballast-stutter-")), f"stutter-{uuid.uuid4().hex[:8]}",
                        agents=3, **STRAGGLERS) as plane:
        restart_agent(plane, 2, {"BALLAST_FAULTS": json.dumps([{"model": SLOW, "slow": 2.0}])})
        for n in range(args.runs):
            results.append(run_once(plane, n))
            r = results[-1]
            print(f"  run {n + 1}: {r['state']}, left out: {r['left_out']} at iteration {r['at']}, "
                  f"{r.get('slow', 0):.1f} samples/s while slow, {r.get('after', 0):.1f} after "
                  f"({r.get('after', 0) / max(r.get('slow', 0), 1e-9):.2f}x)", flush=True)
    ratios = [r["after"] / r["slow"] for r in results if r["left_out"] and r.get("slow")]
    within = all(r["left_out"] and r["at"] is not None and r["at"] <= 20 for r in results)
    print(f"straggler: {len(results)} runs on 3 executor hosts, one 2x slow ({platform.machine()}, "
          f"{os.cpu_count()} cores); GPT 4 layers, batch 48, data parallel")
    print(f"  left out within 20 iterations: {within}; throughput after / while slow: "
          + ", ".join(f"{x:.2f}x" for x in ratios) + " (target >= 1.3x)")
    if not within or not ratios or min(ratios) < 1.3 or any(r["state"] != "JOB_STATE_SUCCEEDED" for r in results):
        print("  MISSED a target")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
