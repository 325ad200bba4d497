"""DP flavours on the cost model (issue 24): ZeRO-1 and ZeRO-2 memory, traffic and step time, proto and text.

Memory per replica of d (DeepSpeed ZeRO, mixed-precision Adam, Ψ parameters): plain 16Ψ, ZeRO-1 4Ψ + 12Ψ/d,
ZeRO-2 2Ψ + 14Ψ/d; fp32 Adam (4 + 4 + 8 B) likewise: 16Ψ, 8Ψ + 8Ψ/d, 4Ψ + 12Ψ/d. ZeRO-2's reduce-scatter runs
once per iteration, so with several micro-batches its gradients accumulate in full (ZeRO-1's bytes).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ballast.v1 import common_pb2, plan_pb2
from services.planner.cost import (
    BYTES_PER_PARAM,
    CostContext,
    CostOptions,
    Dim,
    DpSharding,
    LayerStrategy,
    ModelStateFormat,
    ModelView,
    layer_cost,
    overlap_time,
    stage_cost,
    transform_cost,
)
from tests.cost_support import GB, fleet, layer, model

P = 1000  # parameters per layer
M = 8  # micro-batch size
PLAIN, ZERO1, ZERO2 = DpSharding.PLAIN, DpSharding.ZERO1, DpSharding.ZERO2


def ctx(fmt: ModelStateFormat = ModelStateFormat.MIXED_ADAM, **fleet_kw: float) -> CostContext:
    return CostContext(model(4, params=P), fleet(**fleet_kw), CostOptions(state_format=fmt))


def expected_states(fmt: ModelStateFormat, zero: DpSharding, d: int) -> float:
    """The arithmetic of the module docstring, per parameter times P."""
    p, g, o = BYTES_PER_PARAM[fmt]
    if zero is PLAIN:
        return (p + g + o) * P
    if zero is ZERO1:
        return (p + g) * P + o * P / d
    return p * P + (g + o) * P / d


@pytest.mark.parametrize("fmt", [ModelStateFormat.FP32_ADAM, ModelStateFormat.MIXED_ADAM])
@pytest.mark.parametrize("d", [2, 4])
def test_model_states_per_replica_match_zero_arithmetic(fmt: ModelStateFormat, d: int) -> None:
    c = ctx(fmt)
    costs = {z: layer_cost(c, 1, LayerStrategy(dp=d, dp_sharding=z), M) for z in (PLAIN, ZERO1, ZERO2)}
    for z, lc in costs.items():
        assert lc.model_state_bytes == expected_states(fmt, z, d)
        assert lc.resident_bytes(1) == expected_states(fmt, z, d)
    if fmt is ModelStateFormat.MIXED_ADAM:  # DeepSpeed's figures, Ψ = P
        assert costs[PLAIN].model_state_bytes == 16 * P
        assert costs[ZERO1].model_state_bytes == 4 * P + 12 * P / d
        assert costs[ZERO2].model_state_bytes == 2 * P + 14 * P / d
    # Several micro-batches: ZeRO-2 holds its accumulating gradient, ZeRO-1's bytes; the transient gives it back.
    grad = BYTES_PER_PARAM[fmt][1] * P
    assert costs[ZERO2].accumulation_bytes == grad * (1 - 1 / d)
    assert costs[ZERO2].resident_bytes(4) == pytest.approx(expected_states(fmt, ZERO1, d), abs=1e-9)
    assert costs[ZERO2].resident_bytes(None) == costs[ZERO2].resident_bytes(4)  # unknown: the larger memory
    # One micro-batch: the running layer's full gradient is transient until its reduce-scatter.
    plain_ob = costs[PLAIN].backward_transient_bytes
    assert costs[ZERO1].backward_transient_bytes == plain_ob
    assert costs[ZERO2].transient_bytes(1) == pytest.approx(plain_ob + grad * (1 - 1 / d))
    assert costs[ZERO2].transient_bytes(4) == pytest.approx(plain_ob)
    for lc in costs.values():  # a flavour changes no activation
        assert lc.forward_activation_bytes == costs[PLAIN].forward_activation_bytes


def test_zero2_reduce_scatters_after_the_whole_backward_keep_zero1_memory() -> None:
    """CostOptions.zero2_reduce_scatter_per_layer off: every full gradient waits for the stage's backward."""
    d, fmt = 4, ModelStateFormat.MIXED_ADAM
    c = CostContext(model(4, params=P), fleet(), CostOptions(state_format=fmt, zero2_reduce_scatter_per_layer=False))
    z1, z2 = (layer_cost(c, 1, LayerStrategy(dp=d, dp_sharding=z), M) for z in (ZERO1, ZERO2))
    assert z2.model_state_bytes == z2.resident_bytes(1) == expected_states(fmt, ZERO1, d)
    assert z2.accumulation_bytes == 0 and z2.transient_bytes(1) == z1.backward_transient_bytes
    assert z2.grad_sync_s < z1.grad_sync_s and z2.param_gather_s == z1.param_gather_s  # still ZeRO-2's traffic
    stage = stage_cost(c, 0, 4, LayerStrategy(dp=d, dp_sharding=ZERO2), M, num_micro_batches=1)
    assert stage.model_memory_bytes == 4 * expected_states(fmt, ZERO1, d)


def test_zero_over_tp_and_sdp_shards_their_shards() -> None:
    c = ctx(ModelStateFormat.MIXED_ADAM)
    st = LayerStrategy(dp=2, tp=2, dp_sharding=ZERO2)
    assert layer_cost(c, 1, st, M).model_state_bytes == (2 * P + 14 * P / 2) / 2
    mixed = LayerStrategy(dp=2, sdp=2, dp_sharding=ZERO1)  # outside Takeaway 3: ZeRO-1 of SDP's shards
    assert layer_cost(c, 1, mixed, M).model_state_bytes == (4 * P + 12 * P / 2) / 2


def test_stage_memory_follows_the_micro_batch_count() -> None:
    c = ctx(ModelStateFormat.FP32_ADAM)
    d = 4
    one = stage_cost(c, 0, 4, LayerStrategy(dp=d, dp_sharding=ZERO2), M, num_micro_batches=1)
    many = stage_cost(c, 0, 4, LayerStrategy(dp=d, dp_sharding=ZERO2), M, num_micro_batches=4)
    zero1 = stage_cost(c, 0, 4, LayerStrategy(dp=d, dp_sharding=ZERO1), M, num_micro_batches=4)
    plain = stage_cost(c, 0, 4, LayerStrategy(dp=d), M, num_micro_batches=1)
    assert one.model_memory_bytes == 4 * expected_states(ModelStateFormat.FP32_ADAM, ZERO2, d)
    assert many.model_memory_bytes == zero1.model_memory_bytes == 4 * expected_states(ModelStateFormat.FP32_ADAM,
                                                                                        ZERO1, d)
    assert plain.model_memory_bytes == 4 * 16 * P
    # One layer's full gradient less its kept share on top of the activation transient (none here), not four.
    assert plain.transient_bytes == 0
    assert one.transient_bytes == 4 * P * (1 - 1 / d)
    assert many.transient_bytes == 0


def test_collectives_follow_the_ring_volumes() -> None:
    """Fleet links, one node: all-reduce 2(d-1)/d B, reduce-scatter and all-gather (d-1)/d B, plus latencies."""
    bw, lat, d = 100 * GB, 2e-6, 4
    c = ctx(ModelStateFormat.MIXED_ADAM, intra_lat=lat)
    grad = param = 2 * P  # mixed precision: 2 B gradients and 2 B weights per parameter
    allreduce = 2 * (d - 1) * lat + 2 * (d - 1) / d * grad / bw
    half = (d - 1) * lat + (d - 1) / d * grad / bw
    gather = (d - 1) * lat + (d - 1) / d * param / bw
    plain, z1, z2 = (layer_cost(c, 1, LayerStrategy(dp=d, dp_sharding=z), M) for z in (PLAIN, ZERO1, ZERO2))
    assert plain.grad_sync_s == pytest.approx(allreduce) and plain.param_gather_s == 0.0
    assert z1.grad_sync_s == pytest.approx(allreduce) and z1.param_gather_s == pytest.approx(gather)
    assert z2.grad_sync_s == pytest.approx(half) and z2.param_gather_s == pytest.approx(gather)
    # ZeRO-1 moves 1.5x plain DP's bytes; ZeRO-2's reduce-scatter + all-gather move exactly an all-reduce's.
    assert z1.grad_sync_s + z1.param_gather_s > plain.grad_sync_s
    assert z2.grad_sync_s + z2.param_gather_s == pytest.approx(plain.grad_sync_s)
    assert any(s.startswith("dp reduce_scatter") for s in z2.sources)
    assert any(s.startswith("dp allgather") for s in z1.sources)
    # Per-micro-batch work and the activations are untouched.
    assert z1.per_micro_batch_s == z2.per_micro_batch_s == plain.per_micro_batch_s
    # Across nodes (dp 8 on two nodes of 4) every collective is priced on the slower link.
    wide = layer_cost(c, 1, LayerStrategy(dp=8, dp_sharding=ZERO2), M)
    assert wide.param_gather_s == pytest.approx(7 / 8 * param / (10 * GB))  # inter-node: 10 GB/s, no latency


def test_the_gather_is_exposed_after_the_step_and_the_step_is_sharded() -> None:
    d, step = 4, 1e-3
    layers = tuple(replace(layer(i, params=P), optimizer_step_s=step) for i in range(4))
    c = CostContext(ModelView(layers=layers), fleet(intra_bw=1 * GB),
                    CostOptions(state_format=ModelStateFormat.FP32_ADAM))
    plain = stage_cost(c, 0, 4, LayerStrategy(dp=d), M, num_micro_batches=2)
    costs = [layer_cost(c, i, LayerStrategy(dp=d, dp_sharding=ZERO1), M) for i in range(4)]
    zero1 = stage_cost(c, 0, 4, LayerStrategy(dp=d, dp_sharding=ZERO1), M, num_micro_batches=2)
    back = sum(lc.backward_compute_s for lc in costs)
    sync = sum(lc.grad_sync_s for lc in costs)
    gather = sum(lc.param_gather_s for lc in costs)
    assert gather > 0
    assert zero1.allreduce_s == pytest.approx(overlap_time(back, sync, c.overlap_slowdown) - back + gather)
    assert plain.allreduce_s == pytest.approx(overlap_time(back, sync, c.overlap_slowdown) - back)
    assert plain.update_s == pytest.approx(4 * step * c.compute_scale)
    assert zero1.update_s == pytest.approx(plain.update_s / d)  # each replica steps 1/d of the states
    # LayerCost.iteration_s (Galvatron's c(l, s)) carries the gather too.
    lc = costs[0]
    assert lc.iteration_s(2, c.overlap_slowdown) == pytest.approx(
        2 * lc.per_micro_batch_s + lc.grad_sync_exposed_s(c.overlap_slowdown) + lc.param_gather_s)


def test_a_flavour_keeps_the_sample_layout() -> None:
    plain, z2 = LayerStrategy(dp=4, tp=2), LayerStrategy(dp=4, tp=2, dp_sharding=ZERO2)
    assert plain.layout == z2.layout and plain != z2
    t = transform_cost(ctx(), 1, plain, z2, M)
    assert t.forward_s == t.backward_s == 0.0


def test_strategy_flavour_normalisation_text_and_requirements() -> None:
    assert LayerStrategy(dp=1, dp_sharding=ZERO2).dp_sharding is PLAIN  # no replicas, nothing to shard
    assert LayerStrategy(sdp=4, dp_sharding="zero1").dp_sharding is PLAIN
    assert LayerStrategy(dp=2, dp_sharding="zero2").dp_sharding is ZERO2
    with pytest.raises(ValueError):
        LayerStrategy(dp=2, dp_sharding="zero3")  # type: ignore[arg-type]
    assert LayerStrategy(dp=2, dp_sharding=ZERO2).describe() == "dp2 +zero2"
    assert LayerStrategy(dp=4, tp=2, dp_sharding=ZERO1, checkpoint=True).describe() == "dp4xtp2 +zero1 +ckpt"
    assert LayerStrategy(dp=8).describe() == "dp8"
    assert LayerStrategy(dp=4, tp=2, dp_sharding=ZERO2).requires == ("dp", "tp", "zero2")
    assert LayerStrategy(dp=4, tp=2).requires == ("dp", "tp")
    assert LayerStrategy(dp=2, dp_sharding=ZERO1).sharded and not LayerStrategy(dp=2).sharded


@pytest.mark.parametrize("zero, value", [(PLAIN, common_pb2.DP_SHARDING_UNSPECIFIED),
                                         (ZERO1, common_pb2.DP_SHARDING_ZERO1),
                                         (ZERO2, common_pb2.DP_SHARDING_ZERO2)])
def test_proto_round_trip_carries_the_flavour(zero: DpSharding, value: int) -> None:
    st = LayerStrategy(dp=4, tp=2, order=(Dim.TP, Dim.DP), checkpoint=True, dp_sharding=zero)
    msg = st.to_proto(5, 1)
    assert msg.dp_sharding == value
    back = plan_pb2.LayerStrategy()
    back.ParseFromString(msg.SerializeToString())
    assert LayerStrategy.from_proto(back) == st
    assert LayerStrategy.from_proto(back).dp_sharding is zero


def test_proto_flavour_edge_cases() -> None:
    # A flavour on a layer without dp replicas reads as plain; an unknown value is refused, not guessed.
    assert LayerStrategy.from_proto(plan_pb2.LayerStrategy(dp=1, dp_sharding=2)).dp_sharding is PLAIN
    with pytest.raises(ValueError, match="unknown dp_sharding 7"):
        LayerStrategy.from_proto(plan_pb2.LayerStrategy(dp=2, dp_sharding=7))  # type: ignore[arg-type]
