"""Placing a plan's workers on executor hosts: pure, no I/O.

Executors run pipeline x data parallelism: stage s of a P-stage plan runs as D replicas (D = the stage's
devices, the same for every stage), one worker process per device; inside a stage a layer may instead be
tensor-parallel (TP innermost, DP over the rest of the D devices) or sharded over all D (SDP). Global
rank = s * D + r, so the ranks of one stage are consecutive and, filled host by host, a stage's replicas share
a host where they fit (their gradient allreduce, and TP's per-layer all-reduces, are the heaviest traffic).
Rank 0's host serves the torch.distributed rendezvous.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ballast.v1 import common_pb2, fleet_pb2, job_pb2, plan_pb2
from services.planner.search.space import executable_shape
from services.runtime.errors import FailedPrecondition
from services.specs.parallel import ParallelDims

CPU_KINDS = ("cpu",)
PARALLEL_DIM_NAMES = {common_pb2.PARALLEL_DIM_DP: "dp", common_pb2.PARALLEL_DIM_SDP: "sdp",
                      common_pb2.PARALLEL_DIM_TP: "tp"}


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


def fill(plan: plan_pb2.Plan, hosts: list[fleet_pb2.Host]) -> list[tuple[fleet_pb2.Host, int]]:
    """The (host, device index) slots of ranks 0..P*D-1 filling `hosts` in name order (stable placements); the
    admission engine chooses the slots of a shared fleet, this is the whole-fleet fill."""
    dims = pipeline_shape(plan)
    world, kind = dims.world_size, plan.fleet.device.kind
    usable = sorted((h for h in hosts if h.devices and all(d.spec.kind == kind for d in h.devices)),
                    key=lambda h: h.name)
    slots = [(h, d.index) for h in usable for d in h.devices]
    if len(slots) < world:
        raise FailedPrecondition(
            f"the plan needs {world} {kind} device(s) ({dims.pp} stage(s) x {dims.dp} replica(s)); "
            f"{len(slots)} are online", field="spec.fleet",
            fix="start more executors, or submit with a fleet the online executors form")
    return slots[:world]


def placement(job_id: str, plan: plan_pb2.Plan, slots: Sequence[tuple[fleet_pb2.Host, int]],
              port: Callable[[str], int]) -> fleet_pb2.JobPlacement:
    """The job's placement: rank r on slot r ((host, device index), in placement order, so a stage's replicas
    share a host where they can), the rendezvous on rank 0's host at `port(its address)`, the backend its hosts
    run, and the batch split. Computed here once per start; the store keeps it with the leases."""
    dims = pipeline_shape(plan)
    if len(slots) != dims.world_size:
        raise FailedPrecondition(f"{len(slots)} device(s) leased for a plan of {dims.world_size}",
                                 field="plan_id", fix="lease exactly the plan's device count")
    first = slots[0][0].address
    harmony = plan.HasField("harmony")  # one pipeline over the whole micro-batch: its devices are not replicas
    per_worker = plan.micro_batch_size if harmony else plan.micro_batch_size // dims.dp
    out = fleet_pb2.JobPlacement(
        job_id=job_id, plan_id=plan.id, plan_version=plan.version, stages=dims.pp, replicas=dims.dp,
        world_size=dims.world_size, rendezvous=f"{first or '127.0.0.1'}:{port(first)}",
        backend=backend_for(plan, list({h.id: h for h, _ in slots}.values())),
        micro_batch_size=per_worker, num_micro_batches=plan.num_micro_batches,
        global_batch_size=plan.micro_batch_size * plan.num_micro_batches)
    for rank, (host, index) in enumerate(slots):
        stage, replica = dims.stage_and_replica(rank)
        out.ranks.add(rank=rank, stage_index=stage, replica_index=replica, host_id=host.id, device_index=index)
    return out


def placement_of_assigned_event(job_id: str, plan: plan_pb2.Plan, assigned: job_pb2.JobEvent) -> fleet_pb2.JobPlacement:
    """What an ASSIGNED event says of a job started before placements were stored with leases: its hosts' ranks
    ("host:0,1;host2:2,3") and world size (device indexes were not recorded)."""
    dims = pipeline_shape(plan)
    out = fleet_pb2.JobPlacement(job_id=job_id, plan_id=plan.id, plan_version=plan.version, stages=dims.pp,
                                 replicas=dims.dp, world_size=int(assigned.attributes.get("world_size", "0")),
                                 rendezvous=assigned.attributes.get("rendezvous", ""))
    for part in filter(None, assigned.attributes.get("ranks", "").split(";")):
        host, _, ranks = part.partition(":")
        for rank in (int(r) for r in ranks.split(",") if r):
            stage, replica = dims.stage_and_replica(rank)
            out.ranks.add(rank=rank, stage_index=stage, replica_index=replica, host_id=host)
    out.ranks.sort(key=lambda r: r.rank)
    return out


def backend_for(plan: plan_pb2.Plan, hosts: Sequence[fleet_pb2.Host] = ()) -> str:
    """gloo on CPUs; NCCL on GPUs unless a placed host's agent declares it cannot run it (label "backends", the
    torch.distributed backends its workers run; an agent that declares none is taken to run NCCL on a GPU)."""
    if plan.fleet.device.kind in CPU_KINDS:
        return "gloo"
    declared = [h.labels["backends"].split(",") for h in hosts if "backends" in h.labels]
    return "nccl" if all("nccl" in d for d in declared) else "gloo"
