"""Jobs submitted at once to a shared fleet run alone on their devices, so they train as fast as predicted.

Target (shared-fleet issue): 6 jobs submitted at once (no `--wait`) to `ballast up --executors 2` all end
SUCCEEDED, `device_leases` holds no two overlapping leases of one device, and each job's measured iteration
time is within the estimator's usual error of its prediction: its median measured/predicted ratio is at most
1.5x that of the same job run alone on the idle fleet (run before and after the six; the worse one counts).
Before leases, two such jobs shared both devices and each ran 2.4x its prediction.

Everything goes through the CLI a new user runs (`up`, `submit`, `sql`, `down`) on a fresh data directory.
Run from the repository root: `.venv/bin/python benchmarks/fleet_shared.py [--jobs 6] [--iterations 40]`.
Exits 1 if a job fails, a lease overlaps or a ratio misses.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from startup import plane_env

ROOT = Path(__file__).resolve().parents[1]
OVERLAPS = """
SELECT count(*) FROM device_leases a JOIN device_leases b
  ON a.host_id = b.host_id AND a.device_index = b.device_index AND a.id < b.id
WHERE (b.ended_at IS NULL OR a.started_at < b.ended_at) AND (a.ended_at IS NULL OR b.started_at < a.ended_at)
"""
ENDED = ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED")
MARGIN = 1.5


def ballast(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "ballast", *args], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ballast {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def rows(env: dict[str, str], sql: str) -> list[list]:
    return json.loads(ballast(env, "sql", "--json", sql))["rows"]


def submit(env: dict[str, str], iterations: int) -> str:
    out = ballast(env, "submit", "examples/gpt-tiny.yaml", "--batch", "8", "--iterations", str(iterations))
    return re.search(r"job (job-[0-9a-f]+) submitted", out).group(1)


def wait_ended(env: dict[str, str], job_ids: list[str], timeout_s: float = 900) -> dict[str, str]:
    quoted = ", ".join(f"'{j}'" for j in job_ids)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = dict(rows(env, f"SELECT id, state FROM jobs WHERE id IN ({quoted})"))
        if all(s in ENDED for s in states.values()):
            return states
        time.sleep(1.0)
    raise SystemExit(f"jobs did not end within {timeout_s:.0f} s: {states}")


def ratio(env: dict[str, str], job_id: str) -> float:
    """Median of measured over predicted iteration time, every stage and replica, after two warm-up iterations."""
    got = rows(env, "SELECT iteration_time_s / predicted_iteration_time_s FROM iteration_metrics "
                    f"WHERE job_id = '{job_id}' AND iteration >= 2")
    return statistics.median(r[0] for r in got)


def run_alone(env: dict[str, str], iterations: int) -> float:
    job = submit(env, iterations)
    if wait_ended(env, [job])[job] != "JOB_STATE_SUCCEEDED":
        raise SystemExit(f"the job run alone ended {job}: not SUCCEEDED")
    return ratio(env, job)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args()
    env = plane_env(Path(tempfile.mkdtemp(prefix="ballast-bench-")))
    ballast(env, "up", "--executors", "2")
    try:
        before = run_alone(env, args.iterations)
        start = time.monotonic()
        jobs = [submit(env, args.iterations) for _ in range(args.jobs)]
        submitted_s = time.monotonic() - start
        states = wait_ended(env, jobs)
        makespan = time.monotonic() - start
        after = run_alone(env, args.iterations)
        usual = max(before, after)
        overlaps = rows(env, OVERLAPS)[0][0]
        queued = rows(env, "SELECT count(DISTINCT job_id) FROM job_events WHERE type = 'QUEUED' AND job_id IN ("
                           + ", ".join(f"'{j}'" for j in jobs) + ")")[0][0]
        ratios = {j: ratio(env, j) for j in jobs if states[j] == "JOB_STATE_SUCCEEDED"}
    finally:
        ballast(env, "down")
    failed = [j for j, s in states.items() if s != "JOB_STATE_SUCCEEDED"]
    missed = [j for j, r in ratios.items() if r > MARGIN * usual]
    print(f"fleet_shared: {args.jobs} jobs (gpt-tiny, batch 8, {args.iterations} iterations) submitted at once "
          f"in {submitted_s:.1f} s to `ballast up --executors 2`; all ended in {makespan:.1f} s")
    print(f"  alone on the idle fleet: measured/predicted {before:.2f} before, {after:.2f} after "
          f"(usual error: {usual:.2f}; target for each job: <= {MARGIN * usual:.2f})")
    print(f"  jobs: {len(jobs) - len(failed)} SUCCEEDED, {len(failed)} not; {queued} waited in QUEUED; "
          f"overlapping lease pairs: {overlaps}")
    print("  measured/predicted per job: " + ", ".join(f"{r:.2f}" for r in ratios.values())
          + f" (median {statistics.median(ratios.values()):.2f}, max {max(ratios.values()):.2f}; "
          f"max / usual {max(ratios.values()) / usual:.2f})")
    if failed or overlaps or missed:
        print(f"  MISSED: failed {failed}, overlaps {overlaps}, above target {missed}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
