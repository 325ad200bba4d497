"""Jobs survive lost workers and hosts: kill something at a random iteration, the job morphs and succeeds.

Target (morphing issue): 20 trials on a plane with 2 executor hosts, each killing at a random iteration one
of: a training worker (kill -9), an executor agent (kill -9; its workers die with it), or every process of one
host (agent and workers at once). At least 19 of 20 jobs SUCCEEDED; median seconds from the kill to the first
resumed iteration <= 10; iterations trained again <= the checkpoint interval; per trial, every iteration of
the final run is stored exactly once in `iteration_metrics`; at the end no worker process and no live lease is
left (a worker holds the torch.distributed process group, so none of those either).

The plane is the tests' harness (real gRPC servers in this process, a Celery worker and the agents as
processes); a killed agent is started again before the next trial, as an operator's supervisor would.
Then `--grow` trials (default 3): a job of a bigger GPT (hidden 256, sequence 128, batch 16: compute-bound, so a
second device pays) on both hosts loses one (it morphs onto one device), the agent is started again, and the
job grows back onto two (a morph with cause `grow`); the target is a higher measured throughput after the grow
than before it (median samples/s of the iterations under each plan version).
Run from the repository root: `.venv/bin/python benchmarks/faults.py [--trials 20] [--grow 3] [--seed 1]`.
Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.v1 import job_pb2, model_pb2, services_pb2, store_pb2  # noqa: E402
from tests.harness import STRAGGLERS, executor_plane, kill_group, restart_agent, wait_for  # noqa: E402

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
KINDS = ("worker", "agent", "host")
EVERY = 10
ITERATIONS = 300
MODEL = model_pb2.ModelSpec(  # iterations of a few tens of ms here, so a kill lands mid-run
    name="faults-gpt", family=model_pb2.MODEL_FAMILY_GPT,
    transformer=model_pb2.TransformerConfig(num_layers=4, hidden_size=128, num_heads=4, vocab_size=512,
                                            seq_length=64))
# Growing pays only where a second device's compute outweighs what the two workers' gradient sum and sharing
# two cores with the control plane cost: the kill trials' model runs about as fast on one CPU device as on two
GROW_MODEL = model_pb2.ModelSpec(
    name="faults-grow-gpt", family=model_pb2.MODEL_FAMILY_GPT,
    transformer=model_pb2.TransformerConfig(num_layers=4, hidden_size=256, num_heads=4, vocab_size=512,
                                            seq_length=128))


def pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def agent_pid(plane, host_id: str) -> tuple[int, int]:
    """(index of the agent process in plane.agents, its pid) for a host."""
    host = plane.client().store.GetHost(store_pb2.GetRequest(id=host_id))
    index = int(host.name.rsplit("-", 1)[1]) - plane.settings.executor_port
    return index, plane.agents[index].pid


def trial(plane, kind: str, at: int, number: int) -> dict:
    client = plane.client()
    spec = job_pb2.JobSpec(name=f"fault-{number}-{kind}", model=MODEL, global_batch_size=8, iterations=ITERATIONS,
                           seed=number, checkpoint_every=EVERY)
    job_id = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec)).id
    wait_for(lambda: any(m.iteration >= at for m in client.iteration_metrics(job_id))
             or client.jobs.Get(store_pb2.GetRequest(id=job_id)).state in ENDED, timeout=240,
             what=f"job {job_id} at iteration {at}")
    assigned = next(e for e in client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events
                    if e.type == "ASSIGNED")
    host_id = assigned.attributes["hosts"].split(",")[-1]
    index, agent = agent_pid(plane, host_id)
    rank = int(assigned.attributes["ranks"].split(";")[-1].split(":")[1].split(",")[0])
    killed_at = time.time()
    if kind == "worker":
        for pid in pids(f"{job_id}/rank-{rank}.json"):
            os.kill(pid, signal.SIGKILL)
    elif kind == "agent":
        kill_group(plane.agents[index])  # the agent's own process group: its workers are in their own sessions
    else:  # every process of the host at once: the agent and its workers
        victims = [agent, *pids(f"{job_id}/rank-{rank}.json")]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        plane.agents[index].wait(timeout=30)
    wait_for(lambda: client.jobs.Get(store_pb2.GetRequest(id=job_id)).state in ENDED, timeout=400,
             what=f"job {job_id} to end")
    if kind != "worker":
        restart_agent(plane, index)
    job = client.jobs.Get(store_pb2.GetRequest(id=job_id))
    morphs = list(client.store.ListMorphs(store_pb2.ListMorphsRequest(job_id=job_id)).morphs)
    rows = client.store.Query(store_pb2.QueryRequest(sql=(
        f"SELECT count(*), count(DISTINCT iteration) FROM (SELECT iteration, stage_index, replica_index, count(*) "
        f"AS n FROM iteration_metrics WHERE job_id = '{job_id}' GROUP BY iteration, stage_index, replica_index) x "
        f"WHERE n = 1"))).rows[0]
    repeated = int(client.store.Query(store_pb2.QueryRequest(sql=(
        f"SELECT count(*) FROM (SELECT iteration FROM iteration_metrics WHERE job_id = '{job_id}' "
        f"GROUP BY iteration, stage_index, replica_index HAVING count(*) > 1) x"))).rows[0][0])
    first = morphs[0].first_iteration_at.ToMicroseconds() / 1e6 if morphs and morphs[0].HasField(
        "first_iteration_at") else None
    return {"kind": kind, "at": at, "job": job_id, "state": S.Name(job.state), "message": job.message[:200],
            "morphs": len(morphs), "cause": morphs[0].cause if morphs else "",
            "layout": f"{morphs[0].from_stages}x{morphs[0].from_replicas}->{morphs[0].to_stages}x"
                      f"{morphs[0].to_replicas}" if morphs else "",
            "lost": max((m.lost_iterations for m in morphs), default=0),
            "kill_to_first_s": first - killed_at if first else None,
            "once": repeated == 0 and int(rows[1]) == ITERATIONS}


def grow_trial(plane, number: int) -> dict:
    """Lose a host mid-run, start its agent again: the job shrinks, then grows back."""
    client = plane.client()
    spec = job_pb2.JobSpec(name=f"grow-{number}", model=GROW_MODEL, global_batch_size=16, iterations=300,
                           seed=number, checkpoint_every=20)
    job_id = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec)).id
    wait_for(lambda: any(m.iteration >= 25 for m in client.iteration_metrics(job_id)), timeout=240,
             what=f"job {job_id} to train")
    assigned = next(e for e in client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events
                    if e.type == "ASSIGNED")
    index, _ = agent_pid(plane, assigned.attributes["hosts"].split(",")[-1])
    kill_group(plane.agents[index])
    wait_for(lambda: any(e.type == "MORPHED" for e in client.store.ListJobEvents(
        store_pb2.ListJobEventsRequest(job_id=job_id)).events), timeout=120, what="the shrink")
    restart_agent(plane, index)
    wait_for(lambda: client.jobs.Get(store_pb2.GetRequest(id=job_id)).state in ENDED, timeout=400,
             what=f"job {job_id} to end")
    morphs = list(client.store.ListMorphs(store_pb2.ListMorphsRequest(job_id=job_id)).morphs)
    grown = next((m for m in morphs if m.cause == "grow"), None)

    def throughput(version: int) -> float:
        rows = sorted(m.throughput_samples_per_s for m in client.iteration_metrics(job_id)
                      if m.plan_version == version and m.stage_index == 0 and m.replica_index == 0)
        return rows[len(rows) // 2] if rows else 0.0

    before = throughput(grown.from_plan_version) if grown else 0.0
    after = throughput(grown.to_plan_version) if grown else 0.0
    return {"state": S.Name(client.jobs.Get(store_pb2.GetRequest(id=job_id)).state), "grown": grown is not None,
            "before": before, "after": after, "recovery_s": grown.recovery_s if grown else 0.0,
            "stragglers": stragglers(client, job_id)}


def stragglers(client, job_id: str) -> str:
    """The job's STRAGGLER events in short: the ratio, left out or kept, and whether measured or simulated."""
    events = client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events
    return "; ".join(f"{e.attributes.get('ratio')}x {'left out' if e.attributes.get('left_out') == 'True' else 'kept'}"
                     f" ({e.attributes.get('without_from')})" for e in events if e.type == "STRAGGLER")


def guarded(run, plane, number: int) -> dict:
    """A grow trial that times out is a missed target with its reason, not the end of the benchmark: the leak
    check after it still runs."""
    try:
        return run(plane, number)
    except (TimeoutError, AssertionError, StopIteration) as e:
        client = plane.client()
        for job in client.store.ListJobs(store_pb2.ListJobsRequest()).jobs:  # its job stops: leaks are counted
            if job.spec.name == f"grow-{number}" and job.state not in ENDED:
                client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=job.id, reason="grow trial failed"))
                wait_for(lambda j=job.id: client.jobs.Get(store_pb2.GetRequest(id=j)).state in ENDED, timeout=120,
                         what=f"job {job.id} to cancel")
        return {"state": f"ERROR: {str(e)[:300]}", "grown": False, "before": 0.0, "after": 0.0, "recovery_s": 0.0,
                "stragglers": ""}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--grow", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    with executor_plane(Path(tempfile.mkdtemp(prefix="ballast-faults-")), f"faults-{uuid.uuid4().hex[:8]}",
                        host_lost_s=5.0, **STRAGGLERS) as plane:
        time.sleep(12.5)  # past the planner's reconnect grace, so a lost host is detected in HOST_LOST_S
        for n in range(args.trials):
            kind, at = KINDS[n % len(KINDS)], rng.randint(EVERY + 1, ITERATIONS * 2 // 3)
            results.append(trial(plane, kind, at, n))
            r = results[-1]
            print(f"  trial {n + 1:2d}: kill {r['kind']:6s} at iteration {r['at']:2d} -> {r['state']}, "
                  f"{r['cause'] or 'no morph'} {r['layout']}, {r['lost']} trained again, kill to first resumed "
                  f"iteration {r['kill_to_first_s'] or float('nan'):.2f} s, every iteration once: {r['once']}",
                  flush=True)
        grows = [guarded(grow_trial, plane, n) for n in range(args.grow)]
        for n, g in enumerate(grows, start=1):
            print(f"  grow {n}: {g['state']}, grew: {g['grown']}, {g['before']:.1f} samples/s on one device, "
                  f"{g['after']:.1f} on two after the grow (its morph took {g['recovery_s']:.2f} s); "
                  f"straggler events: {g['stragglers'] or 'none'}", flush=True)
        live = int(plane.client().store.Query(store_pb2.QueryRequest(
            sql="SELECT count(*) FROM device_leases WHERE ended_at IS NULL")).rows[0][0])
        workers = pids("services.executor.train.worker")
    ok = sum(r["state"] == "JOB_STATE_SUCCEEDED" for r in results)
    times = [r["kill_to_first_s"] for r in results if r["kill_to_first_s"] is not None]
    by_kind = {k: [r["kill_to_first_s"] for r in results if r["kind"] == k and r["kill_to_first_s"]] for k in KINDS}
    lost_ok = all(r["lost"] <= EVERY for r in results)
    once_ok = all(r["once"] for r in results if r["state"] == "JOB_STATE_SUCCEEDED")
    median = statistics.median(times) if times else float("inf")
    print(f"faults: {len(results)} trials on 2 executor hosts ({platform.machine()}, {os.cpu_count()} cores), "
          f"gpt 4 layers (hidden 128, seq 64, batch 8), {ITERATIONS} iterations, checkpoint every {EVERY}")
    print(f"  SUCCEEDED {ok}/{len(results)} (target >= {len(results) - 1})")
    print(f"  kill to first resumed iteration: median {median:.2f} s, max {max(times, default=float('nan')):.2f} s "
          f"(target median <= 10 s); by kind: " + ", ".join(
              f"{k} {statistics.median(v):.2f} s" for k, v in by_kind.items() if v))
    print(f"  iterations trained again <= {EVERY}: {lost_ok}; every iteration stored once: {once_ok}")
    print(f"  left behind: {len(workers)} worker process(es), {live} live lease(s)")
    for r in results:
        if r["state"] != "JOB_STATE_SUCCEEDED":
            print(f"  failed trial: {r}")
    grew = all(g["grown"] and g["after"] > g["before"] and g["state"] == "JOB_STATE_SUCCEEDED" for g in grows)
    print(f"  grow: {sum(g['grown'] for g in grows)}/{len(grows)} jobs grew back, faster after: {grew}")
    killed = bool(results) and (ok < len(results) - 1 or median > 10)  # `--trials 0`: the grow trials alone
    if killed or not lost_ok or not once_ok or workers or live or not grew:
        print("  MISSED a target")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
