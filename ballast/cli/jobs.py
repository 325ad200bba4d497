"""`ballast submit SPEC.yaml` and `ballast watch JOB_ID`: submit a training job and follow its events."""

from __future__ import annotations

import argparse
import queue
import threading
from pathlib import Path

import grpc
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn

from ballast.cli.plan import ENGINES, SCHEDULES, parse_bytes
from ballast.client import Client
from ballast.config import Settings
from ballast.v1 import job_pb2, services_pb2, store_pb2

console = Console()
err = Console(stderr=True)
S = job_pb2.JobState
STATES = {name.removeprefix("JOB_STATE_").lower(): value for name, value in S.items() if value}
ORDER = [S.JOB_STATE_SUBMITTED, S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING, S.JOB_STATE_SCHEDULED,
         S.JOB_STATE_RUNNING, S.JOB_STATE_SUCCEEDED]
BAD_END = (S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
TRAINING = (S.JOB_STATE_RUNNING, S.JOB_STATE_REPARTITIONING)  # the progress bar stays up through migrations
COLOURS = {S.JOB_STATE_REPARTITIONING: "magenta", S.JOB_STATE_FAILED: "red", S.JOB_STATE_CANCELLED: "yellow",
           S.JOB_STATE_SUCCEEDED: "green"}


def add_submit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="model spec YAML (e.g. examples/gpt-tiny.yaml)")
    p.add_argument("--fleet", type=Path, default=None,
                   help="fleet YAML to plan for (default: the executors online now)")
    p.add_argument("--batch", type=int, default=8, help="global batch size, fixed for the whole run")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--memory", default="", help="per-device memory budget (16GiB, 16GB, bytes)")
    p.add_argument("--engine", choices=sorted(ENGINES), default=None, help="default: every engine, best wins")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="")
    p.add_argument("--stages", type=int, default=0, help="pipeline stages to plan for (default: the search chooses)")
    p.add_argument("--online", action="store_true",
                   help="let the planner rebalance the pipeline while it trains (vPipe: live layer migration)")
    p.add_argument("--toggle", action="append", default=[], type=parse_toggle, metavar="LAYER:ITERATION:on|off",
                   help="dynamic workload: switch a layer on or off from that iteration (repeatable), e.g. 5:0:off")
    add_follow_arguments(p, "follow the job's events until it ends (or --until)")


def parse_toggle(text: str) -> job_pb2.LayerToggle:
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"--toggle {text!r}: write LAYER:ITERATION:on|off, e.g. 5:10:on")
    return job_pb2.LayerToggle(layer_index=int(parts[0]), iteration=int(parts[1]), active=parts[2] == "on")


def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    p.add_argument("--after", type=int, default=0, help="replay events after this sequence number")
    add_follow_arguments(p, None)


def add_follow_arguments(p: argparse.ArgumentParser, wait_help: str | None) -> None:
    if wait_help:
        p.add_argument("--wait", action="store_true", help=wait_help)
    p.add_argument("--until", choices=[s for s in STATES if STATES[s] in ORDER[1:]], default=None,
                   help="stop following once the job reaches this state (e.g. scheduled)")


def job_spec(args: argparse.Namespace) -> job_pb2.JobSpec:
    from ballast.cli.demo import load_model_spec
    from services.planner.fleet_file import load_fleet

    model = load_model_spec(Path(args.spec))
    spec = job_pb2.JobSpec(name=args.name or model.name, model=model, global_batch_size=args.batch,
                           iterations=args.iterations, seed=args.seed,
                           memory_budget_bytes=parse_bytes(args.memory) if args.memory else 0,
                           engine=ENGINES.get(args.engine or "", 0), schedule=SCHEDULES.get(args.schedule or "", 0),
                           online_repartition=getattr(args, "online", False), layer_toggles=getattr(args, "toggle", []),
                           pipeline_stages=getattr(args, "stages", 0))
    if args.fleet:
        spec.fleet.CopyFrom(load_fleet(args.fleet, dtype=model.dtype or None))
    return spec


def run_submit(settings: Settings, args: argparse.Namespace) -> int:
    try:
        spec = job_spec(args)
    except ValueError as exc:
        err.print(f"[red]error[/red] {escape(str(exc))}")
        return 2
    with _client(settings) as client:
        try:
            job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec))
        except grpc.RpcError as exc:
            err.print(f"[red]error[/red] {exc.code().name}: {escape(exc.details() or '')}")
            return 1
        console.print(f"[bold]job {job.id}[/bold] submitted; `ballast watch {job.id}` follows it")
        if not args.wait and not args.until:
            return 0
        return follow(client, job.id, 0, args.until)


def run_watch(settings: Settings, args: argparse.Namespace) -> int:
    with _client(settings) as client:
        return follow(client, args.job_id, args.after, args.until)


def _client(settings: Settings) -> Client:
    return Client(store=settings.address("store"), planner=settings.address("planner"),
                  token=settings.resolved_token())


def follow(client: Client, job_id: str, after: int, until: str | None) -> int:
    """Print events as they come, with a live bar (step, loss, samples/s) while the job trains; exit 0 at
    SUCCEEDED (or the --until state), 1 at FAILED or CANCELLED."""
    target = STATES[until] if until else S.JOB_STATE_SUCCEEDED
    events: queue.Queue = queue.Queue()
    stream = client.jobs.Watch(services_pb2.WatchJobRequest(job_id=job_id, after_seq=after), timeout=None)

    def pump() -> None:
        try:
            for event in stream:
                events.put(event)
        except grpc.RpcError as exc:
            events.put(exc)
        events.put(None)

    threading.Thread(target=pump, name="watch", daemon=True).start()
    bar: Progress | None = None  # shown only while the job trains
    task = None
    try:
        while True:
            try:
                item = events.get(timeout=0.5)
            except queue.Empty:
                if bar is not None:
                    _progress(client, job_id, bar, task)
                continue
            if item is None:
                return 0
            if isinstance(item, grpc.RpcError):
                if item.code() == grpc.StatusCode.CANCELLED:
                    return 0
                err.print(f"[red]error[/red] {item.code().name}: {escape(item.details() or '')}")
                return 1
            if bar is not None and item.state not in TRAINING:
                _progress(client, job_id, bar, task)
                bar.stop()
                bar = None
            show(item)
            if item.state in BAD_END:
                return 1
            if item.state in ORDER and ORDER.index(item.state) >= ORDER.index(target):
                return 0
            if item.state in TRAINING and bar is None:
                job = client.jobs.Get(store_pb2.GetRequest(id=job_id))
                bar = Progress(TextColumn("{task.description}"), BarColumn(),
                               TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[detail]}"),
                               console=console, transient=True)
                task = bar.add_task("training", total=job.spec.iterations, detail="")
                bar.start()
    finally:
        if bar is not None:
            bar.stop()
        stream.cancel()


def _progress(client: Client, job_id: str, bar: Progress, task) -> None:
    job = client.jobs.Get(store_pb2.GetRequest(id=job_id))
    done = job.iteration + 1 if job.iteration or _any_metric(client, job_id) else 0
    rows = client.store.ListIterationMetrics(store_pb2.ListIterationMetricsRequest(
        job_id=job_id, from_iteration=job.iteration)).metrics
    loss = next((m.loss for m in rows if m.has_loss), None)
    speed = max((m.throughput_samples_per_s for m in rows), default=0.0)
    detail = (f"loss {loss:.4f}  " if loss is not None else "") + (f"{speed:.1f} samples/s" if speed else "")
    bar.update(task, completed=min(done, job.spec.iterations), detail=detail)


def _any_metric(client: Client, job_id: str) -> bool:
    page = client.store.ListIterationMetrics(store_pb2.ListIterationMetricsRequest(job_id=job_id))
    return bool(page.metrics)


def show(event: job_pb2.JobEvent) -> None:
    state = S.Name(event.state).removeprefix("JOB_STATE_")
    colour = COLOURS.get(event.state, "cyan")
    console.print(f"{event.seq:>4} [{colour}]{state:<14}[/{colour}] {event.type:<16} {escape(event.message)}")
