"""Load: 100 concurrent clients for 60 s against one plane, several tenants at once (issue 22, item 5).

Targets: submit p99 <= 50 ms on SQLite here, as the client sees it (throttle waits included); no error but
documented throttling (RESOURCE_EXHAUSTED with retry info); the store consistent afterwards: every
acknowledged submit is exactly one job row of its tenant, every acknowledged cancel ended CANCELLED (or
another end state), nothing half-written (tests/fuzzing.py CONSISTENCY), and the rows match what the
clients saw. Exits 1 if a target is missed.

The plane is `ballast up --executors 0` on a fresh data dir (store, profiler and planner as their own
processes, one Celery worker; SQLite, its broker on SQLite, TLS): submitted jobs are prepared for real --
profiled (one small GPT on a catalog A100 fleet: its analytical profile is cached after the warm-up job of
each tenant) and planned -- then wait in the queue for an executor none offers, so nothing trains. Each
client is a session of a tenant (--tenants, round robin) calling through the SDK (ballast.client: TLS, its
retries) in a loop: pick submit, cancel, watch, list or sql by weight, call, wait a think time (exponential,
mean --think-ms; a session also starts after one). cancel and watch take one of the session's own jobs (a
session without one submits); watch is the time to the first event of a job's stream; sql is the platform
admin's (`ballast sql`). The clients run as threads in --procs processes, so their own interpreter does not
serialise them. --flood N adds N clients of one more tenant calling JobService.List without pause: its rate
limit (BALLAST_RATE_LIMIT_RPS) throttles it, and the others' figures show what it leaves them.
Before and after the run it measures the machine's speed (CPU per in-process CreateQueuedJob,
benchmarks/hot_paths.py) and prints it: on this shared VM the tail follows it from hour to hour.
Run from the repository root: `.venv/bin/python benchmarks/load.py [--clients 100] [--seconds 60]
[--tenants 5] [--seed 1] [--think-ms 1000] [--flood 0] [--no-store-reader]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import sqlalchemy as sa  # noqa: E402

from ballast.client import Client  # noqa: E402
from ballast.config import load_settings  # noqa: E402
from ballast.throttle import retry_after  # noqa: E402
from ballast.v1 import common_pb2, job_pb2, services_pb2, store_pb2  # noqa: E402
from benchmarks.hot_paths import machine_speed  # noqa: E402
from benchmarks.workload import spec  # noqa: E402
from services.store.db import create_engine  # noqa: E402
from tests.fuzzing import inconsistencies  # noqa: E402
from tests.harness import ROOT, make_settings, settings_env, wait_for  # noqa: E402

OPS = {"submit": 30, "list": 30, "watch": 15, "cancel": 15, "sql": 10}  # weights
SUBMIT_P99_MS = 50.0
THROTTLED = "RESOURCE_EXHAUSTED+retry"  # documented throttling: the status with retry advice
SQL = ("SELECT state, COUNT(*) FROM jobs GROUP BY state",
       "SELECT type, COUNT(*) FROM job_events GROUP BY type",
       "SELECT t.name, COUNT(*) FROM jobs j JOIN tenants t ON t.id = j.tenant_id GROUP BY t.name")
S = job_pb2.JobState
ENDED = ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED")  # as the jobs table holds them


class Session:
    """One client: a tenant's SDK client (and the admin's, for sql) calling in a loop until `end`."""

    def __init__(self, name: str, client: Client, admin: Client, seed: int, think_s: float, begin: float,
                 end: float, flood: bool = False):
        self.name, self.client, self.admin, self.think_s, self.flood = name, client, admin, think_s, flood
        self.begin, self.end = begin, end
        self.rng = random.Random(seed)
        self.calls: list[tuple[str, float, str, float]] = []  # (op, ms, code, started: seconds into the run)
        self.submitted: list[str] = []  # acknowledged submits (job ids)
        self.cancelled: list[str] = []  # acknowledged cancels
        self.unsure: list[str] = []  # job names of submits that failed: landed or not, the client cannot tell
        self.open: list[str] = []  # own jobs not yet cancelled

    def run(self) -> None:
        ops, weights = zip(*OPS.items(), strict=True)
        self.pause()  # clients arrive spread over a think time, not all in the same millisecond
        while time.time() < self.end:
            op = "list" if self.flood else self.rng.choices(ops, weights)[0]
            if op in ("cancel", "watch") and not self.open:
                op = "submit"
            start = time.perf_counter()
            try:
                getattr(self, op)()
                code = "OK"
            except grpc.RpcError as exc:
                code = THROTTLED if retry_after(exc) is not None else exc.code().name
            self.calls.append(("flood" if self.flood else op, (time.perf_counter() - start) * 1e3, code,
                               round(time.time() - self.begin, 3)))
            self.pause()

    def pause(self) -> None:
        """A think time: exponential with mean think_s (capped at 10x), so calls arrive as from many users."""
        if self.think_s:
            time.sleep(min(self.rng.expovariate(1 / self.think_s), 10 * self.think_s))

    def submit(self) -> None:
        name = f"{self.name}-{len(self.submitted) + len(self.unsure)}"
        try:
            job = self.client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec(name)))
        except grpc.RpcError:
            self.unsure.append(name)
            raise
        self.submitted.append(job.id)
        self.open.append(job.id)

    def cancel(self) -> None:
        job_id = self.open.pop(self.rng.randrange(len(self.open)))
        self.client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=job_id, reason="load benchmark"))
        self.cancelled.append(job_id)

    def watch(self) -> None:
        stream = self.client.jobs.Watch(services_pb2.WatchJobRequest(job_id=self.rng.choice(self.submitted)),
                                        timeout=30)
        try:
            next(stream)
        finally:
            stream.cancel()

    def list(self) -> None:
        self.client.jobs.List(store_pb2.ListJobsRequest(page=common_pb2.PageRequest(page_size=20)))

    def sql(self) -> None:
        self.admin.store.Query(store_pb2.QueryRequest(sql=self.rng.choice(SQL)))


def child(plan_path: Path, index: int, out: Path) -> None:
    """One client process: its share of the sessions as threads; what they saw goes to `out` as JSON."""
    plan = json.loads(plan_path.read_text())
    settings = load_settings()
    admin = Client.of(settings, ("store",))
    sessions = []
    for number in range(index, plan["clients"], plan["procs"]):
        tenant = plan["tenants"][number % len(plan["tenants"])]
        client = Client.of(settings, ("planner",), token=tenant["token"])
        sessions.append(Session(f"load-{tenant['name']}-c{number}", client, admin, plan["seed"] * 100_003 + number,
                                plan["think_ms"] / 1000, plan["start"], plan["start"] + plan["seconds"]))
    for number in range(index, plan["flood"], plan["procs"]):  # a tenant calling List without pause
        client = Client.of(settings, ("planner",), token=plan["flooder"]["token"])
        sessions.append(Session(f"load-flood-c{number}", client, admin, 0, 0.0, plan["start"],
                                plan["start"] + plan["seconds"], flood=True))
    for s in sessions:  # connect (TLS handshake, token check) before the clock starts
        s.list()
    threads = [threading.Thread(target=s.run) for s in sessions]
    time.sleep(max(0.0, plan["start"] - time.time()))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.write_text(json.dumps([{"name": s.name, "calls": s.calls, "submitted": s.submitted,
                                "cancelled": s.cancelled, "unsure": s.unsure} for s in sessions]))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))] if ordered else 0.0


def ballast(env: dict[str, str], *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ballast", *args], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ballast {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def store_calls(logs: Path, since: float, until: float) -> dict[str, int]:
    """Calls each store process served between two wall-clock times, from its call log (one line per call)."""
    counts = {}
    for name in ("store", "store-read"):
        path = logs / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        counts[name] = 0
        for line in lines:
            if '"msg": "rpc"' not in line:
                continue
            at = datetime.strptime(json.loads(line)["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
            counts[name] += since <= at.timestamp() <= until
    return counts


def cpu_seconds(settings) -> dict[str, float]:
    """CPU seconds each process of the plane (`ballast up`'s children) has used so far."""
    state = json.loads((settings.data_dir / "run" / "state.json").read_text())
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for child in state["children"]:
        try:
            fields = Path(f"/proc/{child['pid']}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used[child["name"]] = (int(fields[11]) + int(fields[12])) / tick
    return used


class MachineLoad(threading.Thread):
    """The whole machine's CPU use each second (/proc/stat), so a run on a busy machine says so."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.busy: list[tuple[float, float]] = []  # (time, fraction of all cores busy over the second before)
        self._stop = threading.Event()

    @staticmethod
    def _read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    def run(self) -> None:
        busy, total = self._read()
        while not self._stop.wait(1.0):
            now_busy, now_total = self._read()
            self.busy.append((time.time(), (now_busy - busy) / max(1, now_total - total)))
            busy, total = now_busy, now_total

    def stop(self, start: float, end: float) -> list[float]:
        """The samples taken within [start, end]."""
        self._stop.set()
        return [frac for at, frac in self.busy if start + 1 <= at <= end]


def warm_up(settings, tenants: list[dict]) -> None:
    """One job per tenant, prepared (profiled, planned) before the clock starts: the profile is cached."""
    jobs = []
    for tenant in tenants:
        with Client.of(settings, ("planner",), token=tenant["token"]) as client:
            jobs.append((tenant, client.jobs.Submit(services_pb2.SubmitJobRequest(
                spec=spec(f"warm-{tenant['name']}"))).id))
    for tenant, job_id in jobs:
        with Client.of(settings, ("planner",), token=tenant["token"]) as client:
            wait_for(lambda c=client, j=job_id: c.jobs.Get(store_pb2.GetRequest(id=j)).state == S.JOB_STATE_QUEUED,
                     timeout=300, what=f"warm-up job {job_id} queued")


def check_store(database_url: str, sessions: list[dict], tenants: list[dict]) -> dict[str, int]:
    """What the store holds against what the clients saw; each rule with its breaking rows (0 = consistent)."""
    engine = create_engine(database_url)
    with engine.connect() as conn:
        jobs = {row.id: row for row in conn.execute(sa.text(
            "SELECT j.id, j.name, j.state, t.name AS tenant FROM jobs j JOIN tenants t ON t.id = j.tenant_id "
            "WHERE j.name LIKE 'load-%'"))}
        cancel_events = {row[0] for row in conn.execute(sa.text(
            "SELECT DISTINCT job_id FROM job_events WHERE type = 'CANCEL_REQUESTED'"))}
        duplicates = conn.execute(sa.text(
            "SELECT COUNT(*) FROM (SELECT tenant_id, name FROM jobs GROUP BY tenant_id, name HAVING COUNT(*) > 1) d"
        )).scalar_one()
    engine.dispose()
    submitted = {j: s["name"] for s in sessions for j in s["submitted"]}
    cancelled = {j for s in sessions for j in s["cancelled"]}
    unsure = {n for s in sessions for n in s["unsure"]}
    per_tenant = Counter(name.split("-")[1] for name in submitted.values())
    rows_per_tenant = Counter(row.tenant for row in jobs.values() if row.name not in unsure)
    broken = {
        "acknowledged submits without their job row": sum(
            1 for j, session in submitted.items() if j not in jobs or not jobs[j].name.startswith(session + "-")),
        "job rows no client saw acknowledged": sum(1 for j, row in jobs.items() if j not in submitted
                                                   and row.name not in unsure),
        "jobs stored twice (same tenant and name)": duplicates,
        "acknowledged cancels not ended": sum(1 for j in cancelled if j not in jobs or jobs[j].state not in ENDED),
        "acknowledged cancels without their event": len(cancelled - cancel_events),
        "cancels stored that no client saw": len({j for j in cancel_events if j in jobs} - cancelled),
        "tenants whose row count differs from their acknowledged submits": sum(
            1 for t in tenants if per_tenant[t["name"]] != rows_per_tenant[t["name"]]),
    }
    broken.update(inconsistencies(database_url))
    return broken


def prepared_jobs(database_url: str) -> int:
    engine = create_engine(database_url)
    with engine.connect() as conn:
        done = conn.execute(sa.text("SELECT COUNT(*) FROM jobs WHERE plan_id IS NOT NULL")).scalar_one()
    engine.dispose()
    return done


def settle(settings, timeout_s: float = 180.0) -> int:
    """Wait until no job is CANCELLING (the worker or scheduler finishing a cancel); returns how many are left."""
    engine = create_engine(settings.database_url)
    query = sa.text("SELECT COUNT(*) FROM jobs WHERE state = :s")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with engine.connect() as conn:
                left = conn.execute(query, {"s": "JOB_STATE_CANCELLING"}).scalar_one()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(1.0)
    finally:
        engine.dispose()


def report(args, sessions: list[dict], throttled_logged: int) -> bool:
    """Print the figures; True if the targets are met."""
    calls = [c for s in sessions for c in s["calls"]]
    by_op: dict[str, list[float]] = defaultdict(list)
    codes: dict[str, Counter] = defaultdict(Counter)
    for op, ms, code, _ in calls:
        by_op[op].append(ms)
        codes[op][code] += 1
    print(f"load: {args.clients} clients x {args.seconds:g} s, {args.tenants} tenants, think {args.think_ms:g} ms, "
          f"seed {args.seed}; {platform.machine()} ({os.cpu_count()} cores); {len(calls)} calls "
          f"({len(calls) / args.seconds:.0f}/s)")
    print("  method  calls  p50 ms  p99 ms  max ms  statuses")
    for op in [*OPS, *(["flood"] if "flood" in by_op else [])]:
        ms = by_op.get(op, [])
        print(f"  {op:<7} {len(ms):>5} {pct(ms, 0.5):>7.1f} {pct(ms, 0.99):>7.1f} {max(ms, default=0):>7.1f}  "
              f"{dict(codes[op].most_common())}")
    errors = Counter(c[2] for c in calls if c[2] not in ("OK", THROTTLED))
    print(f"  errors by status: {dict(errors) or 'none'}; throttled calls the clients saw fail: "
          f"{sum(c[2] == THROTTLED for c in calls)}; throttled calls the servers logged "
          f"(the SDK retried most): {throttled_logged}")
    p99 = pct(by_op.get("submit", []), 0.99)
    print(f"  submit p99 {p99:.1f} ms (target <= {SUBMIT_P99_MS:g} ms: {'met' if p99 <= SUBMIT_P99_MS else 'MISSED'})")
    return p99 <= SUBMIT_P99_MS and not errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tenants", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--think-ms", type=float, default=1000.0, help="mean pause between a client's calls")
    parser.add_argument("--procs", type=int, default=4, help="client processes the sessions are spread over")
    parser.add_argument("--flood", type=int, default=0,
                        help="clients of one more tenant calling JobService.List without pause (rate limits)")
    parser.add_argument("--no-store-reader", action="store_true",
                        help="serve every store call from the one store process (BALLAST_STORE_READER=0)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.index, args.out)
    for name in ("clients", "tenants", "procs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: must be at least 1")
    speed = [machine_speed()]
    settings = make_settings(Path(tempfile.mkdtemp(prefix="ballast-load-")), queue=f"load-{uuid.uuid4().hex[:8]}",
                             store_reader=not args.no_store_reader)
    env = settings_env(settings)
    ballast(env, "up", "--executors", "0")
    try:
        with Client.of(settings, ("store",)) as admin:
            tenants = [{"name": f"t{i}", "token": admin.store.CreateTenant(
                store_pb2.CreateTenantRequest(name=f"t{i}")).token} for i in range(args.tenants)]
        warm_up(settings, tenants)
        with Client.of(settings, ("store",)) as admin:
            flooder = {"name": "flood", "token": admin.store.CreateTenant(
                store_pb2.CreateTenantRequest(name="flood")).token} if args.flood else None
        procs = min(args.procs, args.clients)
        plan = settings.data_dir / "load-plan.json"
        plan.write_text(json.dumps({"clients": args.clients, "procs": procs, "tenants": tenants, "seed": args.seed,
                                    "flood": args.flood, "flooder": flooder,
                                    "think_ms": args.think_ms, "seconds": args.seconds,
                                    "start": time.time() + 5 + args.clients / 20}))
        outs = [settings.data_dir / f"load-{i}.json" for i in range(procs)]
        cpu_before, cpu_since = cpu_seconds(settings), time.time()
        clients_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        machine = MachineLoad()
        machine.start()
        children = [subprocess.Popen([sys.executable, __file__, "--child", str(plan), "--index", str(i),
                                      "--out", str(out)], env=env, cwd=ROOT) for i, out in enumerate(outs)]
        if any(c.wait() for c in children):
            raise SystemExit("a client process failed")
        cpu = {name: used - cpu_before.get(name, 0.0) for name, used in cpu_seconds(settings).items()}
        calls = store_calls(settings.data_dir / "logs", cpu_since, time.time())
        clients_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        start_at = json.loads(plan.read_text())["start"]
        busy = machine.stop(start_at, start_at + args.seconds)
        cpu["clients"] = (clients_after.ru_utime + clients_after.ru_stime - clients_before.ru_utime
                          - clients_before.ru_stime)
        prepared = prepared_jobs(settings.database_url)
        sessions = [s for out in outs for s in json.loads(out.read_text())]
        left = settle(settings)
        throttled = sum(line.count('"RESOURCE_EXHAUSTED"') for log in (settings.data_dir / "logs").glob("*.log")
                        for line in log.read_text(errors="replace").splitlines())
    finally:
        ballast(env, "down")
    speed.append(machine_speed())
    met = report(args, sessions, throttled)
    print(f"  CPU seconds over the run: {', '.join(f'{n} {s:.1f}' for n, s in cpu.items())}; the worker prepared "
          f"{prepared} job(s) (profiled from its cache, planned) by the end")
    store_cpu = cpu.get("store", 0.0) + cpu.get("store-read", 0.0)
    served = sum(calls.values())
    print(f"  store calls over the same span: {served} ({', '.join(f'{n} {k}' for k, n in calls.items())}); the "
          f"store's CPU per call, its two processes: {1e3 * store_cpu / max(1, served):.2f} ms "
          f"(target <= 2 ms: {'met' if store_cpu <= 2e-3 * served else 'missed'})")
    print(f"  machine CPU busy while the clients ran (all processes, 1-s samples): mean "
          f"{100 * sum(busy) / max(1, len(busy)):.0f}%, max {100 * max(busy, default=0):.0f}% of {os.cpu_count()} "
          f"cores")
    broken = {rule: n for rule, n in check_store(settings.database_url, sessions, tenants).items() if n}
    if left:
        broken["jobs still CANCELLING after 180 s"] = left
    submitted = sum(len(s["submitted"]) for s in sessions)
    print(f"  store afterwards: {submitted} acknowledged submits, {sum(len(s['cancelled']) for s in sessions)} "
          f"acknowledged cancels, {sum(len(s['unsure']) for s in sessions)} submits of unknown outcome; "
          f"{'consistent' if not broken else broken}")
    print(f"  this machine's speed, before and after: {speed[0]:.2f} and {speed[1]:.2f} ms of CPU per in-process "
          f"CreateQueuedJob (benchmarks/hot_paths.py; the tail above grows with it)")
    print(f"  data dir (logs, database): {settings.data_dir}")
    if not met or broken:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
