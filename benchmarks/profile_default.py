"""Bounded profiling (issue 17, item 5): the default `ballast profile examples/gpt-tiny.yaml --device cpu` <= 60 s.

Before, the default sweep went up to micro-batch 1024 (> 7 minutes, 3 GB RSS here). Now it doubles from 1 until
time per sample stops improving (Varuna §4.4) or its 30 s budget (services/profiler/bounded.py). Measured as a new
user runs it: `ballast up` on a fresh data directory (free ports of its own), then the command, timed from start to
exit. Peak RSS of the profiling worker (VmHWM, polled every 50 ms in the processes under the profiler service) and
of the CLI (rusage). Run 1 is a user's first call; later runs add --refresh (the cache would answer them).

`--check M ...` also compares the planner's cost view (services/planner/cost/profile_view.py) of the stored profile
at larger micro-batches with direct measurements (the fastest of 2 `measure_layer` runs of each distinct layer,
5 repeats, 1 thread): the extrapolation the planner now relies on above the sizes the sweep stopped at.

Run: .venv/bin/python benchmarks/profile_default.py [--runs 3] [--check 128 256]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ballast.cli.control_plane import State  # noqa: E402
from ballast.config import load_settings  # noqa: E402
from benchmarks.startup import plane_env  # noqa: E402

TARGET_S = 60.0
SPEC = "examples/gpt-tiny.yaml"
BALLAST = [sys.executable, "-m", "ballast"]


def children(pid: int) -> list[int]:
    """Every process under `pid` (from /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


class WorkerPeak(threading.Thread):
    """Largest VmHWM (peak resident set) of any profiling worker under the profiler service while it runs."""

    def __init__(self, profiler_pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_kib, self.done = profiler_pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            for p in children(self.pid):
                try:
                    if b"services.profiler.worker" not in Path(f"/proc/{p}/cmdline").read_bytes():
                        continue
                    status = Path(f"/proc/{p}/status").read_text()
                except OSError:
                    continue
                found = re.search(r"VmHWM:\s+(\d+) kB", status)
                self.peak_kib = max(self.peak_kib, int(found.group(1)) if found else 0)


def profile_once(env: dict[str, str], extra: list[str]) -> dict:
    command = [*BALLAST, "profile", SPEC, "--device", "cpu", *extra]
    state = State.load(load_settings(env))
    peak = WorkerPeak(next(c.pid for c in state.children if c.name == "profiler"))
    peak.start()
    rss = Path(tempfile.mkstemp(prefix="ballast-cli-rss-")[1])
    timed = ["/usr/bin/time", "-f", "%M", "-o", str(rss), *command] if Path("/usr/bin/time").exists() else command
    start = time.perf_counter()
    proc = subprocess.Popen(timed, env={**env, "COLUMNS": "200"}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    peak.done.set()
    peak.join()
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(command)}` failed:\n{out}\n{err}")
    cli_kib = int(rss.read_text().split()[-1]) if rss.read_text().strip() else 0
    rss.unlink()
    swept = next((line.split(" swept ", 1)[1].split("  ", 2)[-1] for line in err.splitlines() if " swept " in line), "")
    sizes = re.search(r"measured sizes (\[[\d, ]*\])", out)
    return {"wall_s": wall, "worker_peak_mib": peak.peak_kib / 1024, "cli_peak_mib": cli_kib / 1024,
            "sizes": sizes.group(1) if sizes else "?",
            "swept": swept, "progress_lines": sum(line.startswith("profile ") for line in err.splitlines())}


def check_extrapolation(env: dict[str, str], sizes: list[int]) -> None:
    """The planner's view of the stored profile against direct measurements at `sizes`."""
    import torch
    from google.protobuf.json_format import ParseDict

    from ballast.v1 import profile_pb2
    from services.planner.cost.profile_view import from_profile
    from services.profiler.measure import iter_layer_args, measure_layer
    from services.specs.model import load_model_spec
    from services.zoo import build_model, example_input

    got = subprocess.run([*BALLAST, "profile", SPEC, "--device", "cpu", "--json"], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)  # the cached profile of the last run
    profile = ParseDict(json.loads(got.stdout), profile_pb2.Profile(), ignore_unknown_fields=True)
    view = from_profile(profile)
    spec = load_model_spec(ROOT / SPEC)
    decomposition = build_model(spec, seed=0).decompose()
    torch.set_num_threads(1)
    reps = sorted({layer.measured_as for layer in profile.layers})
    print(f"\nextrapolation: planner's view of {profile.id} (measured {list(profile.measured_micro_batch_sizes)}) "
          "vs direct measure_layer, forward+backward")
    for m in sizes:
        direct = {}
        for i, args in iter_layer_args(decomposition, example_input(spec, m)):
            if i in reps:
                runs = [measure_layer(decomposition, i, args, repeats=5, warmup=2, micro_batch_size=m)
                        for _ in range(2)]
                direct[i] = min(r.forward_s + r.backward_s for r in runs)
        parts = []
        for i in reps:
            planned = view.point(i, m).forward_s + view.point(i, m).backward_s
            parts.append(f"{profile.layers[i].name} {direct[i] * 1e3:.1f} ms {planned / direct[i] - 1:+.1%}")
        whole = sum(direct[layer.measured_as] for layer in profile.layers)
        planned = sum(view.point(i, m).forward_s + view.point(i, m).backward_s for i in range(len(profile.layers)))
        print(f"  m={m}: model {whole * 1e3:.0f} ms, planner {planned / whole - 1:+.1%}; " + "; ".join(parts))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--check", type=int, nargs="*", default=[], help="micro-batch sizes to check extrapolation at")
    args = ap.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="ballast-bench-profile-"))
    env = plane_env(data_dir)
    up = subprocess.run([*BALLAST, "up"], env=env, cwd=ROOT, capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(f"ballast up failed:\n{up.stdout}\n{up.stderr}")
    results = []
    try:
        for run in range(args.runs):
            results.append(profile_once(env, [] if run == 0 else ["--refresh"]))
            r = results[-1]
            print(f"run {run + 1}{' (--refresh)' if run else ''}: {r['wall_s']:.1f} s wall, peak RSS worker "
                  f"{r['worker_peak_mib']:.0f} MiB, CLI {r['cli_peak_mib']:.0f} MiB; measured {r['sizes']}, "
                  f"{r['progress_lines']} progress lines; "
                  f"{r['swept']}", flush=True)
        if args.check:
            check_extrapolation(env, args.check)
    finally:
        subprocess.run([*BALLAST, "down"], env=env, cwd=ROOT, capture_output=True, text=True)
    worst = max(r["wall_s"] for r in results)
    print(f"\n`ballast profile {SPEC} --device cpu` after `ballast up` (fresh data dir): worst of {len(results)} "
          f"{worst:.1f} s (target {TARGET_S:.0f} s: {'met' if worst <= TARGET_S else 'MISSED'}), worker peak RSS "
          f"max {max(r['worker_peak_mib'] for r in results):.0f} MiB")
    return 0 if worst <= TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
