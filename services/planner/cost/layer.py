"""Cost of one layer under one strategy: time per micro-batch, gradient sync, memory (Galvatron-BMW §III-A, §V).

Split of work. A pipeline replica's micro-batch of m samples is split over dp x sdp devices; each
device runs ``s = ceil(m / (dp * sdp))`` samples (the busiest device sets the pace) and TP divides the
layer's compute by tp (ideal split; Galvatron-BMW §V prices compute from single-device profiles).

Time per micro-batch, one device:

* forward   = F(s)/tp + TP allreduces + SDP all-gather of the parameters (no overlap in forward, §V);
* backward  = overlap(B(s)/tp, SDP all-gather + reduce-scatter) + TP allreduces;
* recompute = R(s)/tp + TP allreduces, under checkpointing only (§III-A multi-GPU: CKPT with TP adds
  the recompute pass's allreduces);
* TP: k allreduces per pass of the layer's hidden state (k = 2 for a transformer block, Megatron;
  see context.TP_ALLREDUCES_PER_PASS), priced on the TP group's link;
* SDP (ZeRO-3): two all-gathers of the parameters (forward, backward) and one reduce-scatter of the
  gradients per micro-batch: 1.5x the volume of DP's allreduce (§III-A);
* DP: one allreduce of the gradient shard ``G / (tp * sdp)`` per *iteration* (gradients accumulate
  over micro-batches), reported separately as `grad_sync_s`.
* DP flavours (strategy.DpSharding, ZeRO over the dp replicas, d = dp): ZeRO-1 all-reduces the gradients
  as plain DP, updates only its 1/d of the optimizer states, then all-gathers the updated parameters
  ``P / (tp * sdp)`` (volume (d-1)/d of them; `param_gather_s`); ZeRO-2 reduce-scatters the gradients
  instead ((d-1)/d of them, half an all-reduce) once per iteration, after the last micro-batch's backward
  of the layer, then updates and all-gathers like ZeRO-1. The all-gather follows the optimizer step, so
  nothing overlaps it (stage level adds it after the exposed sync); the step itself covers 1/d of the
  states (`update_s`).

Overlap (§V). When gradient communication runs beside backward compute both slow down by the
measured factor k (warp contention); whichever finishes first leaves the other to run alone at full
speed. For compute C and communication M: ``k * min(C, M) + |C - M| = max(C, M) + (k - 1) * min(C, M)``
(Galvatron's estimator; k = 1 gives PipeDream's max). Applied to SDP's backward traffic here and to
the iteration-end DP sync against the last micro-batch's backward at stage level.

Links. Dims in `strategy.order` nest outermost first: the innermost gets stride-1 device ranks.
A dimension's groups are intra-node when each group's devices share a node (given where the
stage's device block starts, `offsets`), inter-node otherwise: inner dims keep NVLink while their
group fits a node, outer ones spill to the network.

Memory per device (Eq. 1-3): model states Oms = (P + G + O) / (tp * sdp) (DP replicates; SDP shards all three,
ZeRO-3; TP shards the weights). ZeRO-1: Oms = (P + G + O / d) / (tp * sdp). ZeRO-2: Oms = (P + G / d + O / d)
/ (tp * sdp) while one micro-batch makes the iteration, the running layer's full gradient a backward transient
until its reduce-scatter; with several micro-batches the gradients accumulate in full until the
once-per-iteration reduce-scatter, so the rest of them, `accumulation_bytes` = G (1 - 1/d) / (tp * sdp), is
resident for the iteration instead (LayerCost.resident_bytes / transient_bytes take the micro-batch count).
With CostOptions.zero2_reduce_scatter_per_layer off (reduce-scatters after the stage's whole backward) every
ZeRO-2 gradient is held in full through the backward at any micro-batch count: ZeRO-1's Oms.
Forward activations Of per in-flight micro-batch, at share s: boundary input (replicated across TP ranks,
Galvatron's "additional replications") plus, without checkpointing, the stashed intermediates / tp; under
checkpointing Of = boundary and the recomputed intermediates / tp are the backward transient Ob (c(f)=c(bnd),
c(b)=c(int)). SDP adds the gathered full weights and unreduced gradients of the running layer to Ob. With
swap, Of is also `swap_bytes`: it leaves the device after the forward and is back before the backward
(pipeline.peak_memory).

Transformation (Eq. 4, Slice-Gather §VI): between neighbours with different layouts each device
must end up holding the samples the next layer assigns it; slicing what it already holds is free,
the rest is fetched: ``max over devices of missing fraction x output bytes``, priced as one p2p on
the stage's link, forward for the activation and the reverse layout change for its gradient.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.planner.cost.comm import Scope
from services.planner.cost.context import CostContext
from services.planner.cost.strategy import Dim, DpSharding, LayerStrategy


def overlap_time(compute_s: float, comm_s: float, slowdown: float) -> float:
    """Duration of compute and communication run side by side, both slowed by `slowdown` while both run."""
    if comm_s <= 0.0:
        return compute_s
    if compute_s <= 0.0:
        return comm_s
    lo, hi = (compute_s, comm_s) if compute_s < comm_s else (comm_s, compute_s)
    return hi + (slowdown - 1.0) * lo


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer, one strategy, one micro-batch size; times on one device, bytes per device."""

    index: int
    strategy: LayerStrategy
    micro_batch_size: int
    samples_per_device: int
    forward_s: float
    backward_s: float
    recompute_s: float
    grad_sync_s: float  # DP allreduce of this layer's gradient shard, once per iteration, not overlapped
    forward_compute_s: float
    backward_compute_s: float
    recompute_compute_s: float
    tp_comm_s: float  # all TP allreduces of one micro-batch (forward + backward + recompute)
    sdp_comm_s: float  # SDP all-gathers + reduce-scatter of one micro-batch, before overlap
    overlap_extra_s: float  # what overlapping SDP traffic added to backward compute
    model_state_bytes: float  # Oms
    forward_activation_bytes: float  # Of, per in-flight micro-batch (swapped or not)
    backward_transient_bytes: float  # Ob
    swap_bytes: float  # the part of Of that waits on the host between forward and backward (all of it, or 0)
    grad_shard_bytes: float  # gradient bytes each device holds (what any replica sync moves)
    scopes: tuple[tuple[Dim, Scope], ...]
    sources: tuple[str, ...]  # where each comm price came from (measured / from fleet links)
    update_s: float = 0.0  # the optimizer step over this device's share of the layer, once per iteration
    param_gather_s: float = 0.0  # ZeRO-1/2: all-gather of the updated parameters after the step, not overlapped
    accumulation_bytes: float = 0.0  # ZeRO-2: gradient bytes beyond the 1/dp share, held while they accumulate

    @property
    def per_micro_batch_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s

    @staticmethod
    def accumulates(num_micro_batches: int | None) -> bool:
        """Several micro-batches (None: unknown, priced as several, the larger memory) accumulate gradients."""
        return num_micro_batches is None or num_micro_batches > 1

    def resident_bytes(self, num_micro_batches: int | None = 1) -> float:
        """Oms held for the whole iteration: a ZeRO-2 layer's accumulating gradient joins it past one micro-batch."""
        if self.accumulation_bytes and self.accumulates(num_micro_batches):
            return self.model_state_bytes + self.accumulation_bytes
        return self.model_state_bytes

    def transient_bytes(self, num_micro_batches: int | None = 1) -> float:
        """Ob: with accumulation the ZeRO-2 full gradient is resident already, so it leaves the transient."""
        if self.accumulation_bytes and self.accumulates(num_micro_batches):
            return self.backward_transient_bytes - self.accumulation_bytes
        return self.backward_transient_bytes

    def grad_sync_exposed_s(self, slowdown: float, overlap: bool = True) -> float:
        """Time the DP sync adds to an iteration when it overlaps one backward (or not at all)."""
        if not overlap:
            return self.grad_sync_s
        return overlap_time(self.backward_compute_s, self.grad_sync_s, slowdown) - self.backward_compute_s

    def iteration_s(self, num_micro_batches: int, slowdown: float, overlap: bool = True) -> float:
        """This layer's share of an iteration without pipelining: c(l, s) of Galvatron's DP (Eq. 4), plus a
        ZeRO layer's parameter all-gather (the optimizer step is left out, as before)."""
        return (num_micro_batches * self.per_micro_batch_s + self.grad_sync_exposed_s(slowdown, overlap)
                + self.param_gather_s)


def dim_scopes(
    strategy: LayerStrategy, offsets: tuple[int, ...], devices_per_node: int
) -> tuple[tuple[Dim, Scope], ...]:
    """Scope of each dimension of degree > 1 for a device block starting at each of `offsets`."""
    out = []
    stride = 1
    for dim in reversed(strategy.order):
        n = strategy.degree(dim)
        span = stride * (n - 1)
        intra = all(
            (o + base) // devices_per_node == (o + base + span) // devices_per_node
            for o in offsets
            for base in range(strategy.devices)
            if (base // stride) % n == 0
        )
        out.append((dim, Scope.INTRA if intra else Scope.INTER))
        stride *= n
    return tuple(reversed(out))


def block_scope(devices: int, offsets: tuple[int, ...], devices_per_node: int) -> Scope:
    """Intra-node when every block of `devices` starting at `offsets` sits in one node."""
    intra = all(o // devices_per_node == (o + devices - 1) // devices_per_node for o in offsets)
    return Scope.INTRA if intra else Scope.INTER


def _scopes(ctx: CostContext, strategy: LayerStrategy, offsets: tuple[int, ...]) -> dict[Dim, Scope]:
    key = ("dims", strategy.layout, offsets)
    hit = ctx.scope_cache.get(key)
    if hit is None:
        hit = ctx.scope_cache[key] = dict(dim_scopes(strategy, offsets, ctx.fleet.devices_per_node))
    return hit  # type: ignore[return-value]


def layer_cost(
    ctx: CostContext, index: int, strategy: LayerStrategy, micro_batch_size: int, offsets: tuple[int, ...] = (0,)
) -> LayerCost:
    """Memoised cost of layer `index` (see the module docstring for every rule)."""
    offsets = ctx.node_offsets(offsets)
    key = (index, strategy, micro_batch_size, offsets)
    hit = ctx.layer_cache.get(key)
    if hit is None:
        hit = ctx.layer_cache[key] = _layer_cost(ctx, index, strategy, micro_batch_size, offsets)
    return hit  # type: ignore[return-value]


def _layer_cost(
    ctx: CostContext, index: int, st: LayerStrategy, m: int, offsets: tuple[int, ...]
) -> LayerCost:
    if m < 1:
        raise ValueError(f"micro-batch size must be at least 1, got {m}")
    view, comm = ctx.view, ctx.comm
    layer = view.layers[index]
    share = -(-m // st.batch_split)
    pt = view.point(index, share)
    tp, sdp, dp = st.tp, st.sdp, st.dp
    params, grads, opt = ctx.state_bytes[index]
    scopes = _scopes(ctx, st, offsets)
    sources: list[str] = []

    scale = ctx.compute_scale / tp  # co-located devices slow each other down (profile calibration)
    f_comp, b_comp = pt.forward_s * scale, pt.backward_s * scale
    r_comp = pt.recompute_s * scale if st.checkpoint else 0.0

    tp_pass = 0.0
    if tp > 1 and ctx.tp_allreduces[index]:
        hidden, sc = max(pt.output_bytes, pt.boundary_bytes / (1 + len(layer.extra_inputs))), scopes[Dim.TP]
        if st.sequence_parallel:  # each all-reduce becomes an all-gather (sequence) and a reduce-scatter (sequence)
            tp_pass = ctx.tp_allreduces[index] * (comm.allgather(hidden, tp, sc) + comm.reduce_scatter(hidden, tp, sc))
            sources.append("tp allgather: " + comm.source("allgather", tp, sc))
            sources.append("tp reduce_scatter: " + comm.source("reduce_scatter", tp, sc))
        else:
            tp_pass = ctx.tp_allreduces[index] * comm.allreduce(hidden, tp, sc)
            sources.append("tp allreduce: " + comm.source("allreduce", tp, sc))
    tp_rec = tp_pass if st.checkpoint else 0.0

    sdp_gather = scatter = 0.0
    if sdp > 1:
        sc = scopes[Dim.SDP]
        sdp_gather = comm.allgather(params / tp, sdp, sc)
        scatter = comm.reduce_scatter(grads / tp, sdp, sc)
        sources.append("sdp allgather: " + comm.source("allgather", sdp, sc))
        sources.append("sdp reduce_scatter: " + comm.source("reduce_scatter", sdp, sc))
    grad_shard = grads / (tp * sdp)
    zero = st.dp_sharding  # PLAIN whenever dp == 1
    sync = gather = 0.0
    if dp > 1:
        sc = scopes[Dim.DP]
        collective = "reduce_scatter" if zero is DpSharding.ZERO2 else "allreduce"
        sync = comm.time(collective, grad_shard, dp, sc)
        sources.append(f"dp {collective}: " + comm.source(collective, dp, sc))
        if zero is not DpSharding.PLAIN:
            gather = comm.allgather(params / (tp * sdp), dp, sc)
            sources.append("dp allgather: " + comm.source("allgather", dp, sc))
    opt_kept = opt / dp if zero is not DpSharding.PLAIN else opt  # ZeRO-1/2: 1/dp of the optimizer states
    # ZeRO-2: 1/dp of the reduced gradients, unless its reduce-scatters wait for the whole backward (options)
    frees = zero is DpSharding.ZERO2 and ctx.options.zero2_reduce_scatter_per_layer
    grads_kept = grads / dp if frees else grads
    accumulation = grad_shard - grads_kept / (tp * sdp)

    bwd_overlapped = overlap_time(b_comp, sdp_gather + scatter, ctx.overlap_slowdown)

    stashed = pt.stashed_bytes / tp
    boundary = pt.boundary_bytes / tp if st.sequence_parallel else pt.boundary_bytes  # SP splits it by sequence
    if st.checkpoint:
        fwd_act, transient = boundary, stashed
    else:
        fwd_act, transient = boundary + stashed, 0.0
    if sdp > 1:
        transient += (params + grads) / tp * (1.0 - 1.0 / sdp)
    transient += accumulation  # one micro-batch: the layer's full gradient until its reduce-scatter
    swap = fwd_act if st.swap else 0.0

    return LayerCost(
        index=index,
        strategy=st,
        micro_batch_size=m,
        samples_per_device=share,
        forward_s=f_comp + tp_pass + sdp_gather,
        backward_s=bwd_overlapped + tp_pass,
        recompute_s=r_comp + tp_rec,
        grad_sync_s=sync,
        forward_compute_s=f_comp,
        backward_compute_s=b_comp,
        recompute_compute_s=r_comp,
        tp_comm_s=2 * tp_pass + tp_rec,
        sdp_comm_s=2 * sdp_gather + scatter,
        overlap_extra_s=bwd_overlapped - b_comp,
        model_state_bytes=(params + grads_kept + opt_kept) / (tp * sdp),
        forward_activation_bytes=fwd_act,
        backward_transient_bytes=transient,
        swap_bytes=swap,
        grad_shard_bytes=grad_shard,
        scopes=tuple(scopes.items()),
        sources=tuple(sources),
        # TP and SDP shard the states; ZeRO-1/2 leave each dp replica 1/dp of them to step
        update_s=layer.optimizer_step_s * ctx.compute_scale / (tp * sdp * (dp if zero is not DpSharding.PLAIN else 1)),
        param_gather_s=gather,
        accumulation_bytes=accumulation,
    )


# --- Transformation between neighbouring layouts (Eq. 4) -----------------------------------------


@dataclass(frozen=True, slots=True)
class Transform:
    """Re-layout of layer index-1's output for layer index (forward) and of its gradient (backward)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_bytes: float = 0.0  # per device, the worst device
    backward_bytes: float = 0.0
    source: str = "same layout"


NO_TRANSFORM = Transform()


def _sample_chunks(st: LayerStrategy) -> tuple[np.ndarray, np.ndarray]:
    """Which of the st.batch_split sample chunks each device (rank inside the block) holds, and which of the tp
    sequence parts (all of the sequence, part 0 of 1, without sequence parallelism)."""
    devices = np.arange(st.devices)
    strides: dict[Dim, int] = {}
    stride = 1
    for dim in reversed(st.order):
        strides[dim] = stride
        stride *= st.degree(dim)
    chunk = np.zeros(st.devices, dtype=np.int64)
    for dim in st.order:
        if dim is not Dim.TP:
            n = st.degree(dim)
            chunk = chunk * n + (devices // strides[dim]) % n
    part = (devices // strides[Dim.TP]) % st.tp if st.sequence_parallel else np.zeros(st.devices, dtype=np.int64)
    return chunk, part


def missing_fraction(held: LayerStrategy, needed: LayerStrategy) -> float:
    """Largest fraction of a micro-batch's tensor that a device lacks after a layout change."""
    if held.devices != needed.devices:
        raise ValueError(f"layouts on different device counts: {held.devices} vs {needed.devices}")
    return float(_fractions((held.layout, needed.layout))[0, 1])


def transform_cost(
    ctx: CostContext,
    index: int,
    prev: LayerStrategy,
    strategy: LayerStrategy,
    micro_batch_size: int,
    offsets: tuple[int, ...] = (0,),
) -> Transform:
    """R(index, prev, strategy) of Galvatron-BMW Eq. 4; zero when the sample layouts agree."""
    if index < 1 or prev.layout == strategy.layout:
        return NO_TRANSFORM
    offsets = ctx.node_offsets(offsets)
    key = (index, prev.layout, strategy.layout, micro_batch_size, offsets)
    hit = ctx.transform_cache.get(key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    fkey = ("missing", prev.layout, strategy.layout)
    fractions = ctx.scope_cache.get(fkey)
    if fractions is None:
        fractions = ctx.scope_cache[fkey] = (missing_fraction(prev, strategy), missing_fraction(strategy, prev))
    out_bytes = ctx.view.point(index - 1, micro_batch_size).output_bytes
    fwd_b, bwd_b = fractions[0] * out_bytes, fractions[1] * out_bytes  # type: ignore[index]
    if fwd_b <= 0 and bwd_b <= 0:
        result = NO_TRANSFORM
    else:
        scope = block_scope(strategy.devices, offsets, ctx.fleet.devices_per_node)
        result = Transform(
            forward_s=ctx.comm.p2p(fwd_b, scope),
            backward_s=ctx.comm.p2p(bwd_b, scope),
            forward_bytes=fwd_b,
            backward_bytes=bwd_b,
            source=ctx.comm.source("p2p", 2, scope),
        )
    ctx.transform_cache[key] = result
    return result


def transform_matrix(
    ctx: CostContext, index: int, layouts: Sequence[LayerStrategy], micro_batch_size: int,
    offsets: tuple[int, ...] = (0,), *, after: Sequence[LayerStrategy] | None = None,
) -> np.ndarray:
    """transform_cost's forward + backward seconds into layer `index` for every (previous, next) pair of
    `layouts` (one device count), priced at once: a search over 1,024 devices asks for thousands of pairs. With
    `after`, layer `index` runs after[b] where layer index-1 runs layouts[b] (the pair (a, b) is layouts[a] into
    after[b]: a layer and its predecessor may differ in sequence parallelism)."""
    if index < 1:
        return np.zeros((len(layouts), len(layouts)))
    line = ctx.comm.line("p2p", 2, block_scope(layouts[0].devices, ctx.node_offsets(offsets),
                                               ctx.fleet.devices_per_node))
    out_bytes = ctx.view.point(index - 1, micro_batch_size).output_bytes

    def seconds(frac: np.ndarray) -> np.ndarray:
        nbytes = frac * out_bytes
        return np.where(nbytes > 0, line.latency_s + line.seconds_per_byte * nbytes, 0.0)

    if after is None:
        fwd = seconds(_fractions(tuple(st.layout for st in layouts)))
        return fwd + fwd.T
    union = tuple(dict.fromkeys(st.layout for st in (*layouts, *after)))
    frac = _fractions(union)
    held, needed = [union.index(st.layout) for st in layouts], [union.index(st.layout) for st in after]
    return seconds(frac[np.ix_(held, needed)]) + seconds(frac[np.ix_(needed, held)].T)


@functools.lru_cache(maxsize=4096)
def _fractions(layouts: tuple[tuple, ...]) -> np.ndarray:
    """missing_fraction of every (held, needed) pair of layouts (rows held), all pairs at once, broadcast over
    (held, needed, device): a 1,024-device search asks for thousands of pairs, and every later search on the
    same device count asks again. A device holds a rectangle of (samples x sequence): its sample chunk, and all
    of the sequence or (sequence parallelism) its tp rank's part of it. It lacks what the rectangle it needs
    does not share with the one it holds."""
    sts = [LayerStrategy.of_layout(layout) for layout in layouts]
    held = [_sample_chunks(st) for st in sts]
    chunks, parts = np.stack([c for c, _ in held]), np.stack([p for _, p in held])
    splits = np.array([st.batch_split for st in sts])[:, None]
    ways = np.array([st.tp if st.sequence_parallel else 1 for st in sts])[:, None]
    low, high = chunks / splits, (chunks + 1) / splits
    overlap = np.maximum(0.0, np.minimum(high[:, None], high[None]) - np.maximum(low[:, None], low[None]))
    if (ways > 1).any():
        first, last = parts / ways, (parts + 1) / ways
        overlap = overlap * np.maximum(0.0, np.minimum(last[:, None], last[None]) - np.maximum(first[:, None],
                                                                                              first[None]))
    worst = np.maximum(0.0, (1.0 / (splits * ways)[None] - overlap).max(axis=2))
    out = np.where(worst < 1e-12, 0.0, worst)
    out.flags.writeable = False
    return out


def ceil_bytes(x: float) -> int:
    return int(math.ceil(x - 1e-9)) if x > 0 else 0
