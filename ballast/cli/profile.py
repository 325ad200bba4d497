"""`ballast profile SPEC.yaml`: profile a model against a running control plane, with progress."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ballast.cli.options import DTYPES
from ballast.client import Client
from ballast.config import Settings
from ballast.sdk import LOCAL_DEVICE as DEVICE
from ballast.sdk import REPEATS, THREADS
from ballast.sdk import profile_request as build_request
from ballast.v1 import profile_pb2, services_pb2
from services.profiler.bounded import DEFAULT_TIME_BUDGET_S
from services.specs.model import load_model_spec

console = Console()
err = Console(stderr=True)
MiB = 2**20
# `ballast profile`'s defaults (DEVICE, REPEATS, THREADS) and its request (build_request) are the SDK's, so
# `ballast plan` and `Client.profile` profile as it does.


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="model spec YAML (e.g. examples/gpt-tiny.yaml)")
    p.add_argument("--device", default=DEVICE, help="device to measure on (this host's: cpu)")
    p.add_argument("--project-to", default="", help="also project onto a catalog device, e.g. A100-80GB")
    p.add_argument("--dtype", choices=list(DTYPES), default=None)
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[], help="measure exactly these")
    p.add_argument("--max-micro-batch", type=int, default=0,
                   help="sweep every size up to this cap (default: double from 1 until time per sample stops "
                        "improving, or the time budget)")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help=f"seconds the sweep may spend (default {DEFAULT_TIME_BUDGET_S:g} for the default sweep, "
                        "no limit with --max-micro-batch or --micro-batch-sizes)")
    p.add_argument("--memory-cap-mib", type=int, default=0, help="memory cap of the sweep, MiB")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--stride", type=int, default=0, help="measure every n-th swept size, interpolate the rest")
    p.add_argument("--threads", type=int, default=THREADS, help="intra-op threads while measuring")
    p.add_argument("--calibrate", action="store_true", help="also calibrate links (2 gloo processes)")
    p.add_argument("--refresh", action="store_true", help="measure even if a cached profile exists")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def request_from_args(args: argparse.Namespace) -> services_pb2.ProfileRequest:
    """The request for `ballast profile`'s parsed options (add_arguments)."""
    return build_request(
        load_model_spec(Path(args.spec)), device=args.device, project_to=args.project_to, refresh=args.refresh,
        dtype=DTYPES.get(args.dtype or "", 0), max_micro_batch=args.max_micro_batch,
        memory_cap_bytes=args.memory_cap_mib * MiB, repeats=args.repeats, stride=args.stride, threads=args.threads,
        micro_batch_sizes=args.micro_batch_sizes, calibrate=args.calibrate, time_budget_s=args.time_budget_s)


def layer_table(profile: profile_pb2.Profile) -> Table:
    table = Table("#", "layer", "kind", "params", "as", "m", "fwd ms", "bwd ms", "spread", "recomp ms", "stash MiB",
                  "peak MiB", title=f"profile {profile.id} on {profile.device.kind}"
                  + (" (projected)" if profile.projected else ""))
    for layer in profile.layers:
        measured = [s for s in layer.samples if s.measured] or list(layer.samples)
        if not measured:
            table.add_row(str(layer.index), layer.name, layer.kind, f"{layer.parameter_count:,}", "", "", "", "",
                          "", "", "", "", end_section=False)
            continue
        s = measured[-1]
        table.add_row(str(layer.index), layer.name, layer.kind, f"{layer.parameter_count:,}",
                      "" if layer.measured_as == layer.index else str(layer.measured_as), str(s.micro_batch_size),
                      f"{s.forward_s * 1e3:.2f}", f"{s.backward_s * 1e3:.2f}",
                      (f"{max(s.forward_spread, s.backward_spread):.1%}"
                       + (f", {s.off_line:.0%} off line" if s.off_line else "")) if s.measured else "",
                      f"{s.recompute_s * 1e3:.2f}",
                      f"{s.stashed_activation_bytes / MiB:.1f}", f"{s.peak_memory_bytes / MiB:.1f}")
    return table


class Eta:
    """Seconds left at the pace of the progress so far. The pace counts from the first update with progress, so
    the CLI's start, a wait for the profiler's turn and the worker's start do not count as slowness."""

    def __init__(self) -> None:
        self.first: tuple[float, float] | None = None  # (time, fraction) of the first update with progress

    def __call__(self, now: float, fraction: float) -> float | None:
        """None until two updates have shown progress."""
        if fraction >= 1.0:
            return 0.0
        if fraction <= 0.0:
            return None
        if self.first is None:
            self.first = (now, fraction)
        t0, f0 = self.first
        if fraction <= f0 or now <= t0:
            return None
        return (now - t0) * (1.0 - fraction) / (fraction - f0)


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--"
    minutes, secs = divmod(round(max(0.0, seconds)), 60)
    return f"{minutes}:{secs:02d}"


def label(update: services_pb2.ProfileProgress) -> str:
    text = update.phase
    if update.phase == "measure" and update.layers_total:
        text += f" layer {update.layer_index + 1}/{update.layers_total}"
    return text + (f" m={update.micro_batch_size}" if update.micro_batch_size else "")


def progress_line(update: services_pb2.ProfileProgress, elapsed: float, eta: float | None) -> str:
    """One plain line per update, for a stderr that is not a terminal (CI logs, pipes)."""
    return (f"profile {update.fraction:4.0%} {label(update)}  elapsed {clock(elapsed)} eta {clock(eta)}  "
            f"{update.message}").rstrip()


class EtaColumn(ProgressColumn):
    """The ETA of the last update (`Eta`), counting down until the next one."""

    def render(self, task: Task) -> Text:
        eta, at = task.fields.get("eta"), task.fields.get("at", 0.0)
        left = None if eta is None else eta - (time.monotonic() - at)
        return Text(f"eta {clock(left)}", style="progress.remaining")


def stream(client: Client, request: services_pb2.ProfileRequest) -> services_pb2.ProfileProgress:
    """ProfileStream with progress on stderr: a bar with an ETA on a terminal, plain lines otherwise (the service
    streams an update per probe and per layer measured). Returns the last update (it carries the profile)."""
    updates = client.profiler.ProfileStream(request)
    return _bar(updates) if err.is_terminal else _lines(updates)


def _lines(updates: Iterable[services_pb2.ProfileProgress]) -> services_pb2.ProfileProgress:
    final, t0, eta = None, time.monotonic(), Eta()
    for update in updates:
        now = time.monotonic()
        err.print(progress_line(update, now - t0, eta(now, update.fraction)), markup=False, highlight=False,
                  soft_wrap=True)
        final = update
    return final


def _bar(updates: Iterable[services_pb2.ProfileProgress]) -> services_pb2.ProfileProgress:
    final, eta = None, Eta()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), EtaColumn(), console=err, transient=True) as bar:
        task = bar.add_task("profiling", total=1.0, eta=None, at=0.0)
        for update in updates:
            if update.phase == "swept":  # why the sweep stopped: kept above the bar
                bar.console.print(update.message, markup=False, highlight=False)
            now = time.monotonic()
            bar.update(task, completed=update.fraction, description=label(update), eta=eta(now, update.fraction),
                       at=now)
            final = update
    return final


def run(settings: Settings, args: argparse.Namespace) -> int:
    request = request_from_args(args)
    with Client.of(settings, ("profiler",)) as client:
        try:
            final = stream(client, request)
        except grpc.RpcError as exc:
            err.print(f"[red]error[/red] {exc.code().name}: {exc.details()}")
            return 1
    profile = final.profile
    if args.json:
        print(json.dumps(MessageToDict(profile, preserving_proto_field_name=True)))
        return 0
    console.print(layer_table(profile))
    console.print(f"{final.message}; non-model memory {profile.non_model_memory_bytes / MiB:.1f} MiB; "
                  f"measured sizes {list(profile.measured_micro_batch_sizes)}; "
                  f"{profile.profiling_time_s:.1f} s", markup=False)
    from services.planner.plans.make import profile_note  # the planner's own words for it; not at CLI start

    if note := profile_note(profile):
        console.print(note, markup=False)
    return 0
