"""CommModel: ring formulas on fleet links, measured fits (exact and rescaled), byte conventions."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ballast.v1 import fleet_pb2
from services.planner.cost import CommModel, CostContext, FleetView, MeasuredFit, ModelView, Scope
from tests.cost_support import GB, fleet

MB = 1e6


def test_fleet_link_ring_formulas() -> None:
    comm = CommModel(fleet(intra_bw=10 * GB, intra_lat=1e-6, inter_bw=1 * GB, inter_lat=1e-5))
    n, b = 4, 100 * MB
    assert comm.allreduce(b, n, Scope.INTRA) == pytest.approx(2 * 3 / 4 * b / 10e9 + 2 * 3 * 1e-6)
    assert comm.allgather(b, n, Scope.INTRA) == pytest.approx(3 / 4 * b / 10e9 + 3 * 1e-6)
    assert comm.reduce_scatter(b, n, Scope.INTRA) == pytest.approx(3 / 4 * b / 10e9 + 3 * 1e-6)
    assert comm.all_to_all(b, n, Scope.INTRA) == pytest.approx(3 / 4 * b / 10e9 + 3 * 1e-6)
    assert comm.p2p(b, Scope.INTER) == pytest.approx(1e-5 + b / 1e9)
    assert comm.allreduce(b, 2, Scope.INTER) == pytest.approx(b / 1e9 + 2 * 1e-5)
    assert comm.source("allreduce", 4, Scope.INTRA).startswith("from fleet links")


def test_trivial_groups_and_empty_messages_are_free() -> None:
    comm = CommModel(fleet())
    assert comm.allreduce(1e9, 1) == 0.0
    assert comm.allgather(0, 8) == 0.0
    assert comm.p2p(0) == 0.0


def test_allreduce_equals_allgather_plus_reduce_scatter_on_links() -> None:
    comm = CommModel(fleet(intra_lat=2e-6))
    b = 64 * MB
    for n in (2, 4):
        assert comm.allreduce(b, n) == pytest.approx(comm.allgather(b, n) + comm.reduce_scatter(b, n))


def test_measured_fit_is_used_for_its_collective_group_and_scope() -> None:
    fits = [MeasuredFit("allreduce", 2, "intra_node", 1e-5, 2e9, 0.99)]
    comm = CommModel(fleet(), fits)
    assert comm.allreduce(1 * MB, 2, Scope.INTRA) == pytest.approx(1e-5 + 1e6 / 2e9)
    assert comm.source("allreduce", 2, Scope.INTRA).startswith("measured (allreduce n=2")
    # Another scope has no fit: the fleet's inter-node link.
    assert comm.allreduce(1 * MB, 2, Scope.INTER) == pytest.approx(1e6 / 10e9)
    assert comm.source("allreduce", 2, Scope.INTER).startswith("from fleet links")
    # Another collective has no fit either.
    assert comm.source("allgather", 2, Scope.INTRA).startswith("from fleet links")


def test_measured_fit_rescaled_to_other_group_size_by_bus_bandwidth() -> None:
    comm = CommModel(fleet(), [MeasuredFit("allreduce", 2, "intra_node", 1e-5, 2e9)])
    # n=2: bus bandwidth = 2(n-1)/n * algbw = 2e9. n=4: algbw = busbw / 1.5; latency x (2*3)/(2*1).
    assert comm.allreduce(1 * MB, 4) == pytest.approx(3e-5 + 1.5 * 1e6 / 2e9)
    assert comm.source("allreduce", 4).startswith("measured, rescaled")


def test_allgather_fit_takes_the_shard_and_api_takes_the_full_tensor() -> None:
    comm = CommModel(fleet(), [MeasuredFit("allgather", 2, "intra_node", 0.0, 1e9)])
    # The fit says a 1 MB shard gathers in 1 ms; the full gathered tensor is 2 MB.
    assert comm.allgather(2 * MB, 2) == pytest.approx(1e-3)
    # Rescaled to n=4: bus bandwidth (n-1) x algbw = 1e9; a 4 MB tensor (1 MB shards) moves 3 MB per rank.
    assert comm.allgather(4 * MB, 4) == pytest.approx(3e-3)


def test_use_measured_false_prices_from_links() -> None:
    fits = [MeasuredFit("allreduce", 2, "intra_node", 1e-3, 1e6)]
    assert CommModel(fleet(), fits, use_measured=False).allreduce(1 * MB, 2) == pytest.approx(1e6 / 100e9)


def test_p2p_link_is_the_measured_fit_or_the_fleet_link() -> None:
    comm = CommModel(fleet(inter_lat=5e-6), [MeasuredFit("p2p", 2, "intra_node", 2e-6, 40e9)])
    intra = comm.p2p_link(Scope.INTRA)
    assert (intra.latency_s, intra.bandwidth_bytes_per_s) == (2e-6, pytest.approx(40e9))
    inter = comm.p2p_link(Scope.INTER)
    assert (inter.latency_s, inter.bandwidth_bytes_per_s) == (5e-6, pytest.approx(10e9))


def test_missing_link_bandwidth_raises_instead_of_being_free() -> None:
    view = FleetView.from_fleet(fleet_pb2.Fleet(devices_per_node=8, nodes=1, intra_node=fleet_pb2.Link(
        kind=fleet_pb2.LINK_KIND_NVLINK, bandwidth_bytes_per_s=450e9, latency_s=2e-6)))
    comm = CommModel(view)
    assert comm.allreduce(1 * MB, 8) > 0
    with pytest.raises(ValueError, match="inter_node"):
        comm.allreduce(1 * MB, 2, Scope.INTER)
    assert view.host_link is None


def test_fleet_view_from_proto() -> None:
    pb = fleet_pb2.Fleet(
        name="f", devices_per_node=4, nodes=3,
        device=fleet_pb2.DeviceSpec(kind="a100", memory_bytes=40 * 2**30,
                                    host_link=fleet_pb2.Link(bandwidth_bytes_per_s=31.5e9, latency_s=5e-6)),
        intra_node=fleet_pb2.Link(bandwidth_bytes_per_s=300e9, latency_s=2e-6),
        inter_node=fleet_pb2.Link(bandwidth_bytes_per_s=25e9, latency_s=5e-6),
    )
    v = FleetView.from_fleet(pb)
    assert v.devices == 12
    assert v.intra_node.bandwidth_bytes_per_s == 300e9
    assert v.host_link.latency_s == 5e-6
    assert v.device_memory_bytes == 40 * 2**30
    assert math.isfinite(CommModel(pb).p2p(1e6, Scope.INTER))


def test_unknown_collective_rejected() -> None:
    with pytest.raises(ValueError):
        CommModel(fleet()).time("broadcast", 1e6, 2)


def test_context_ignores_fits_measured_on_another_device_kind() -> None:
    fits = (MeasuredFit("allreduce", 2, "intra_node", 1e-3, 1e6),)
    view = ModelView(layers=(), comm_fits=fits, device_kind="cpu")
    assert CostContext(view, replace(fleet(), device_kind="cpu")).comm.source("allreduce", 2).startswith("measured")
    other = CostContext(view, replace(fleet(), device_kind="nvidia-h100-80gb")).comm
    assert other.source("allreduce", 2).startswith("from fleet links")
