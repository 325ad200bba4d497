"""`ballast fidelity`: predicted against measured iteration time and peak memory over the stored runs.

Thin: the rows come through the store's typed List RPCs (so a tenant sees its own jobs and the platform admin
every job, as `ballast queue` and `watch` do), the numbers from services/planner/plans/fidelity.py, which the
user guide's `fidelity` SQL (docs/user-guide.md) reproduces.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ballast.client import Client, pages
from ballast.config import Settings
from ballast.v1 import common_pb2, store_pb2

if TYPE_CHECKING:  # the module itself is imported on use: it brings the cost model, which `ballast -h` needs not
    from services.planner.plans.fidelity import Report, Run

console = Console()
err = Console(stderr=True)
MiB = float(1 << 20)


def nothing(model: str | None) -> str:
    """Why there is no report, and the fix."""
    which = f" of model {model!r}" if model else ""
    return f"no measured iterations{which} yet: run a job first, e.g. `ballast demo`"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="NAME", help="only this stored model (as `ballast sql` shows "
                                                                 "models.name)")
    p.add_argument("--json", action="store_true", help="print the groups, the runs and the errors as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH.png",
                   help="also write predicted against measured (one point per plan version) as a PNG")


def fetch_runs(client: Client, model: str | None) -> list[Run]:
    """Every run of the caller's jobs (of `model` only, when given) from the store."""
    from services.planner.plans.fidelity import runs_of_job

    big = common_pb2.PageRequest(page_size=1000)
    models = {m.id: m.spec.name for reply in pages(client.store.ListModels, store_pb2.ListModelsRequest(
        name=model or "", page=big)) for m in reply.models}
    hosts = {h.id: h for reply in pages(client.store.ListHosts, store_pb2.ListHostsRequest(page=big))
             for h in reply.hosts}
    runs: list[Run] = []
    for model_id, name in sorted(models.items()):
        for reply in pages(client.store.ListJobs, store_pb2.ListJobsRequest(model_id=model_id, page=big)):
            for job in reply.jobs:
                metrics = client.iteration_metrics(job.id)
                if not metrics:
                    continue
                plans = [p for r in pages(client.store.ListPlans, store_pb2.ListPlansRequest(job_id=job.id, page=big))
                         for p in r.plans]
                leased = {lease.device.host_id for r in pages(client.store.ListLeases, store_pb2.ListLeasesRequest(
                    job_id=job.id, page=big)) for lease in r.leases}
                runs += runs_of_job(job.id, name, plans, metrics, [hosts[h] for h in sorted(leased) if h in hosts])
    return runs


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def table(rep: Report) -> Table:
    t = Table("model", "layout", "host class", caption="layout: stages x replicas, mN: N micro-batches; calib.: runs "
              "planned with a calibration; error: (predicted - measured) / measured, over the steady iterations")
    for name in ("runs", "calib.", "iters", "predicted s", "measured s", "error", "peak pred MiB", "peak meas MiB",
                 "mem error"):
        t.add_column(name, justify="right")
    for g in rep.groups:
        t.add_row(escape(g.model), g.layout, escape(g.host_class), str(g.runs), str(g.calibrated), str(g.iterations),
                  f"{g.predicted_s:.4f}", f"{g.measured_s:.4f}", _pct(g.error), _mib(g.predicted_peak_bytes),
                  _mib(g.measured_peak_bytes), _pct(g.memory_error))
    return t


def summary(rep: Report) -> str:
    memory = "" if rep.memory_mae is None else f", peak memory {rep.memory_mae:.1%}"
    return f"mean absolute error over {len(rep.groups)} group(s): iteration time {rep.mae:.1%}{memory}"


def _percent(x: float | None) -> float | None:
    return None if x is None else 100 * x


def as_json(rep: Report, runs: list[Run]) -> dict[str, Any]:
    """The user guide SQL's columns (unrounded), the runs behind them, and the mean absolute errors in percent."""
    groups = [{"model": g.model, "stages": g.stages, "replicas": g.replicas, "micro_batches": g.micro_batches,
               "host_class": g.host_class, "runs": g.runs, "calibrated": g.calibrated, "iterations": g.iterations,
               "predicted_s": g.predicted_s, "measured_s": g.measured_s, "error_pct": 100 * g.error,
               "predicted_peak_mib": None if g.predicted_peak_bytes is None else g.predicted_peak_bytes / MiB,
               "measured_peak_mib": None if g.measured_peak_bytes is None else g.measured_peak_bytes / MiB,
               "memory_error_pct": _percent(g.memory_error)} for g in rep.groups]
    plan_versions = [{"job_id": r.job_id, "plan_version": r.plan_version, "model": r.model, "stages": r.stages,
                      "replicas": r.replicas, "micro_batches": r.micro_batches, "host_class": r.host_class,
                      "calibrated": r.calibrated, "iterations": r.iterations, "predicted_s": r.predicted_s,
                      "measured_s": r.measured_s, "error_pct": 100 * r.error} for r in runs]
    return {"groups": groups, "runs": plan_versions, "mae_pct": 100 * rep.mae,
            "memory_mae_pct": _percent(rep.memory_mae)}


def plot(runs: list[Run], rep: Report, path: Path) -> None:
    """Measured (x) against predicted (y) per plan version, coloured by group, with y = x and a ±10% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    keys = [(g.model, g.stages, g.replicas, g.micro_batches, g.host_class) for g in rep.groups]
    for key, g in zip(keys, rep.groups, strict=True):
        mine = [r for r in runs if (r.model, r.stages, r.replicas, r.micro_batches, r.host_class) == key]
        ax.scatter([r.measured_s for r in mine], [r.predicted_s for r in mine], s=24,
                   label=f"{g.model} {g.layout} {g.host_class} ({g.error:+.0%})")
    values = [v for r in runs for v in (r.measured_s, r.predicted_s)]
    low, high = min(values) * 0.8, max(values) * 1.2
    line = [low, high]
    ax.plot(line, line, color="black", linewidth=1, label="predicted = measured")
    ax.fill_between(line, [v * 0.9 for v in line], [v * 1.1 for v in line], color="grey", alpha=0.2,
                    label="±10%")
    if high / low > 20:  # times from ms to s: equal ratios at equal distances
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("measured iteration time (s, mean of steady iterations)")
    ax.set_ylabel("predicted iteration time (s)")
    ax.set_title(f"Prediction fidelity: {len(runs)} plan version(s), MAE {rep.mae:.1%} over groups")
    ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(settings: Settings, args: argparse.Namespace) -> int:
    from services.planner.plans.fidelity import report

    with Client.of(settings, ("store",)) as client:
        try:
            runs = fetch_runs(client, args.model)
        except grpc.RpcError as exc:
            err.print(f"[red]error[/red] {exc.code().name}: {escape(exc.details() or '')}")
            return 1
    if not runs:
        err.print(f"[red]error[/red] {escape(nothing(args.model))}")
        return 1
    rep = report(runs)
    if args.json:
        print(json.dumps(as_json(rep, runs)))
    else:
        console.print(table(rep))
        console.print(summary(rep))
    if args.plot:
        try:
            plot(runs, rep, args.plot)
        except OSError as exc:
            err.print(f"[red]error[/red] cannot write {escape(str(args.plot))}: {escape(str(exc))}")
            return 1
        (err if args.json else console).print(f"plot: {escape(str(args.plot))}")
    return 0
