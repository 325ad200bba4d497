"""Placing a plan's workers on executor hosts: pure, no I/O.

Executors run pipeline x data parallelism: stage s of a P-stage plan runs as D replicas (D = the stage's
devices, the same for every stage), one worker process per device; inside a stage a layer may instead be
tensor-parallel (TP innermost, DP over the rest of the D devices) or sharded over all D (SDP). Global
rank = s * D + r, so the ranks of one stage are consecutive and, filled host by host, a stage's replicas share
a host where they fit (their gradient allreduce, and TP's per-layer all-reduces, are the heaviest traffic).
Rank 0's host serves the torch.distributed rendezvous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ballast.v1 import common_pb2, executor_pb2, fleet_pb2, plan_pb2
from services.planner.search.space import executable_shape
from services.runtime.errors import FailedPrecondition
from services.specs.parallel import ParallelDims

CPU_KINDS = ("cpu",)
PARALLEL_DIM_NAMES = {common_pb2.PARALLEL_DIM_DP: "dp", common_pb2.PARALLEL_DIM_SDP: "sdp",
                      common_pb2.PARALLEL_DIM_TP: "tp"}


@dataclass(frozen=True)
class Placement:
    """One host's share of a job."""

    host: fleet_pb2.Host
    workers: tuple[executor_pb2.WorkerAssignment, ...]


def pipeline_shape(plan: plan_pb2.Plan) -> ParallelDims:
    """The layout of a plan the executors can run (stages x replicas); FailedPrecondition naming what they cannot.
    Computed here, once per plan, and read everywhere else: admission, placement, recovery, the events."""
    if not plan.stages:
        raise FailedPrecondition(f"plan {plan.id} has no stages", field="plan_id", fix="plan the job again")
    replicas = {s.devices for s in plan.stages}
    if len(replicas) != 1:
        raise FailedPrecondition(f"plan {plan.id} gives its stages different device counts {sorted(replicas)}",
                                 field="plan_id", fix="executors run equal stages; plan again")
    d = replicas.pop()
    for layer in plan.layers:
        dp, sdp, tp = max(layer.dp, 1), max(layer.sdp, 1), max(layer.tp, 1)
        names = [PARALLEL_DIM_NAMES.get(x, "") for x in layer.order]
        names = [n for n in names if n and {"dp": dp, "sdp": sdp, "tp": tp}[n] > 1]
        if dp * sdp * tp != d or not executable_shape(names, bool(layer.dp_sharding)):
            raise FailedPrecondition(
                f"layer {layer.layer_index} of plan {plan.id} uses dp={layer.dp} sdp={layer.sdp} tp={layer.tp} "
                f"(order {names}); executors run, on each stage's {d} device(s), DP, TP innermost with DP outside it, "
                "or SDP alone", field="plan_id", fix="plan with the executors' runnable dims (not a what-if plan)")
    if plan.micro_batch_size % d and not plan.HasField("harmony"):  # Harmony's devices are one pipeline's
        raise FailedPrecondition(f"micro-batch {plan.micro_batch_size} does not split over {d} replicas",
                                 field="plan_id", fix="plan the job again")
    return ParallelDims(pp=len(plan.stages), dp=d)


def place(plan: plan_pb2.Plan, hosts: list[fleet_pb2.Host]) -> list[Placement]:
    """Fill hosts in order (by name, for stable placements) with ranks 0..P*D-1."""
    dims = pipeline_shape(plan)
    world = dims.world_size
    kind = plan.fleet.device.kind
    usable = sorted((h for h in hosts if h.devices and all(d.spec.kind == kind for d in h.devices)),
                    key=lambda h: h.name)
    slots = sum(len(h.devices) for h in usable)
    if slots < world:
        raise FailedPrecondition(
            f"the plan needs {world} {kind} device(s) ({dims.pp} stage(s) x {dims.dp} replica(s)); "
            f"{slots} are online", field="spec.fleet",
            fix="start more executors, or submit with a fleet the online executors form")
    placements, rank = [], 0
    for host in usable:
        workers = []
        for device in host.devices:
            if rank == world:
                break
            stage, replica = dims.stage_and_replica(rank)
            workers.append(executor_pb2.WorkerAssignment(device_index=device.index, rank=rank,
                                                         stage_index=stage, replica_index=replica))
            rank += 1
        if workers:
            placements.append(Placement(host, tuple(workers)))
    return placements


def place_on(plan: plan_pb2.Plan, slots: list[tuple[fleet_pb2.Host, int]]) -> list[Placement]:
    """Ranks 0..P*D-1 on exactly the leased devices `slots` ((host, device index), in placement order), so a
    stage's replicas share a host where they can; one Placement per host, in first-use order."""
    dims = pipeline_shape(plan)
    if len(slots) != dims.world_size:
        raise FailedPrecondition(f"{len(slots)} device(s) leased for a plan of {dims.world_size}",
                                 field="plan_id", fix="lease exactly the plan's device count")
    workers: dict[str, list[executor_pb2.WorkerAssignment]] = {}
    hosts: dict[str, fleet_pb2.Host] = {}
    for rank, (host, index) in enumerate(slots):
        hosts.setdefault(host.id, host)
        stage, replica = dims.stage_and_replica(rank)
        workers.setdefault(host.id, []).append(executor_pb2.WorkerAssignment(
            device_index=index, rank=rank, stage_index=stage, replica_index=replica))
    return [Placement(hosts[h], tuple(w)) for h, w in workers.items()]


def backend_for(plan: plan_pb2.Plan, hosts: Sequence[fleet_pb2.Host] = ()) -> str:
    """gloo on CPUs; NCCL on GPUs unless a placed host's agent declares it cannot run it (label "backends", the
    torch.distributed backends its workers run; an agent that declares none is taken to run NCCL on a GPU)."""
    if plan.fleet.device.kind in CPU_KINDS:
        return "gloo"
    declared = [h.labels["backends"].split(",") for h in hosts if "backends" in h.labels]
    return "nccl" if all("nccl" in d for d in declared) else "gloo"
