"""Assign instructions for agent and worker tests, placed by the planner's own `assign.placement`."""

from __future__ import annotations

from ballast.v1 import executor_pb2, fleet_pb2, plan_pb2
from services.planner.jobs.assign import pipeline_shape, placement
from services.specs.placement import workers_on

HOST = fleet_pb2.Host(id="hst-a", name="a", address="127.0.0.1")


def assign_on_one_host(given: plan_pb2.Plan, job_id: str = "job-x", port: int = 1) -> executor_pb2.AssignInstruction:
    """Every rank of `plan` on one CPU host's devices 0..world-1, its rendezvous on 127.0.0.1:`port`."""
    plan = plan_pb2.Plan()
    plan.CopyFrom(given)  # a copy: the CPU kind below is the test's, not the caller's plan's
    plan.fleet.device.kind = plan.fleet.device.kind or "cpu"
    world = pipeline_shape(plan).world_size
    placed = placement(job_id, plan, [(HOST, i) for i in range(world)], lambda _: port)
    return executor_pb2.AssignInstruction(plan=plan, placement=placed, workers=workers_on(placed, HOST.id))
