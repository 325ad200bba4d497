"""How long the Galvatron-BMW search takes, per layer count L and device count N (single process).

Model: an analytical GPT profile (services.profiler.projection.analytical_profile) with L transformer blocks
plus embedding and head, hidden 4096, 32 heads, sequence 2048, vocabulary 50257, fp16 on A100 80 GB.
Fleets: 8 and 16 devices of examples/fleet-2x8xA100.yaml (NVLink 3 in a node, InfiniBand HDR between
nodes), 64 devices on a synthetic 8 x 8 A100 fleet with the same links. Search options are the defaults
(printed below): the throughput sweep over global batches 1, 2, 4, ..., 1024, 1F1B, DP/SDP/TP with and
without checkpointing, memory granularity 64 MiB, the device's memory as the budget. Each cell is the
best of --runs searches, each on a fresh CostContext (nothing cached between runs), CPU time. The
search plans configurations in decreasing order of a throughput bound and stops once none left can enter
the top_k; the "every configuration" column plans all of them (one run), which is what the bound saves.

Targets (issue): 48 layers on 8 devices <= 1 s, 48 layers on 64 devices <= 10 s. Exits 1 if one is missed.
Run from the repository root: `.venv/bin/python benchmarks/planner.py [--runs N] [--profile L N]`.
"""

from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from google.protobuf.json_format import ParseDict  # noqa: E402

from ballast.v1 import model_pb2  # noqa: E402
from services.planner.cost import CostContext, from_profile  # noqa: E402
from services.planner.search.galvatron import Planner  # noqa: E402
from services.planner.search.problem import PricedPlan, SearchOptions  # noqa: E402
from services.profiler.projection import analytical_profile  # noqa: E402
from services.specs.fleet import fleet_from_dict, load_fleet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (24, 48, 96)
DEVICES = (8, 16, 64)
TARGETS_S = {(48, 8): 1.0, (48, 64): 10.0}


def view(layers: int):
    spec = {"name": f"gpt-{layers}", "family": "MODEL_FAMILY_GPT", "dtype": "DTYPE_FP16",
            "transformer": {"num_layers": layers, "hidden_size": 4096, "num_heads": 32, "vocab_size": 50257,
                            "seq_length": 2048}}
    return from_profile(analytical_profile(ParseDict(spec, model_pb2.ModelSpec()), "nvidia-a100-80gb"))


def fleet(devices: int):
    if devices <= 16:
        return load_fleet(ROOT / "examples" / "fleet-2x8xA100.yaml")
    return fleet_from_dict({"name": "8x8-a100-80gb", "device": "nvidia-a100-80gb", "nodes": devices // 8,
                            "devices_per_node": 8, "intra_node": "nvlink3", "inter_node": "ib-hdr-200"})


def search(layers: int, devices: int, runs: int, every: bool = False) -> tuple[float, Planner, PricedPlan | None]:
    """Best CPU time of `runs` searches; `every` plans every configuration (top_k so large that the throughput
    bound never lets the sweep stop early), to show what the bound saves."""
    v, f = view(layers), fleet(devices)
    options = SearchOptions(memory_budget_bytes=f.device.memory_bytes, top_k=10**9 if every else 5)
    best, planner, plans = float("inf"), None, []
    for _ in range(runs):
        start = time.process_time()
        planner = Planner(CostContext(v, f), devices, options)
        plans = planner.run()
        best = min(best, time.process_time() - start)
    return best, planner, plans[0] if plans else None  # type: ignore[return-value]


def describe(plan: PricedPlan | None) -> str:
    if plan is None:
        return "nothing fits"
    kinds = sorted({st.describe() for st in plan.strategies})
    shown = ", ".join(kinds[:3]) + (f" +{len(kinds) - 3}" if len(kinds) > 3 else "")
    return (f"B={plan.global_batch_size} P={len(plan.stage_bounds)} m={plan.micro_batch_size}"
            f" nm={plan.num_micro_batches}: {plan.throughput:.1f} samples/s ({shown})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="searches per cell (best CPU time reported)")
    parser.add_argument("--profile", type=int, nargs=2, metavar=("L", "N"), help="cProfile one cell and stop")
    args = parser.parse_args()
    if args.profile:
        layers, devices = args.profile
        cProfile.runctx("search(layers, devices, 1)", globals(), locals(), "/tmp/planner.prof")
        pstats.Stats("/tmp/planner.prof").sort_stats("cumulative").print_stats(40)
        return 0
    defaults = SearchOptions(memory_budget_bytes=0)
    print(f"Python {platform.python_version()}, {platform.machine()}; best of {args.runs} runs, CPU seconds.")
    print(f"Batch ladder 1..{defaults.max_global_batch_size} (powers of two), memory granularity "
          f"{defaults.memory_granularity_bytes >> 20} MiB, schedules {[s.value for s in defaults.schedules]}, "
          f"dims {defaults.dims}, checkpoint {defaults.checkpoint}, top_k {defaults.top_k}.\n")
    print("| L | N | search (s) | configurations planned / skipped by the bound | stage DPs | partitions | priced "
          "| every configuration (s, configurations) | best plan |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    times = {}
    for layers in LAYERS:
        for devices in DEVICES:
            seconds, planner, best = search(layers, devices, args.runs)
            times[(layers, devices)] = seconds
            st = planner.stats
            all_s, all_planner, all_best = search(layers, devices, 1, every=True)
            same = "" if best is None or all_best is None or all_best.throughput <= best.throughput * (1 + 1e-9) \
                else " (better plan found!)"
            print(f"| {layers} | {devices} | {seconds:.2f} | {st.configurations} / {st.skipped_bound} | "
                  f"{st.stage_dps} | {st.partitions} | {st.priced} | {all_s:.2f}, "
                  f"{all_planner.stats.configurations}{same} | {describe(best)} |", flush=True)
    print()
    failed = False
    for (layers, devices), target in TARGETS_S.items():
        ok = times[(layers, devices)] <= target
        failed |= not ok
        print(f"{layers} layers on {devices} devices: {times[(layers, devices)]:.2f} s "
              f"(target {target:.0f} s): {'met' if ok else 'MISSED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
