"""Background checkpoints (issue 16, Varuna §4.5): how long a checkpointing boundary stalls training.

Two local CPU workers (2 stages x 1 replica, gloo, one intra-op thread each, steady allocator; `--stages 1`: one
worker, leaving a core free for the write as a GPU host's CPU is) train a GPT from
the zoo (hidden 384, 4 blocks, vocabulary 4096: about 10 M parameters, ~120 MB of per-layer files with Adam's
two moments) for 25 iterations with a per-layer checkpoint every 4, once writing synchronously at the boundary
and once in the background (WorkerConfig.checkpoint_background).

Iteration wall time = interval between consecutive "iteration" events of the last stage ("time" fields): the
interval ending at event K + 1 holds boundary K's checkpoint work. Reported per mode: the median interval after
a checkpointing boundary, the median of the others, their ratio, and the stall rank 0 reports (checkpoint_s:
the host copy, plus the write when synchronous) and its background write time (write_s). The write of the
checkpoint taken at boundary K overlaps iteration K + 1, which is reported only once the checkpoint is complete
(so a failure trains at most the interval again): where the CPU has no core to spare (two workers on two cores)
the write cannot overlap anything and K + 1 waits for it. Target: in the background a checkpointing iteration
takes <= 1.25x an ordinary one.

    .venv/bin/python benchmarks/checkpoint_stall.py [--iterations 25] [--every 4] [--record]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

from google.protobuf.json_format import MessageToDict, ParseDict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ballast.v1 import model_pb2  # noqa: E402
from services.executor.train.config import WorkerConfig  # noqa: E402
from services.executor.train.launch import plan_configs, run_local  # noqa: E402
from services.runtime.allocator import STEADY_ALLOCATOR  # noqa: E402

TARGET = 1.25
SPEC = ParseDict({"name": "gpt-ckpt", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 4, "hidden_size": 384, "num_heads": 6, "vocab_size": 4096, "seq_length": 64}},
    model_pb2.ModelSpec())


def run(background: bool, iterations: int, every: int, root: Path, stages: int) -> dict[str, float]:
    config = WorkerConfig(
        job_id="bench-ckpt", model=MessageToDict(SPEC, preserving_proto_field_name=True), stage_bounds=[[0, 6]],
        num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=2,
        num_micro_batches=4, iterations=iterations, init_method="", seed=1, timeout_s=120,
        checkpoint_dir=str(root), checkpoint_every=every, checkpoint_background=background)
    bounds = [[0, 3], [3, 6]] if stages == 2 else [[0, 6]]
    events = run_local(plan_configs(config, bounds, 1), env=STEADY_ALLOCATOR, timeout_s=600)
    last = [e for e in events[-1] if e["event"] == "iteration"]
    intervals = {e["iteration"]: e["time"] - p["time"] for p, e in zip(last, last[1:], strict=False)}
    after = [s for k, s in intervals.items() if (k - 1) % every == 0 and k > 2]  # boundary k-1 checkpointed
    ordinary = [s for k, s in intervals.items() if (k - 1) % every != 0 and k > 2]
    vouched = [e for e in events[0] if e["event"] == "checkpoint" and e["iteration"] < iterations]
    return {"after": statistics.median(after), "ordinary": statistics.median(ordinary),
            "stall": statistics.median(e["checkpoint_s"] for e in vouched),
            "write": statistics.median(e["write_s"] for e in vouched),
            "mb": sum(x["bytes"] for x in vouched[0]["every_layer"]) / 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=25)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--stages", type=int, choices=(1, 2), default=2,
                        help="1: one worker, so a core is free for the write (as on a GPU host)")
    parser.add_argument("--record", action="store_true", help="append the rows to BENCHMARKS.md")
    args = parser.parse_args()
    rows, ratio = [], {}
    for background in (False, True):
        with tempfile.TemporaryDirectory(prefix="ballast-ckpt-") as tmp:
            r = run(background, args.iterations, args.every, Path(tmp), args.stages)
        mode = ("background" if background else "synchronous") + f", {args.stages} worker(s) on 2 cores"
        ratio[background] = r["after"] / r["ordinary"]
        rows.append(f"| {date.today()} | {mode} | {r['mb']:.0f} MB | {r['ordinary'] * 1e3:.0f} ms | "
                    f"{r['after'] * 1e3:.0f} ms | {ratio[background]:.2f}x | {r['stall'] * 1e3:.0f} ms | "
                    f"{r['write'] * 1e3:.0f} ms |")
        print(rows[-1], flush=True)
    met = ratio[True] <= TARGET
    print(f"background checkpointing iteration {ratio[True]:.2f}x an ordinary one (target <= {TARGET}x): "
          f"{'met' if met else 'MISSED'}; synchronous {ratio[False]:.2f}x")
    if args.record:
        path = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
        text = path.read_text()
        marker = "| date | mode | checkpoint | ordinary iteration | checkpointing iteration | ratio | stall | write |"
        if marker not in text:
            text += (f"\n## Background checkpoints (issue 16)\n\n`.venv/bin/python benchmarks/checkpoint_stall.py "
                     f"--record` on {platform.processor() or platform.machine()}, 2 stages x 1 replica on CPU.\n\n"
                     f"{marker}\n| --- | --- | --- | --- | --- | --- | --- | --- |\n")
        path.write_text(text.rstrip("\n") + "\n" + "\n".join(rows) + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
