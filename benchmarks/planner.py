"""How long the Galvatron-BMW search takes, per layer count L and device count N (single process).

Model: an analytical GPT profile (services.profiler.projection.analytical_profile) with L transformer blocks
plus embedding and head, hidden 4096, 32 heads, sequence 2048, vocabulary 50257, fp16 on A100 80 GB.
Fleets: 8 and 16 devices of examples/fleet-2x8xA100.yaml (NVLink 3 in a node, InfiniBand HDR between
nodes), 64 and 1,024 devices on synthetic N/8 x 8 A100 fleets with the same links (benchmarks/planner_cases.py).
Search options are the defaults (printed below): the throughput sweep over global batches 1, 2, 4, ..., 1024,
1F1B, DP/SDP/TP (TP with sequence parallelism where no slower) with and without checkpointing, memory granularity
64 MiB, the device's memory as the budget. `--no-sp` searches Galvatron-BMW's space without sequence parallelism
(what the plans recorded for the plans-kept test were searched in).
"cold" is the first search in the process with the module-level caches emptied (the layout-change fractions
a 1,024-device search asks for by the thousand); "best" is the best of --runs searches after it, each on a
fresh CostContext, as a planner process answering its next request on that device count. CPU seconds. The
search plans configurations in decreasing order of a throughput bound and stops once none left can enter
the top_k; the "every configuration" column plans all of them (one run), which is what the bound saves.

Targets (issue 44): 96 layers on 1,024 devices <= 2 s, 48 layers on 64 devices <= 0.3 s, best of 3 (the cold
search is printed beside it); exits 1 if one is missed. `--record` writes the plans of every case
(benchmarks/planner_cases.py) that tests/planner/search/test_plans_kept.py holds the search to.
Run from the repository root: `.venv/bin/python benchmarks/planner.py [--runs N] [--profile L N] [--record]`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_cases as cases  # noqa: E402

from services.planner.cost import CostContext  # noqa: E402
from services.planner.cost import layer as cost_layer  # noqa: E402
from services.planner.search.galvatron import Planner  # noqa: E402
from services.planner.search.problem import PricedPlan  # noqa: E402

CELLS = [*[(layers, devices) for layers in cases.LAYERS for devices in cases.DEVICES], (96, 1024)]
TARGETS_S = {(48, 64): 0.3, (96, 1024): 2.0}
view, fleet = cases.view, cases.fleet


def cold() -> None:
    """Empty the module-level caches a planner process keeps between searches."""
    cost_layer._fractions.cache_clear()


def search(
    layers: int, devices: int, runs: int, every: bool = False, sequence: bool = True
) -> tuple[float, float, Planner, PricedPlan | None]:
    """(cold CPU time, best CPU time of `runs` searches after it, the last planner, its best plan); `every`
    plans every configuration (top_k so large that the throughput bound never lets the sweep stop early), to
    show what the bound saves."""
    v, f = view(layers), fleet(devices)
    options = cases.options(devices, sequence, top_k=10**9 if every else 5)
    times, planner, plans = [], None, []
    cold()
    for _ in range(1 + runs):
        start = time.process_time()
        planner = Planner(CostContext(v, f), devices, options)
        plans = planner.run()
        times.append(time.process_time() - start)
    return times[0], min(times[1:] or times), planner, plans[0] if plans else None  # type: ignore[return-value]


def describe(plan: PricedPlan | None) -> str:
    if plan is None:
        return "nothing fits"
    kinds = sorted({st.describe() for st in plan.strategies})
    shown = ", ".join(kinds[:3]) + (f" +{len(kinds) - 3}" if len(kinds) > 3 else "")
    return (f"B={plan.global_batch_size} P={len(plan.stage_bounds)} m={plan.micro_batch_size}"
            f" nm={plan.num_micro_batches}: {plan.throughput:.1f} samples/s ({shown})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="searches per cell after the cold one (best reported)")
    parser.add_argument("--profile", type=int, nargs=2, metavar=("L", "N"), help="cProfile one cell and stop")
    parser.add_argument("--record", action="store_true", help=f"write every case's plans to {cases.RECORD}")
    parser.add_argument("--skip-every", action="store_true", help="leave out the every-configuration column")
    parser.add_argument("--no-sp", action="store_true", help="search without sequence parallelism")
    args = parser.parse_args()
    if args.record:
        cases.RECORD.write_text(json.dumps(cases.record(), indent=1) + "\n")
        print(f"wrote {cases.RECORD}")
        return 0
    if args.profile:
        layers, devices = args.profile
        cProfile.runctx("search(layers, devices, 0)", globals(), locals(), "/tmp/planner.prof")
        pstats.Stats("/tmp/planner.prof").sort_stats("cumulative").print_stats(40)
        return 0
    defaults = cases.options(8, not args.no_sp)
    print(f"Python {platform.python_version()}, {platform.machine()}; cold and best of {args.runs} runs, CPU "
          "seconds.")
    print(f"Batch ladder 1..{defaults.max_global_batch_size} (powers of two), memory granularity "
          f"{defaults.memory_granularity_bytes >> 20} MiB, schedules {[s.value for s in defaults.schedules]}, "
          f"dims {defaults.dims}, checkpoint {defaults.checkpoint}, top_k {defaults.top_k}.\n")
    print("| L | N | search cold / best (s) | configurations planned / skipped by the bounds | stage DPs | "
          "partitions | priced | every configuration (s, configurations) | best plan |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    times = {}
    for layers, devices in CELLS:
        first, seconds, planner, best = search(layers, devices, args.runs, sequence=not args.no_sp)
        times[(layers, devices)] = (first, seconds)
        st = planner.stats
        every = "skipped"
        if not args.skip_every:
            _, all_s, all_planner, all_best = search(layers, devices, 0, every=True, sequence=not args.no_sp)
            same = "" if best is None or all_best is None or all_best.throughput <= best.throughput * (1 + 1e-9) \
                else " (better plan found!)"
            every = f"{all_s:.2f}, {all_planner.stats.configurations}{same}"
        print(f"| {layers} | {devices} | {first:.2f} / {seconds:.2f} | {st.configurations} / {st.skipped_bound} | "
              f"{st.stage_dps} | {st.partitions} | {st.priced} | {every} | {describe(best)} |", flush=True)
    print()
    failed = False
    for (layers, devices), target in TARGETS_S.items():
        first, seconds = times[(layers, devices)]
        ok = seconds <= target
        failed |= not ok
        print(f"{layers} layers on {devices} devices: {seconds:.2f} s, best of {args.runs} (cold {first:.2f} s; "
              f"target {target:g} s): {'met' if ok else 'MISSED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
