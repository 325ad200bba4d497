"""ParallelDims from a plan: the one place a job's stages x replicas and its rank layout are computed."""

from __future__ import annotations

import pytest

from ballast.v1 import plan_pb2
from services.specs.parallel import ParallelDims


def plan_of(*devices: int) -> plan_pb2.Plan:
    return plan_pb2.Plan(id="pln-x", stages=[plan_pb2.Stage(devices=d) for d in devices])


def test_a_plans_layout_is_its_stages_by_their_devices():
    dims = ParallelDims.of_plan(plan_of(2, 2, 2))
    assert (dims.pp, dims.dp, dims.world_size) == (3, 2, 6)
    assert [dims.stage_and_replica(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert dims.rank(pp=2, dp=1) == 5  # stage-major: a stage's replicas hold consecutive ranks
    assert ParallelDims.of_plan(plan_of(0)).dp == 1  # a stage that names no device count runs on one


def test_stages_of_different_device_counts_are_refused_by_name():
    with pytest.raises(ValueError, match=r"pln-x: stages over \[1, 2\] device count"):
        ParallelDims.of_plan(plan_of(2, 1))
    with pytest.raises(ValueError, match="no"):
        ParallelDims.of_plan(plan_of())
