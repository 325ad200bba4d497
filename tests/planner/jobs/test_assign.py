"""Placing a plan's ranks on executor hosts (assign.py): what executors can run, and where each rank goes."""

from __future__ import annotations

import pytest

from ballast.v1 import common_pb2, fleet_pb2, plan_pb2
from services.planner.jobs.assign import backend_for, fill, pipeline_shape, placement
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.specs import placement as placement_spec
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


def placed(p: plan_pb2.Plan, hosts: list[fleet_pb2.Host]) -> fleet_pb2.JobPlacement:
    return placement("job-1", p, fill(p, hosts), lambda address: 29500)


def test_ranks_are_stage_major_and_fill_hosts_in_name_order():
    got = placed(plan(2, 2), [host("b", 2), host("a", 2)])
    assert placement_spec.hosts(got) == ["hst-a", "hst-b"]
    ranks = [(r.rank, r.stage_index, r.replica_index, r.host_id, r.device_index) for r in got.ranks]
    assert ranks == [(0, 0, 0, "hst-a", 0), (1, 0, 1, "hst-a", 1), (2, 1, 0, "hst-b", 0), (3, 1, 1, "hst-b", 1)]
    assert [w.rank for w in placement_spec.workers_on(got, "hst-b")] == [2, 3]


def test_spare_devices_stay_free_and_small_hosts_are_used_up():
    got = placed(plan(3, 1), [host("a", 1), host("b", 4)])
    assert placement_spec.ranks_by_host(got) == {"hst-a": [0], "hst-b": [1, 2]}


def test_the_placement_carries_the_layout_the_rendezvous_and_the_batch_split_whole():
    got = placed(plan(2, 2, micro_batch=4), [host("a", 4)])
    assert (got.job_id, got.plan_id, got.stages, got.replicas, got.world_size) == ("job-1", "pln-x", 2, 2, 4)
    assert (got.rendezvous, got.backend) == ("127.0.0.1:29500", "gloo")
    # the plan's micro-batch of 4 split over a stage's 2 replicas; 2 micro-batches of 4 samples per iteration
    assert (got.micro_batch_size, got.num_micro_batches, got.global_batch_size) == (2, 2, 8)
    harmony = plan(1, 2, micro_batch=4)
    harmony.harmony.devices = 2  # one pipeline's devices over the whole micro-batch: not replicas splitting it
    got = placed(harmony, [host("a", 2)])
    assert (got.micro_batch_size, got.global_batch_size) == (4, 8)


def test_the_store_refuses_a_placement_that_does_not_match_its_leases():
    got = placed(plan(2, 1), [host("a", 2)])
    devices = [("hst-a", 0), ("hst-a", 1)]
    placement_spec.check(got, "job-1", devices)
    for job_id, where, field in [("job-2", devices, "placement.job_id"),
                                 ("job-1", [("hst-a", 0), ("hst-a", 2)], "placement.ranks")]:
        with pytest.raises(InvalidArgument) as err:
            placement_spec.check(got, job_id, where)
        assert err.value.field == field
    swapped = fleet_pb2.JobPlacement()
    swapped.CopyFrom(got)
    swapped.ranks[0].stage_index = 1
    with pytest.raises(InvalidArgument) as err:
        placement_spec.check(swapped, "job-1", devices)
    assert err.value.field == "placement.ranks[0]"


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
        fill(plan(2, 2), [host("a", 2), host("g", 8, kind="nvidia-h100-80gb")])
    assert "needs 4 cpu device(s)" in str(err.value) and "2 are online" in str(err.value)


def test_backend_follows_the_device_kind():
    assert backend_for(plan(1, 1)) == "gloo" and backend_for(plan(1, 1, kind="nvidia-h100-80gb")) == "nccl"
    # a GPU host whose agent declares gloo only (a CPU-only torch) gets gloo; undeclared hosts are taken as NCCL
    gpu = plan(1, 1, kind="nvidia-h100-80gb")
    both, gloo = fleet_pb2.Host(labels={"backends": "gloo,nccl"}), fleet_pb2.Host(labels={"backends": "gloo"})
    assert backend_for(gpu, [both, fleet_pb2.Host()]) == "nccl" and backend_for(gpu, [both, gloo]) == "gloo"
