"""Their data and their weights (issue 40): what reading the user's data, evaluating and exporting cost.

1. Data loading is never the bottleneck: gpt-tiny (examples/gpt-tiny.yaml) on a token file made from this
   repository's README (`ballast data tokenize`, bytes as tokens) as 2 pipeline stages x 2 replicas on real gloo
   workers: each rank's `data_s` (drawing its samples: the memory-mapped windows, the epoch's permutation) as a
   share of its iteration time, against the same job on synthetic samples.
2. Evaluation: `eval_every`, `eval_batches` validation batches forward only, its seconds against an iteration's.
3. Weights out: the final checkpoint consolidated into model.safetensors (the export worker's work), its seconds
   and bytes, and whether every layer's tensors hash as the ranks held them (`layer_sha256`).

    .venv/bin/python benchmarks/data_weights.py [--iterations 40] [--share 0.05]

Exit status 0 when every rank's median data share is within --share.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from google.protobuf.json_format import MessageToDict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from ballast.cli.data import tokenize  # noqa: E402
from services.executor.train import checkpoint as ckpt  # noqa: E402
from services.executor.train import weights  # noqa: E402
from services.executor.train.config import WorkerConfig  # noqa: E402
from services.executor.train.launch import plan_configs, run_local  # noqa: E402
from services.runtime.allocator import STEADY_ALLOCATOR  # noqa: E402
from services.specs.model import load_model_spec  # noqa: E402
from services.specs.user_inputs import UserInputs  # noqa: E402
from services.zoo import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = [[0, 3], [3, 6]]


def run(config: WorkerConfig) -> list[list[dict]]:
    return run_local(plan_configs(config, BOUNDS, 2), env=STEADY_ALLOCATOR, timeout_s=900)


def shares(events: list[list[dict]], skip: int = 3) -> list[float]:
    """Each rank's median data_s / iteration_s over its iterations after the first `skip` (warm-up)."""
    return [statistics.median(e["data_s"] / e["iteration_s"] for e in rank if e["event"] == "iteration"
                              and e["iteration"] > skip) for rank in events]


def iteration_s(events: list[list[dict]], skip: int = 3) -> float:
    return statistics.median(e["iteration_s"] for e in events[0] if e["event"] == "iteration" and e["iteration"] > skip)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--share", type=float, default=0.05)
    args = parser.parse_args()
    spec = load_model_spec(str(ROOT / "examples" / "gpt-tiny.yaml"))
    with tempfile.TemporaryDirectory(prefix="ballast-data-bench-") as tmp:
        root = Path(tmp)
        made = tokenize(ROOT / "README.md", root / "readme", None, 0.1)
        data = {"tokens": {"path": str(made["train"]), "validation_path": str(made["validation"])}}
        base = WorkerConfig(job_id="job-data-bench", model=MessageToDict(spec, preserving_proto_field_name=True),
                            stage_bounds=BOUNDS, num_replicas=2, stage_index=0, replica_index=0, rank=0, world_size=4,
                            micro_batch_size=2, num_micro_batches=2, iterations=args.iterations,
                            init_method="tcp://127.0.0.1:1", optimizer={"name": "adam", "learning_rate": 1e-3},
                            seed=0, timeout_s=300, user_inputs=UserInputs.of(data_roots=[str(root)]))
        print(f"machine: {os.cpu_count()} CPUs; gpt-tiny as 2 stages x 2 replicas, global batch 8, "
              f"{args.iterations} iterations; token file: {made['tokens']} tokens of README.md")
        synthetic = run(base)
        on_file = run(replace(base, data=data, eval_every=10, eval_batches=4, checkpoint_dir=str(root / "ckpt"),
                              final_checkpoint=True))
        file_shares, synthetic_shares = shares(on_file), shares(synthetic)
        print("1. data_s / iteration_s, median per rank (token file):  "
              + "  ".join(f"{s:.2%}" for s in file_shares))
        print("   data_s / iteration_s, median per rank (synthetic):   "
              + "  ".join(f"{s:.2%}" for s in synthetic_shares))
        print(f"   iteration time, median: token file {iteration_s(on_file) * 1e3:.1f} ms, synthetic "
              f"{iteration_s(synthetic) * 1e3:.1f} ms")
        evaluations = [e for rank in on_file for e in rank if e["event"] == "evaluation"]
        print(f"2. {len(evaluations)} evaluations of 4 batches x 8 samples: eval_s median "
              f"{statistics.median(e['eval_s'] for e in evaluations) * 1e3:.1f} ms (an iteration: "
              f"{iteration_s(on_file) * 1e3:.1f} ms); last validation loss {evaluations[-1]['loss']:.4f}")
        started = time.perf_counter()
        files, _ = weights.export(ckpt.checkpoint_path(root / "ckpt", args.iterations), spec, "safetensors",
                                  root / "export", UserInputs(), {})
        export_s = time.perf_counter() - started
        state = load_file(str(root / "export" / weights.WEIGHTS))
        model = build_model(spec, device="meta")
        dec = model.decompose()
        names = weights.layer_names(model, dec, spec)
        held = {k: v for rank in on_file for e in rank if e["event"] == "done" for k, v in e["layer_sha256"].items()}
        same = sum(weights.digest([(f"param/{n}", state[names[(layer.index, n)]])
                                   for n, _ in layer.module.named_parameters()]) == held[str(layer.index)]
                   for layer in dec.layers)
        size = sum(f["bytes"] for f in files if f["name"] == weights.WEIGHTS)
        print(f"3. export: {size / 2**20:.2f} MiB of safetensors in {export_s:.2f} s; {same}/{len(dec.layers)} layers "
              "bit-equal to the ranks' final weights")
    ok = max(file_shares) <= args.share and same == len(dec.layers)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
