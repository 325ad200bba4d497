"""`benchmarks/fleet_scale.py replay` (issue 43, item 6): a seeded job trace through the live plane on emulated hosts,
beside `ballast fleet simulate`'s replay of the same trace.

The trace comes from the generator `ballast fleet trace` uses (services/planner/elastic/trace.py), seeded, with
Poisson arrivals over `--hours` and log-normal iteration counts; one tenant and one priority (the live plane's
tenants are its tokens, and the comparison is of the plane, not of fair-share), and every job static (min = max =
its request), so the live admission engine and the simulator's `backfill` decide alike. It is then time
compressed by `--compress`: arrivals and iteration counts are divided by it, each iteration keeps the plan's
predicted time, and the compressed trace (written beside the results) is what both replay. A job's iterations
are capped so it runs at most `--max-job-s` alone on its request (by the simulator's curve), so the log-normal
tail and a one-device job at a large batch cannot outlast the run.

The simulator prices each (model, batch, devices) with the planner on the emulated device kind (`--curves
planner`); the emulated workers advance at the live plan's predicted time (with a seeded 2% noise), so the
two share their iteration times and the JCT difference is the plane itself: preparation, admission passes,
assignment, start, end, and the morphs of the `--losses` hosts lost during the replay (the simulator loses none).

Printed: hosts connected, heartbeat lag, admission pass p50/p99 (the planner's histogram, bucket bounds),
submit -> RUNNING for jobs that never waited for devices, store rows written per second (PostgreSQL's
statistics, or row counts on SQLite), each process's CPU and RSS, overlapping leases, lost or duplicated
iterations and events, and each job's JCT beside the simulator's (all in replay.csv; the summary and the worst
jobs printed).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import ssl
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from ballast.cli.fleet_simulate import build_curves, example_models
from ballast.tls import scraper_identity, tls_files
from ballast.v1 import job_pb2, services_pb2, store_pb2
from benchmarks.fleet_probe import epoch, hosts_by_state, plane_pids, usage
from benchmarks.load import pct
from services.executor.emulated import Behaviour
from services.executor.emulated_hosts import EmulatedHosts
from services.planner.elastic import BACKFILL, TraceJob, simulate
from services.planner.elastic.policy import Curves
from services.planner.elastic.trace import generate_trace, write_trace
from services.runtime.metrics_http import metrics_url
from services.specs.model import load_model_spec
from tests.harness import ROOT, Plane, lineage_problems
from tests.store_fixtures import OVERLAPS

KIND = "nvidia-h100-sxm-80gb"
DEVICES_PER_HOST = 8
INTER_NODE = "eth-10"  # what the live planner prices between distinct hosts (jobs/prepare.py fleet_of_hosts)
MODELS = ("bert-huge-32", "vit-huge-32", "t5-large-32")
BATCHES = (64, 128, 256)
JCT_TARGET = 0.10  # the live average JCT within 10% of the simulator's (issue 43's acceptance)


def compressed_trace(args: argparse.Namespace) -> list[TraceJob]:
    """The seeded trace, every job static, arrivals and iterations divided by --compress."""
    devices = args.hosts * DEVICES_PER_HOST
    raw = generate_trace(args.jobs, args.seed, MODELS, fleet_devices=devices,
                         mean_interarrival_s=args.hours * 3600.0 / args.jobs, median_iterations=args.median_iterations,
                         iterations_sigma=args.sigma, global_batches=args.batches, tenants=("replay",), priorities=(0,),
                         max_request=args.max_request)
    return [replace(j, submit_time_s=round(j.submit_time_s / args.compress, 3),
                    iterations=max(1, round(j.iterations / args.compress)),
                    min_devices=j.requested_devices, max_devices=j.requested_devices) for j in raw]


def capped(trace: list[TraceJob], curves: Curves, longest_s: float, shortest: int) -> list[TraceJob]:
    """Each job's iterations cut so it runs at most `longest_s` alone on its request (at least `shortest`): the
    log-normal tail, and a one-device job at a large batch, would otherwise outlast the compressed trace."""
    out = []
    for j in trace:
        step = curves[(j.model, j.global_batch_size)].iteration_s_on(j.requested_devices)
        out.append(replace(j, iterations=max(shortest, min(j.iterations, int(longest_s / step)))))
    return out


@dataclass
class Live:
    """What the replay's threads record while the plane runs it."""

    ids: dict[str, str] = field(default_factory=dict)  # trace name -> job id
    lost: list[tuple[float, str, int]] = field(default_factory=list)  # (replay time, host, workers it ran)
    lags: list[float] = field(default_factory=list)
    submit_errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def spec(job: TraceJob, checkpoint_every: int) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(name=job.name, model=load_model_spec(ROOT / "examples" / f"{job.model}.yaml"),
                           global_batch_size=job.global_batch_size, iterations=job.iterations, seed=1,
                           min_devices=job.requested_devices, max_devices=job.requested_devices,
                           checkpoint_every=checkpoint_every)


def submit_all(plane: Plane, trace: list[TraceJob], t0: float, live: Live, checkpoint_every: int) -> None:
    client = plane.client()
    specs = {}
    for job in sorted(trace, key=lambda j: j.submit_time_s):
        specs.setdefault(job.model, spec(job, checkpoint_every).model)
        time.sleep(max(0.0, t0 + job.submit_time_s - time.monotonic()))
        request = job_pb2.JobSpec(name=job.name, model=specs[job.model], global_batch_size=job.global_batch_size,
                                  iterations=job.iterations, seed=1, min_devices=job.requested_devices,
                                  max_devices=job.requested_devices, checkpoint_every=checkpoint_every)
        try:
            submitted = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=request))
        except Exception as exc:  # noqa: BLE001 - a refused submission is a result to report, not a crash
            live.submit_errors.append(f"{job.name}: {exc}")
            continue
        with live.lock:
            live.ids[job.name] = submitted.id


def lose_hosts(plane: Plane, fleet: EmulatedHosts, count: int, until: float, t0: float, live: Live,
               stop: threading.Event, seed: int) -> None:
    """`count` hosts lost at even intervals until `until` (replay seconds), each one that runs some job's workers."""
    rng, store = random.Random(seed), plane.client().store
    names = {a.host_id: a.name for a in fleet.agents}
    gone: set[str] = set()
    for i in range(count):
        if stop.wait(max(0.0, t0 + until * (i + 1) / (count + 1) - time.monotonic())):
            return
        leases = store.ListLeases(store_pb2.ListLeasesRequest(live_only=True)).leases
        hosts = sorted({names[x.device.host_id] for x in leases if x.device.host_id in names} - gone)
        if not hosts:
            continue
        victim = rng.choice(hosts)
        gone.add(victim)
        live.lost.append((time.monotonic() - t0, victim, fleet.lose(victim)))


def rows_written(engine: sa.Engine) -> int:
    """Rows inserted into the store's tables so far: PostgreSQL's statistics, else every table's row count."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            return int(conn.execute(sa.text("SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables")).scalar())
        tables = [t for t in sa.inspect(engine).get_table_names() if t != "alembic_version"]
        return sum(int(conn.execute(sa.text(f'SELECT count(*) FROM "{t}"')).scalar()) for t in tables)


def admission_passes(plane: Plane) -> dict[float, float]:
    """The planner's admission-pass histogram: {bucket upper bound: passes at or below}."""
    settings = plane.settings
    context = ssl.create_default_context(cafile=str(tls_files(settings).ca))
    scraper = scraper_identity(settings)
    context.load_cert_chain(str(scraper.cert), str(scraper.key))
    with urllib.request.urlopen(metrics_url(settings, settings.planner_metrics_port), context=context,
                                timeout=10) as reply:
        text = reply.read().decode()
    return {float(s.labels["le"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "ballast_admission_pass_seconds_bucket"}


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile q (a bound, never an underestimate)."""
    total = buckets.get(float("inf"), 0.0)
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound
    return float("inf")


@dataclass
class Outcome:
    """Per job, what the store says happened."""

    jct_s: dict[str, float]
    start_s: dict[str, float]  # submit -> first ASSIGNED, for jobs that never queued for devices
    states: dict[str, str]
    problems: list[str]
    morphed: set[str]
    predicted_s: dict[str, float]  # the live plan's predicted seconds per iteration, for jobs never morphed


def outcome(engine: sa.Engine, live: Live, trace: list[TraceJob]) -> Outcome:
    """JCT, start latency and integrity of every job, read from the store's tables."""
    by_id = {job_id: name for name, job_id in live.ids.items()}
    iterations = {j.name: j.iterations for j in trace}
    events: dict[str, list] = {}
    with engine.connect() as conn:
        for row in conn.execute(sa.text("SELECT job_id, seq, type, created_at, message FROM job_events "
                                        "ORDER BY job_id, seq")):
            if row.job_id in by_id:
                events.setdefault(by_id[row.job_id], []).append(row)
        states, predicted = {}, {}
        for r in conn.execute(sa.text("SELECT j.id, j.state, p.prediction FROM jobs j LEFT JOIN plans p "
                                      "ON p.id = j.plan_id")):
            if r.id in by_id:
                states[by_id[r.id]] = r.state.removeprefix("JOB_STATE_")
                prediction = json.loads(r.prediction) if isinstance(r.prediction, str) else (r.prediction or {})
                predicted[by_id[r.id]] = float(prediction.get("iteration_time_s", 0.0))
        rows: dict[str, list] = {}
        for r in conn.execute(sa.text("SELECT job_id, stage_index, replica_index, iteration, first_iteration, "
                                      "iterations FROM iteration_metrics")):
            if r.job_id in by_id:
                rows.setdefault(by_id[r.job_id], []).append(r)
    jct, start, problems, morphed = {}, {}, [], set()
    for name, evs in events.items():
        kinds = [e.type for e in evs]
        if kinds.count("SUBMITTED") != 1 or kinds.count("SUCCEEDED") > 1:
            problems.append(f"{name}: {kinds.count('SUBMITTED')} SUBMITTED, {kinds.count('SUCCEEDED')} SUCCEEDED "
                            "events")
        if kinds.count("ASSIGNED") > 1:
            morphed.add(name)
        if "SUBMITTED" in kinds and "SUCCEEDED" in kinds:
            jct[name] = _at(evs, "SUCCEEDED") - _at(evs, "SUBMITTED")
        if "ASSIGNED" in kinds and not any(e.type == "QUEUED" and "needs" in (e.message or "") for e in evs):
            start[name] = _at(evs, "ASSIGNED") - _at(evs, "SUBMITTED")
        if states.get(name) == "SUCCEEDED":  # a job still running has not stored its every iteration yet
            problems += [f"{name}: {p}" for p in lineage_problems(rows.get(name, []), iterations[name])]
    return Outcome(jct, start, states, problems, morphed,
                   {n: s for n, s in predicted.items() if n not in morphed})


def _at(events: list, kind: str) -> float:
    return epoch(next(e.created_at for e in events if e.type == kind))


def report_jct(live_jct: dict[str, float], sim_jct: dict[str, float], out: Path, morphed: set[str]) -> float:
    """Per-job CSV, a summary, the jobs furthest from the simulator; returns the relative average difference."""
    names = sorted(set(live_jct) & set(sim_jct))
    with out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["job", "live_jct_s", "simulated_jct_s", "morphed"])
        for n in names:
            writer.writerow([n, f"{live_jct[n]:.3f}", f"{sim_jct[n]:.3f}", int(n in morphed)])
    live_avg = statistics.fmean(live_jct[n] for n in names)
    sim_avg = statistics.fmean(sim_jct[n] for n in names)
    calm = [n for n in names if n not in morphed]
    print(f"  JCT over {len(names)} jobs: live average {live_avg:.1f} s, simulated {sim_avg:.1f} s "
          f"({(live_avg - sim_avg) / sim_avg:+.1%}; target within {JCT_TARGET:.0%}); p50 "
          f"{pct([live_jct[n] for n in names], 0.5):.1f} / {pct([sim_jct[n] for n in names], 0.5):.1f} s, p99 "
          f"{pct([live_jct[n] for n in names], 0.99):.1f} / {pct([sim_jct[n] for n in names], 0.99):.1f} s")
    if calm:
        print(f"  JCT of the {len(calm)} jobs never morphed: live {statistics.fmean(live_jct[n] for n in calm):.1f} s, "
              f"simulated {statistics.fmean(sim_jct[n] for n in calm):.1f} s; every job in {out}")
    worst = sorted(names, key=lambda n: -(live_jct[n] - sim_jct[n]))[:5]
    print("  furthest behind the simulator: " + ", ".join(
        f"{n} {live_jct[n]:.0f}/{sim_jct[n]:.0f} s{' (morphed)' if n in morphed else ''}" for n in worst))
    return (live_avg - sim_avg) / sim_avg


def run(args: argparse.Namespace) -> bool:
    """The whole replay; True when every target holds."""
    from benchmarks.load import ballast
    from tests.harness import free_port, make_settings, settings_env

    devices = args.hosts * DEVICES_PER_HOST
    data_dir = Path(args.data_dir or f"/tmp/ballast-replay-{int(time.time())}")
    data_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    trace = compressed_trace(args)
    curves = build_curves(trace, devices, KIND, "planner", example_models(), workers=2, inter_node=INTER_NODE)
    trace = capped(trace, curves, args.max_job_s, args.checkpoint_every)
    write_trace(trace, data_dir / "trace.csv")
    sim = simulate(trace, devices, [BACKFILL], curves)[BACKFILL]
    sim_s = time.monotonic() - started
    sim_jct = sim.jct_s
    rank_iterations = sum(j.iterations * j.requested_devices for j in trace)
    print(f"fleet_scale replay: {len(trace)} jobs over {args.hours:g} h compressed {args.compress:g}x "
          f"(last arrival {max(j.submit_time_s for j in trace):.0f} s), {args.hosts} hosts x {DEVICES_PER_HOST} "
          f"{KIND}; trace {data_dir / 'trace.csv'}")
    print(f"  simulator (backfill, planner curves, {sim_s:.0f} s): average JCT {sim.average_jct_s:.1f} s, p99 "
          f"{sim.p99_jct_s:.1f} s, makespan {sim.makespan_s:.0f} s, utilisation {sim.utilisation:.1%}, peak "
          f"{sim.peak_devices} devices; {rank_iterations} rank-iterations "
          f"({rank_iterations / sim.makespan_s:.0f}/s to report)")
    if args.simulate_only:
        return True
    overrides = {"database_url": args.database_url} if args.database_url else {}
    settings = make_settings(data_dir, agent_heartbeat_s=2.0, host_lost_s=args.host_lost_s, metrics_window_s=10.0,
                             planner_metrics_port=free_port(), **overrides)
    env = settings_env(settings)
    ballast(env, "up", "--executors", "0")
    workers = [subprocess.Popen([sys.executable, "-m", "ballast", "worker"], env=env, cwd=ROOT,
                                stdout=open(settings.data_dir / "logs" / f"worker-{i + 2}.log", "w"),  # noqa: SIM115
                                stderr=subprocess.STDOUT) for i in range(args.workers)]
    plane, live, stop = Plane(settings), Live(), threading.Event()
    fleet = EmulatedHosts(settings, args.hosts, DEVICES_PER_HOST, KIND, Behaviour(noise=args.noise, seed=args.seed))
    engine = sa.create_engine(settings.database_url)
    try:
        started = time.monotonic()
        fleet.start()
        while hosts_by_state(engine)[0].get("ONLINE", 0) < args.hosts:
            if time.monotonic() - started > 600:
                print("the fleet did not come ONLINE in 600 s")
                return False
            time.sleep(2.0)
        print(f"  all {args.hosts} hosts ONLINE {time.monotonic() - started:.0f} s after the emulator started")
        pids = {**plane_pids(settings.data_dir, ("planner", "store", "store-read", "profiler", "worker")),
                **{f"worker-{i + 2}": w.pid for i, w in enumerate(workers)}, "emulator+driver": os.getpid()}
        before, rows_before, t0 = usage(pids), rows_written(engine), time.monotonic()
        last = max(j.submit_time_s for j in trace)
        threads = [threading.Thread(target=submit_all, args=(plane, trace, t0, live, args.checkpoint_every),
                                    daemon=True),
                   threading.Thread(target=lose_hosts, args=(plane, fleet, args.losses, last, t0, live, stop,
                                                             args.seed), daemon=True)]
        for t in threads:
            t.start()
        ended = 0
        while time.monotonic() - t0 < args.timeout:
            time.sleep(5.0)
            states, lags = hosts_by_state(engine)
            live.lags += lags
            with engine.connect() as conn:
                ended = conn.execute(sa.text("SELECT count(*) FROM jobs WHERE state IN ('JOB_STATE_SUCCEEDED', "
                                             "'JOB_STATE_FAILED', 'JOB_STATE_CANCELLED')")).scalar_one()
            if not threads[0].is_alive() and ended >= len(live.ids):
                break
        replay_s = time.monotonic() - t0
        stop.set()
        after, rows_after = usage(pids), rows_written(engine)
        passes = admission_passes(plane)
        with engine.connect() as conn:
            overlaps = conn.execute(sa.text(OVERLAPS)).scalar_one()
        result = outcome(engine, live, trace)
    finally:
        stop.set()
        fleet.stop()
        engine.dispose()
        for worker in workers:
            worker.terminate()
            worker.wait(timeout=60)
        ballast(env, "down")
    shared(trace, curves, result.predicted_s)
    return report(args, trace, live, result, sim_jct, data_dir, replay_s, before, after, rows_after - rows_before,
                  passes, overlaps, ended)


def shared(trace: list[TraceJob], curves: Curves, predicted_s: dict[str, float]) -> None:
    """How far each live plan's predicted iteration time is from the simulator's curve at the job's request."""
    gaps = sorted((abs(predicted_s[j.name] / curves[(j.model, j.global_batch_size)].iteration_s_on(
        j.requested_devices) - 1.0), j.name) for j in trace if predicted_s.get(j.name))
    if gaps:
        print(f"  live plans vs the simulator's curves, seconds per iteration: {len(gaps)} jobs, "
              f"{sum(1 for g, _ in gaps if g > 0.01)} differ by over 1%, the most {gaps[-1][0]:.1%} ({gaps[-1][1]})")


def report(args, trace, live: Live, result: Outcome, sim_jct, data_dir: Path, replay_s: float, before, after,
           rows: int, passes: dict[float, float], overlaps: int, ended: int) -> bool:
    print(f"  replayed in {replay_s:.0f} s: {len(live.ids)} submitted ({len(live.submit_errors)} refused), {ended} "
          f"ended; states {dict(sorted(Counter(result.states.values()).items()))}")
    print(f"  heartbeat lag p50 {pct(live.lags, 0.5):.1f} s, p99 {pct(live.lags, 0.99):.1f} s")
    print(f"  admission passes {passes.get(float('inf'), 0):.0f}: p50 <= {bucket_quantile(passes, 0.5) * 1e3:.0f} ms, "
          f"p99 <= {bucket_quantile(passes, 0.99) * 1e3:.0f} ms (histogram bucket bounds)")
    starts = list(result.start_s.values())
    print(f"  submit -> ASSIGNED for the {len(starts)} jobs that never waited for devices: p50 "
          f"{pct(starts, 0.5):.2f} s, p99 {pct(starts, 0.99):.2f} s")
    print(f"  store rows written {rows / replay_s:.0f}/s ({rows} in all)")
    span = after.at - before.at
    for name in sorted(after.cpu_s):
        print(f"  {name:<16} CPU {(after.cpu_s[name] - before.cpu_s.get(name, 0.0)) / span:6.1%} of one core, "
              f"RSS {after.rss_mb[name]:6.0f} MB")
    affected = sum(1 for _, _, n in live.lost if n)
    print(f"  hosts lost {len(live.lost)} ({affected} running workers); jobs morphed {len(result.morphed)}, of them "
          f"SUCCEEDED {sum(1 for n in result.morphed if result.states.get(n) == 'SUCCEEDED')}")
    print(f"  overlapping leases {overlaps}; lost or duplicated iterations and events {len(result.problems)}")
    for problem in result.problems[:10]:
        print(f"    {problem}")
    for error in live.submit_errors[:5]:
        print(f"    refused: {error}")
    diff = report_jct(result.jct_s, sim_jct, data_dir / "replay.csv", result.morphed)
    succeeded = all(result.states.get(j.name) == "SUCCEEDED" for j in trace)
    return succeeded and not overlaps and not result.problems and abs(diff) <= JCT_TARGET


def add_arguments(sub) -> None:
    p = sub.add_parser("replay", help="replay a seeded job trace through the plane on emulated hosts")
    p.add_argument("--hosts", type=int, default=1024)
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hours", type=float, default=8.0, help="the trace's span before compression")
    p.add_argument("--compress", type=float, default=32.0, help="arrivals and iterations divided by this")
    p.add_argument("--median-iterations", type=float, default=600.0, help="before compression")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the iteration counts")
    p.add_argument("--max-job-s", type=float, default=240.0, help="cap on a job's run time alone, after compression")
    p.add_argument("--batches", type=lambda t: tuple(int(x) for x in t.split(",")), default=BATCHES,
                   help="global batch sizes drawn from (comma list)")
    p.add_argument("--max-request", type=int, default=32, help="largest device request")
    p.add_argument("--checkpoint-every", type=int, default=10, help="also the fewest iterations a job has")
    p.add_argument("--losses", type=int, default=100, help="hosts lost during the replay")
    p.add_argument("--host-lost-s", type=float, default=5.0, help="BALLAST_HOST_LOST_S for the plane")
    p.add_argument("--noise", type=float, default=0.02, help="emulated iteration time noise (relative)")
    p.add_argument("--workers", type=int, default=0, help="planner workers beyond the one `ballast up` starts")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the replay may take in all")
    p.add_argument("--database-url", default="", help="the store's database (default: SQLite in the data dir)")
    p.add_argument("--data-dir", default="", help="where the plane, the trace and replay.csv go")
    p.add_argument("--simulate-only", action="store_true", help="only the trace and the simulator's replay")
