"""`ballast fleet simulate` and `ballast fleet trace`: the elastic-fleet simulator (issue 20) run locally.

No server: a trace is parsed against the model files under examples/, one scaling curve is priced per
(model, global batch), and every chosen policy replays the trace through services.planner.elastic. Nothing
is printed until every policy has finished, so a bad trace or a stalled replay never shows a partial result.
"""

from __future__ import annotations

import argparse
import csv
import io
import multiprocessing
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import cache
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape

from services.planner.elastic import (
    COLUMNS,
    DEFAULT_MORPH_COST_S,
    ELASTIC,
    FIFO,
    POLICIES,
    SYNTHETIC_SHAPES,
    PolicyResult,
    ScalingCurve,
    TraceError,
    TraceJob,
    generate_trace,
    parse_trace,
    planner_curve,
    simulate,
    synthetic_curve,
    write_trace,
)
from services.runtime.errors import BallastError, InvalidArgument
from services.specs import catalog

err = Console(stderr=True)
DEFAULT_KIND = "nvidia-a100-80gb"  # the catalog's A100, as in examples/fleet-2x8xA100.yaml
DEVICES_PER_NODE = 8  # the planner's fleets: one node up to 8 devices, whole 8-device nodes beyond
DEFAULT_INTER_NODE = "ib-hdr-200"  # catalog.fleet's default: a training cluster's fabric
CURVES = ("planner", "synthetic")
SPAWN_FROM = 4  # curves; fewer are priced in this process (starting workers costs about a second)
TABLE_COLUMNS = (
    "policy",
    "average_jct_s",
    "p99_jct_s",
    "makespan_s",
    "utilisation",
    "average_wait_s",
    "morphs",
    "worst_fairness",
)
CurveKey = tuple[str, int]


def policies(text: str) -> list[str]:
    """argparse type: a comma list of known policies, in the order given."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {unknown[0]!r}; choose from {','.join(POLICIES)}"
            if unknown
            else f"name at least one of {','.join(POLICIES)}"
        )
    return list(dict.fromkeys(names))


def add_arguments(actions: argparse._SubParsersAction) -> None:
    sim = actions.add_parser(
        "simulate",
        help="replay a job trace through fifo, backfill and elastic on a simulated fleet, locally (no server)",
    )
    sim.add_argument("trace", type=Path, metavar="TRACE.csv", help="job trace (format: docs/operator-guide.md)")
    sim.add_argument("--devices", type=int, required=True, help="devices in the simulated fleet")
    sim.add_argument("--device-kind", default=DEFAULT_KIND, help=f"catalog kind or alias (default {DEFAULT_KIND})")
    sim.add_argument(
        "--policy",
        dest="policies",
        type=policies,
        default=list(POLICIES),
        metavar="P[,P...]",
        help=f"policies to compare, in one run (default {','.join(POLICIES)})",
    )
    sim.add_argument(
        "--curves",
        choices=CURVES,
        default="planner",
        help="planner: the planner prices each device count (analytical profile on --device-kind); "
        "synthetic: Amdahl curves per model, as benchmarks/fleet_sim.py (fast)",
    )
    sim.add_argument(
        "--inter-node",
        default=DEFAULT_INTER_NODE,
        metavar="LINK",
        help=f"catalog link between nodes (default {DEFAULT_INTER_NODE}; a live plane's distinct hosts are priced on "
        "eth-10)",
    )
    sim.add_argument(
        "--morph-cost",
        type=float,
        default=DEFAULT_MORPH_COST_S,
        metavar="S",
        help=f"seconds a resize pauses a job (default {DEFAULT_MORPH_COST_S:g})",
    )
    sim.add_argument("--csv", type=Path, default=None, metavar="OUT.csv", help="also write the table as CSV")
    sim.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="OUT.png",
        help="PNG: JCT CDF and device utilisation over time, per policy",
    )
    sim.add_argument(
        "--workers",
        type=int,
        default=0,
        help=f"processes pricing planner curves (default: one per CPU from {SPAWN_FROM} curves on, "
        "at most one per curve)",
    )
    gen = actions.add_parser("trace", help="write a synthetic, seeded trace (Poisson arrivals, log-normal lengths)")
    gen.add_argument("out", type=Path, metavar="OUT.csv")
    gen.add_argument("--jobs", type=int, required=True)
    gen.add_argument("--seed", type=int, required=True)
    gen.add_argument("--devices", type=int, required=True, help="fleet size (requests are at most half of it)")
    gen.add_argument(
        "--models",
        default=",".join(SYNTHETIC_SHAPES),
        help="comma list of models under examples/ to draw from (default: %(default)s)",
    )
    gen.add_argument(
        "--mean-interarrival",
        type=float,
        default=180.0,
        metavar="S",
        help="mean seconds between submissions (default 180: 160 jobs in about eight hours)",
    )
    gen.add_argument("--median-samples", type=float, default=None, metavar="S",
                     help="draw each job's length in samples (log-normal, this median) and divide it by its batch "
                          "(default: 2,000 iterations median, whatever the batch)")
    gen.add_argument("--batches", default="64,128,256", metavar="B[,B...]",
                     help="global batch sizes to draw from (default %(default)s)")
    gen.add_argument("--sizes", default="", metavar="N[,N...]",
                     help="device requests to draw from, smaller likelier (default: powers of two up to half the "
                          "fleet); any count, whole nodes or not")


# --- models and curves ----------------------------------------------------------------------------------
def example_models() -> dict[str, Path]:
    """Model files under examples/ (of the working directory, else of this checkout) by every name a trace may
    use for them: the spec's `name`, the file name and its stem. Fleet and policy files are not models."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (base / "examples").is_dir():
            break
    else:
        return {}
    found: dict[str, Path] = {}
    for path in sorted((base / "examples").glob("*.yaml")):
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(data, dict) and "family" in data:
            for name in (str(data.get("name") or ""), path.name, path.stem):
                if name:
                    found.setdefault(name, path)
    return found


@cache
def _profile(spec_path: Path, kind: str):
    from services.profiler.projection import analytical_profile
    from services.specs.model import load_model_spec

    spec = load_model_spec(spec_path)
    return spec, analytical_profile(spec, kind, spec.dtype or None)


def _price(spec_path: Path, kind: str, model: str, global_batch_size: int, counts: tuple[int, ...],
           inter_node: str = DEFAULT_INTER_NODE) -> ScalingCurve:
    """One planner curve (a worker process's task; the profile is built once per model and process)."""
    spec, profile = _profile(spec_path, kind)
    template = catalog.fleet(kind, DEVICES_PER_NODE, 1, inter_node, dtype=spec.dtype or None)
    return planner_curve(profile, template, global_batch_size, counts, model=model)


def counts_for(jobs: Sequence[TraceJob]) -> tuple[int, ...]:
    """Device counts to price for jobs sharing a curve: powers of two up to their largest max, and every
    min and request (a curve serves any count at its best plan at or below it, so between priced counts
    the policies see steps)."""
    top = max(j.max_devices for j in jobs)
    asked = {n for j in jobs for n in (j.min_devices, j.requested_devices)}
    return tuple(sorted({1 << i for i in range(top.bit_length())} | asked))


def build_curves(
    trace: Sequence[TraceJob],
    devices: int,
    kind: str,
    source: str,
    models: Mapping[str, Path],
    workers: int = 0,
    inter_node: str = DEFAULT_INTER_NODE,
) -> dict[CurveKey, ScalingCurve]:
    """One curve per (model, global batch) of the trace, nodes of DEVICES_PER_NODE joined by `inter_node`."""
    keys: dict[CurveKey, list[TraceJob]] = {}
    for j in trace:
        keys.setdefault((j.model, j.global_batch_size), []).append(j)
    if source == "synthetic":
        return {(m, b): synthetic_curve(_canonical(models[m]), b, devices) for m, b in keys}
    tasks = sorted(keys, key=lambda k: (-max(counts_for(keys[k])), -k[1], k))  # the dearest first
    if not workers:
        workers = (os.cpu_count() or 1) if len(tasks) >= SPAWN_FROM else 1
    workers = min(workers, len(tasks))
    err.print(
        f"pricing {len(tasks)} scaling curve(s) with the planner on {kind} ({workers} process(es))...", soft_wrap=True
    )
    args = [(models[m], kind, m, b, counts_for(keys[(m, b)]), inter_node) for m, b in tasks]
    if workers <= 1:
        return {k: _price(*a) for k, a in zip(tasks, args, strict=True)}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_price, *a) for a in args]
        return {k: f.result() for k, f in zip(tasks, futures, strict=True)}


@cache
def _canonical(spec_path: Path) -> str:
    """The spec's own name: every alias of a model shares its curves."""
    return str(yaml.safe_load(spec_path.read_text()).get("name") or spec_path.stem)


def check_requests(trace: Sequence[TraceJob], text: str, curves: Mapping[CurveKey, ScalingCurve]) -> None:
    """A job whose plan fits none of the counts up to its request is a bad line of the trace."""
    lines = _lines(text)
    for j in trace:
        curve = curves[(j.model, j.global_batch_size)]
        if curve.rate(j.requested_devices) <= 0:
            fewest = f"the fewest it runs on is {curve.min_devices}" if curve.min_devices else "no count fits it"
            raise TraceError(
                lines[j.name],
                "requested_devices",
                f"{j.model} at global batch {j.global_batch_size} has no plan on {j.requested_devices} device(s); "
                f"{fewest}",
                "request (and allow) more devices, or a smaller model",
            )


def _lines(text: str) -> dict[str, int]:
    reader = csv.reader(io.StringIO(text))
    header = [h.strip() for h in next(reader, [])]
    at = header.index("name")
    return {row[at].strip(): reader.line_num for row in reader if len(row) > at}


# --- output ---------------------------------------------------------------------------------------------
def table(results: Mapping[str, PolicyResult]) -> str:
    rows = [
        f"{'policy':<9} {'avg JCT s':>10} {'p99 JCT s':>10} {'makespan s':>11} {'util':>6} {'avg wait s':>11} "
        f"{'morphs':>7} {'worst fairness':>15}"
    ]
    for name, r in results.items():
        rows.append(
            f"{name:<9} {r.average_jct_s:>10.0f} {r.p99_jct_s:>10.0f} {r.makespan_s:>11.0f} "
            f"{r.utilisation:>6.1%} {r.average_wait_s:>11.0f} {r.morphs:>7d} {r.worst_fairness:>15.2f}"
        )
    return "\n".join(rows)


def comparison(results: Mapping[str, PolicyResult]) -> str:
    """elastic's average JCT against the static policies, and its fairness per job against fifo's."""
    if ELASTIC not in results or len(results) < 2:
        return ""
    el = results[ELASTIC]
    parts = [
        f"{1 - el.average_jct_s / r.average_jct_s:.1%} below {name}" for name, r in results.items() if name != ELASTIC
    ]
    line = f"elastic average JCT {', '.join(parts)}"
    if FIFO in results:
        ratio = {n: el.fairness[n] / results[FIFO].fairness[n] for n in el.fairness}
        worst = max(ratio, key=ratio.__getitem__)
        line += f"; per job, fairness at most {ratio[worst]:.2f}x its fifo fairness ({worst})"
    return line


def write_csv(results: Mapping[str, PolicyResult], path: Path) -> None:
    """The table, one row per policy, unrounded (utilisation a fraction, times in seconds)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(TABLE_COLUMNS)
    for name, r in results.items():
        writer.writerow(
            [
                name,
                r.average_jct_s,
                r.p99_jct_s,
                r.makespan_s,
                r.utilisation,
                r.average_wait_s,
                r.morphs,
                r.worst_fairness,
            ]
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())


def plot(results: Mapping[str, PolicyResult], trace: Sequence[TraceJob], devices: int, path: Path) -> None:
    """Left: the CDF of job completion times per policy; right: the share of devices held over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(j.submit_time_s for j in trace)
    end = max(start + r.makespan_s for r in results.values())
    fig, (cdf, use) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        jct = sorted(r.jct_s.values())
        cdf.step(
            jct,
            [(i + 1) / len(jct) for i in range(len(jct))],
            where="post",
            label=f"{name} (average {r.average_jct_s:,.0f} s)",
        )
        edges, held = binned(r.utilisation_series, start, end, 200)
        use.stairs(
            [n / devices for n in held],
            [(t - start) / 3600 for t in edges],
            linewidth=1.5,
            label=f"{name} ({r.utilisation:.0%} over its makespan)",
        )
    cdf.set_xscale("log")
    cdf.set_xlabel("job completion time (s)")
    cdf.set_ylabel("fraction of jobs")
    cdf.set_title(f"JCT CDF, {len(trace)} jobs")
    use.set_xlabel("hours since the first submission")
    use.set_ylabel(f"devices held / {devices}")
    use.set_ylim(0, 1.05)
    width_s = (end - start) / 200
    per = f"{width_s / 60:.0f}-minute" if width_s >= 120 else f"{width_s:.0f}-second"
    use.set_title(f"device utilisation (mean over {per} bins)")
    for ax, corner in ((cdf, "upper left"), (use, "upper right")):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc=corner)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def binned(series: Sequence[tuple[float, int]], start: float, end: float, bins: int) -> tuple[list[float], list[float]]:
    """Bin edges and the time-weighted mean of a step series ((time, value from then on)) in each bin: a
    replay changes allocations every few seconds, too often to read raw."""
    width = (end - start) / bins if end > start else 1.0
    area = [0.0] * bins
    for (t, n), (until, _) in zip(series, [*series[1:], (end, 0)], strict=True):
        lo, hi, i = max(t, start), min(until, end), int((max(t, start) - start) // width)
        while lo < hi and i < bins:
            step = min(hi, start + (i + 1) * width)
            area[i] += n * (step - lo)
            lo, i = step, i + 1
    return [start + i * width for i in range(bins + 1)], [a / width for a in area]


# --- commands -------------------------------------------------------------------------------------------
def run_simulate(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        if args.devices < 1:
            raise InvalidArgument(f"{args.devices} devices", field="devices", fix="simulate at least 1 device")
        if args.morph_cost < 0:
            raise InvalidArgument(f"{args.morph_cost:g} s", field="morph_cost", fix="a morph costs 0 s or more")
        kind = catalog.device(args.device_kind).kind  # an unknown kind fails here, naming the catalog's
        text = _read(args.trace)
        models = example_models()
        trace = [replace(j, model=_canonical(models[j.model])) for j in parse_trace(text, models, args.devices)]
        curves = build_curves(trace, args.devices, kind, args.curves, models, args.workers, args.inter_node)
        check_requests(trace, text, curves)
        results = simulate(trace, args.devices, args.policies, curves, morph_cost_s=args.morph_cost)
    except BallastError as exc:
        return _error(exc)
    took = time.perf_counter() - start
    curves_of = f"planner curves on {kind}" if args.curves == "planner" else "synthetic curves"
    print(
        f"{len(trace)} jobs from {args.trace} on {args.devices} devices ({curves_of}); morph cost "
        f"{args.morph_cost:g} s; curves and replay {took:.1f} s"
    )
    print(table(results))
    if comparison(results):
        print(comparison(results))
    try:
        if args.csv:
            write_csv(results, args.csv)
            print(f"csv: {args.csv}")
        if args.plot:
            plot(results, trace, args.devices, args.plot)
            print(f"plot: {args.plot}")
    except OSError as exc:
        err.print(f"[red]error[/red] cannot write: {escape(str(exc))}")
        return 1
    return 0


def run_trace(args: argparse.Namespace) -> int:
    try:
        models = example_models()
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in names if m not in models]
        if unknown or not names:
            known = ", ".join(sorted(set(map(_canonical, models.values()))))
            raise InvalidArgument(
                f"unknown model {unknown[0]!r}" if unknown else "no models named",
                field="models",
                fix=f"name models under examples/: {known}",
            )
        jobs = generate_trace(
            args.jobs, args.seed, names, fleet_devices=args.devices, mean_interarrival_s=args.mean_interarrival,
            global_batches=_counts(args.batches, "batches"), sizes=_counts(args.sizes, "sizes") or None,
            median_samples=args.median_samples,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_trace(jobs, args.out)
    except BallastError as exc:
        return _error(exc)
    except OSError as exc:
        err.print(f"[red]error[/red] cannot write {escape(str(args.out))}: {escape(str(exc))}")
        return 1
    print(f"wrote {len(jobs)} jobs ({','.join(COLUMNS)}) to {args.out}")
    return 0


def _counts(text: str, field: str) -> tuple[int, ...]:
    """A comma list of positive integers ("" is none); InvalidArgument naming the flag otherwise."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = (0,)
    if any(v < 1 for v in values):
        raise InvalidArgument(f"--{field} {text!r} is not a comma list of positive integers", field=field,
                              fix=f"e.g. --{field} 64,256,1024")
    return values


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read {path}: {exc}", field="trace", fix="pass a readable CSV file") from None


def _error(exc: BallastError) -> int:
    """Exit 2 with the field, the line (trace errors) and the fix; nothing else was printed before."""
    err.print(f"[red]error[/red] {escape(str(exc))}", soft_wrap=True)
    return 2
