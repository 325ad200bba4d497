"""`ballast profile SPEC.yaml`: profile a model against a running control plane, with progress."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ballast.client import Client
from ballast.config import Settings
from ballast.v1 import common_pb2, profile_pb2, services_pb2

console = Console()
err = Console(stderr=True)
MiB = 2**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="model spec YAML (e.g. examples/gpt-tiny.yaml)")
    p.add_argument("--device", default="cpu", help="device to measure on (this host's: cpu)")
    p.add_argument("--project-to", default="", help="also project onto a catalog device, e.g. A100-80GB")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None)
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[], help="measure exactly these")
    p.add_argument("--max-micro-batch", type=int, default=0, help="cap of the micro-batch sweep")
    p.add_argument("--memory-cap-mib", type=int, default=0, help="memory cap of the sweep, MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stride", type=int, default=0, help="measure every n-th swept size, interpolate the rest")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads while measuring")
    p.add_argument("--calibrate", action="store_true", help="also calibrate links (2 gloo processes)")
    p.add_argument("--refresh", action="store_true", help="measure even if a cached profile exists")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def build_request(args: argparse.Namespace) -> services_pb2.ProfileRequest:
    from ballast.cli.demo import load_model_spec

    spec = load_model_spec(Path(args.spec))
    dtype = {"fp32": common_pb2.DTYPE_FP32, "fp16": common_pb2.DTYPE_FP16, "bf16": common_pb2.DTYPE_BF16}
    return services_pb2.ProfileRequest(
        model=spec, device_kind=args.device, project_to=args.project_to, refresh=args.refresh,
        dtype=dtype.get(args.dtype or "", 0), max_micro_batch_size=args.max_micro_batch,
        memory_cap_bytes=args.memory_cap_mib * MiB,
        options=services_pb2.ProfileOptions(repeats=args.repeats, stride=args.stride, intra_op_threads=args.threads,
                                            micro_batch_sizes=args.micro_batch_sizes, calibrate=args.calibrate),
    )


def layer_table(profile: profile_pb2.Profile) -> Table:
    table = Table("#", "layer", "kind", "params", "as", "m", "fwd ms", "bwd ms", "recomp ms", "stash MiB",
                  "peak MiB", title=f"profile {profile.id} on {profile.device.kind}"
                  + (" (projected)" if profile.projected else ""))
    for layer in profile.layers:
        measured = [s for s in layer.samples if s.measured] or list(layer.samples)
        if not measured:
            table.add_row(str(layer.index), layer.name, layer.kind, f"{layer.parameter_count:,}", "", "", "", "",
                          "", "", "", end_section=False)
            continue
        s = measured[-1]
        table.add_row(str(layer.index), layer.name, layer.kind, f"{layer.parameter_count:,}",
                      "" if layer.measured_as == layer.index else str(layer.measured_as), str(s.micro_batch_size),
                      f"{s.forward_s * 1e3:.2f}", f"{s.backward_s * 1e3:.2f}", f"{s.recompute_s * 1e3:.2f}",
                      f"{s.stashed_activation_bytes / MiB:.1f}", f"{s.peak_memory_bytes / MiB:.1f}")
    return table


def stream(client: Client, request: services_pb2.ProfileRequest) -> services_pb2.ProfileProgress:
    """ProfileStream with a progress bar on stderr; the last update (it carries the profile)."""
    final = None
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("profiling", total=1.0)
        for update in client.profiler.ProfileStream(request):
            label = update.phase + (f" layer {update.layer_index + 1}/{update.layers_total}"
                                    if update.layers_total else "")
            if update.micro_batch_size:
                label += f" m={update.micro_batch_size}"
            bar.update(task, completed=update.fraction, description=label)
            final = update
    return final


def run(settings: Settings, args: argparse.Namespace) -> int:
    request = build_request(args)
    with Client(profiler=settings.address("profiler"), token=settings.resolved_token()) as client:
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
                  f"{profile.profiling_time_s:.1f} s")
    return 0
