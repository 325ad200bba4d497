"""How long `ballast up --executors 2` takes until every component reports SERVING, and `down` to finish.

Target (foundation issue): SERVING within 30 s on a 2-core machine. Run: `make bench` or
`.venv/bin/python benchmarks/startup.py [--runs N] [--executors N] [--no-store-reader]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.runtime.ports import free_port  # noqa: E402


def plane_env(data_dir: Path, store_reader: bool = True) -> dict[str, str]:
    """The environment for a `ballast` CLI plane of its own: a fresh data directory and free ports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_")}
    env.update({"BALLAST_DATA_DIR": str(data_dir), "BALLAST_STORE_PORT": str(free_port()),
                "BALLAST_STORE_READ_PORT": str(free_port()), "BALLAST_STORE_READER": str(int(store_reader)),
                "BALLAST_PROFILER_PORT": str(free_port()), "BALLAST_PLANNER_PORT": str(free_port()),
                "BALLAST_EXECUTOR_PORT": str(free_port())})
    return env


def run_once(executors: int, store_reader: bool) -> tuple[float, float]:
    env = plane_env(Path(tempfile.mkdtemp(prefix="ballast-bench-")), store_reader)
    cmd = [sys.executable, "-m", "ballast"]
    start = time.perf_counter()
    up = subprocess.run([*cmd, "up", "--executors", str(executors)], env=env, capture_output=True, text=True)
    up_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([*cmd, "down"], env=env, capture_output=True, text=True, check=True)
    down_s = time.perf_counter() - start
    if up.returncode != 0:
        raise SystemExit(f"ballast up failed:\n{up.stdout}\n{up.stderr}")
    return up_s, down_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--no-store-reader", action="store_true", help="without the read-only store process")
    args = parser.parse_args()
    ups, downs = zip(*(run_once(args.executors, not args.no_store_reader) for _ in range(args.runs)), strict=True)
    print(f"startup: ballast up --executors {args.executors} (fresh data dir, includes migrations) until all SERVING")
    print(f"  runs={args.runs} up median={statistics.median(ups):.2f}s max={max(ups):.2f}s "
          f"down median={statistics.median(downs):.2f}s max={max(downs):.2f}s (target: up < 30 s)")


if __name__ == "__main__":
    main()
