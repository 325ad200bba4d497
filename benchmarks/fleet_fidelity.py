"""Fidelity of the fleet simulator (issue 20): a 6-job trace replayed for real, against the simulator's
prediction for the same trace.

Target: each policy's measured average job completion time within 20% of the simulator's prediction, and
elastic measured faster than the static policy.

Plane: the tests' harness with two executor agents on this machine (one CPU device each), a Celery worker and
real worker processes over gloo; the scheduler's elastic pass every --interval seconds, at most one resize per
job per --min-resize seconds (the simulator gets the same knobs). The default trace is
benchmarks/traces/fleet-fidelity-mixed-6.csv: jobs that scale (gpt-tiny at global batch 8 and 16) mixed with one
that does not (examples/gpt-wide-vocab.yaml: a second device makes it no faster), requests of 1 and 2 devices,
arrivals over a minute (--trace benchmarks/traces/fleet-fidelity-6.csv replays the gpt-tiny-only trace).
First the scaling curves are measured, not predicted: each (model, batch) trains 40 iterations on both
devices alone, then on one device beside a job of each (model, batch) in turn (as jobs share the machine in
the replay; the mean over partners). Its seconds per iteration, by the clock (each row's recorded_at is when
the worker finished the iteration) over iterations 21-40, which hold one checkpoint as every 20 iterations of a
long job do, give the throughput on 1 and 2 devices. The same jobs give the costs outside the iterations
(simulate.JobCosts, medians): preparation from SUBMITTED to PLAN_CHOSEN (also the re-plan an elastic job pays
when started on another count than its plan's: the same path through the queue), the start from ADMITTED to
the 20th iteration's end less 20 iterations at the steady rate, and the end from the last iteration to
SUCCEEDED.
The simulator then replays the trace under `backfill` (the live admission engine: priorities, backfilling)
and `elastic`, each job priced on exactly the devices it holds; `fifo` is shown beside them. The elastic
replay is predicted with each job asking for its maximum, as a live `--elastic` job's plan does. Then the
trace is submitted for real twice at its arrival times: every job on exactly its requested devices (static),
then every job `--elastic` within its range. A job's completion time is its
SUCCEEDED event's time less its SUBMITTED event's.
Run from the repository root: `.venv/bin/python benchmarks/fleet_fidelity.py [--interval 2] [--min-resize 30]
[--morph-cost 10]`. Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.v1 import job_pb2, services_pb2, store_pb2  # noqa: E402
from services.planner.elastic import (  # noqa: E402
    BACKFILL,
    ELASTIC,
    FIFO,
    ElasticPolicy,
    JobCosts,
    ScalingCurve,
    TraceJob,
    parse_trace,
    simulate,
)
from services.specs.model import load_model_spec  # noqa: E402
from tests.harness import ROOT, executor_plane, job_story, wait_for  # noqa: E402

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
TRACE = ROOT / "benchmarks" / "traces" / "fleet-fidelity-mixed-6.csv"
DEVICES = 2
CHECKPOINT_EVERY = 20
MEASURE_ITERATIONS = 2 * CHECKPOINT_EVERY
# A measurement's steady window: from the end of the first checkpoint cadence's iterations to its last, so it
# holds one checkpoint per CHECKPOINT_EVERY iterations, as a long job does (the last is written after it).
WINDOW_START = CHECKPOINT_EVERY
TARGET = 0.20


def spec(job: TraceJob, name: str, low: int, high: int, elastic: bool = False) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(name=name, model=load_model_spec(ROOT / "examples" / f"{job.model}.yaml"),
                           global_batch_size=job.global_batch_size, iterations=job.iterations, seed=1,
                           checkpoint_every=CHECKPOINT_EVERY, min_devices=low, max_devices=high, elastic=elastic)


def events(plane, job_id: str) -> list[job_pb2.JobEvent]:
    return list(plane.client().store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events)


def wait_all(plane, ids: list[str]) -> None:
    client = plane.client()
    for job_id in ids:
        wait_for(lambda j=job_id: client.jobs.Get(store_pb2.GetRequest(id=j)).state in ENDED, timeout=1200,
                 what=f"job {job_id} to end", story=lambda j=job_id: job_story(client, j, plane.settings.data_dir))
        done = client.jobs.Get(store_pb2.GetRequest(id=job_id))
        if done.state != S.JOB_STATE_SUCCEEDED:
            raise SystemExit(f"job {done.spec.name} ended {S.Name(done.state)}: {done.message}")


def seconds(ts) -> float:
    return ts.ToMicroseconds() / 1e6


def measured(plane, job_id: str) -> tuple[float, JobCosts]:
    """(seconds per iteration in the steady window, the job's costs outside its iterations), by the clock: each
    iteration row's recorded_at is when the worker finished it (the slowest rank's).

    By the clock, not the iterations' own times: a checkpoint (every CHECKPOINT_EVERY iterations) is written
    between iterations, and a job's completion time pays for it. The start is from admission to the window's
    beginning less its iterations at the steady rate (workers spawned, the process group, the model, slow
    first iterations); the end from the last iteration to SUCCEEDED (its checkpoint, the workers' exit)."""
    job = plane.client().jobs.Get(store_pb2.GetRequest(id=job_id))
    ended: dict[int, float] = {}
    for m in plane.client().iteration_metrics(job_id):
        if m.plan_version == job.plan_version:
            ended[m.iteration] = max(ended.get(m.iteration, 0.0), seconds(m.recorded_at))
    order = sorted(ended)
    warm, last = ended[order[WINDOW_START - 1]], ended[order[-1]]
    per_iteration = (last - warm) / (len(order) - WINDOW_START)
    at = {}
    for e in events(plane, job_id):
        at.setdefault(e.type, seconds(e.created_at))  # the first of each
    prepare = at["PLAN_CHOSEN"] - at["SUBMITTED"]  # through the queue: a re-plan takes the same path
    # the end holds the last checkpoint, which the rate also counts (one per CHECKPOINT_EVERY): one checkpoint
    # twice per job, a tenth of a second here
    return per_iteration, JobCosts(prepare_s=prepare, replan_s=prepare, end_s=max(0.0, at["SUCCEEDED"] - last),
                                   start_s=max(0.0, warm - at["ADMITTED"] - WINDOW_START * per_iteration))


def median_costs(costs: list[JobCosts]) -> JobCosts:
    return JobCosts(**{name: statistics.median(getattr(c, name) for c in costs)
                       for name in ("prepare_s", "start_s", "end_s", "replan_s")})


def measure_curves(plane, trace: list[TraceJob]) -> tuple[dict, JobCosts]:
    """Scaling curves per (model, batch) on 1 and 2 devices, as the replay will run them, and the job costs.

    Two devices: the job alone. One device: the mean over partners of the job's time while a job of each
    (model, batch) of the trace, itself included, trains on the other device for the whole measurement (it is
    cancelled once the measured job ends): in the replay a job on one device shares the machine with whichever
    job holds the other, and an embedding-heavy partner slows it more than a small one does."""
    client = plane.client()
    keys = sorted({(j.model, j.global_batch_size) for j in trace})
    probe = {k: next(j for j in trace if (j.model, j.global_batch_size) == k) for k in keys}
    times: dict[tuple[str, int], dict[int, float]] = {k: {} for k in keys}
    costs = []
    for k in keys:  # both devices, alone
        job = replace(probe[k], iterations=MEASURE_ITERATIONS)
        job_id = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec(job, f"measure-{k[0]}-{k[1]}-2", 2, 2))).id
        wait_all(plane, [job_id])
        times[k][2], start = measured(plane, job_id)
        costs.append(start)
    beside: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
    for k in keys:  # one device, beside each partner in turn
        for partner in keys:
            busy = replace(probe[partner], iterations=100 * MEASURE_ITERATIONS)
            partner_id = client.jobs.Submit(services_pb2.SubmitJobRequest(
                spec=spec(busy, f"partner-{partner[0]}-{partner[1]}-for-{k[0]}-{k[1]}", 1, 1))).id
            wait_for(lambda j=partner_id: client.iteration_metrics(j), timeout=300,
                     what=f"partner {partner} training")
            job = replace(probe[k], iterations=MEASURE_ITERATIONS)
            job_id = client.jobs.Submit(services_pb2.SubmitJobRequest(
                spec=spec(job, f"measure-{k[0]}-{k[1]}-1-beside-{partner[0]}-{partner[1]}", 1, 1))).id
            wait_all(plane, [job_id])
            client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=partner_id, reason="measured beside it"))
            wait_for(lambda j=partner_id: client.jobs.Get(store_pb2.GetRequest(id=j)).state in ENDED, timeout=120,
                     what=f"partner {partner} cancelled")
            seconds_per_iteration, start = measured(plane, job_id)
            beside[k].append(seconds_per_iteration)
            costs.append(start)
        times[k][1] = statistics.fmean(beside[k])
    curves = {k: ScalingCurve(k[0], k[1], {n: k[1] / t for n, t in times[k].items()}) for k in keys}
    for k in keys:
        print(f"  measured {k[0]} batch {k[1]}: {times[k][1] * 1e3:.1f} ms/iteration on 1 device (beside "
              + ", ".join(f"{p[0]}/{p[1]} {t * 1e3:.0f}" for p, t in zip(keys, beside[k], strict=True))
              + f"), {times[k][2] * 1e3:.1f} ms on 2", flush=True)
    return curves, median_costs(costs)


def replay(plane, trace: list[TraceJob], elastic: bool) -> dict[str, float]:
    """Submit the trace at its arrival times; each job's completion time (s)."""
    client, tag = plane.client(), "elastic" if elastic else "static"
    ids: dict[str, str] = {}
    begin = time.time()
    for job in sorted(trace, key=lambda j: j.submit_time_s):
        time.sleep(max(0.0, begin + job.submit_time_s - time.time()))
        low, high = (job.min_devices, job.max_devices) if elastic else (job.requested_devices,) * 2
        ids[job.name] = client.jobs.Submit(services_pb2.SubmitJobRequest(
            spec=spec(job, f"{tag}-{job.name}", low, high, elastic))).id
    wait_all(plane, list(ids.values()))
    jct = {}
    for name, job_id in ids.items():
        found = {e.type: seconds(e.created_at) for e in events(plane, job_id)}
        jct[name] = found["SUCCEEDED"] - found["SUBMITTED"]
    return jct


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between the elastic pass's decisions")
    parser.add_argument("--min-resize", type=float, default=30.0, help="least seconds between two resizes of a job")
    parser.add_argument("--morph-cost", type=float, default=10.0,
                        help="seconds a resize costs in the simulator (the scheduler's default before it measured one)")
    parser.add_argument("--trace", type=Path, default=TRACE, help="the trace to replay (the format of `ballast fleet "
                        "simulate`; at most 2 devices per job)")
    args = parser.parse_args()
    trace = parse_trace(args.trace.read_text(), [p.stem for p in (ROOT / "examples").glob("*.yaml")], DEVICES)
    with executor_plane(Path(tempfile.mkdtemp(prefix="ballast-fleet-fidelity-")), f"ff-{uuid.uuid4().hex[:8]}",
                        elastic_interval_s=args.interval, elastic_min_resize_interval_s=args.min_resize) as plane:
        curves, costs = measure_curves(plane, trace)
        elastic_policy = ElasticPolicy(name=ELASTIC, min_interval_s=args.min_resize, tick_s=args.interval)
        predicted = simulate(trace, DEVICES, [ElasticPolicy(name=FIFO), ElasticPolicy(name=BACKFILL)], curves,
                             morph_cost_s=args.morph_cost, costs=costs)
        asks_max = [replace(j, requested_devices=j.max_devices) for j in trace]  # an --elastic job's plan does
        predicted |= simulate(asks_max, DEVICES, [elastic_policy], curves, morph_cost_s=args.morph_cost, costs=costs)
        print(f"  job costs (medians): preparation and re-plan {costs.prepare_s:.1f} s, start {costs.start_s:.1f} s, "
              f"end {costs.end_s:.1f} s; morph cost {args.morph_cost:g} s", flush=True)
        live = {BACKFILL: replay(plane, trace, elastic=False), ELASTIC: replay(plane, trace, elastic=True)}
        morphs = [m for m in plane.client().store.ListMorphs(store_pb2.ListMorphsRequest()).morphs
                  if m.cause == "resize"]
    print(f"fleet_fidelity: {args.trace.name}, {len(trace)} jobs on {DEVICES} CPU devices; {platform.machine()} "
          f"({os.cpu_count()} cores); elastic pass every {args.interval:g} s, a resize at most every "
          f"{args.min_resize:g} s")
    print(f"  {'policy':<10} {'predicted avg JCT':>18} {'measured avg JCT':>17} {'error':>7}   per job measured / "
          "predicted s")
    missed = False
    for policy, jct in live.items():
        sim = predicted[policy].jct_s
        avg_live, avg_sim = statistics.fmean(jct.values()), statistics.fmean(sim.values())
        err = (avg_sim - avg_live) / avg_live
        missed |= abs(err) > TARGET
        label = "static" if policy == BACKFILL else policy
        print(f"  {label:<10} {avg_sim:16.1f} s {avg_live:15.1f} s {err:+7.1%}   "
              + ", ".join(f"{n} {jct[n]:.0f}/{sim[n]:.0f}" for n in sorted(jct)))
    print(f"  simulator's fifo (head-of-line blocking, not run live): {predicted[FIFO].average_jct_s:.1f} s")
    faster = statistics.fmean(live[ELASTIC].values()) < statistics.fmean(live[BACKFILL].values())
    print(f"  elastic measured {'faster' if faster else 'NOT faster'} than static; {len(morphs)} resize morph(s), "
          f"recovery {', '.join(f'{m.recovery_s:.1f}' for m in morphs) or '-'} s")
    if missed or not faster:
        print("  MISSED a target")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
