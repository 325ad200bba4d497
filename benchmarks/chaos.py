"""Faults of the servers the plane depends on: the database, the broker, the disk, the store itself.

Target (hardening issue, item 4): each scenario run at least 3 times; every time the services recover
unattended, no metric row or event is lost or duplicated (what the workers sent against what the store holds),
and the job ends as it would have without the fault, or FAILED with a message that names the cause.

Scenarios, each on a plane of its own (the store as its own process, so it can be killed; the profiler and
planner in this process; a Celery worker and 2 executor agents as processes; TLS as always):
- `store`: the store process is killed (SIGKILL) at a random iteration of a training job and started again
  3 s later, as a supervisor (compose's `restart:`) would.
- `postgres`: the store runs on a scratch PostgreSQL cluster of its own on a spare port; it is stopped
  (`pg_ctl stop -m fast`) at a random iteration, left down 3 s and started again.
- `broker`: Celery runs on a scratch Redis on a spare port; it is killed while the job is being profiled and
  planned (a queued search) and started again 3 s later, empty: what it held is gone, as after a crash. The
  store's request row brings the work back: the sweeper publishes again a request nobody claimed for
  `requeue_unclaimed_s` (20 s here, 300 s by default, which suits a broker that keeps its messages).
- `disk`: the data dir (SQLite, its broker, the checkpoints) is a small tmpfs; at a random iteration a file
  fills it, held 4 s, then removed. A worker whose checkpoint write fails for want of space reports lost
  infrastructure, so the job may morph once (cause worker_lost) and resume from its last complete checkpoint.
The job: a GPT of 4 layers on both executors (data parallel), 400 iterations, a checkpoint every 20.
Checked per run: the job's end state and message; every (iteration, stage, replica) of the final run stored
exactly once in `iteration_metrics`; the job's once-only events (SUBMITTED and its end) at most once each; any
morph and its cause (a fault of the plane's servers is no reason to morph); for `broker`, one plan for the job.

Run from the repository root as root (the scratch PostgreSQL runs as the `postgres` user; `disk` mounts a
tmpfs): `.venv/bin/python benchmarks/chaos.py [--runs 3] [--scenarios store,postgres,broker,disk] [--seed 1]`.
Exits 1 if a run missed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.v1 import fleet_pb2, job_pb2, model_pb2, services_pb2, store_pb2  # noqa: E402
from tests.harness import (  # noqa: E402
    Plane,
    free_port,
    kill_group,
    make_settings,
    spawn_cli,
    start_plane,
    wait_for,
)

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
ITERATIONS, EVERY, DOWN_S = 400, 20, 3.0
REQUEUE_S = 20.0  # BALLAST_REQUEUE_UNCLAIMED_S for the broker runs (default 300): a message the crash took
ONCE = ("SUBMITTED", "SUCCEEDED", "FAILED", "CANCELLED")  # a morph chooses and admits again
MODEL = model_pb2.ModelSpec(
    name="chaos-gpt", family=model_pb2.MODEL_FAMILY_GPT,
    transformer=model_pb2.TransformerConfig(num_layers=4, hidden_size=128, num_heads=4, vocab_size=512,
                                            seq_length=64))
PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), Path("/usr/bin"))


@dataclass
class Chaos:
    """A plane whose store is a process (index 0 of `procs` is always the current one)."""

    plane: Plane
    store: subprocess.Popen
    procs: list[subprocess.Popen] = field(default_factory=list)

    def restart_store(self) -> None:
        self.store = spawn_cli(self.plane.settings, "serve", "store", log=self.plane.settings.data_dir / "store.log")
        self.procs.append(self.store)


def store_up(plane: Plane) -> bool:
    try:
        plane.client().store.ListHosts(store_pb2.ListHostsRequest())
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


@contextlib.contextmanager
def chaos_plane(data_dir: Path, **overrides: object) -> Iterator[Chaos]:
    settings = make_settings(data_dir, queue=f"chaos-{uuid.uuid4().hex[:8]}", lease_seconds=10.0,
                             sweep_interval_s=0.5, worker_heartbeat_s=0.5, **overrides)
    start_plane(settings, services=())  # migrate, write the admin token
    store = spawn_cli(settings, "serve", "store", log=data_dir / "store.log")
    chaos = Chaos(Plane(settings), store, [store])
    try:
        wait_for(lambda: store_up(chaos.plane), timeout=60, what="the store process")
        chaos.plane.servers = start_plane(settings, services=("profiler", "planner")).servers
        chaos.procs.append(spawn_cli(settings, "worker", log=data_dir / "worker.log"))
        chaos.procs += [spawn_cli(settings, "serve", "executor", "--index", str(i), log=data_dir / f"agent-{i}.log")
                        for i in range(2)]
        online = store_pb2.ListHostsRequest(state=fleet_pb2.HOST_STATE_ONLINE)
        wait_for(lambda: len(chaos.plane.client().store.ListHosts(online).hosts) == 2, timeout=90,
                 what="2 executor agents online")
        yield chaos
    finally:
        for proc in chaos.procs:
            kill_group(proc)
        chaos.plane.stop()


# --- the servers the faults hit -------------------------------------------------------------------------------

@contextlib.contextmanager
def scratch_postgres() -> Iterator[tuple[str, Callable[[], None], Callable[[], None]]]:
    """(url, stop, start) of a PostgreSQL cluster of its own on a spare port, run as `postgres`."""
    home = Path(tempfile.mkdtemp(prefix="ballast-chaos-pg-"))
    shutil.chown(home, "postgres", "postgres")
    port = free_port()
    data = home / "data"

    def as_postgres(*argv: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.STDOUT)

    as_postgres(str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres")

    def start() -> None:
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-w", "-l", str(home / "log"), "-o",
                    f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=on", "start")

    def stop() -> None:
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-w", "-m", "fast", "stop")

    start()
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", stop, start
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            stop()
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def scratch_redis() -> Iterator[tuple[str, Callable[[], None], Callable[[], None]]]:
    """(url, kill, start) of a Redis of its own on a spare port, nothing persisted (a restart is empty)."""
    port = free_port()
    proc: list[subprocess.Popen] = []

    def start() -> None:
        proc.append(subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, start_new_session=True))
        wait_for(lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                                        text=True).stdout.strip() == "PONG", timeout=20, what="redis")

    def kill() -> None:
        kill_group(proc[-1])

    start()
    try:
        yield f"redis://127.0.0.1:{port}/0", kill, start
    finally:
        kill()


@contextlib.contextmanager
def small_disk(megabytes: int) -> Iterator[Path]:
    """A tmpfs of `megabytes`, mounted for the run."""
    where = Path(tempfile.mkdtemp(prefix="ballast-chaos-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(where: Path) -> Path:
    """Write zeros into `where` until the disk is full; the file is returned to be removed."""
    ballast = where / "fill.bin"
    with open(ballast, "wb") as out:
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):
            while True:
                out.write(chunk)
                out.flush()
    return ballast


# --- one run -------------------------------------------------------------------------------------------------

def submit(plane: Plane, name: str, seed: int) -> str:
    spec = job_pb2.JobSpec(name=name, model=MODEL, global_batch_size=8, iterations=ITERATIONS, seed=seed,
                           checkpoint_every=EVERY)
    return plane.client().jobs.Submit(services_pb2.SubmitJobRequest(spec=spec)).id


def at_iteration(plane: Plane, job_id: str, at: int) -> None:
    client = plane.client()
    wait_for(lambda: any(m.iteration >= at for m in client.iteration_metrics(job_id))
             or client.jobs.Get(store_pb2.GetRequest(id=job_id)).state in ENDED, timeout=300,
             what=f"job {job_id} at iteration {at}")


def verdict(plane: Plane, job_id: str, scenario: str, fault_s: float) -> dict:
    """How the job ended and what the store holds of it, once it has ended."""
    client = plane.client()
    wait_for(lambda: store_up(plane) and client.jobs.Get(store_pb2.GetRequest(id=job_id)).state in ENDED,
             timeout=400, what=f"job {job_id} to end")
    job = client.jobs.Get(store_pb2.GetRequest(id=job_id))
    metrics = client.iteration_metrics(job_id)
    final = max((m.plan_version for m in metrics), default=0)
    per_slot = Counter((m.iteration, m.stage_index, m.replica_index) for m in metrics)
    ranks = {(m.stage_index, m.replica_index) for m in metrics if m.plan_version == final}
    expected = {(i, s, r) for i in range(ITERATIONS) for s, r in ranks}
    log = list(client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events)
    events = Counter(e.type for e in log)
    plans = list(client.store.ListPlans(store_pb2.ListPlansRequest(job_id=job_id)).plans)
    morphs = list(client.store.ListMorphs(store_pb2.ListMorphsRequest(job_id=job_id)).morphs)
    succeeded = job.state == S.JOB_STATE_SUCCEEDED
    missing = len(expected - set(per_slot)) if succeeded else 0
    return {"scenario": scenario, "job": job_id, "state": S.Name(job.state), "message": job.message[:300],
            "missing": missing, "duplicated": sum(n > 1 for n in per_slot.values()),
            "events_twice": sorted(t for t in ONCE if events[t] > 1), "plans": len(plans),
            "morphs": [m.cause for m in morphs], "fault_s": round(fault_s, 2),
            "why": [e.message[:200] for e in log if e.type in ("STRAGGLER", "MORPHING")]}


def run_store(seed: int, rng: random.Random) -> dict:
    with chaos_plane(Path(tempfile.mkdtemp(prefix="ballast-chaos-"))) as c:
        job_id = submit(c.plane, f"chaos-store-{seed}", seed)
        at_iteration(c.plane, job_id, rng.randint(EVERY, ITERATIONS // 2))
        start = time.monotonic()
        kill_group(c.store)
        time.sleep(DOWN_S)
        c.restart_store()
        wait_for(lambda: store_up(c.plane), timeout=60, what="the store back")
        return verdict(c.plane, job_id, "store", time.monotonic() - start)


def run_postgres(seed: int, rng: random.Random) -> dict:
    with scratch_postgres() as (url, stop, start):
        with chaos_plane(Path(tempfile.mkdtemp(prefix="ballast-chaos-")), database_url=url) as c:
            job_id = submit(c.plane, f"chaos-pg-{seed}", seed)
            at_iteration(c.plane, job_id, rng.randint(EVERY, ITERATIONS // 2))
            begin = time.monotonic()
            stop()
            time.sleep(DOWN_S)
            start()
            return verdict(c.plane, job_id, "postgres", time.monotonic() - begin)


def run_broker(seed: int, rng: random.Random) -> dict:
    with scratch_redis() as (url, kill, start):
        with chaos_plane(Path(tempfile.mkdtemp(prefix="ballast-chaos-")), broker_url=url,
                         requeue_unclaimed_s=REQUEUE_S) as c:
            client = c.plane.client()
            job_id = submit(c.plane, f"chaos-broker-{seed}", seed)
            # at once (the request's message still in the broker: the crash loses it) or while a worker runs it
            time.sleep(0.0 if seed % 2 == 0 else rng.uniform(0.5, 1.5))
            state = S.Name(client.jobs.Get(store_pb2.GetRequest(id=job_id)).state)
            begin = time.monotonic()
            kill()
            time.sleep(DOWN_S)
            start()
            out = verdict(c.plane, job_id, "broker", time.monotonic() - begin)
            out["killed_in"] = state
            return out


def run_disk(seed: int, rng: random.Random) -> dict:
    with small_disk(256) as disk:
        data = disk / "state"
        data.mkdir()
        with chaos_plane(data) as c:
            job_id = submit(c.plane, f"chaos-disk-{seed}", seed)
            at_iteration(c.plane, job_id, rng.randint(EVERY, ITERATIONS // 2))
            begin = time.monotonic()
            ballast = fill(disk)
            time.sleep(4.0)
            ballast.unlink()
            return verdict(c.plane, job_id, "disk", time.monotonic() - begin)


SCENARIOS = {"store": run_store, "postgres": run_postgres, "broker": run_broker, "disk": run_disk}


def clean(r: dict) -> bool:
    """Recovered (SUCCEEDED, every row once) or a clear FAILED naming the cause; never a row lost or twice."""
    rows_ok = r["missing"] == 0 and r["duplicated"] == 0 and not r["events_twice"]
    ended_ok = r["state"] == "JOB_STATE_SUCCEEDED" or (
        r["state"] == "JOB_STATE_FAILED" and any(w in r["message"].lower() for w in ("disk", "space", "full")))
    # a full disk fails the checkpoint a worker was writing: it reports lost infrastructure and the job resumes
    # from the last complete checkpoint (a morph); no other fault here is a reason to morph
    morphs_ok = not r["morphs"] or (r["scenario"] == "disk" and set(r["morphs"]) == {"worker_lost"})
    return rows_ok and ended_ok and morphs_ok and (r["scenario"] != "broker" or r["plans"] == 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("chaos.py runs as root: the scratch PostgreSQL runs as `postgres`, `disk` mounts a tmpfs")
    rng = random.Random(args.seed)
    results = []
    print(f"chaos: {platform.machine()}, {os.cpu_count()} cores; gpt 4 layers on 2 executors, {ITERATIONS} "
          f"iterations, a checkpoint every {EVERY}", flush=True)
    for scenario in args.scenarios.split(","):
        for n in range(args.runs):
            t0 = time.monotonic()
            try:
                r = SCENARIOS[scenario](args.seed * 100 + n, rng)
            except (AssertionError, TimeoutError, subprocess.CalledProcessError) as e:
                r = {"scenario": scenario, "job": "", "state": f"ERROR {str(e)[:400]}", "message": "", "missing": -1,
                     "duplicated": -1, "events_twice": [], "plans": 0, "morphs": [], "fault_s": 0.0, "why": []}
            results.append(r)
            for why in r["why"]:
                print(f"    {why}")
            print(f"  {scenario:8s} run {n + 1}: {r['state']} ({r['message'][:120]!r}); fault {r['fault_s']} s; "
                  f"rows missing {r['missing']}, twice {r['duplicated']}; events twice {r['events_twice'] or 'none'}"
                  f"; plans {r['plans']}; morphs {r['morphs'] or 'none'}"
                  + (f"; killed while {r['killed_in']}" if "killed_in" in r else "")
                  + f"; {time.monotonic() - t0:.0f} s -> {'clean' if clean(r) else 'MISSED'}", flush=True)
    missed = [r for r in results if not clean(r)]
    print(f"  {len(results) - len(missed)}/{len(results)} runs clean")
    if missed:
        raise SystemExit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
