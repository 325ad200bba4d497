"""`ballast submit SPEC.yaml` and `ballast watch JOB_ID`: submit a training job and follow its events."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
from rich.console import Console
from rich.markup import escape

from ballast import sdk
from ballast.cli.follow import add_follow_arguments, follow
from ballast.cli.options import ENGINES, SCHEDULES, refused
from ballast.client import Client
from ballast.config import Settings
from ballast.v1 import job_pb2
from services.specs.fleet import load_fleet
from services.specs.model import load_model_spec

console = Console()
err = Console(stderr=True)


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
    p.add_argument("--priority", default="", metavar="CLASS",
                   help="priority class of the fleet policy (`ballast policy show`; default: the policy's default)")
    p.add_argument("--min-devices", type=device_count("--min-devices"), default=None, metavar="N",
                   help="with --max-devices: the job may be re-planned for any device count in the range to start "
                        "sooner (default: exactly the devices its plan needs)")
    p.add_argument("--max-devices", type=device_count("--max-devices"), default=None, metavar="N",
                   help="upper end of the device range (see --min-devices); the first plan uses at most N devices")
    p.add_argument("--raw-metrics", action="store_true",
                   help="store a metrics row per iteration of every worker (default: each worker's iterations "
                        "summarised over windows of about BALLAST_METRICS_WINDOW_S seconds)")
    p.add_argument("--elastic", action="store_true",
                   help="with --min-devices/--max-devices: the scheduler may resize the running job within the range "
                        "(by morphing it) when that lowers the fleet's predicted average completion time")
    p.add_argument("--micro-batches", type=device_count("--micro-batches", 0, "micro-batches"), default=0, metavar="NM",
                   help="micro-batches per iteration per pipeline replica, planned by the Varuna engine (default 0: "
                        "the planner chooses)")
    p.add_argument("--checkpoint-every", type=device_count("--checkpoint-every", 0, "iterations"), default=0,
                   metavar="N",
                   help="write a per-layer checkpoint every N iterations: a job that loses a worker or host resumes "
                        "from the last one (default 0: none, so it restarts from the first iteration)")
    add_data_arguments(p)
    p.add_argument("--eval-every", type=device_count("--eval-every", 0, "iterations"), default=0, metavar="N",
                   help="evaluate on the validation set every N iterations and after the last (validation loss, and "
                        "perplexity for language models, in `ballast watch` and the evaluations table)")
    p.add_argument("--eval-batches", type=device_count("--eval-batches", 0, "batches"), default=0, metavar="K",
                   help="batches of the global batch size per evaluation (default 4)")
    p.add_argument("--keep-checkpoints", type=device_count("--keep-checkpoints", 0, "checkpoints"), default=0,
                   metavar="K", help="complete checkpoints kept on disk, older ones deleted (default 3)")
    p.add_argument("--init-from", default="", metavar="JOB[:ITERATION]|DIR",
                   help="start from these weights (fine-tuning): a job of yours (its last checkpoint, or the one "
                        "after ITERATION), or a directory of exported weights")
    p.add_argument("--resume-from", default="", metavar="JOB",
                   help="continue a finished, failed or cancelled job from its last checkpoint, with its optimizer "
                        "state and its place in the data (--iterations is the total)")
    p.set_defaults(check=device_range_problem)
    add_follow_arguments(p, "follow the job's events until it ends (or --until)")


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The job's samples (docs/data.md): a data spec file, or a token file for short."""
    p.add_argument("--data", type=Path, default=None, metavar="DATA.yaml",
                   help="the data to train on: a YAML with tokens:, hf_dataset: or factory: (docs/data.md)")
    p.add_argument("--tokens", type=Path, default=None, metavar="TRAIN.bin",
                   help="train on a flat file of token ids (nanoGPT's layout), instead of --data")
    p.add_argument("--validation-tokens", type=Path, default=None, metavar="VAL.bin",
                   help="with --tokens: held-out token ids to evaluate on")
    p.add_argument("--token-dtype", choices=["uint16", "uint32"], default="uint16")


def data_of(args: argparse.Namespace):
    """The DataSpec the flags name, or None (synthetic samples)."""
    if getattr(args, "data", None) and getattr(args, "tokens", None):
        raise ValueError("--data and --tokens each name the data: give one of them")
    if getattr(args, "tokens", None):
        return sdk.token_data(args.tokens, args.validation_tokens, args.token_dtype)
    if getattr(args, "validation_tokens", None):
        raise ValueError("--validation-tokens goes with --tokens (the training file)")
    return sdk.data_spec(args.data) if getattr(args, "data", None) else None


def device_kind(flag: str):
    """An argparse type: a device kind the catalog knows (its canonical name), refused with the catalog's fix."""

    def parse(text: str) -> str:
        from services.runtime.errors import BallastError
        from services.specs import catalog

        try:
            return catalog.device(text).kind
        except BallastError as exc:
            raise argparse.ArgumentTypeError(f"{exc} ({flag})") from None

    return parse


def device_count(flag: str, least: int = 1, what: str = "devices"):
    """An argparse type: a whole number >= `least`, refused with a message naming `flag` and an example."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"must be a whole number of {what} >= {least} (got {text!r}), "
                                             f"e.g. {flag} 2")
        return value

    return parse


def device_range_problem(args: argparse.Namespace) -> str | None:
    """Why --min-devices/--max-devices (and --elastic) cannot go together (checked after parsing, before any
    RPC), or None."""
    if getattr(args, "elastic", False) and getattr(args, "min_devices", None) is None:
        return ("--elastic needs the range the job may be resized within: give --min-devices and --max-devices "
                "too, e.g. --elastic --min-devices 1 --max-devices 4")
    return sdk.device_range_problem(getattr(args, "min_devices", None), getattr(args, "max_devices", None),
                                    flags=True)


def parse_toggle(text: str) -> job_pb2.LayerToggle:
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"--toggle {text!r}: write LAYER:ITERATION:on|off, e.g. 5:10:on")
    return job_pb2.LayerToggle(layer_index=int(parts[0]), iteration=int(parts[1]), active=parts[2] == "on")


def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    p.add_argument("--after", type=int, default=0, help="replay events after this sequence number")
    add_follow_arguments(p, None)


def job_spec(args: argparse.Namespace) -> job_pb2.JobSpec:
    """The SDK's JobSpec for the parsed flags; the fleet file is read here (its catalog lives in the specs)."""
    model = load_model_spec(Path(args.spec))
    return sdk.job_spec(model, batch=args.batch, iterations=args.iterations, seed=args.seed, name=args.name,
                        memory=args.memory or 0, engine=args.engine, schedule=args.schedule,
                        fleet=load_fleet(args.fleet, dtype=model.dtype or None) if args.fleet else None,
                        online=getattr(args, "online", False), toggles=getattr(args, "toggle", []),
                        stages=getattr(args, "stages", 0), priority=getattr(args, "priority", "") or "",
                        min_devices=getattr(args, "min_devices", None), max_devices=getattr(args, "max_devices", None),
                        micro_batches=getattr(args, "micro_batches", 0) or 0,
                        checkpoint_every=getattr(args, "checkpoint_every", 0) or 0,
                        elastic=getattr(args, "elastic", False), data=data_of(args),
                        eval_every=getattr(args, "eval_every", 0) or 0, eval_batches=getattr(args, "eval_batches", 0)
                        or 0, keep_checkpoints=getattr(args, "keep_checkpoints", 0) or 0,
                        init_from=getattr(args, "init_from", "") or "",
                        resume_from=getattr(args, "resume_from", "") or "",
                        raw_metrics=getattr(args, "raw_metrics", False))


def run_submit(settings: Settings, args: argparse.Namespace) -> int:
    problem = device_range_problem(args)  # main() refuses it at parse time; callers that skip main() too
    if problem:
        err.print(f"[red]error[/red] {escape(problem)}")
        return 2
    try:
        spec = job_spec(args)
    except ValueError as exc:
        err.print(f"[red]error[/red] {escape(str(exc))}")
        return 2
    with _client(settings) as client:
        try:
            job = client.submit(spec)
        except grpc.RpcError as exc:
            err.print(f"[red]error[/red] {exc.code().name}: {escape(exc.details() or '')}")
            return 1
        console.print(f"[bold]job {job.id}[/bold] submitted; `ballast watch {job.id}` follows it")
        if not args.wait and not args.until:
            return 0
        return follow(client, job.id, 0, args.until)


def add_cancel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    p.add_argument("--reason", default="", help="why (kept in the job's CANCELLED event)")


def run_cancel(settings: Settings, args: argparse.Namespace) -> int:
    with _client(settings) as client:
        try:
            job = client.cancel(args.job_id, reason=args.reason)
        except grpc.RpcError as exc:
            return refused(exc)
    state = job_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
    after = "" if job.state == job_pb2.JOB_STATE_CANCELLED else f"; `ballast watch {job.id}` follows it to CANCELLED"
    console.print(f"job {job.id} {state}{after}")
    return 0


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    p.add_argument("--out", required=True, help="a new or empty directory to write the weights into")
    p.add_argument("--iteration", type=int, default=0,
                   help="the checkpoint after this iteration (default: the job's newest)")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "torch", "hf"],
                   help="model.safetensors (default), model.pt, or a Hugging Face save_pretrained directory")


def run_export(settings: Settings, args: argparse.Namespace) -> int:
    with _client(settings) as client:
        try:
            done = client.export(args.job_id, args.out, iteration=args.iteration, format=args.format)
        except grpc.RpcError as exc:
            return refused(exc)
    names = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for name, size in done.files.items())
    console.print(f"job {args.job_id}: iteration {done.iteration} ({done.checkpoint_id}) exported to "
                  f"{done.directory}: {names}")
    return 0


def run_watch(settings: Settings, args: argparse.Namespace) -> int:
    with _client(settings) as client:
        return follow(client, args.job_id, args.after, args.until)


def _client(settings: Settings) -> Client:
    return Client.of(settings, ("store", "planner"))
