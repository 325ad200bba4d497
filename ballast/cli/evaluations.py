"""`ballast evaluations JOB`: a job's validation losses beside its training loss at the same iteration, from the
store's typed List RPCs (a tenant sees its own jobs, as `ballast watch` does)."""

from __future__ import annotations

import argparse
import bisect
import json

import grpc
from rich.console import Console
from rich.table import Table

from ballast.client import Client
from ballast.config import Settings
from ballast.v1 import job_pb2
from ballast.windows import first_iteration

console = Console()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true", help="one JSON object per evaluation")


def rows(evaluations: list[job_pb2.Evaluation], metrics: list[job_pb2.IterationMetric]) -> list[dict]:
    """Each evaluation with the training loss of the iteration it followed (metrics number iterations from 0)."""
    ends = sorted((m.iteration, first_iteration(m), m.loss) for m in metrics if m.has_loss)
    train = {}  # iterations done -> the loss of the row covering the last of them (a window's mean)
    for e in evaluations:
        at = bisect.bisect_left(ends, (e.iteration - 1, -1, float("-inf")))
        if at < len(ends) and ends[at][1] <= e.iteration - 1:
            train[e.iteration] = ends[at][2]
    return [{"iteration": e.iteration, "validation_loss": e.loss, "perplexity": e.perplexity or None,
             "training_loss": train.get(e.iteration), "eval_s": e.eval_s, "samples": e.samples} for e in evaluations]


def run(settings: Settings, args: argparse.Namespace) -> int:
    with Client.of(settings, ("store",)) as client:
        try:
            found, metrics = client.evaluations(args.job_id), client.iteration_metrics(args.job_id)
        except grpc.RpcError as exc:
            console.print(f"[red]error[/red] {exc.code().name}: {exc.details()}")
            return 1
    table = rows(found, metrics)
    if args.json:
        for row in table:
            print(json.dumps(row))
        return 0
    if not table:
        console.print(f"job {args.job_id} has no evaluations: submit with --eval-every N (and validation data)")
        return 0
    out = Table("iteration", "validation loss", "perplexity", "training loss", "eval s", "samples",
                title=f"job {args.job_id}: evaluations")
    for r in table:
        out.add_row(str(r["iteration"]), f"{r['validation_loss']:.4f}",
                    f"{r['perplexity']:.3f}" if r["perplexity"] else "-",
                    f"{r['training_loss']:.4f}" if r["training_loss"] is not None else "-", f"{r['eval_s']:.3f}",
                    str(r["samples"]))
    console.print(out)
    return 0
