"""Run a whole plan as local worker processes on one host (tests, benchmarks, the embedded mode).

`plan_configs` expands one template into the per-rank WorkerConfigs of a stages x replicas plan;
`run_local` starts `python -m services.executor.train.worker` per rank and returns each rank's JSON events.
"""

from __future__ import annotations

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
from services.executor.train.dims import ParallelDims
from services.runtime.ports import free_port


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
    commands: dict[int, list[dict[str, Any]]] | None = None,
) -> list[list[dict[str, Any]]]:
    """Start every rank, wait for all (at most `timeout_s` in all), return each rank's events.

    `commands` maps a rank to command dicts written as JSON lines to its stdin at start (then stdin is closed;
    a rank without commands gets an empty stdin), so tests schedule plan changes through `not_before`.

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
                procs.append(subprocess.Popen(command, stdin=inp, stdout=out, stderr=err, env=env))
        deadline = time.monotonic() + timeout_s
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
