"""`ballast plan SPEC.yaml --fleet FLEET.yaml` and `ballast explain PLAN_ID` against a running control plane.

A plan is priced on a profile of the fleet's device. This host can only measure its own device (cpu),
so for any other fleet the honest default is an analytical profile of that device (FLOP and byte
counts at an assumed fraction of its datasheet peaks; nothing measured, and the output says so).
`--profile projected` measures here and projects by roofline instead, which carries this CPU's
efficiency over to the target device: anchored in a measurement, but of the wrong hardware.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ballast.cli.options import DTYPES, ENGINES, SCHEDULES, parse_bytes
from ballast.cli.profile import stream
from ballast.client import Client
from ballast.config import Settings
from ballast.errors import PlanSearchFailed
from ballast.sdk import LOCAL_DEVICE, profile_kind
from ballast.sdk import plan_profile_request as profile_request
from ballast.specfile import safe_yaml
from ballast.v1 import common_pb2, plan_pb2, profile_pb2, queue_pb2, services_pb2
from services.specs.fleet import load_fleet
from services.specs.model import load_model_spec

console = Console()
err = Console(stderr=True)
GiB = float(1 << 30)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="model spec YAML (e.g. examples/gpt-tiny.yaml)")
    p.add_argument("--fleet", type=Path, required=True, help="fleet YAML (e.g. examples/fleet-8xTITAN.yaml)")
    p.add_argument("--memory", default="", help="per-device memory budget: 16GiB (2**30), 16GB (10**9), bytes; "
                                                "default the device's memory")
    p.add_argument("--batch", type=int, default=0, help="global batch size (default: the search chooses)")
    p.add_argument("--engine", choices=sorted(ENGINES), default=None, help="default: every engine, best wins")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default=None, help="default: 1F1B and GPipe priced")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="training precision (default: the model's, else the fleet file's)")
    p.add_argument("--profile", choices=["auto", "measured", "projected", "analytical"], default="auto",
                   help="auto: measured here if the fleet's device is this host's (cpu), else analytical")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="sizes the profile holds (measured or computed); the cost model extends them linearly")
    p.add_argument("--what-if", action="store_true",
                   help="search the full space (TP/SDP too) synchronously; the plan is not stored")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the search")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def add_explain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan_id")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def precision(args: argparse.Namespace, spec) -> int:
    """--dtype, else the model's, else the fleet file's; 0 leaves both to the device's default."""
    if args.dtype:
        return DTYPES[args.dtype]
    if spec.dtype:
        return spec.dtype
    named = (safe_yaml(Path(args.fleet).read_text()) or {}).get("dtype")
    return DTYPES.get(str(named).lower(), 0) if named else 0


def describe_profile(profile: profile_pb2.Profile, kind: str) -> str:
    if kind == "measured":
        return f"measured on {profile.device.kind} ({profile.software})"
    if kind == "projected":
        return (f"measured on {LOCAL_DEVICE} as {profile.source_profile_id}, projected by roofline to "
                f"{profile.device.kind}: an estimate, not a measurement")
    return f"analytical for {profile.device.kind}, nothing measured: {profile.software}"


def run_plan(settings: Settings, args: argparse.Namespace) -> int:
    spec = load_model_spec(Path(args.spec))
    fleet = load_fleet(args.fleet)  # validates the file before anything is sent
    dtype = precision(args, spec)
    if dtype:  # profile and fleet priced at one precision
        fleet = load_fleet(args.fleet, dtype=dtype)
    kind = profile_kind(args.profile, fleet.device.kind)
    if kind == "measured" and fleet.device.kind != LOCAL_DEVICE:
        err.print(f"[red]error[/red] --profile measured: this host measures {LOCAL_DEVICE}, not {fleet.device.kind}; "
                  "use --profile analytical or projected, or run `ballast plan` where that device is")
        return 2
    try:
        budget = parse_bytes(args.memory) if args.memory else 0
    except ValueError as exc:
        err.print(f"[red]error[/red] --memory: {escape(str(exc))}")
        return 2
    with Client.of(settings) as client:
        try:
            profiled = stream(client, profile_request(spec, args.micro_batch_sizes, kind, fleet.device.kind, dtype))
            profile = profiled.profile
            if args.json:
                err.print(f"profile {profile.id}: {describe_profile(profile, kind)}", markup=False)
            request = services_pb2.PlanRequest(
                profile_id=profile.id, fleet=fleet, global_batch_size=args.batch, memory_budget_bytes=budget,
                engine=ENGINES.get(args.engine or "", 0), schedule=SCHEDULES.get(args.schedule or "", 0))
            if args.what_if:
                with err.status("what-if search (not stored)…"):
                    plan = client.planner.WhatIf(request, timeout=args.timeout)
                request_id = ""
            else:
                op = client.planner.Plan(request)
                request_id = op.request.id
                try:
                    op = wait(client, op, args.timeout)
                except PlanSearchFailed as exc:
                    err.print(f"[red]search failed[/red] (request {exc.request_id}): {escape(exc.reason)}")
                    return 1
                plan = client.explain(op.plan_id)
        except grpc.RpcError as exc:
            err.print(f"[red]error[/red] {exc.code().name}: {escape(exc.details() or '')}")
            return 1
        except TimeoutError as exc:
            err.print(f"[red]error[/red] {escape(str(exc))}")
            return 1
    if args.json:
        print(json.dumps({"plan": MessageToDict(plan, preserving_proto_field_name=True), "request_id": request_id,
                          "profile": {"id": profile.id, "kind": kind, "device": profile.device.kind,
                                      "software": profile.software}}))
        return 0
    if args.what_if:
        console.print("[bold]what-if plan[/bold] (not stored)")
    else:
        console.print(f"[bold]plan {plan.id}[/bold] (request {request_id}); `ballast explain {plan.id}` shows it again")
    reused = (" (measurement reused)" if kind == "projected" else " (reused)") if profiled.cached else ""
    console.print(f"profile {profile.id}: {describe_profile(profile, kind)}{reused}", markup=False)
    show(plan)
    return 0


def wait(client: Client, op: services_pb2.PlanOperation, timeout: float) -> services_pb2.PlanOperation:
    """The SDK's wait for a queued search, with a spinner; PlanSearchFailed if it failed."""
    with err.status(f"searching (request {op.request.id})…") as status:
        return client.wait_plan(op, timeout=timeout, on_update=lambda op: status.update(
            f"searching (request {op.request.id}, {state_name(op)}, attempt {op.request.attempts})…"))


def state_name(op: services_pb2.PlanOperation) -> str:
    return queue_pb2.RequestState.Name(op.request.state).removeprefix("REQUEST_STATE_").lower()


def run_explain(settings: Settings, args: argparse.Namespace) -> int:
    with Client.of(settings, ("planner",)) as client:
        try:
            plan = client.explain(args.plan_id)
        except grpc.RpcError as exc:
            err.print(f"[red]error[/red] {exc.code().name}: {escape(exc.details() or '')}")
            return 1
    if args.json:
        print(json.dumps(MessageToDict(plan, preserving_proto_field_name=True)))
        return 0
    console.print(f"[bold]plan {plan.id}[/bold] for model {plan.model_id}, profile {plan.profile_id}")
    show(plan)
    return 0


def show(plan: plan_pb2.Plan) -> None:
    """Summary, stages, per-layer strategies, alternatives and baselines, then the explanation."""
    p, fleet = plan.prediction, plan.fleet
    console.print(
        f"{plan_pb2.PlanEngine.Name(plan.engine).removeprefix('PLAN_ENGINE_').lower()} plan on "
        f"{fleet.name or fleet.device.kind} ({fleet.nodes}x{fleet.devices_per_node} {fleet.device.kind}): "
        f"batch {plan.global_batch_size} = {plan.micro_batch_size} x {plan.num_micro_batches} micro-batches, "
        f"{plan_pb2.Schedule.Name(plan.schedule).removeprefix('SCHEDULE_')}, {len(plan.stages)} stage(s); "
        f"predicted {p.iteration_time_s:.4g} s/iteration, {p.throughput_samples_per_s:.4g} samples/s, "
        f"peak {p.peak_memory_bytes / GiB:.2f} of {plan.memory_budget_bytes / GiB:.2f} GiB per device", markup=False)
    console.print(stage_table(plan))
    if plan.HasField("offload"):
        console.print(offload_table(plan.offload))
    if plan.HasField("harmony"):
        console.print(harmony_table(plan.harmony))
    console.print(layer_table(plan))
    console.print(alternatives_table(plan))
    console.print(plan.explanation, markup=False)


def offload_table(off: plan_pb2.ChunkOffload) -> Table:
    """A chunk-offload plan's layout and the simulator's swap prediction per iteration (rank 0's)."""
    mib = float(1 << 20)
    table = Table("chunks", "chunk MiB", "device budget MiB", "device peak MiB", "host MiB", "in MiB/it",
                  "out MiB/it", "gathered MiB/it", "reduced MiB/it", "swap s/it", title="chunk offload (PatrickStar)")
    table.add_row(str(off.chunks), f"{off.chunk_bytes / mib:.1f}", f"{off.device_budget_bytes / mib:.1f}",
                  f"{off.predicted_device_peak_bytes / mib:.1f}", f"{off.predicted_host_bytes / mib:.1f}",
                  f"{off.predicted_to_device_bytes / mib:.1f}", f"{off.predicted_to_host_bytes / mib:.1f}",
                  f"{off.predicted_gathered_bytes / mib:.1f}", f"{off.predicted_reduced_bytes / mib:.1f}",
                  f"{off.predicted_swap_s:.4g}")
    return table


def harmony_table(h: plan_pb2.HarmonySwap) -> Table:
    """A Harmony plan's four-tuple and the estimator's prediction per iteration (all devices together)."""
    mib = float(1 << 20)

    def packs(spans) -> str:  # noqa: ANN001 - repeated LayerSpan
        return " ".join(f"{s.begin}-{s.end - 1}" for s in spans)

    table = Table("devices", "forward packs (U_F)", "backward packs (U_B)", "prefetch", "device budget MiB",
                  "device peak MiB", "in MiB/it", "out MiB/it", "peer MiB/it", "s/it",
                  title="Harmony swap schedule (wrap-around pipeline)")
    table.add_row(str(h.devices), f"{packs(h.forward_packs) or '-'} ({h.forward_micro_batch})",
                  f"{packs(h.backward_packs)} ({h.backward_micro_batch})", "yes" if h.prefetch else "no",
                  f"{h.device_budget_bytes / mib:.1f}", f"{h.predicted_device_peak_bytes / mib:.1f}",
                  f"{h.predicted_to_device_bytes / mib:.1f}", f"{h.predicted_to_host_bytes / mib:.1f}",
                  f"{h.predicted_peer_bytes / mib:.1f}", f"{h.predicted_iteration_s:.4g}")
    return table


def stage_table(plan: plan_pb2.Plan) -> Table:
    table = Table("stage", "layers", "devices", "time/micro-batch ms", "peak GiB", title="stages")
    for s in plan.stages:
        table.add_row(str(s.index), f"{s.layer_begin}-{s.layer_end - 1}", str(s.devices),
                      f"{s.predicted_time_s * 1e3:.3f}", f"{s.predicted_peak_memory_bytes / GiB:.2f}")
    return table


_FLAVOURS = {common_pb2.DP_SHARDING_ZERO1: "zero1", common_pb2.DP_SHARDING_ZERO2: "zero2"}


def strategy(layer: plan_pb2.LayerStrategy) -> str:
    """E.g. "dp8 +zero2 +ckpt", "dp2xtp4 +sp": the dims outermost first, sequence parallelism, the DP flavour (ZeRO-1/2
    over the dp replicas), the flags."""
    dims = "x".join(f"{name}{getattr(layer, name)}" for name in
                    (common_pb2.ParallelDim.Name(d).removeprefix("PARALLEL_DIM_").lower() for d in layer.order)
                    if name in ("dp", "sdp", "tp")) or "single"
    zero = _FLAVOURS.get(layer.dp_sharding, f"dp_sharding={layer.dp_sharding}") \
        if layer.dp_sharding and layer.dp > 1 else ""
    return (dims + (" +sp" if layer.sequence_parallel and layer.tp > 1 else "") + (f" +{zero}" if zero else "")
            + (" +ckpt" if layer.checkpoint else "")
            + (" +swap" if layer.swap_activations else ""))


def layer_table(plan: plan_pb2.Plan) -> Table:
    table = Table("layer", "stage", "dp", "sdp", "tp", "strategy", title="per-layer strategies")
    for layer in plan.layers:
        table.add_row(str(layer.layer_index), str(layer.stage_index), str(layer.dp), str(layer.sdp), str(layer.tp),
                      strategy(layer))
    return table


def alternatives_table(plan: plan_pb2.Plan) -> Table:
    table = Table("alternative", "engine", "batch", "s/iteration", "samples/s", "peak GiB", "vs chosen",
                  title="alternatives and baselines (same cost model)")
    chosen = plan.prediction.throughput_samples_per_s
    for alt in plan.alternatives:
        q = alt.prediction
        fits = not q.out_of_memory
        table.add_row(escape(alt.name), plan_pb2.PlanEngine.Name(alt.engine).removeprefix("PLAN_ENGINE_").lower(),
                      str(alt.global_batch_size), f"{q.iteration_time_s:.4g}" if fits else "-",
                      f"{q.throughput_samples_per_s:.4g}" if fits else "out of memory",
                      f"{q.peak_memory_bytes / GiB:.2f}" if q.peak_memory_bytes else "-",
                      f"{q.throughput_samples_per_s / chosen:.2f}x" if fits and chosen else "-")
    return table

