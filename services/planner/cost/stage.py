"""Aggregate the layers [begin, end) of one pipeline stage into the simulator's StageCost.

* forward/backward/recompute: sums of the layers' per-micro-batch times plus the transformation
  costs between neighbours with different layouts (Galvatron-BMW Eq. 4, forward for activations,
  backward for their gradients).
* output_bytes: per device, what crosses the cut after the stage: the last layer's output plus every
  earlier output a later layer reads (the layer graph's skip edges, e.g. a T5 encoder output read by
  decoder blocks on later stages, relayed stage to stage; Varuna §5 cut-points). The share of the
  micro-batch is the larger of the sender's and the receiver's (a receiving device gathers its samples).
* allreduce_s: the iteration-end gradient sync: in-stage DP allreduces (ZeRO-2: reduce-scatters; run after
  the last backward, as Ballast's executors do, the plain-DP layers of one DP group share one allreduce
  bucket, so its latency is paid once, not once per layer; ZeRO layers sync one layer at a time), the
  allreduce of the gradient shards across `replicas` pipeline copies (Varuna's D), and the sync of
  weights tied to a layer on another stage; overlapped with the last micro-batch's backward compute
  (Galvatron-BMW §V slowdown) when options.overlap_grad_sync, else run after it. ZeRO-1/2 layers add
  their parameter all-gathers after it: they follow the optimizer step, so nothing overlaps them (the
  simulator runs allreduce_s and update_s back to back, so their order within the sum does not matter).
* model_memory_bytes: model states Oms of all layers + the resident baseline (context docstring); with
  more than one micro-batch (`num_micro_batches`; None: unknown, priced as several) a ZeRO-2 layer's
  accumulating gradient is resident too (layer docstring).
* activation_bytes: sum of Of per in-flight micro-batch, swapped layers included (the simulator holds
  them from the forward until the swap-out ends and again from the swap-in); swap_bytes: the swapped part.
* transient_bytes: Eq. 2 exactly: peak while one micro-batch runs backward is
  ``max_i (sum_{k<=i} Of_k + Ob_i)``; what the simulator adds on top of that micro-batch's Of is
  ``max(0, max_i (Ob_i - sum_{k>i} Of_k))``.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.planner.cost import calibration
from services.planner.cost.comm import Scope
from services.planner.cost.context import CostContext
from services.planner.cost.layer import LayerCost, ceil_bytes, layer_cost, overlap_time, transform_cost
from services.planner.cost.strategy import Dim, DpSharding, LayerStrategy
from services.planner.sim.model import StageCost


def stage_strategies(
    strategies: Sequence[LayerStrategy] | LayerStrategy, begin: int, end: int, num_layers: int
) -> tuple[LayerStrategy, ...]:
    """The stage's strategies from one for all, one per stage layer, or one per model layer."""
    if isinstance(strategies, LayerStrategy):
        return (strategies,) * (end - begin)
    if len(strategies) == end - begin:
        return tuple(strategies)
    if len(strategies) == num_layers:
        return tuple(strategies[begin:end])
    raise ValueError(f"{len(strategies)} strategies for stage [{begin}, {end}) of a {num_layers}-layer model")


def stage_layer_costs(
    ctx: CostContext,
    begin: int,
    end: int,
    strategies: Sequence[LayerStrategy] | LayerStrategy,
    micro_batch_size: int,
    offsets: tuple[int, ...] = (0,),
) -> tuple[LayerCost, ...]:
    """Per-layer costs of a stage (for explanations and searches that need the breakdown)."""
    sts = stage_strategies(strategies, begin, end, len(ctx.view))
    return tuple(layer_cost(ctx, begin + k, st, micro_batch_size, offsets) for k, st in enumerate(sts))


def cut_bytes(
    ctx: CostContext, cut: int, micro_batch_size: int, sender: LayerStrategy, receiver: LayerStrategy | None = None
) -> int:
    """Bytes one device sends across the cut before layer `cut` (activation; its gradient comes back)."""
    split = sender.batch_split if receiver is None else min(sender.batch_split, receiver.batch_split)
    share = -(-micro_batch_size // split)
    view = ctx.view
    return ceil_bytes(sum(view.point(e, share).output_bytes for e in view.crossing(cut)))


def stage_cost(
    ctx: CostContext,
    begin: int,
    end: int,
    strategies: Sequence[LayerStrategy] | LayerStrategy,
    micro_batch_size: int,
    *,
    offsets: tuple[int, ...] = (0,),
    next_strategy: LayerStrategy | None = None,
    replicas: int = 1,
    replica_scope: Scope = Scope.INTER,
    tied_sync_s: float = 0.0,
    num_micro_batches: int | None = None,
) -> StageCost:
    """StageCost of layers [begin, end) at `micro_batch_size` per pipeline replica (module docstring).

    `offsets` are the first device of this stage in each replica (link scopes depend on them);
    `next_strategy` is the next stage's first layer's strategy (None: same split as this stage's last);
    `num_micro_batches` sizes ZeRO-2's gradient memory (None: several, the larger).
    """
    n = len(ctx.view)
    if not 0 <= begin < end <= n:
        raise ValueError(f"stage [{begin}, {end}) outside a {n}-layer model")
    sts = stage_strategies(strategies, begin, end, n)
    devices = {st.devices for st in sts}
    if len(devices) != 1:
        raise ValueError(f"stage [{begin}, {end}) mixes device counts {sorted(devices)}; every layer must use all")
    costs = stage_layer_costs(ctx, begin, end, sts, micro_batch_size, offsets)

    fwd = sum(c.forward_s for c in costs)
    bwd = sum(c.backward_s for c in costs)
    for k in range(1, len(sts)):
        t = transform_cost(ctx, begin + k, sts[k - 1], sts[k], micro_batch_size, offsets)
        fwd += t.forward_s
        bwd += t.backward_s

    sync = _grad_sync(ctx, costs) + tied_sync_s
    if replicas > 1:
        sync += ctx.comm.allreduce(sum(c.grad_shard_bytes for c in costs), replicas, replica_scope)
    if ctx.options.overlap_grad_sync and sync > 0:
        b_comp = sum(c.backward_compute_s for c in costs)
        sync = overlap_time(b_comp, sync, ctx.overlap_slowdown) - b_comp
    sync += sum(c.param_gather_s for c in costs)

    nm = num_micro_batches
    transient, later = 0.0, 0.0
    for c in reversed(costs):
        transient = max(transient, c.transient_bytes(nm) - later)
        later += c.forward_activation_bytes
    if not ctx.options.overlap_grad_sync or replicas > 1:
        # the executors pack the plain-DP gradients into one allreduce bucket after the last backward, when no
        # activation is held any more: a transient of their bytes (priced on top of one micro-batch's Of)
        transient = max(transient, _bucket_bytes(costs, replicas) - later)

    return calibration.apply(StageCost(
        forward_s=fwd,
        backward_s=bwd,
        recompute_s=sum(c.recompute_s for c in costs),
        output_bytes=cut_bytes(ctx, end, micro_batch_size, sts[-1], next_strategy) if end < n else 0,
        allreduce_s=sync,
        update_s=sum(c.update_s for c in costs),
        model_memory_bytes=ceil_bytes(sum(c.resident_bytes(nm) for c in costs)) + ctx.resident_baseline_bytes,
        activation_bytes=ceil_bytes(later),
        transient_bytes=ceil_bytes(transient),
        swap_bytes=ceil_bytes(sum(c.swap_bytes for c in costs)),
    ), ctx.calibration)


def _grad_sync(ctx: CostContext, costs: Sequence[LayerCost]) -> float:
    """The layers' DP gradient sync. Overlapped with the backward (Galvatron's DDP buckets) it is the sum of
    the layers' own; after the last backward (options.overlap_grad_sync off: Ballast's executors) the plain-DP
    layers of one DP group go in one allreduce, as services/executor/train/comms.py sends them."""
    if ctx.options.overlap_grad_sync:
        return sum(c.grad_sync_s for c in costs)
    sync, buckets = 0.0, {}
    for c in costs:
        st = c.strategy
        if _plain_dp(c):
            key = (st.dp, dict(c.scopes)[Dim.DP])
            buckets[key] = buckets.get(key, 0.0) + c.grad_shard_bytes
        else:
            sync += c.grad_sync_s
    return sync + sum(ctx.comm.allreduce(size, dp, scope) for (dp, scope), size in buckets.items())


def _bucket_bytes(costs: Sequence[LayerCost], replicas: int) -> float:
    """Bytes of the executors' packed allreduce bucket: the plain-DP layers' gradients (every layer's when the
    stage is copied across `replicas`)."""
    return sum(c.grad_shard_bytes for c in costs if replicas > 1 or _plain_dp(c))


def _plain_dp(c: LayerCost) -> bool:
    """The layer's gradient goes in the executors' packed allreduce bucket (plain DP, not ZeRO)."""
    return c.strategy.dp > 1 and c.strategy.dp_sharding is DpSharding.PLAIN
