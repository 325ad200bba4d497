"""Are profiles reproducible? (fidelity issue 45, item 1.) Profiles gpt-tiny afresh N times, as a job's profile
is taken (the profiling worker process, the request `prepare.profile_request` makes for the two CPU executors of
`ballast up --executors 2`), and compares them.

Target: every per-layer forward and backward time within 10% of each other (or flagged: a profile found the row off
its layer's line through the other sizes after re-measuring it, LayerSample.off_line), and the
uncalibrated whole-plan prediction of each layout `benchmarks/fidelity.py` runs (1x1, 1x2, 2x1 at 2 and 8
micro-batches, global batch 16) within 10% of the first's. Also printed: the whole-model composition factor, the
co-location slowdown and the loopback link fit of each profile, since each enters every prediction.

Run from the repository root: `.venv/bin/python benchmarks/profile_repro.py [--profiles 2]` (about 1 minute a
profile). Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.v1 import fleet_pb2, job_pb2  # noqa: E402
from services.executor.inventory import devices  # noqa: E402
from services.planner.jobs.prepare import fleet_of_hosts, plan_inputs, profile_request, shrink  # noqa: E402
from services.planner.plans.calibrate import simulated_s  # noqa: E402
from services.planner.plans.make import make_plan  # noqa: E402
from services.profiler.runner import run_worker  # noqa: E402
from services.specs.model import load_model_spec  # noqa: E402
from services.specs.user_inputs import NO_USER_INPUTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(stages, replicas, nm) for stages, replicas in ((1, 1), (1, 2), (2, 1)) for nm in (2, 8)]
BATCH, TARGET = 16, 0.10


def fleet() -> fleet_pb2.Fleet:
    """The fleet two CPU executor agents on this machine form (one node of two devices)."""
    hosts = [fleet_pb2.Host(name=f"vm-{i}", address="127.0.0.1", devices=devices(1)) for i in range(2)]
    return fleet_of_hosts(hosts)


def take_profile(spec, job: job_pb2.Job, nodes: fleet_pb2.Fleet):
    request = profile_request(job, nodes)
    for message in run_worker(request, spec, "cpu", NO_USER_INPUTS, lambda: True):
        if message.HasField("profile"):
            return message.profile
    raise SystemExit("the profiling worker gave no profile")


def predictions(profile, job: job_pb2.Job, nodes: fleet_pb2.Fleet) -> dict[tuple[int, int, int], float]:
    out = {}
    for stages, replicas, nm in LAYOUTS:
        spec = job_pb2.JobSpec()
        spec.CopyFrom(job.spec)
        spec.pipeline_stages, spec.micro_batches = stages, nm
        inputs = plan_inputs(job_pb2.Job(spec=spec), ("dp",))
        plan = make_plan(profile, shrink(nodes, stages * replicas), inputs)
        out[(stages, replicas, nm)] = simulated_s(profile, plan, None)
    return out


def spread(values: list[float]) -> float:
    """(max - min) / min: how far apart the profiles put one figure."""
    low = min(values)
    return (max(values) - low) / low if low > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profiles", type=int, default=2)
    args = parser.parse_args()
    spec = load_model_spec(ROOT / "examples" / "gpt-tiny.yaml")
    job = job_pb2.Job(spec=job_pb2.JobSpec(model=spec, global_batch_size=BATCH, iterations=40))
    nodes = fleet()
    profiles, plans = [], []
    for i in range(args.profiles):
        began = time.perf_counter()
        profile = take_profile(spec, job, nodes)
        profiles.append(profile)
        plans.append(predictions(profile, job, nodes))
        load = os.getloadavg()[0]
        spreads = sorted(max(x.forward_spread, x.backward_spread) for layer in profile.layers for x in layer.samples
                         if x.measured)
        print(f"  profile {i + 1}: {time.perf_counter() - began:.1f} s, load {load:.2f}, host noise "
              f"{profile.host_noise:.1%} ({profile.measure_passes} pass(es)"
              f"{', flagged noisy' if profile.noisy else ''}), "
              f"layer spread over repeats median {spreads[len(spreads) // 2]:.1%} worst {spreads[-1]:.1%}, "
              f"composition factor {profile.composition_factor:.3f}, co-location slowdown "
              f"{profile.comm.colocated_slowdown:.3f}", flush=True)
    print(f"profile reproducibility: gpt-tiny, {args.profiles} fresh profiles, {platform.machine()} "
          f"({os.cpu_count()} cores); spread = (max - min) / min over the profiles")
    worst_layer, worst_flagged, flagged, missed = 0.0, 0.0, 0, False
    sizes = sorted({s.micro_batch_size for s in profiles[0].layers[0].samples if s.measured})
    for index, layer in enumerate(profiles[0].layers):
        for m in sizes:
            rows = [next(s for s in p.layers[index].samples if s.micro_batch_size == m) for p in profiles]
            f, b = spread([r.forward_s for r in rows]), spread([r.backward_s for r in rows])
            off = max(r.off_line for r in rows)  # a profile flagged the row: off its layer's line after re-measuring
            if off:
                flagged += 1
                worst_flagged = max(worst_flagged, f, b)
            else:
                worst_layer = max(worst_layer, f, b)
            print(f"  {layer.name:<10} m={m:<3} forward {min(r.forward_s for r in rows) * 1e6:8.1f} us {f:6.1%}   "
                  f"backward {min(r.backward_s for r in rows) * 1e6:8.1f} us {b:6.1%}"
                  + (f"   flagged ({off:.0%} off its line)" if off else ""))
    print(f"  per-layer times: worst spread {worst_layer:.1%} among unflagged rows (target <= {TARGET:.0%}); "
          f"{flagged} row(s) flagged by a profile, their worst spread {worst_flagged:.1%}")
    missed |= worst_layer > TARGET
    worst_plan = 0.0
    for layout in LAYOUTS:
        values = [p[layout] for p in plans]
        worst_plan = max(worst_plan, spread(values))
        print(f"  {layout[0]}x{layout[1]} Nm={layout[2]:<3} uncalibrated prediction "
              + " / ".join(f"{v * 1e3:.1f}" for v in values) + f" ms, spread {spread(values):.1%}")
    print(f"  whole-plan predictions: worst spread {worst_plan:.1%} (target <= {TARGET:.0%})")
    missed |= worst_plan > TARGET
    for name, values in (("composition factor", [p.composition_factor for p in profiles]),
                         ("co-location slowdown", [p.comm.colocated_slowdown for p in profiles])):
        print(f"  {name}: " + " / ".join(f"{v:.3f}" for v in values) + f", spread {spread(values):.1%}")
    if missed:
        print("  MISSED a target")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
