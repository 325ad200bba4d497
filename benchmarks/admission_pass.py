"""What one admission pass costs with a deep queue on a full fleet (issue 43, item 5: ≤ 100 ms p99 with 5,000 jobs
queued, and about the same with 50).

    .venv/bin/python benchmarks/admission_pass.py [--queued 5000] [--hosts 1024] [--passes 100]

A store process of its own (SQLite, served on a loopback port and read over gRPC, as the planner reads the store
reader) holds `--hosts` hosts of 8 devices, every device leased to a running job of 8 devices, and `--queued`
jobs waiting (QUEUED, each planned for 8 devices, three priority classes, the top one preempting, 5 tenants).
Each pass, every 0.5 s as the scheduler ticks, is what the scheduler does to decide: the admission snapshot
(`services/planner/jobs/admit.Reader`, which keeps what it read and re-reads only what changed) and `decide()` on
it. Between passes the queue moves as a live one does: one job arrives (created, planned, queued) and one waiting
job is cancelled (the set-up's writes are first left OVERLAP_S behind, as a live queue's are). Printed: the
pass's wall time p50/p99/max (snapshot and decide apart), this process's CPU per pass, the slowest passes, and
the first pass (the whole reads a planner makes when it starts) apart. Exits 1 when 5,000 or more are queued and
the p99 misses 100 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.client import open_channel  # noqa: E402
from ballast.config import load_settings  # noqa: E402
from ballast.transport import client_transport  # noqa: E402
from ballast.v1 import fleet_pb2, job_pb2, plan_pb2, store_pb2  # noqa: E402
from benchmarks.load import pct  # noqa: E402
from services.planner.jobs.admit import Reader  # noqa: E402
from services.planner.jobs.changes import OVERLAP_S  # noqa: E402
from services.runtime.store_api import Store  # noqa: E402
from services.runtime.store_client import RemoteStore  # noqa: E402
from services.store import schema  # noqa: E402
from services.store.db import create_engine  # noqa: E402
from services.store.local import LocalStore  # noqa: E402
from services.store.repository import Repository  # noqa: E402
from services.store.service import build_server  # noqa: E402
from tests.store_builders import job_spec, profile_msg  # noqa: E402

S = job_pb2.JobState
KIND, PER_HOST = "nvidia-h100-sxm-80gb", 8
TARGET_P99_S = 0.100
INTERVAL_S = 0.5  # the scheduler's pass interval (Scheduler interval_s)
ADMIN_TOKEN = "blt_bench-admin-token"
TENANTS = (("prod", 3.0), ("research", 1.0), ("vision", 1.0), ("speech", 2.0), ("interns", 0.5))
CLASSES = (("low", 0, False), ("normal", 10, False), ("high", 100, True))


def plan_for(model_id: str, job_id: str, profile_id: str, iteration_s: float) -> plan_pb2.Plan:
    return plan_pb2.Plan(
        model_id=model_id, job_id=job_id, profile_id=profile_id, engine=plan_pb2.PLAN_ENGINE_GALVATRON,
        global_batch_size=64, micro_batch_size=8, num_micro_batches=8, schedule=plan_pb2.SCHEDULE_1F1B,
        fleet=fleet_pb2.Fleet(name="h100", device=fleet_pb2.DeviceSpec(kind=KIND), devices_per_node=PER_HOST,
                              nodes=1),
        stages=[plan_pb2.Stage(index=0, layer_begin=0, layer_end=2, devices=PER_HOST, predicted_time_s=iteration_s)],
        prediction=plan_pb2.Prediction(iteration_time_s=iteration_s, throughput_samples_per_s=64 / iteration_s,
                                       peak_memory_bytes=1 << 30),
        explanation="benchmark", memory_budget_bytes=80 << 30)


class Fleet:
    """The store's rows: tenants and policy, hosts, running and waiting jobs, through `admin` and the tenants'
    stores (the repository in the store's process while setting up; gRPC from the benchmark's process after)."""

    def __init__(self, admin: Store, tenants: list[Store], rng: random.Random):
        self.admin, self.tenants, self.rng = admin, tenants, rng
        self.profiles: dict[str, str] = {}  # model id -> its profile
        self.waiting: list[str] = []

    @classmethod
    def create(cls, repo: Repository, rng: random.Random) -> tuple[Fleet, dict[str, str]]:
        """Tenants and the fleet policy on an empty store; (the fleet, tenant id -> token)."""
        admin = LocalStore(repo, repo.ensure_admin(ADMIN_TOKEN))
        tokens, tenants = {admin.principal.tenant_id: ADMIN_TOKEN}, []
        for name, _ in TENANTS:
            made = repo.create_tenant(admin.principal, store_pb2.CreateTenantRequest(name=name))
            principal = repo.principal_for_token(made.token)
            tokens[principal.tenant_id] = made.token
            tenants.append(LocalStore(repo, principal))
        policy = fleet_pb2.FleetPolicy(
            priority_classes=[fleet_pb2.PriorityClass(name=c, priority=p, preempts=x) for c, p, x in CLASSES],
            default_priority_class="normal", max_preemptions_per_hour=2, fair_share_half_life_s=3600.0,
            tenants=[fleet_pb2.TenantPolicy(tenant=t, weight=w, max_priority_class="high") for t, w in TENANTS])
        admin.set_fleet_policy(store_pb2.SetFleetPolicyRequest(policy=policy))
        return cls(admin, tenants, rng), tokens

    def hosts(self, n: int) -> list[fleet_pb2.Host]:
        made = []
        for i in range(n):
            host = fleet_pb2.Host(name=f"emu-{i:05d}", address="10.0.0.1", agent_port=50060, agent_version="0.1.0",
                                  devices=[fleet_pb2.Device(index=d, uuid=f"u{i}-{d}", spec=fleet_pb2.DeviceSpec(
                                      kind=KIND, memory_bytes=80 << 30)) for d in range(PER_HOST)])
            made.append(self.admin.register_host(store_pb2.RegisterHostRequest(host=host)))
        return made

    def job(self, state: int) -> job_pb2.Job:
        """A job planned for 8 devices and moved to `state` (SCHEDULED, then QUEUED or RUNNING)."""
        store = self.rng.choice(self.tenants)
        cls = self.rng.choices(CLASSES, weights=(3, 6, 1))[0][0]
        spec = job_spec(f"j{self.rng.randrange(1 << 30)}", priority_class=cls)
        spec.iterations = self.rng.randint(100, 5000)
        job = store.create_job(store_pb2.CreateJobRequest(spec=spec))
        profile = self.profiles.get(job.model_id)
        if profile is None:
            profile = self.profiles[job.model_id] = store.create_profile(
                store_pb2.CreateProfileRequest(profile=profile_msg(job.model_id))).id
        plan = store.create_plan(store_pb2.CreatePlanRequest(plan=plan_for(job.model_id, job.id, profile,
                                                                            self.rng.uniform(0.2, 2.0))))
        for step in (S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING):
            store.transition_job(store_pb2.TransitionJobRequest(id=job.id, state=step))
        job = store.transition_job(store_pb2.TransitionJobRequest(id=job.id, state=S.JOB_STATE_SCHEDULED,
                                                                  plan_id=plan.id))
        if state == S.JOB_STATE_QUEUED:
            job = store.transition_job(store_pb2.TransitionJobRequest(id=job.id, state=state))
            self.waiting.append(job.id)
        return job

    def running(self, host: fleet_pb2.Host) -> None:
        job = self.job(S.JOB_STATE_SCHEDULED)
        self.admin.acquire_leases(store_pb2.AcquireLeasesRequest(
            job_id=job.id, devices=[fleet_pb2.DeviceRef(host_id=host.id, device_index=d) for d in range(PER_HOST)]))
        self.admin.transition_job(store_pb2.TransitionJobRequest(id=job.id, state=S.JOB_STATE_RUNNING))

    def churn(self) -> None:
        """One arrival, one cancellation: what a live queue does between two passes."""
        self.job(S.JOB_STATE_QUEUED)
        gone = self.waiting.pop(self.rng.randrange(len(self.waiting)))
        self.admin.transition_job(store_pb2.TransitionJobRequest(id=gone, state=S.JOB_STATE_CANCELLED))


def serve(tmp: str, args: argparse.Namespace, pipe) -> None:
    """The store's process: set the rows up through the repository, then serve them on a loopback port until
    told to stop. What it sends back: the port, the tokens, the hosts, the waiting jobs and the profiles."""
    url = f"sqlite:///{Path(tmp) / 'ballast.db'}"
    schema.upgrade(url)
    repo = Repository(create_engine(url))
    fleet, tokens = Fleet.create(repo, random.Random(args.seed))
    started = time.monotonic()
    hosts = fleet.hosts(args.hosts)
    for host in hosts:
        fleet.running(host)
    for _ in range(args.queued):
        fleet.job(S.JOB_STATE_QUEUED)
    setup_s = time.monotonic() - started
    server = build_server(load_settings({}, data_dir=Path(tmp), store_metrics_port=0), repo.engine,
                          "127.0.0.1:0", repo=repo).start()
    pipe.send({"port": server.port, "tokens": tokens, "admin": fleet.admin.principal.tenant_id,
               "tenants": [t.principal.tenant_id for t in fleet.tenants], "hosts": [h.id for h in hosts],
               "waiting": fleet.waiting, "profiles": fleet.profiles, "setup_s": setup_s})
    pipe.recv()
    server.stop(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queued", type=int, default=5000)
    parser.add_argument("--hosts", type=int, default=1024)
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ballast-admission-") as tmp, contextlib.ExitStack() as stack:
        here, there = multiprocessing.Pipe()
        store_process = multiprocessing.get_context("spawn").Process(target=serve, args=(tmp, args, there))
        store_process.start()
        stack.callback(store_process.join, 30)
        stack.callback(here.send, "stop")
        given = here.recv()
        print(f"set up {args.hosts} hosts x {PER_HOST} (all leased to {args.hosts} running jobs) and "
              f"{args.queued} queued jobs in {given['setup_s']:.0f} s", flush=True)
        transport = client_transport(load_settings({}, data_dir=Path(tmp)))

        def remote(tenant_id: str) -> Store:
            token = given["tokens"][tenant_id]
            channel = open_channel(f"127.0.0.1:{given['port']}", lambda: token, transport=transport)
            stack.callback(channel.close)
            return RemoteStore(channel)

        fleet = Fleet(remote(given["admin"]), [remote(t) for t in given["tenants"]], random.Random(args.seed + 1))
        fleet.waiting, fleet.profiles = given["waiting"], given["profiles"]
        gc.freeze()  # as `ballast serve` does once a service has started (ballast/cli/main.py)
        reader = Reader(remote(given["admin"]))
        connected = set(given["hosts"])
        walls, snaps, decides, cpus = [], [], [], []
        first = None
        for i in range(args.passes + 1):
            cpu0, t0 = time.process_time(), time.perf_counter()
            snap = reader.snapshot(connected, set())
            t1 = time.perf_counter()
            decision = snap.decide()
            t2 = time.perf_counter()
            cpu = time.process_time() - cpu0
            if i == 0:
                first = (t2 - t0, len(snap.queue), len(snap.running), len(decision.admit), len(decision.preempt))
                time.sleep(OVERLAP_S)  # the set-up's burst of writes out of the re-read margin, as in a live queue
            else:
                walls.append(t2 - t0)
                snaps.append(t1 - t0)
                decides.append(t2 - t1)
                cpus.append(cpu)
            fleet.churn()
            time.sleep(max(0.0, INTERVAL_S - (time.perf_counter() - t0)))  # the scheduler's tick
        assert first is not None
        print(f"first pass (whole reads): {first[0] * 1e3:.1f} ms; queue {first[1]}, running {first[2]}, "
              f"admitted {first[3]}, preemptions {first[4]}")
        reads = {name: part.reads["whole"] for name, part in
                 (("hosts", reader.fleet), ("jobs", reader.jobs), ("leases", reader.leases))}
        print(f"{args.passes} passes, {args.queued} queued, {args.hosts} hosts (whole reads: {reads}):")
        for name, values in (("pass", walls), ("  snapshot", snaps), ("  decide", decides), ("CPU", cpus)):
            print(f"{name:>10} p50 {pct(values, 0.5) * 1e3:7.1f} ms  p99 {pct(values, 0.99) * 1e3:7.1f} ms  "
                  f"max {max(values) * 1e3:7.1f} ms")
        slowest = sorted(range(len(walls)), key=lambda i: -walls[i])[:3]
        print("slowest passes: " + ", ".join(f"#{i + 1} {walls[i] * 1e3:.1f} ms" for i in slowest))
        p99 = pct(walls, 0.99)
        print(f"pass p99 {p99 * 1e3:.1f} ms (target {TARGET_P99_S * 1e3:.0f} ms with 5,000 queued: "
              f"{'met' if p99 <= TARGET_P99_S else 'missed'})")
    return 0 if p99 <= TARGET_P99_S or args.queued < 5000 else 1


if __name__ == "__main__":
    raise SystemExit(main())
