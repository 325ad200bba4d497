"""One layer under each strategy: memory (Eq. 1-3), TP/SDP/DP communication, overlap, links, transformations."""

from __future__ import annotations

import pytest

from services.planner.cost import (
    CostContext,
    CostOptions,
    Dim,
    LayerStrategy,
    ModelStateFormat,
    Scope,
    dim_scopes,
    layer_cost,
    missing_fraction,
    overlap_time,
    transform_cost,
)
from services.planner.cost.layer import transform_matrix
from services.planner.search.problem import to_strategy
from services.planner.search.space import layer_candidates
from tests.cost_support import GB, fleet, model

P = 1000  # parameters per layer; fp32 Adam: 16 * P bytes of model states
M = 8  # micro-batch size
MS, BWD = 1e-3, 2e-3  # forward / backward seconds per sample
BND, STASH, OUT = 100, 1000, 100  # bytes per sample


def ctx(**options: object) -> CostContext:
    return CostContext(model(4, params=P), fleet(), CostOptions(**options))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("strategy", "states"),
    [
        (LayerStrategy(), 16 * P),
        (LayerStrategy(dp=2), 16 * P),  # DP replicates
        (LayerStrategy(dp=4), 16 * P),
        (LayerStrategy(sdp=2), 8 * P),  # SDP shards parameters, gradients and optimizer state
        (LayerStrategy(sdp=4), 4 * P),
        (LayerStrategy(tp=2), 8 * P),  # TP shards the weights
        (LayerStrategy(tp=4), 4 * P),
        (LayerStrategy(dp=2, tp=2), 8 * P),
        (LayerStrategy(sdp=2, tp=2), 4 * P),
        (LayerStrategy(dp=2, sdp=2), 8 * P),
    ],
)
def test_model_states_per_device(strategy: LayerStrategy, states: int) -> None:
    assert layer_cost(ctx(), 1, strategy, M).model_state_bytes == pytest.approx(states)


def test_mixed_precision_states_and_gradient_traffic() -> None:
    fp32 = layer_cost(ctx(state_format=ModelStateFormat.FP32_ADAM), 1, LayerStrategy(dp=2), M)
    mixed = layer_cost(ctx(state_format=ModelStateFormat.MIXED_ADAM), 1, LayerStrategy(dp=2), M)
    assert fp32.model_state_bytes == mixed.model_state_bytes == 16 * P
    assert mixed.grad_sync_s == pytest.approx(fp32.grad_sync_s / 2)  # fp16 gradients: half the bytes


@pytest.mark.parametrize(
    ("strategy", "forward_act", "transient"),
    [
        (LayerStrategy(), M * (BND + STASH), 0),
        (LayerStrategy(dp=2), M / 2 * (BND + STASH), 0),  # half the samples per device
        (LayerStrategy(dp=4), M / 4 * (BND + STASH), 0),
        (LayerStrategy(tp=2), M * BND + M * STASH / 2, 0),  # boundary replicated, intermediates split
        (LayerStrategy(checkpoint=True), M * BND, M * STASH),  # c(f)=c(bnd), c(b)=c(int)
        (LayerStrategy(tp=2, checkpoint=True), M * BND, M * STASH / 2),
        (LayerStrategy(dp=2, checkpoint=True), M / 2 * BND, M / 2 * STASH),
        # SDP: the gathered weights and unreduced gradients of the running layer are transient.
        (LayerStrategy(sdp=2), M / 2 * (BND + STASH), (4 * P + 4 * P) / 2),
    ],
)
def test_activation_memory(strategy: LayerStrategy, forward_act: float, transient: float) -> None:
    c = layer_cost(ctx(), 1, strategy, M)
    assert c.forward_activation_bytes == pytest.approx(forward_act)
    assert c.backward_transient_bytes == pytest.approx(transient)


def test_checkpoint_trades_memory_for_recompute_time() -> None:
    plain = layer_cost(ctx(), 1, LayerStrategy(), M)
    ckpt = layer_cost(ctx(), 1, LayerStrategy(checkpoint=True), M)
    assert plain.recompute_s == 0.0
    assert ckpt.recompute_s == pytest.approx(M * MS)
    assert ckpt.forward_s == plain.forward_s == pytest.approx(M * MS)
    assert ckpt.backward_s == plain.backward_s == pytest.approx(M * BWD)
    assert ckpt.forward_activation_bytes < plain.forward_activation_bytes


def test_swap_moves_kept_activations_to_host() -> None:
    c = layer_cost(ctx(), 1, LayerStrategy(checkpoint=True, swap=True), M)
    assert c.forward_activation_bytes == pytest.approx(M * BND)
    assert c.swap_bytes == pytest.approx(M * BND)
    assert layer_cost(ctx(), 1, LayerStrategy(checkpoint=True), M).swap_bytes == 0


def test_tp_splits_compute_and_pays_two_allreduces_per_pass() -> None:
    c = layer_cost(ctx(), 1, LayerStrategy(tp=2), M)
    allreduce = 2 * (2 - 1) / 2 * (M * OUT) / (100 * GB)  # hidden state of the micro-batch, intra-node ring
    assert c.forward_compute_s == pytest.approx(M * MS / 2)
    assert c.forward_s == pytest.approx(M * MS / 2 + 2 * allreduce)
    assert c.backward_s == pytest.approx(M * BWD / 2 + 2 * allreduce)
    assert c.tp_comm_s == pytest.approx(4 * allreduce)
    ck = layer_cost(ctx(), 1, LayerStrategy(tp=2, checkpoint=True), M)
    assert ck.tp_comm_s == pytest.approx(6 * allreduce)  # recompute repeats the forward's allreduces
    assert ck.recompute_s == pytest.approx(M * MS / 2 + 2 * allreduce)
    assert any(s.startswith("tp allreduce: from fleet links") for s in c.sources)


def test_tp_allreduce_count_follows_layer_kind() -> None:
    two = layer_cost(ctx(), 1, LayerStrategy(tp=2), M).tp_comm_s
    three = layer_cost(ctx(tp_allreduces=(("block", 3),)), 1, LayerStrategy(tp=2), M).tp_comm_s
    assert three == pytest.approx(1.5 * two)
    norm = CostContext(model(2, kind="norm"), fleet())
    assert layer_cost(norm, 1, LayerStrategy(tp=2), M).tp_comm_s == 0


@pytest.mark.parametrize("n", [2, 4])
def test_sdp_moves_one_and_a_half_times_dp_volume(n: int) -> None:
    c = ctx(overlap_slowdown=1.0)
    dp = layer_cost(c, 1, LayerStrategy(dp=n), M)
    sdp = layer_cost(c, 1, LayerStrategy(sdp=n), M)
    assert dp.grad_sync_s == pytest.approx(2 * (n - 1) / n * 4 * P / (100 * GB))
    assert dp.sdp_comm_s == 0
    assert sdp.grad_sync_s == 0  # no DP dimension
    assert sdp.sdp_comm_s == pytest.approx(1.5 * dp.grad_sync_s)


def test_sdp_forward_gather_is_serial_backward_traffic_overlaps_with_slowdown() -> None:
    c = CostContext(model(2, params=10**9), fleet(intra_bw=1 * GB), CostOptions(overlap_slowdown=1.3))
    st = LayerStrategy(sdp=2)
    lc = layer_cost(c, 1, st, M)
    gather = 0.5 * 4e9 / 1e9  # (n-1)/n of the 4 GB parameters over 1 GB/s
    scatter = 0.5 * 4e9 / 1e9
    b_comp = M / 2 * BWD
    assert lc.forward_s == pytest.approx(M / 2 * MS + gather)
    assert lc.backward_s == pytest.approx(overlap_time(b_comp, gather + scatter, 1.3))
    assert lc.backward_s == pytest.approx(gather + scatter + 0.3 * b_comp)  # communication-bound
    assert lc.overlap_extra_s == pytest.approx(lc.backward_s - b_comp)


def test_overlap_time_model() -> None:
    assert overlap_time(10, 4, 1.3) == pytest.approx(11.2)  # 1.3*4 together, then 6 alone
    assert overlap_time(4, 10, 1.3) == pytest.approx(11.2)
    assert overlap_time(10, 4, 1.0) == 10  # PipeDream's max
    assert overlap_time(10, 0, 1.3) == 10
    assert overlap_time(0, 3, 1.3) == 3


def test_overlap_slowdown_source_order() -> None:
    from services.planner.cost import GALVATRON_OVERLAP_SLOWDOWN, ModelView

    view = model(2)
    assert CostContext(view, fleet()).overlap_slowdown == GALVATRON_OVERLAP_SLOWDOWN
    measured = ModelView(layers=view.layers, overlap_slowdown=1.1)
    assert CostContext(measured, fleet()).overlap_slowdown == 1.1
    assert CostContext(measured, fleet(), CostOptions(overlap_slowdown=1.5)).overlap_slowdown == 1.5


def test_grad_sync_exposed_and_iteration() -> None:
    lc = layer_cost(ctx(), 1, LayerStrategy(dp=2), M)
    assert lc.grad_sync_exposed_s(1.3, overlap=False) == lc.grad_sync_s
    exposed = lc.grad_sync_exposed_s(1.3)
    assert exposed == pytest.approx(0.3 * lc.grad_sync_s)  # tiny sync hides under backward, slowing it
    assert lc.iteration_s(4, 1.3) == pytest.approx(4 * lc.per_micro_batch_s + exposed)


def test_links_by_order_and_node_size() -> None:
    # 4 devices per node: dp2 x tp4 on 8 devices.
    tp_inner = dict(dim_scopes(LayerStrategy(dp=2, tp=4, order=(Dim.DP, Dim.TP)), (0,), 4))
    assert tp_inner == {Dim.TP: Scope.INTRA, Dim.DP: Scope.INTER}
    dp_inner = dict(dim_scopes(LayerStrategy(dp=2, tp=4, order=(Dim.TP, Dim.DP)), (0,), 4))
    assert dp_inner == {Dim.DP: Scope.INTRA, Dim.TP: Scope.INTER}
    # Whole block inside a node: everything intra.
    assert dict(dim_scopes(LayerStrategy(dp=2, tp=2), (0,), 4)) == {Dim.DP: Scope.INTRA, Dim.TP: Scope.INTRA}
    # The same block starting mid-node straddles two nodes: the outer dimension spills.
    assert dict(dim_scopes(LayerStrategy(dp=2, tp=2), (2,), 4)) == {Dim.DP: Scope.INTER, Dim.TP: Scope.INTRA}
    # Any replica's misalignment counts.
    assert dict(dim_scopes(LayerStrategy(dp=2, tp=2), (0, 2), 4))[Dim.DP] is Scope.INTER


def test_link_choice_changes_prices() -> None:
    c = ctx()
    st_tp_inner = LayerStrategy(dp=2, tp=4, order=(Dim.DP, Dim.TP))
    st_dp_inner = LayerStrategy(dp=2, tp=4, order=(Dim.TP, Dim.DP))
    a, b = layer_cost(c, 1, st_tp_inner, M), layer_cost(c, 1, st_dp_inner, M)
    assert b.tp_comm_s == pytest.approx(10 * a.tp_comm_s)  # TP on the 10x slower inter-node link
    assert a.grad_sync_s == pytest.approx(10 * b.grad_sync_s)
    assert dict(a.scopes) == {Dim.DP: Scope.INTER, Dim.TP: Scope.INTRA}


def test_uneven_split_uses_the_busiest_device() -> None:
    c = layer_cost(ctx(), 1, LayerStrategy(dp=4), 6)
    assert c.samples_per_device == 2
    assert c.forward_s == pytest.approx(2 * MS)


def test_transformation_zero_for_equal_layouts_and_free_slicing() -> None:
    c = ctx()
    same = transform_cost(c, 2, LayerStrategy(dp=2, tp=2), LayerStrategy(dp=2, tp=2, checkpoint=True), M)
    assert same.forward_s == same.backward_s == 0
    # Galvatron's example: 2-way DP x 2-way TP -> 4-way DP. Each device already holds the half its quarter
    # comes from (slice, free); the gradient going back must gather a quarter from a peer.
    t = transform_cost(c, 2, LayerStrategy(dp=2, tp=2), LayerStrategy(dp=4), M)
    assert t.forward_bytes == 0
    assert t.backward_bytes == pytest.approx(0.25 * M * OUT)
    assert t.backward_s == pytest.approx(0.25 * M * OUT / (100 * GB))
    # DP and SDP split samples the same way: nothing to move.
    assert transform_cost(c, 2, LayerStrategy(dp=4), LayerStrategy(sdp=4), M).forward_s == 0


def test_missing_fraction_follows_order() -> None:
    a = LayerStrategy(dp=2, tp=2, order=(Dim.DP, Dim.TP))  # devices hold samples [0, 0, 1, 1]
    b = LayerStrategy(dp=2, tp=2, order=(Dim.TP, Dim.DP))  # devices hold samples [0, 1, 0, 1]
    assert missing_fraction(a, b) == pytest.approx(0.5)
    assert missing_fraction(LayerStrategy(dp=4), LayerStrategy(dp=2, tp=2)) == pytest.approx(0.25)
    assert missing_fraction(LayerStrategy(tp=4), LayerStrategy(dp=4)) == 0
    with pytest.raises(ValueError):
        missing_fraction(LayerStrategy(dp=2), LayerStrategy(dp=4))


def test_costs_are_memoised() -> None:
    c = ctx()
    st = LayerStrategy(sdp=2, tp=2)
    assert layer_cost(c, 1, st, M) is layer_cost(c, 1, LayerStrategy(sdp=2, tp=2), M)
    assert layer_cost(c, 1, st, M, offsets=(0,)) is layer_cost(c, 1, st, M, offsets=(8,))  # same spot in a node


def test_colocated_devices_slow_each_others_compute_as_measured() -> None:
    """The profile's co-location factor scales compute when a node has several devices; one alone runs at speed."""
    from dataclasses import replace

    crowded_model = replace(model(4, params=P), colocated_slowdown=1.25)
    plain = layer_cost(CostContext(model(4, params=P), fleet(), CostOptions()), 1, LayerStrategy(), M)
    crowded = layer_cost(CostContext(crowded_model, fleet(), CostOptions()), 1, LayerStrategy(), M)
    assert crowded.forward_compute_s == pytest.approx(1.25 * plain.forward_compute_s)
    assert crowded.backward_compute_s == pytest.approx(1.25 * plain.backward_compute_s)
    alone = layer_cost(CostContext(crowded_model, fleet(devices_per_node=1, nodes=4), CostOptions()), 1,
                       LayerStrategy(), M)
    assert alone.forward_compute_s == pytest.approx(plain.forward_compute_s)
    ignored = layer_cost(CostContext(crowded_model, fleet(), CostOptions(colocated_slowdown=1.0)), 1,
                         LayerStrategy(), M)
    assert ignored.forward_compute_s == pytest.approx(plain.forward_compute_s)


def test_measured_optimizer_steps_and_composition_are_priced() -> None:
    """The optimizer step is priced once per iteration on each device's share of the states; the composition
    factor (layers in sequence vs alone) scales compute."""
    from dataclasses import replace

    base = model(4, params=P)
    stepped = replace(base, layers=tuple(replace(x, optimizer_step_s=4e-3) for x in base.layers),
                      composition_factor=1.1)
    plain = layer_cost(CostContext(base, fleet(), CostOptions()), 1, LayerStrategy(sdp=2), M)
    cost = layer_cost(CostContext(stepped, fleet(), CostOptions()), 1, LayerStrategy(sdp=2), M)
    assert plain.update_s == 0.0 and cost.update_s == pytest.approx(1.1 * 4e-3 / 2)
    assert cost.forward_compute_s == pytest.approx(1.1 * plain.forward_compute_s)



@pytest.mark.parametrize(("devices_per_node", "nodes", "offsets"), [(8, 1, (0,)), (4, 2, (0,)), (4, 4, (4,))])
def test_the_transform_matrix_prices_every_pair_as_transform_cost_does(devices_per_node, nodes, offsets) -> None:
    """layer_tables prices re-layouts all pairs at once (transform_matrix: the fractions broadcast over
    held x needed x device); each entry is transform_cost's forward + backward for that pair, bit for bit."""
    devices = 8
    c = CostContext(model(4, params=P), fleet(devices_per_node=devices_per_node, nodes=nodes, inter_lat=1e-5))
    layouts = list({st.layout: st for st in (to_strategy(x) for x in layer_candidates(devices))}.values())
    assert len(layouts) > 4
    got = transform_matrix(c, 2, layouts, M, offsets)
    for a, held in enumerate(layouts):
        for b, needed in enumerate(layouts):
            t = transform_cost(c, 2, held, needed, M, offsets)
            assert got[a, b] == t.forward_s + t.backward_s
    assert (got > 0).sum() > len(layouts)
    assert not transform_matrix(c, 0, layouts, M, offsets).any()  # nothing re-lays the first layer's input
