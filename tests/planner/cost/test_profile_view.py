"""ModelView: interpolation, extrapolation, unfit layers, relay edges, and conversion from a Profile proto."""

from __future__ import annotations

import pytest

from ballast.v1 import common_pb2, fleet_pb2, profile_pb2
from services.planner.cost import LayerDoesNotFit, LayerTable, LayerView, ModelView, from_profile
from tests.cost_support import layer


def test_interpolates_between_samples_and_is_exact_at_them() -> None:
    t = LayerTable.from_rows(
        [(2, 0.010, 0.030, 0.011, 200, 2000, 100, 5000), (4, 0.014, 0.050, 0.015, 400, 4000, 200, 9000)]
    )
    assert t.point(2).forward_s == pytest.approx(0.010)
    p = t.point(3)
    assert p.forward_s == pytest.approx(0.012)
    assert p.backward_s == pytest.approx(0.040)
    assert p.recompute_s == pytest.approx(0.013)
    assert p.boundary_bytes == pytest.approx(300)
    assert p.stashed_bytes == pytest.approx(3000)
    assert p.output_bytes == pytest.approx(150)
    assert p.peak_bytes == pytest.approx(7000)


def test_extrapolates_linearly_and_never_negative() -> None:
    t = LayerTable.from_rows([(2, 0.010, 0.030, 0.0, 200, 2000, 100, 0), (4, 0.014, 0.050, 0.0, 400, 4000, 200, 0)])
    assert t.point(8).forward_s == pytest.approx(0.022)  # slope 0.002/sample beyond the last sample
    assert t.point(1).forward_s == pytest.approx(0.008)  # keeps the fixed per-call cost going down
    steep = LayerTable.from_rows([(4, 0.001, 0.001, 0, 10, 10, 10, 0), (8, 0.009, 0.009, 0, 90, 90, 90, 0)])
    assert steep.point(1).forward_s == 0.0  # the line would go negative: clamped
    assert steep.point(1).stashed_bytes == 0.0


def test_extrapolates_up_along_the_upper_half_so_one_noisy_top_row_cannot_tilt_it() -> None:
    """Rows as the profiler stores them: measured at 1, 2, 4, 8, the regression's line in between, the top
    measured 5% slow. The chord from 4 carries that 5% as 5% of the slope; from 7 it would be 40%."""
    line = [(m, 0.001 * m, 0.002 * m, 0.0, 0, 0, 0, 0) for m in range(1, 8)]
    table = LayerTable.from_rows([*line, (8, 0.0084, 0.016, 0.0, 0, 0, 0, 0)])
    assert table.point(64).forward_s == pytest.approx(0.0084 + 56 * (0.0084 - 0.004) / 4)  # 0.070, not 0.084
    assert table.point(6).forward_s == pytest.approx(0.006)  # inside: exact at the rows, as before
    assert table.point(64).backward_s == pytest.approx(0.128)  # linear rows: the same line either way
    dense = LayerTable.from_rows([(m, 0.001 * m, 0.0, 0.0, 0, 0, 0, 0) for m in (1, 2, 3)])
    assert dense.point(5).forward_s == pytest.approx(0.005)


def test_single_sample_scales_proportionally_and_recompute_falls_back_to_forward() -> None:
    t = LayerTable.from_rows([(4, 0.004, 0.008, 0.0, 40, 400, 40, 0)])
    p = t.point(6)
    assert p.forward_s == pytest.approx(0.006)
    assert p.stashed_bytes == pytest.approx(600)
    assert p.recompute_s == pytest.approx(0.006)  # no recompute measured: a forward again


def test_table_validation() -> None:
    with pytest.raises(ValueError):
        LayerTable(micro_batch_sizes=(2, 1), forward_s=(1.0, 2.0), backward_s=(1.0, 2.0))
    with pytest.raises(ValueError):
        LayerTable(micro_batch_sizes=(1,), forward_s=(-1.0,), backward_s=(1.0,))
    with pytest.raises(ValueError):
        LayerTable.from_rows([(1, 0.1, 0.2, 0.1, 1, 1, 1, 1)]).point(0)


def test_unfit_layer_is_flagged_and_raises_with_its_note() -> None:
    view = ModelView(layers=(layer(0), LayerView(index=1, name="huge", note="does not fit at micro-batch 1: OOM")))
    assert view.unfit_layers == (1,)
    assert not view.layers[1].fits
    with pytest.raises(LayerDoesNotFit, match="does not fit at micro-batch 1"):
        view.point(1, 2)


def test_crossing_relays_skip_edges_past_cuts() -> None:
    # 0 enc.embed, 1 enc, 2 enc (encoder output), 3 dec.embed, 4 dec reads 2, 5 dec reads 2, 6 head
    layers = [layer(i) for i in range(4)] + [layer(4, extra_inputs=(2,)), layer(5, extra_inputs=(2,)), layer(6)]
    view = ModelView(layers=tuple(layers))
    assert view.crossing(3) == (2,)  # the predecessor is the encoder output itself: counted once
    assert view.crossing(4) == (2, 3)
    assert view.crossing(5) == (2, 4)
    assert view.crossing(6) == (5,)  # no reader of 2 after 5
    with pytest.raises(ValueError):
        view.crossing(0)
    with pytest.raises(ValueError):
        ModelView(layers=(layer(0), layer(1, extra_inputs=(0,))))  # predecessor is not an extra input


def _profile() -> profile_pb2.Profile:
    p = profile_pb2.Profile(
        id="prf-1",
        dtype=common_pb2.DTYPE_BF16,
        device=fleet_pb2.DeviceSpec(kind="nvidia-h100-80gb", memory_bytes=80 * 2**30),
        non_model_memory_bytes=12345,
    )
    emb = p.layers.add(index=0, name="embed", kind="embed", parameter_count=10, parameter_bytes=20,
                       gradient_bytes=20, optimizer_state_bytes=120, tied_with=[2], batch_input_bytes=64)
    for m, f in ((1, 0.001), (4, 0.004)):
        emb.samples.add(micro_batch_size=m, measured=True, forward_s=f, backward_s=2 * f, recompute_s=f,
                        boundary_activation_bytes=0, stashed_activation_bytes=10 * m, output_bytes=100 * m,
                        peak_memory_bytes=1000 * m)
    emb.samples.add(micro_batch_size=4, measured=False, forward_s=9.0, backward_s=9.0)  # duplicate, not measured
    p.layers.add(index=1, name="block.0", kind="block", note="does not fit at micro-batch 1: too big")
    head = p.layers.add(index=2, name="head", kind="head", parameter_count=10, tied_with=[0], extra_inputs=[0])
    head.samples.add(micro_batch_size=2, measured=True, forward_s=0.002, backward_s=0.004, output_bytes=4)
    p.comm.overlap_slowdown = 1.25
    p.comm.collectives.add(collective="allreduce", group_size=2, scope=profile_pb2.LINK_SCOPE_INTRA_NODE,
                           bytes=1024, seconds=1e-4)
    p.comm.links.add(scope=profile_pb2.LINK_SCOPE_INTRA_NODE, bytes=1024, seconds=1e-5)
    p.comm.fits.add(collective="allreduce", group_size=2, latency_s=1e-5, bandwidth_bytes_per_s=5e9, r2=0.99)
    p.comm.fits.add(collective="p2p", group_size=2, latency_s=-1e-7, bandwidth_bytes_per_s=9e9, r2=0.98)
    p.comm.fits.add(collective="allgather", group_size=2, latency_s=1e-5, bandwidth_bytes_per_s=0.0)  # rejected
    return p


def test_from_profile_converts_every_field() -> None:
    view = from_profile(_profile())
    assert len(view) == 3
    assert view.profile_id == "prf-1"
    assert view.dtype == "bf16"
    assert view.device_kind == "nvidia-h100-80gb"
    assert view.non_model_memory_bytes == 12345
    assert view.overlap_slowdown == 1.25
    emb = view.layers[0]
    sizes = (emb.parameter_count, emb.parameter_bytes, emb.gradient_bytes, emb.optimizer_state_bytes)
    assert sizes == (10, 20, 20, 120)
    assert emb.tied_with == (2,)
    assert emb.batch_input_bytes == 64
    assert emb.table.micro_batch_sizes == (1, 4)
    assert emb.forward_s(4) == pytest.approx(0.004)  # the measured row won over the interpolated duplicate
    assert emb.forward_s(2) == pytest.approx(0.002)
    assert emb.output_bytes(3) == pytest.approx(300)
    assert view.unfit_layers == (1,)
    assert "too big" in view.layers[1].note
    assert view.layers[2].extra_inputs == (0,)
    assert view.crossing(1) == (0,)
    assert view.crossing(2) == (0, 1)
    fits = {(f.collective, f.group_size): f for f in view.comm_fits}
    assert set(fits) == {("allreduce", 2), ("p2p", 2)}  # zero-bandwidth fit dropped
    assert fits[("allreduce", 2)].scope == "intra_node"
    assert fits[("p2p", 2)].latency_s == 0.0  # negative latency clamped


def test_from_profile_unset_slowdown_is_none() -> None:
    view = from_profile(profile_pb2.Profile())
    assert view.overlap_slowdown is None
    assert view.layers == ()
