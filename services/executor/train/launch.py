"""Run a whole plan as local worker processes on one host (tests, benchmarks, the embedded mode).

`plan_configs` expands one template into the per-rank WorkerConfigs of a stages x replicas plan;
`run_local` starts `python -m services.executor.train.worker` per rank and returns each rank's JSON events.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.executor.train.config import WorkerConfig
from services.executor.train.hold import hold_command
from services.runtime.ports import free_port
from services.specs.parallel import ParallelDims


def plan_configs(template: WorkerConfig, stage_bounds: list[list[int]], num_replicas: int) -> list[WorkerConfig]:
    """Per-rank configs (rank order) for `stage_bounds` x `num_replicas`, on a fresh local TCP rendezvous."""
    dims = ParallelDims(pp=len(stage_bounds), dp=num_replicas)
    init = f"tcp://127.0.0.1:{free_port()}"
    configs = []
    for rank in range(dims.world_size):
        at = dims.coords(rank)
        configs.append(replace(template, stage_bounds=stage_bounds, num_replicas=num_replicas, stage_index=at["pp"],
                               replica_index=at["dp"], rank=rank, world_size=dims.world_size, init_method=init))
    return configs


def run_local(
    configs: list[WorkerConfig], *, env: dict[str, str] | None = None, timeout_s: float = 120.0, check: bool = True,
    commands: dict[int, list[dict[str, Any]]] | None = None, hold: tuple[int, float] | None = None,
) -> list[list[dict[str, Any]]]:
    """Start every rank, wait for all (at most `timeout_s` in all), return each rank's events.

    `commands` maps a rank to command dicts written as JSON lines to its stdin at start (then stdin is closed;
    a rank without commands gets an empty stdin), so tests schedule plan changes through `not_before`.
    `hold` = (iteration, seconds): once rank 0 reports that iteration, every rank is told to hold, and released
    that many seconds later (what the agent does while the store's disk is full; stdin stays open until then).

    With `check`, a rank that exits non-zero raises RuntimeError with the stderr tails; without, the caller
    reads the ranks' "error" events.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="ballast-train-") as tmp:
        procs = []
        for config in configs:
            path = Path(tmp) / f"rank-{config.rank}.json"
            path.write_text(config.to_json())
            stdin = path.with_suffix(".in")
            stdin.write_text("".join(json.dumps(c) + "\n" for c in (commands or {}).get(config.rank, [])))
            with (open(path.with_suffix(".out"), "w") as out, open(path.with_suffix(".err"), "w") as err,
                  open(stdin) as inp):
                command = [sys.executable, "-m", "services.executor.train.worker", str(path)]
                procs.append(subprocess.Popen(command, stdin=subprocess.PIPE if hold else inp, stdout=out,
                                              stderr=err, env=env, text=True))
        deadline = time.monotonic() + timeout_s
        if hold:
            hold_ranks(procs, Path(tmp) / f"rank-{configs[0].rank}.out", *hold, deadline)
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
                proc.wait()
        results, failures = [], []
        for config, proc in zip(configs, procs, strict=True):
            path = Path(tmp) / f"rank-{config.rank}.json"
            lines = path.with_suffix(".out").read_text().splitlines()
            results.append([json.loads(line) for line in lines if line.strip()])
            if proc.returncode != 0:
                failures.append(f"rank {config.rank} exit {proc.returncode}: "
                                f"{path.with_suffix('.err').read_text()[-2000:]}")
        if failures and check:
            raise RuntimeError("\n".join(failures))
        return results


def hold_ranks(procs: list[subprocess.Popen], first_out: Path, iteration: int, seconds: float,
               deadline: float) -> None:
    """Hold every rank once the first one's events (`first_out`) report `iteration`, release them `seconds`
    later, then close their stdin."""
    def send(held: bool) -> None:
        for proc in procs:
            if proc.poll() is None and proc.stdin is not None:
                with contextlib.suppress(OSError):  # it just exited: its events say why
                    proc.stdin.write(hold_command(held, "run_local"))
                    proc.stdin.flush()

    def reported() -> bool:
        for line in first_out.read_text().splitlines():
            event = json.loads(line) if line.strip().endswith("}") else {}
            if event.get("event") == "iteration" and event.get("iteration", 0) >= iteration:
                return True
        return False

    while time.monotonic() < deadline and not reported() and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    send(True)
    time.sleep(seconds)
    send(False)
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
