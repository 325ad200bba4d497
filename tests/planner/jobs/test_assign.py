"""Placing a plan's ranks on executor hosts (assign.py): what executors can run, and where each rank goes."""

from __future__ import annotations

import pytest

from ballast.v1 import common_pb2, fleet_pb2, plan_pb2
from services.planner.jobs.assign import backend_for, pipeline_shape, place
from services.runtime.errors import FailedPrecondition
from services.specs.parallel import ParallelDims


def plan(stages: int, replicas: int, *, layers_per_stage: int = 2, kind: str = "cpu", micro_batch: int = 4,
         order: tuple[int, ...] = (), dp_sharding: int = 0, **layer_kw) -> plan_pb2.Plan:
    p = plan_pb2.Plan(id="pln-x", micro_batch_size=micro_batch, num_micro_batches=2)
    p.fleet.device.kind = kind
    for s in range(stages):
        p.stages.add(index=s, layer_begin=s * layers_per_stage, layer_end=(s + 1) * layers_per_stage,
                     devices=replicas)
        for i in range(s * layers_per_stage, (s + 1) * layers_per_stage):
            p.layers.add(layer_index=i, stage_index=s, dp=layer_kw.get("dp", replicas), sdp=layer_kw.get("sdp", 1),
                         tp=layer_kw.get("tp", 1), order=order, dp_sharding=dp_sharding)
    return p


DP, SDP, TP = common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_SDP, common_pb2.PARALLEL_DIM_TP


def host(name: str, slots: int, kind: str = "cpu") -> fleet_pb2.Host:
    return fleet_pb2.Host(id=f"hst-{name}", name=name, address="127.0.0.1",
                          devices=[fleet_pb2.Device(index=i, spec=fleet_pb2.DeviceSpec(kind=kind))
                                   for i in range(slots)])


def test_ranks_are_stage_major_and_fill_hosts_in_name_order():
    placed = place(plan(2, 2), [host("b", 2), host("a", 2)])
    assert [p.host.name for p in placed] == ["a", "b"]
    ranks = [(w.rank, w.stage_index, w.replica_index, w.device_index) for p in placed for w in p.workers]
    assert ranks == [(0, 0, 0, 0), (1, 0, 1, 1), (2, 1, 0, 0), (3, 1, 1, 1)]


def test_spare_devices_stay_free_and_small_hosts_are_used_up():
    placed = place(plan(3, 1), [host("a", 1), host("b", 4)])
    assert [(p.host.name, len(p.workers)) for p in placed] == [("a", 1), ("b", 2)]


@pytest.mark.parametrize("good", [plan(2, 2, tp=2, dp=1), plan(2, 2, sdp=2, dp=1, order=(SDP,)),
                                  plan(1, 4, tp=2, dp=2, order=(DP, TP)), plan(1, 4, dp_sharding=2)])
def test_the_shapes_the_workers_run_are_accepted(good):
    """TP innermost with DP outside it, SDP alone, ZeRO on plain DP (train/hybrid.py, workers.hybrid_layers)."""
    assert pipeline_shape(good) == ParallelDims(pp=len(good.stages), dp=good.stages[0].devices)


@pytest.mark.parametrize("bad, words", [
    (plan(1, 4, tp=2, dp=2, order=(TP, DP)), "tp=2"),  # DP inside TP
    (plan(1, 4, sdp=2, tp=2, dp=1, order=(SDP, TP)), "sdp=2"),  # SDP beside TP
    (plan(1, 4, tp=2, dp=2, order=(DP, TP), dp_sharding=1), "TP innermost"),  # ZeRO on a TP layer
    (plan(2, 2, tp=4, dp=1), "tp=4"),  # more devices than the stage has
    (plan(1, 4, micro_batch=2), "does not split"),
])
def test_plans_executors_cannot_run_are_refused(bad, words):
    with pytest.raises(FailedPrecondition) as err:
        pipeline_shape(bad)
    assert words in str(err.value)


def test_uneven_stages_are_refused():
    p = plan(2, 2)
    p.stages[1].devices = 1
    with pytest.raises(FailedPrecondition, match="different device counts"):
        pipeline_shape(p)


def test_too_few_devices_or_the_wrong_kind_says_how_many_are_needed():
    with pytest.raises(FailedPrecondition) as err:
        place(plan(2, 2), [host("a", 2), host("g", 8, kind="nvidia-h100-80gb")])
    assert "needs 4 cpu device(s)" in str(err.value) and "2 are online" in str(err.value)


def test_backend_follows_the_device_kind():
    assert backend_for(plan(1, 1)) == "gloo" and backend_for(plan(1, 1, kind="nvidia-h100-80gb")) == "nccl"
    # a GPU host whose agent declares gloo only (a CPU-only torch) gets gloo; undeclared hosts are taken as NCCL
    gpu = plan(1, 1, kind="nvidia-h100-80gb")
    both, gloo = fleet_pb2.Host(labels={"backends": "gloo,nccl"}), fleet_pb2.Host(labels={"backends": "gloo"})
    assert backend_for(gpu, [both, fleet_pb2.Host()]) == "nccl" and backend_for(gpu, [both, gloo]) == "gloo"
