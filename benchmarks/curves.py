"""How long one scaling curve takes: make_plan at a pinned global batch for every count 1, 2, 4, ..., 1,024.

A curve is what the elastic policy and `ballast fleet simulate --curves planner` price per (model, global
batch): one plan search per device count, each on the fleet `ballast fleet simulate` prices (A100 80 GB,
8 per node, NVLink 3 inside, InfiniBand HDR between nodes; cost.fleet_cut.cut_shape for counts that are not whole
nodes). Analytical profiles of the example zoo models, one process, CPU seconds, the planner's module caches
emptied before each curve.

Target (issue 44): a whole curve (1 ... 1,024 in powers of two) for one model <= 5 s. Prints every model's
time; exits 1 when none meets it.
Run from the repository root: `.venv/bin/python benchmarks/curves.py [--models m,m] [--batch B]`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.cli.fleet_simulate import DEFAULT_INTER_NODE, _profile  # noqa: E402
from services.planner.cost import layer as cost_layer  # noqa: E402
from services.planner.elastic.curves import planner_curve  # noqa: E402
from services.planner.search import problem  # noqa: E402
from services.specs import catalog  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("vit-huge-32", "bert-huge-32", "bert-huge-48", "t5-large-32", "swin-huge-32", "gpt3-15b")
KIND = "nvidia-a100-80gb"
TARGET_S = 5.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=1024, help="global batch of every curve (default 1024)")
    args = parser.parse_args()
    counts = [1 << i for i in range(11)]
    print("| model | global batch | curve (CPU s) | counts planned | samples/s at 1 / 8 / 64 / 1,024 |")
    print("| --- | --- | --- | --- | --- |")
    met = []
    for model in args.models.split(","):
        spec, profile = _profile(ROOT / "examples" / f"{model}.yaml", KIND)
        template = catalog.fleet(KIND, 8, 1, DEFAULT_INTER_NODE, dtype=spec.dtype or None)
        for cache in (cost_layer._fractions, problem.to_strategy):
            cache.cache_clear()
        start = time.process_time()
        curve = planner_curve(profile, template, args.batch, counts, model=model)
        seconds = time.process_time() - start
        met.append(seconds <= TARGET_S)
        rates = " / ".join(f"{curve.throughput.get(n, 0.0):.1f}" for n in (1, 8, 64, 1024))
        print(f"| {model} | {args.batch} | {seconds:.2f} | {len(curve.throughput)} of {len(counts)} | {rates} |",
              flush=True)
    print(f"\n{sum(met)} of {len(met)} curves within {TARGET_S:g} s")
    return 0 if any(met) else 1


if __name__ == "__main__":
    sys.exit(main())
