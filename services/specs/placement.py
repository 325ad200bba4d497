"""A job's placement (fleet.proto `JobPlacement`) read and checked: pure, no I/O.

The placement is computed once, by the planner when it starts a job on its leased devices
(services/planner/jobs/assign.py `placement`); the store keeps it with those leases, the agent and the workers
read it. These are the only questions asked of it downstream (which ranks run on a host, which hosts run the
job, its ParallelDims), so nobody re-derives a layout from a plan or from a list of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from ballast.v1 import executor_pb2, fleet_pb2
from services.runtime.errors import InvalidArgument
from services.specs.parallel import ParallelDims

FIX = "send the placement assign.placement computed for exactly these devices"


def dims(placement: fleet_pb2.JobPlacement) -> ParallelDims:
    return ParallelDims(pp=placement.stages, dp=placement.replicas)


def hosts(placement: fleet_pb2.JobPlacement) -> list[str]:
    """Host ids running the job, in order of their first rank (rank 0's host, which serves the rendezvous, first)."""
    return list(dict.fromkeys(r.host_id for r in placement.ranks))


def ranks_on(placement: fleet_pb2.JobPlacement, host_id: str) -> list[fleet_pb2.RankPlacement]:
    return [r for r in placement.ranks if r.host_id == host_id]


def workers_on(placement: fleet_pb2.JobPlacement, host_id: str) -> list[executor_pb2.WorkerAssignment]:
    """The workers a host's agent launches: its ranks of the placement (AssignInstruction.workers)."""
    return [executor_pb2.WorkerAssignment(device_index=r.device_index, rank=r.rank, stage_index=r.stage_index,
                                          replica_index=r.replica_index) for r in ranks_on(placement, host_id)]


def ranks_by_host(placement: fleet_pb2.JobPlacement) -> dict[str, list[int]]:
    """Host id -> the ranks it runs, hosts in order of their first rank."""
    out: dict[str, list[int]] = {}
    for r in placement.ranks:
        out.setdefault(r.host_id, []).append(r.rank)
    return out


def check(placement: fleet_pb2.JobPlacement, job_id: str, devices: Sequence[tuple[str, int]]) -> None:
    """INVALID_ARGUMENT naming the field unless `placement` places job `job_id`'s ranks 0..world-1, laid out by
    its ParallelDims, once each on exactly `devices` ((host id, device index) pairs), with a batch split that adds
    up."""
    def refuse(field: str, why: str) -> InvalidArgument:
        return InvalidArgument(why, field=f"placement.{field}", fix=FIX)

    if placement.job_id != job_id:
        raise refuse("job_id", f"places job {placement.job_id!r}, not {job_id!r}")
    try:
        layout = dims(placement)
    except ValueError as exc:
        raise refuse("stages", str(exc)) from None
    if placement.world_size != layout.world_size or len(placement.ranks) != layout.world_size:
        raise refuse("world_size", f"{placement.world_size} rank(s) and {len(placement.ranks)} placed for "
                     f"{layout.pp} stage(s) x {layout.dp} replica(s)")
    for n, r in enumerate(placement.ranks):
        if r.rank != n or layout.stage_and_replica(n) != (r.stage_index, r.replica_index):
            raise refuse(f"ranks[{n}]", f"rank {r.rank} at stage {r.stage_index} replica {r.replica_index}; "
                         f"rank {n} is stage {layout.stage_and_replica(n)[0]} replica {layout.stage_and_replica(n)[1]}")
    placed = sorted((r.host_id, r.device_index) for r in placement.ranks)
    if placed != sorted(devices):
        raise refuse("ranks", f"places ranks on {placed}, but the devices are {sorted(devices)}")
    if not placement.rendezvous or placement.backend not in ("gloo", "nccl"):
        raise refuse("rendezvous", f"rendezvous {placement.rendezvous!r}, backend {placement.backend!r}: give "
                     "host:port and gloo or nccl")
    if placement.micro_batch_size < 1 or placement.num_micro_batches < 1 or placement.global_batch_size < (
            placement.micro_batch_size * placement.num_micro_batches):
        raise refuse("global_batch_size", f"{placement.global_batch_size} samples from micro-batches of "
                     f"{placement.micro_batch_size} x {placement.num_micro_batches}")
