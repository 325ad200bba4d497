"""Stages and pipelines: aggregation, relayed cut bytes, placement and links, in-flight counts, peak memory."""

from __future__ import annotations

import math

import pytest

from services.planner.cost import (
    CostContext,
    CostOptions,
    DeviceLayout,
    LayerStrategy,
    ModelView,
    Placement,
    Scope,
    bounds_from_sizes,
    build_pipeline,
    in_flight_micro_batches,
    layer_cost,
    overlap_time,
    peak_memory,
    pipeline_peak_memory,
    stage_cost,
    stage_peak_memory,
    transform_cost,
)
from services.planner.cost.strategy import DpSharding
from services.planner.sim.model import Pipeline, Schedule, StageCost
from tests.cost_support import GB, fleet, layer, model

P, M = 1000, 8
MS, BWD, BND, STASH, OUT = 1e-3, 2e-3, 100, 1000, 100
NO_OVERLAP = CostOptions(overlap_grad_sync=False)


def test_stage_sums_layers() -> None:
    ctx = CostContext(model(4, params=P), fleet())
    sc = stage_cost(ctx, 0, 2, LayerStrategy(), M)
    assert isinstance(sc, StageCost)
    assert sc.forward_s == pytest.approx(2 * M * MS)
    assert sc.backward_s == pytest.approx(2 * M * BWD)
    assert sc.recompute_s == 0
    assert sc.output_bytes == M * OUT
    assert sc.allreduce_s == 0
    assert sc.model_memory_bytes == 2 * 16 * P
    assert sc.activation_bytes == 2 * M * (BND + STASH)
    assert sc.transient_bytes == 0
    last = stage_cost(ctx, 2, 4, LayerStrategy(), M)
    assert last.output_bytes == 0  # nothing after the last stage


def test_stage_checkpointing_and_eq2_transient() -> None:
    ctx = CostContext(model(4, params=P), fleet())
    ck = stage_cost(ctx, 0, 2, LayerStrategy(checkpoint=True), M)
    assert ck.activation_bytes == 2 * M * BND
    assert ck.recompute_s == pytest.approx(2 * M * MS)
    assert ck.transient_bytes == M * STASH  # one layer's intermediates recomputed at a time
    # Checkpointed layer 0 before a plain layer 1: layer 1's kept intermediates are freed by its own
    # backward before layer 0 recomputes, so the Eq. 2 peak is the plain forward total: no transient.
    mixed = stage_cost(ctx, 0, 2, [LayerStrategy(checkpoint=True), LayerStrategy()], M)
    assert mixed.activation_bytes == M * BND + M * (BND + STASH)
    assert mixed.transient_bytes == 0
    eq2 = max(M * BND + M * STASH, M * BND + M * (BND + STASH))  # max_i sum_{k<=i} Of + Ob_i
    assert mixed.activation_bytes + mixed.transient_bytes == eq2


def test_stage_swap_and_transformation() -> None:
    ctx = CostContext(model(4, params=P), fleet())
    sw = stage_cost(ctx, 0, 2, LayerStrategy(checkpoint=True, swap=True), M)
    assert sw.activation_bytes == sw.swap_bytes == 2 * M * BND
    assert sw.transient_bytes == M * STASH
    # Parked micro-batches hold nothing on the device; the one in backward has its activations back.
    assert peak_memory(sw, 4) == sw.model_memory_bytes + 2 * M * BND + M * STASH
    half = stage_cost(ctx, 0, 2, [LayerStrategy(checkpoint=True, swap=True), LayerStrategy(checkpoint=True)], M)
    assert (half.activation_bytes, half.swap_bytes) == (2 * M * BND, M * BND)
    assert peak_memory(half, 4) == half.model_memory_bytes + 4 * M * BND + M * BND + M * STASH
    a, b = LayerStrategy(dp=4), LayerStrategy(dp=2, tp=2)
    changed = stage_cost(ctx, 0, 2, [a, b], M)
    t = transform_cost(ctx, 1, a, b, M)
    assert t.forward_s == pytest.approx(0.25 * M * OUT / (100 * GB))  # a quarter of layer 0's output fetched
    assert t.backward_s == 0  # the gradient goes back by slicing
    assert changed.forward_s == pytest.approx(
        layer_cost(ctx, 0, a, M).forward_s + layer_cost(ctx, 1, b, M).forward_s + t.forward_s
    )
    bwd = layer_cost(ctx, 0, a, M).backward_s + layer_cost(ctx, 1, b, M).backward_s
    assert changed.backward_s == pytest.approx(bwd)


def test_stage_rejects_mixed_device_counts_and_bad_ranges() -> None:
    ctx = CostContext(model(4), fleet())
    with pytest.raises(ValueError, match="device counts"):
        stage_cost(ctx, 0, 2, [LayerStrategy(dp=2), LayerStrategy()], M)
    with pytest.raises(ValueError):
        stage_cost(ctx, 2, 2, LayerStrategy(), M)
    with pytest.raises(ValueError):
        stage_cost(ctx, 0, 2, [LayerStrategy()] * 3, M)


def test_cut_relays_skip_edges() -> None:
    # T5-like: 0-2 encoder (2 = encoder output, 300 B/sample), 3 decoder embed, 4-5 decoder blocks reading 2.
    layers = [layer(0), layer(1), layer(2, output=300), layer(3), layer(4, extra_inputs=(2,)),
              layer(5, extra_inputs=(2,)), layer(6)]
    ctx = CostContext(ModelView(layers=tuple(layers)), fleet())
    assert stage_cost(ctx, 0, 3, LayerStrategy(), M).output_bytes == M * 300
    assert stage_cost(ctx, 0, 4, LayerStrategy(), M).output_bytes == M * (100 + 300)
    assert stage_cost(ctx, 4, 5, LayerStrategy(), M).output_bytes == M * (100 + 300)
    assert stage_cost(ctx, 5, 6, LayerStrategy(), M).output_bytes == M * 100


def test_grad_sync_at_iteration_end_overlapped_or_not() -> None:
    view = model(4, params=10**8)  # 400 MB of gradients per layer
    plain = stage_cost(CostContext(view, fleet(), NO_OVERLAP), 0, 2, LayerStrategy(dp=2), M)
    per_layer = 2 * 0.5 * 4e8 / (100 * GB)
    assert plain.allreduce_s == pytest.approx(2 * per_layer)
    hidden = stage_cost(CostContext(view, fleet(), CostOptions(overlap_slowdown=1.3)), 0, 2, LayerStrategy(dp=2), M)
    b_comp = 2 * M / 2 * BWD
    assert hidden.allreduce_s == pytest.approx(overlap_time(b_comp, 2 * per_layer, 1.3) - b_comp)
    assert 0 < hidden.allreduce_s < plain.allreduce_s


def test_plain_dp_layers_sync_in_one_bucket_after_the_backward() -> None:
    """After the last backward (the executors' way) a stage's plain-DP layers share one allreduce, so the
    latency is paid once, and DP inside the stage prices like the same stage copied across replicas; overlapped
    (Galvatron's DDP) every layer keeps its own."""
    view = model(4, params=10**6)
    slow = fleet(intra_lat=5e-3)  # a per-call latency, as gloo has
    ctx = CostContext(view, slow, NO_OVERLAP)
    inside = stage_cost(ctx, 0, 4, LayerStrategy(dp=2), M)
    across = stage_cost(ctx, 0, 4, LayerStrategy(), M // 2, replicas=2, replica_scope=Scope.INTRA)
    one = ctx.comm.allreduce(4 * 4e6, 2, Scope.INTRA)
    assert inside.allreduce_s == pytest.approx(one) == pytest.approx(across.allreduce_s)
    each = sum(layer_cost(ctx, i, LayerStrategy(dp=2), M).grad_sync_s for i in range(4))
    assert each == pytest.approx(4 * ctx.comm.allreduce(4e6, 2, Scope.INTRA)) and each > one
    zero = stage_cost(ctx, 0, 4, LayerStrategy(dp=2, dp_sharding=DpSharding.ZERO1), M)
    assert zero.allreduce_s > one  # ZeRO layers sync one at a time, and gather their parameters after the step


def test_the_packed_allreduce_bucket_is_a_transient_of_plain_dp_only() -> None:
    """The executors pack plain-DP gradients into one tensor for the allreduce: a peak of model states plus those
    bytes after the last backward; ZeRO layers reduce in place, one layer at a time."""
    view = model(4, params=10**6)  # 4 MB of gradients per layer, activations of a few KB
    ctx = CostContext(view, fleet(), NO_OVERLAP)
    plain = stage_cost(ctx, 0, 4, LayerStrategy(dp=2), M)
    assert plain.activation_bytes + plain.transient_bytes >= 4 * 4e6
    zero = stage_cost(ctx, 0, 4, LayerStrategy(dp=2, dp_sharding=DpSharding.ZERO2), M)
    assert zero.activation_bytes + zero.transient_bytes < 4e6
    overlapped = stage_cost(CostContext(view, fleet()), 0, 4, LayerStrategy(dp=2), M)  # DDP's own buckets
    assert overlapped.transient_bytes < 4e6


def test_resident_baseline_options() -> None:
    view = ModelView(layers=model(2).layers, non_model_memory_bytes=5000)
    base = stage_cost(CostContext(view, fleet()), 0, 2, LayerStrategy(), M).model_memory_bytes
    assert base == 2 * 16 * P  # not added by default: it would count activations twice
    opts = CostOptions(include_profile_non_model_memory=True, extra_resident_bytes=7)
    assert stage_cost(CostContext(view, fleet(), opts), 0, 2, LayerStrategy(), M).model_memory_bytes == base + 5007


def test_build_pipeline_sizes_and_links() -> None:
    view = model(4, params=P)
    pipe = build_pipeline(view, fleet(devices_per_node=2, nodes=2, inter_lat=1e-5), [(0, 2), (2, 4)],
                          LayerStrategy(dp=2), M, 6, options=NO_OVERLAP)
    assert isinstance(pipe, Pipeline)
    assert len(pipe.stages) == 2 and pipe.num_micro_batches == 6 and pipe.replicas == 1
    s0, s1 = pipe.stages
    assert s0.output_bytes == M // 2 * OUT  # each device sends its half of the micro-batch
    assert s0.forward_s == pytest.approx(2 * M / 2 * MS)
    assert s0.allreduce_s == pytest.approx(2 * (2 * 0.5 * 4 * P / (100 * GB)))
    assert s0.model_memory_bytes == s1.model_memory_bytes == 2 * 16 * P
    (link,) = pipe.boundary_links
    assert (link.latency_s, link.bandwidth_bytes_per_s) == (1e-5, 10 * GB)  # stages on different nodes
    assert pipe.host_link.bandwidth_bytes_per_s == 20 * GB
    same_node = build_pipeline(view, fleet(devices_per_node=4), bounds_from_sizes([2, 2]), LayerStrategy(dp=2), M, 6)
    assert same_node.boundary_links[0].bandwidth_bytes_per_s == 100 * GB


def test_build_pipeline_receiver_share_and_strategy_list() -> None:
    view = model(4)
    sts = [LayerStrategy(dp=2)] * 2 + [LayerStrategy()] * 2
    pipe = build_pipeline(view, fleet(), [(0, 2), (2, 4)], sts, M, 4)
    assert pipe.stages[0].output_bytes == M * OUT  # the single receiving device needs all samples


@pytest.mark.parametrize(
    ("placement", "boundary", "replica"),
    [
        (Placement.PIPELINES_CONTIGUOUS, Scope.INTRA, Scope.INTER),
        (Placement.REPLICAS_CONTIGUOUS, Scope.INTER, Scope.INTRA),
    ],
)
def test_replicas_placement(placement: Placement, boundary: Scope, replica: Scope) -> None:
    f = fleet(devices_per_node=2, nodes=2)
    layout = DeviceLayout((1, 1), replicas=2, placement=placement)
    assert layout.boundary_scope(0, 2) is boundary
    assert layout.replica_scope(0, 2) is replica
    pipe = build_pipeline(model(4, params=P), f, [(0, 2), (2, 4)], LayerStrategy(), M, 4, replicas=2,
                          placement=placement, options=NO_OVERLAP)
    assert pipe.replicas == 2
    bw = 100 * GB if replica is Scope.INTRA else 10 * GB
    assert pipe.stages[0].allreduce_s == pytest.approx(2 * 0.5 * (2 * 4 * P) / bw)
    assert pipe.boundary_links[0].bandwidth_bytes_per_s == (100 * GB if boundary is Scope.INTRA else 10 * GB)


def test_tied_weights_on_different_stages_sync() -> None:
    layers = (layer(0, tied_with=(3,)), layer(1), layer(2), layer(3, params=2 * P, tied_with=(0,)))
    view = ModelView(layers=layers)
    pipe = build_pipeline(view, fleet(), [(0, 2), (2, 4)], LayerStrategy(), M, 4, options=NO_OVERLAP)
    shared = 2 * 0.5 * 4 * P / (100 * GB)  # the smaller gradient, allreduced between two stages in one node
    assert pipe.stages[0].allreduce_s == pytest.approx(shared)
    assert pipe.stages[1].allreduce_s == pytest.approx(shared)
    together = build_pipeline(view, fleet(), [(0, 4)], LayerStrategy(), M, 4, options=NO_OVERLAP)
    assert together.stages[0].allreduce_s == 0


def test_build_pipeline_validation() -> None:
    view = model(4)
    with pytest.raises(ValueError, match="tile"):
        build_pipeline(view, fleet(), [(0, 2), (3, 4)], LayerStrategy(), M, 4)
    with pytest.raises(ValueError, match="end at"):
        build_pipeline(view, fleet(), [(0, 2)], LayerStrategy(), M, 4)
    with pytest.raises(ValueError, match="devices"):
        build_pipeline(view, fleet(devices_per_node=4, nodes=1), [(0, 2), (2, 4)], LayerStrategy(dp=4), M, 4)
    with pytest.raises(ValueError, match="host link"):
        build_pipeline(view, fleet(host_bw=None), [(0, 4)], LayerStrategy(checkpoint=True, swap=True), M, 4)
    ctx = CostContext(model(4), fleet())
    with pytest.raises(ValueError, match="another ModelView"):
        build_pipeline(view, None, [(0, 4)], LayerStrategy(), M, 4, context=ctx)
    pipe = build_pipeline(ctx.view, None, [(0, 4)], LayerStrategy(), M, 4, context=ctx)
    assert pipe.boundary_links == () and math.isfinite(pipe.stages[0].forward_s)


def test_in_flight_micro_batches() -> None:
    assert [in_flight_micro_batches(Schedule.GPIPE, 4, s, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight_micro_batches(Schedule.ONE_F_ONE_B, 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight_micro_batches("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight_micro_batches(Schedule.VARUNA, 4, s, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight_micro_batches(Schedule.HARMONY_WRAP, 4, s, 8) for s in range(4)] == [8, 8, 8, 8]
    with pytest.raises(ValueError):
        in_flight_micro_batches(Schedule.GPIPE, 4, 4, 8)


def test_stage_peak_memory_without_simulating() -> None:
    sc = StageCost(forward_s=1, backward_s=2, model_memory_bytes=1000, activation_bytes=10, transient_bytes=5)
    assert peak_memory(sc, 3) == 1035
    assert stage_peak_memory(sc, Schedule.ONE_F_ONE_B, 4, 0, 8) == 1000 + 4 * 10 + 5
    assert stage_peak_memory(sc, Schedule.GPIPE, 4, 0, 8) == 1000 + 8 * 10 + 5
    pipe = Pipeline(stages=(sc, sc), num_micro_batches=8)
    assert pipeline_peak_memory(pipe, Schedule.ONE_F_ONE_B) == (1025, 1015)
