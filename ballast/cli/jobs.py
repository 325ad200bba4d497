"""`ballast submit SPEC.yaml` and `ballast watch JOB_ID`: submit a training job and follow its events."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
from rich.console import Console
from rich.markup import escape

from ballast.cli.plan import ENGINES, SCHEDULES, parse_bytes
from ballast.client import Client
from ballast.config import Settings
from ballast.v1 import job_pb2, services_pb2

console = Console()
err = Console(stderr=True)
S = job_pb2.JobState
STATES = {name.removeprefix("JOB_STATE_").lower(): value for name, value in S.items() if value}
ORDER = [S.JOB_STATE_SUBMITTED, S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING, S.JOB_STATE_SCHEDULED,
         S.JOB_STATE_RUNNING, S.JOB_STATE_SUCCEEDED]
BAD_END = (S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
COLOURS = {S.JOB_STATE_FAILED: "red", S.JOB_STATE_CANCELLED: "yellow", S.JOB_STATE_SUCCEEDED: "green"}


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
    add_follow_arguments(p, "follow the job's events until it ends (or --until)")


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
                           engine=ENGINES.get(args.engine or "", 0), schedule=SCHEDULES.get(args.schedule or "", 0))
    if args.fleet:
        spec.fleet.CopyFrom(load_fleet(args.fleet, dtype=model.dtype or None))
    return spec


def run_submit(settings: Settings, args: argparse.Namespace) -> int:
    try:
        spec = job_spec(args)
    except ValueError as exc:
        err.print(f"[red]error[/red] {escape(str(exc))}")
        return 2
    with Client(planner=settings.address("planner"), token=settings.resolved_token()) as client:
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
    with Client(planner=settings.address("planner"), token=settings.resolved_token()) as client:
        return follow(client, args.job_id, args.after, args.until)


def follow(client: Client, job_id: str, after: int, until: str | None) -> int:
    """Print events as they come; exit 0 at SUCCEEDED (or the --until state), 1 at FAILED or CANCELLED."""
    target = STATES[until] if until else S.JOB_STATE_SUCCEEDED
    try:
        for event in client.jobs.Watch(services_pb2.WatchJobRequest(job_id=job_id, after_seq=after), timeout=None):
            show(event)
            if event.state in BAD_END:
                return 1
            if event.state in ORDER and ORDER.index(event.state) >= ORDER.index(target):
                return 0
    except grpc.RpcError as exc:
        err.print(f"[red]error[/red] {exc.code().name}: {escape(exc.details() or '')}")
        return 1
    return 0


def show(event: job_pb2.JobEvent) -> None:
    state = S.Name(event.state).removeprefix("JOB_STATE_")
    colour = COLOURS.get(event.state, "cyan")
    console.print(f"{event.seq:>4} [{colour}]{state:<14}[/{colour}] {event.type:<16} {escape(event.message)}")
