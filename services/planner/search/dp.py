"""Per-stage dynamic program over layer strategies (Galvatron-BMW §IV-A2, Eq. 2-4, Appendix A1-A3).

Inside one pipeline stage every layer picks a strategy (DP/SDP/TP nesting and CKPT, space.py). Eq. 4:
``C(l, e) = min_s C(l-1, e - Ef(l, s)) + c(l, s) + R(l, s_prev, s)`` where

* c(l, s) = nm x (forward + backward + recompute of one micro-batch) + w x the layer's DP gradient sync
  + what runs after the sync, once per iteration and not overlapped: the optimizer step over the device's
  share and, for ZeRO-1/2, the all-gather of the updated parameters (a DP flavour's whole saving in time
  is there: 1/dp of the step; its price is the gather);
* R = nm x (forward + backward) re-layout cost between neighbouring layouts (cost.transform_cost);
* Ef(l, s) = Oms + n x Of: model states plus the forward activations of the n micro-batches the stage
  holds at once (cost.in_flight_micro_batches; Eq. 3 with the schedule's in-flight multiplier). Oms and
  Eq. 2's transient depend on nm for ZeRO-2 (LayerTables.memory: its accumulating gradient is resident
  past one micro-batch), so each solver reads them at its own nm.

Exact cost. The shared cost model (cost.stage_cost) overlaps a stage's whole gradient sync M with its last
backward C: exposed = overlap(C, M) - C, not a per-layer sum (LayerCost.iteration_s, the paper's c(l, s),
overlaps layer by layer and over-charges DP layers next to SDP/TP ones). With w = min(k - 1, 1) (k the
overlap slowdown; w = 1 without overlap) the DP's sum is a lower bound of that cost, equal to it whenever
the sync fits under the backward (M <= C). Every candidate is re-scored exactly (`LayerTables.check`: the
stage_cost time and the cost model's peak, ceil(sum Oms) + baseline + n x ceil(sum Of) + Eq. 2's transient),
and `StagePlan.cost_s` / `memory_bytes` are those exact numbers.

Memory. Eq. 2's max over layers (the backward transient) would need a second memory state (Appendix A1),
so, as in Algorithm 3, the DP constrains only Ef on a grid of `granularity` bytes and the forward budget is
swept: a budget's strategies are reconstructed and kept if their exact peak fits E. Per-layer Ef is rounded
to the nearest unit and the grid runs to floor((E - baseline) / g) + ceil(L / 2), so rounding never
excludes an assignment that fits exactly. Budgets are visited by increasing DP value (one per distinct
value, the smallest budget reaching it) while a later one could still win; that decoupling is Galvatron's
heuristic: a budget's cheapest assignment can hide a dearer one with a smaller transient. A stage is
answered, cheapest first, by:

1. the memory-free optimum (a Viterbi pass over layouts, no memory axis) when it fits and is tight: exact;
2. every assignment priced at once when there are at most TINY: exact;
3. the forward-budget sweep above (the memory tables are built only now);
4. with `enumerate_limit` (ENUMERATE_LIMIT by default, so small stages are exact), stages with at most that many
   assignments continue best-first through assignments in increasing DP value -- the kept tables are an
   exact A* heuristic -- until none left can beat the best exact cost found: exact on the grid's top, within
   `expansions`. Two more lower bounds keep that proof short where the grid's is loose (near-equal
   alternatives such as DP flavours multiply the assignments it must otherwise walk): partial assignments
   whose exact peak (Eq. 2's transient included) cannot fit are dropped, and the grid budget left is cut to
   what the fixed layers' exact bytes leave; and the sync's exact overlap, where it exceeds the DP's
   w x sync, bounds the cost (bounds.py).

Nothing fits: an infeasible StagePlan (cost inf), never an exception. Speed: numpy over the memory axis in
float32 (exact costs are recomputed in float64); slots laid out `checkpoint flag x layout` so the re-layout
step is a min-plus product over layouts only (R ignores CKPT), layouts that re-layout alike merged into
classes (a DP flavour is its own layout here, with its plain twin's sample layout: R between them is 0 and
they always share a class, so flavours widen the tables but not the min-plus product); one forward pass per
first layer (or a backward pass from the model's end) serves every range sharing it; layers with equal cost
inputs (identical blocks) share one cost-model call; an Arena recycles the tables between configurations
(fresh memory costs a page fault per 4 KiB).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from services.planner.cost import CostContext, LayerStrategy, dim_scopes, layer_cost
from services.planner.cost.layer import LayerCost, block_scope, transform_matrix
from services.planner.cost.profile_view import LayerView
from services.planner.search.bounds import CostBound, PeakBound
from services.planner.search.problem import PricedPlan, to_strategy
from services.planner.search.space import Candidate, executable_shape

INF = math.inf
RESCORE = 20  # forward budgets the sweep reconstructs while their DP value could still beat the best found
TABLE_DTYPE = np.float32  # the memory DP's tables: half the memory traffic; exact costs are recomputed in float64
TINY = 1024  # stages with at most this many assignments are priced exhaustively
ENUMERATE_LIMIT = 1 << 20  # stages with at most this many assignments get the exact enumeration (0: sweep only)
EXPANSIONS = 50_000  # and it gives up proving after this many expansions


@dataclass(frozen=True, eq=False)
class LayerTables:
    """Every layer x strategy slot of one group size at one micro-batch size and device offset.

    Slot k = flag * num_layouts + layout; a missing combination holds None and infinite cost. Times per
    micro-batch are kept apart from the once-per-iteration sync, so one table serves every nm; so are a
    ZeRO-2 slot's accumulation bytes (`memory`).
    """

    strategies: tuple[LayerStrategy | None, ...]
    num_layouts: int
    layout: np.ndarray  # (S,) layout of each slot
    per_micro_batch_s: np.ndarray  # (L, S) forward + backward + recompute of one micro-batch
    grad_sync_s: np.ndarray  # (L, S) DP gradient allreduce, once per iteration
    backward_compute_s: np.ndarray  # (L, S) what that sync overlaps with
    recompute_s: np.ndarray  # (L, S) the recompute part of per_micro_batch_s (CKPT)
    model_state_bytes: np.ndarray  # (L, S) Oms
    forward_activation_bytes: np.ndarray  # (L, S) Of, per in-flight micro-batch
    backward_transient_bytes: np.ndarray  # (L, S) Ob
    transform_s: np.ndarray  # (L, layouts, layouts) re-layout into layer l (forward + backward), per micro-batch
    layer_rep: tuple[int, ...]  # a layer with identical rows (shared work)
    transform_rep: tuple[int, ...]  # a layer with an identical transform_s entry
    baseline_bytes: int
    micro_batch_size: int
    overlap_slowdown: float
    overlap_grad_sync: bool
    post_sync_s: np.ndarray | None = None  # (L, S) optimizer step + ZeRO parameter all-gather, once per iteration
    sequence: np.ndarray | None = None  # (L, layouts) the layer runs that TP layout with sequence parallelism
    accumulation_bytes: np.ndarray | None = None  # (L, S) ZeRO-2: resident instead of transient past one micro-batch
    _memory: dict[bool, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    _post: bool = field(default=False, repr=False)  # some slot has a post-sync cost (checks skip it otherwise)

    def __post_init__(self) -> None:
        for name in ("post_sync_s", "accumulation_bytes"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros_like(self.per_micro_batch_s))
        object.__setattr__(self, "_post", bool(self.post_sync_s.any()))  # type: ignore[union-attr]

    @property
    def num_layers(self) -> int:
        return self.per_micro_batch_s.shape[0]

    def memory(self, num_micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
        """(Oms, Ob) of every layer and slot at nm micro-batches per iteration, as LayerCost.resident_bytes and
        transient_bytes give them (the same float64 operations, so sums agree with cost.stage_cost)."""
        several = num_micro_batches > 1 and bool(self.accumulation_bytes.any())  # type: ignore[union-attr]
        if several not in self._memory:
            oms, ob, acc = self.model_state_bytes, self.backward_transient_bytes, self.accumulation_bytes
            self._memory[several] = (np.where(acc > 0, oms + acc, oms), np.where(acc > 0, ob - acc, ob)) \
                if several else (oms, ob)
        return self._memory[several]

    @property
    def sync_weight(self) -> float:
        """w of the module docstring: the sync's weight in the DP's lower bound."""
        return min(self.overlap_slowdown - 1.0, 1.0) if self.overlap_grad_sync else 1.0

    def layer_costs(self, num_micro_batches: int) -> np.ndarray:
        """c(l, s) of Eq. 4 for every layer and slot."""
        return self.per_micro_batch_s * num_micro_batches + self.sync_weight * self.grad_sync_s + self.post_sync_s

    def check_one(
        self, begin: int, slots: Sequence[int], in_flight: int, num_micro_batches: int
    ) -> tuple[float, float]:
        """(peak bytes, exact cost) of one assignment: `check` for a single column, in plain
        Python (sequential sums, as cost.stage_cost adds)."""
        rows = np.arange(begin, begin + len(slots))
        cols = np.asarray(slots)
        states, transients = self.memory(num_micro_batches)
        per, sync, back, post, oms, of, ob = (a[rows, cols].tolist() for a in (
            self.per_micro_batch_s, self.grad_sync_s, self.backward_compute_s, self.post_sync_s, states,
            self.forward_activation_bytes, transients))
        lay = self.layout[cols]
        moves = self.transform_s[rows[1:], lay[:-1], lay[1:]].tolist()
        transient, later = 0.0, 0.0
        for k in range(len(slots) - 1, -1, -1):
            transient = max(transient, ob[k] - later)
            later += of[k]
        peak = _ceil(sum(oms)) + self.baseline_bytes + in_flight * _ceil(later) + _ceil(transient)
        m_sync, m_back = sum(sync), sum(back)
        if not self.overlap_grad_sync or m_sync <= 0 or m_back <= 0:
            exposed = m_sync
        else:
            hi, lo = max(m_back, m_sync), min(m_back, m_sync)
            exposed = hi + (self.overlap_slowdown - 1) * lo - m_back
        return float(peak), (sum(per) + sum(moves)) * num_micro_batches + exposed + sum(post)

    def check(
        self, begin: int, slots: np.ndarray, in_flight: int, num_micro_batches: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(peak bytes, exact cost) of each column of slots (layers x assignments) for the stage starting at
        `begin`: the rules of cost.stage_cost and cost.pipeline.peak_memory, summed in their order (cumsum is
        sequential) so bytes agree with the simulator's; cost = nm x per-micro-batch time + exposed sync."""
        count, width = slots.shape
        flat = (np.arange(begin, begin + count) * self.layout.size)[:, None] + slots

        def pick(a: np.ndarray) -> np.ndarray:
            return a.take(flat)

        oms, ob = self.memory(num_micro_batches)
        states = np.cumsum(pick(oms), axis=0)[-1]
        later = np.cumsum(pick(self.forward_activation_bytes)[::-1], axis=0)  # last layer first
        before = np.concatenate((np.zeros((1, width)), later[:-1]))
        transient = np.maximum((pick(ob)[::-1] - before).max(axis=0), 0.0)
        peak = _ceil_bytes(states) + self.baseline_bytes + in_flight * _ceil_bytes(later[-1]) + _ceil_bytes(transient)
        per = pick(self.per_micro_batch_s).sum(axis=0)
        if count > 1:
            nl = self.num_layouts
            lay = self.layout[slots]
            moves = (np.arange(begin + 1, begin + count) * nl * nl)[:, None] + lay[:-1] * nl + lay[1:]
            per = per + self.transform_s.take(moves).sum(axis=0)
        sync, back = pick(self.grad_sync_s).sum(axis=0), pick(self.backward_compute_s).sum(axis=0)
        if self.overlap_grad_sync:
            hi, lo = np.maximum(back, sync), np.minimum(back, sync)
            exposed = np.where(sync <= 0, 0.0, np.where(back <= 0, sync, hi + (self.overlap_slowdown - 1) * lo - back))
        else:
            exposed = sync
        cost = per * num_micro_batches + exposed
        return peak, cost + np.cumsum(pick(self.post_sync_s), axis=0)[-1] if self._post else cost


@dataclass(frozen=True)
class StagePlan:
    """The DP's answer for layers [begin, end): strategies, exact stage cost (inf: nothing fits), peak bytes."""

    begin: int
    end: int
    in_flight: int
    strategies: tuple[LayerStrategy, ...]
    cost_s: float  # nm micro-batches + exposed gradient sync + the step and ZeRO gathers after it
    memory_bytes: float  # per-device peak (Eq. 2 with in-flight micro-batches); inf when infeasible
    exact: bool = False  # proved the least cost that fits (on the grid's top), not just the best found
    recompute_s: float = 0.0  # per micro-batch, the part of cost_s a schedule may skip (1F1B's last stage)

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.cost_s)


def _layer_key(ctx: CostContext, index: int) -> tuple:
    """What layer_cost reads of a layer: its table, skip-edge count, state bytes, TP allreduce count and
    optimizer step; and what `runs_on_workers` reads."""
    lv = ctx.view.layers[index]
    return (lv.table, len(lv.extra_inputs), ctx.state_bytes[index], ctx.tp_allreduces[index], lv.optimizer_step_s,
            lv.tensor_parallel, lv.sequence_parallel, bool(lv.tied_with))


def runs_on_workers(layer: LayerView, st: LayerStrategy) -> bool:
    """Whether Ballast's workers can run `layer` under `st` (train/hybrid.py): the shape (SDP alone, TP innermost
    with DP outside it), TP only where the profile says the layer splits (and its sequence, for SP), no TP or SDP
    on a tied weight."""
    if not executable_shape((d.value for d in st.order if st.degree(d) > 1), st.sharded):
        return False
    if st.tp > 1 and (not layer.tensor_parallel or layer.tensor_parallel % st.tp):
        return False
    if st.sequence_parallel and (not layer.sequence_parallel or layer.sequence_parallel % st.tp):
        return False
    return not (layer.tied_with and (st.tp > 1 or st.sdp > 1))


def plan_runs_on_workers(ctx: CostContext, plan: PricedPlan) -> bool:
    """Every layer of a whole plan (any engine's, a baseline's) as the workers run it (`runs_on_workers`), each
    micro-batch split over its stage's devices."""
    return all(runs_on_workers(ctx.view.layers[i], st) and plan.micro_batch_size % st.devices == 0
               for i, st in enumerate(plan.strategies))


def scope_key(ctx: CostContext, candidates: Sequence[Candidate], offsets: tuple[int, ...]) -> tuple:
    """What the cost model reads of a stage's device offset: every strategy's dim scopes and the block's
    scope (cost.layer). Offsets with equal keys price identically, so they share one LayerTables."""
    offsets, dpn = ctx.node_offsets(offsets), ctx.fleet.devices_per_node
    sts = [to_strategy(c) for c in candidates]
    size = sts[0].devices if sts else 1
    return (*(dim_scopes(st, offsets, dpn) for st in sts), block_scope(size, offsets, dpn))


_COLUMNS = ("per_micro_batch_s", "grad_sync_s", "backward_compute_s", "recompute_s", "model_state_bytes",
            "forward_activation_bytes", "backward_transient_bytes", "post_sync_s", "accumulation_bytes")


def layer_tables(
    ctx: CostContext, candidates: Sequence[Candidate], micro_batch_size: int, offsets: tuple[int, ...] = (0,),
    *, executable_only: bool = False, sequence: bool = False,
) -> LayerTables:
    """Price every layer under every candidate on the shared cost model (layer_cost, transform_matrix).

    `executable_only` leaves a layer's TP strategies infeasible unless its profile says the workers can split
    it, its TP and SDP strategies infeasible when it holds a tied weight (the workers keep those DP), and every
    strategy infeasible at a micro-batch its group's devices do not divide (the workers' layout between layers).

    `sequence`: a layer runs each TP layout with sequence parallelism where it may (its profile, under
    `executable_only`) and that is no slower per micro-batch than plain TP. It always holds less (its boundary
    activation is split by the sequence) and, on fleet links, costs the same; the search space stays the size of
    plain TP's. The choice looks at the layer alone, not at its neighbours' re-layouts nor at a budget only plain
    TP's slower twin would meet: with measured collective fits where SP is slower, or TP neighbours that differ in
    it, a plan may be a little off the best. Decided per (layer, layout), so transformations (which depend on the
    layouts on both sides) are priced on what each layer runs."""
    if not candidates:
        raise ValueError("no candidate strategies")
    layouts = list(dict.fromkeys((c.dims, c.dp_sharding) for c in candidates))  # a DP flavour is a layout here
    flags = list(dict.fromkeys(c.checkpoint for c in candidates))
    by_key = {(c.checkpoint, c.dims, c.dp_sharding): to_strategy(c) for c in candidates}
    sts = [by_key.get((f, *d)) for f in flags for d in layouts]
    nl, n = len(layouts), len(ctx.view)
    cols = {name: np.zeros((n, len(sts))) for name in _COLUMNS}
    cols["per_micro_batch_s"][:] = INF
    slow, overlap = ctx.overlap_slowdown, ctx.options.overlap_grad_sync
    reps: dict[tuple, int] = {}
    layer_rep = [reps.setdefault(_layer_key(ctx, i), i) for i in range(n)]
    seq = np.zeros((n, nl), dtype=bool)
    for i in range(n):
        if layer_rep[i] != i:
            for arr in cols.values():
                arr[i] = arr[layer_rep[i]]
            seq[i] = seq[layer_rep[i]]
            continue
        decided: dict[int, bool] = {}
        for k, st in enumerate(sts):
            # A strategy whose dp x sdp does not divide the micro-batch would split samples: infeasible here.
            # The workers also split every micro-batch over the whole group between layers (train/hybrid.py).
            split = st.devices if executable_only and st is not None else getattr(st, "batch_split", 1)
            if st is not None and micro_batch_size % split == 0 and (
                    not executable_only or runs_on_workers(ctx.view.layers[i], st)):
                c = layer_cost(ctx, i, st, micro_batch_size, offsets)
                if sequence and st.tp > 1:
                    c = _sequence_choice(ctx, i, st, c, micro_batch_size, offsets, executable_only, decided, k % nl)
                    seq[i, k % nl] = c.strategy.sequence_parallel
                values = (c.per_micro_batch_s, c.grad_sync_s, c.backward_compute_s, c.recompute_s, c.model_state_bytes,
                          c.forward_activation_bytes, c.backward_transient_bytes, c.update_s + c.param_gather_s,
                          c.accumulation_bytes)
                for name, v in zip(_COLUMNS, values, strict=True):
                    cols[name][i, k] = v
    per_layout = [next(s for s in sts[a::nl] if s is not None) for a in range(nl)]
    trans = np.zeros((n, nl, nl))
    transform_rep = [0] * n
    firsts: dict[tuple, int] = {}
    for i in range(1, n):
        # R into i depends on layer i-1's output, and on which layouts each side runs with sequence parallelism
        rep = transform_rep[i] = firsts.setdefault((layer_rep[i - 1], seq[i - 1].tobytes(), seq[i].tobytes()), i)
        if rep != i:
            trans[i] = trans[rep]
        elif seq[i - 1].any() or seq[i].any():
            trans[i] = transform_matrix(ctx, i, _with_sequence(per_layout, seq[i - 1]), micro_batch_size, offsets,
                                        after=_with_sequence(per_layout, seq[i]))
        else:
            trans[i] = transform_matrix(ctx, i, per_layout, micro_batch_size, offsets)
    return LayerTables(
        strategies=tuple(sts), num_layouts=nl, layout=np.arange(len(sts)) % nl, **cols,
        transform_s=trans, layer_rep=tuple(layer_rep),
        transform_rep=tuple(transform_rep), baseline_bytes=ctx.resident_baseline_bytes,
        micro_batch_size=micro_batch_size, overlap_slowdown=slow, overlap_grad_sync=overlap,
        sequence=seq if seq.any() else None,
    )


def _sequence_choice(ctx: CostContext, index: int, st: LayerStrategy, plain: LayerCost, micro_batch_size: int,
                     offsets: tuple[int, ...], executable_only: bool, decided: dict[int, bool],
                     layout: int) -> LayerCost:
    """`plain` (a TP strategy's cost) or its sequence-parallel twin's, one answer per layout of the layer: SP where
    the layer may run it and its micro-batch is no slower (it never holds more)."""
    twin = sequence_twin(st)
    if layout not in decided:
        runs = not executable_only or runs_on_workers(ctx.view.layers[index], twin)
        decided[layout] = runs and (layer_cost(ctx, index, twin, micro_batch_size, offsets).per_micro_batch_s
                                    <= plain.per_micro_batch_s * (1 + 1e-12))
    if not decided[layout]:
        return plain
    return layer_cost(ctx, index, twin, micro_batch_size, offsets)


@functools.lru_cache(maxsize=8192)
def sequence_twin(st: LayerStrategy) -> LayerStrategy:
    """`st` with sequence parallelism (plans ask for the same few strategies' twins thousands of times)."""
    return replace(st, sequence_parallel=True)


def _with_sequence(layouts: Sequence[LayerStrategy], flags: np.ndarray) -> list[LayerStrategy]:
    return [sequence_twin(st) if flag else st for st, flag in zip(layouts, flags, strict=True)]


def _ceil(x: float) -> float:
    return math.ceil(x - 1e-9) if x > 0 else 0.0


def _ceil_bytes(x: np.ndarray) -> np.ndarray:
    """cost.layer.ceil_bytes, elementwise."""
    return np.where(x > 0, np.ceil(x - 1e-9), 0.0)


def forward_units(
    tables: LayerTables, begin: int, end: int, in_flight: int, granularity: int, num_micro_batches: int = 1
) -> np.ndarray:
    """Ef(l, s) = Oms + n x Of of every stage layer and slot at nm micro-batches, in grid units rounded to the
    nearest."""
    x = tables.memory(num_micro_batches)[0][begin:end] + in_flight * tables.forward_activation_bytes[begin:end]
    return np.floor(x / granularity + 0.5).astype(np.int64)


def _infeasible(begin: int, end: int, in_flight: int) -> StagePlan:
    return StagePlan(begin, end, in_flight, (), INF, INF)


@dataclass(frozen=True, eq=False)
class _Step:
    """R x nm into one layer, oriented (previous, newest) for the pass direction. Layouts that price alike
    (equal rows and columns, e.g. DP and SDP of one degree) merge into classes for the min-plus product."""

    key: tuple[int, bool]
    full: np.ndarray  # (layouts, layouts)
    pairs: np.ndarray  # (slots, slots): full between the slots' layouts
    reps: np.ndarray  # first layout of each class
    extra: tuple[tuple[int, int], ...]  # (class, layout) of the other members
    reduced: np.ndarray  # (classes, classes)
    slot_class: np.ndarray  # (slots,)
    cube: np.ndarray  # scratch for the product (classes, classes, budgets)


def _make_step(key: tuple[int, bool], full: np.ndarray, layout: np.ndarray, budgets: int) -> _Step:
    ids: dict[bytes, int] = {}
    cls = np.array([ids.setdefault(full[a].tobytes() + full[:, a].tobytes(), len(ids)) for a in range(len(full))])
    reps = np.array([int(np.flatnonzero(cls == c)[0]) for c in range(len(ids))])
    extra = tuple((int(cls[a]), a) for a in range(len(full)) if reps[cls[a]] != a)
    reduced = full[np.ix_(reps, reps)].astype(TABLE_DTYPE)
    return _Step(key, full, full[np.ix_(layout, layout)], reps, extra, reduced, cls[layout],
                 np.empty((len(reps), len(reps), budgets), dtype=TABLE_DTYPE))


class _Pass:
    """Eq. 4 run layer by layer away from an anchor: forward from `begin`, or backward from `end`.

    Keeps, per processed layer, the memory-free optimum per slot (Viterbi over layouts) and, only when a
    range needs it, the table D[slot, e] (least DP cost of the layers so far with that slot on the newest
    layer and forward memory <= e units); any range sharing the anchor is answered from them.
    """

    def __init__(self, solver: StageSolver, anchor: int, forward: bool) -> None:
        self.s, self.anchor, self.forward = solver, anchor, forward
        self.layers: list[int] = []
        self.free: list[np.ndarray] = []  # (S,) per processed layer
        self.back: list[np.ndarray | None] = []  # (S,) the previous slot of each slot's memory-free optimum
        self.steps: list[_Step | None] = []  # the re-layout into processed layer j (None: free)
        self.tables: list[np.ndarray] = []  # (S, E) per processed layer, built on demand
        self.bands: list[tuple[int, int]] = []  # per processed layer: (fewest, most) units of the layers so far

    def extend_free(self, count: int) -> None:
        s = self.s
        nl = s.tables.num_layouts
        while len(self.layers) < count:
            y = self.anchor + len(self.layers) if self.forward else self.anchor - 1 - len(self.layers)
            if not self.layers:
                self.free.append(s.cost[y].copy())
                self.steps.append(None)
                self.back.append(None)
            else:
                step = s.step(y if self.forward else y + 1, self.forward)
                grouped = self.free[-1].reshape(-1, nl)
                flag = grouped.argmin(axis=0)
                best = grouped[flag, s.layouts]
                if step is not None:
                    total = best[:, None] + step.full  # (previous, newest)
                    origin = total.argmin(axis=0)
                    reach = total[origin, s.layouts]
                else:
                    origin = np.full(nl, best.argmin())
                    reach = best[origin]
                self.free.append(reach[s.tables.layout] + s.cost[y])
                self.back.append((flag[origin] * nl + origin)[s.tables.layout])
                self.steps.append(step)
            self.layers.append(y)

    def extend(self, count: int) -> None:
        s = self.s
        self.extend_free(count)
        nl, size = s.tables.num_layouts, s.budgets.size
        while len(self.tables) < count:
            j = len(self.tables)
            y, step = self.layers[j], self.steps[j]
            table = s.arena.take((s.tables.layout.size, size))
            if j == 0:
                np.copyto(table, np.where(s.units[y][:, None] <= s.budgets[None, :], s.cost32[y][:, None], INF))
            elif step is None:  # no re-layout cost: every slot continues from the cheapest previous one
                s.reach[0] = self.tables[-1].min(axis=0)
                s.shifted(y, None, table)
                table += s.cost32[y][:, None]
            else:
                lo, hi = self._band(j)
                if lo >= size:  # no assignment of these layers fits any budget of the grid
                    table.fill(INF)
                    self.tables.append(table)
                    continue
                # Only budgets in [lo, hi] differ: below lo nothing fits, from hi up everything does. The
                # product reads the previous layer at those budgets less this layer's units.
                units = s.units[y][np.isfinite(s.cost[y])]
                a, b = max(0, lo - int(units.max())), min(size, hi - int(units.min()) + 1)
                prev = self.tables[-1][:, a:b]  # (layouts, E) below: the cheapest CKPT flag per layout
                best = np.minimum(prev[:nl], prev[nl:]) if prev.shape[0] == 2 * nl else \
                    prev.reshape(-1, nl, b - a).min(axis=0)
                classes = best[step.reps]
                for c, x in step.extra:
                    np.minimum(classes[c], best[x], out=classes[c])
                k = step.reduced.shape[0]
                cube = step.cube.ravel()[: k * k * (b - a)].reshape(k, k, b - a)  # contiguous: a slice would stride
                np.add(classes[:, None, :], step.reduced[:, :, None], out=cube)
                np.min(cube, axis=0, out=s.reach[:k, a:b])
                s.shifted(y, step, table)
                table += s.cost32[y][:, None]
                table[:, :lo] = INF
                table[:, hi + 1:] = table[:, hi: hi + 1]
            self.tables.append(table)

    def _band(self, j: int) -> tuple[int, int]:
        """Budgets where processed layer j's table can change: from the fewest units the first j+1 layers'
        feasible strategies take to the most (capped at the grid's top)."""
        while len(self.bands) <= j:
            y = self.layers[len(self.bands)]
            units = self.s.units[y][np.isfinite(self.s.cost[y])]
            lo0, hi0 = self.bands[-1] if self.bands else (0, 0)
            low, high = (int(units.min()), int(units.max())) if units.size else (self.s.top + 1, 0)
            self.bands.append((lo0 + low, hi0 + high))
        lo, hi = self.bands[j]
        return lo, min(hi, self.s.budgets.size - 1)

    def lower_bound(self, count: int, memory: bool) -> float:
        """No assignment of the range that fits costs less: the memory-free optimum, or with `memory` the DP
        value at the grid's top (every assignment that fits exactly lies below it)."""
        if memory:
            self.extend(count)
            return float(self.tables[count - 1][:, -1].min())
        self.extend_free(count)
        return float(self.free[count - 1].min())

    def _walk(self, count: int, last: np.ndarray, previous: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
        """Slots (processed order x columns) walking back from `last`, re-deriving each argmin of Eq. 4 from
        the kept values (the same sums, so the same minimum); `previous(j, slots)` gives layer j-1's values."""
        out = np.empty((count, last.size), dtype=np.int64)
        out[-1] = last
        for j in range(count - 1, 0, -1):
            vals = previous(j, out[j])
            step = self.steps[j]
            if step is not None:
                vals = vals + step.pairs[:, out[j]]
            out[j - 1] = vals.argmin(axis=0)
        return out if self.forward else out[::-1]

    def _check(self, begin: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.s
        return s.tables.check(begin, slots, s.in_flight, s.nm)

    def answer(self, count: int) -> StagePlan:
        """The range of the first `count` processed layers (module docstring). The memory-free optimum is
        the answer when it fits and its DP value is its exact cost; otherwise the forward-budget sweep."""
        s = self.s
        begin, end = (self.anchor, self.anchor + count) if self.forward else (self.anchor - count, self.anchor)
        if float(s.tables.layout.size) ** count <= TINY:
            return self._every(count, begin, end)
        self.extend_free(count)
        value = float(self.free[count - 1].min())
        if not math.isfinite(value):
            return _infeasible(begin, end, s.in_flight)
        path = [int(self.free[count - 1].argmin())]
        for j in range(count - 1, 0, -1):
            path.append(int(self.back[j][path[-1]]))  # type: ignore[index]
        slots = path[::-1] if self.forward else path
        peak, cost = s.tables.check_one(begin, slots, s.in_flight, s.nm)
        if peak <= s.budget and cost <= value * (1 + 1e-12):
            return self._plan(begin, end, np.array(slots), cost, peak, True)
        return self._sweep(count, begin, end)

    def _sweep(self, count: int, begin: int, end: int) -> StagePlan:
        """Algorithm 3's forward-budget sweep (module docstring), then the exact enumeration if enabled."""
        s = self.s
        s.binding = True
        self.extend(count)
        table = self.tables[count - 1]
        value = table.min(axis=0)
        starts = np.flatnonzero(np.isfinite(value) & np.concatenate(([True], value[1:] < value[:-1])))
        budgets = starts[::-1]  # one budget per distinct DP value, cheapest first
        best: StagePlan | None = None
        done, width = 0, 4
        while done < budgets.size and (best is None or (value[budgets[done]] < best.cost_s and done < RESCORE)):
            chunk = budgets[done:done + width]
            done, width = done + chunk.size, width * 4
            slots = self._walk(count, table[:, chunk].argmin(axis=0), _Spender(self, s.units, chunk))
            peaks, costs = self._check(begin, slots)
            for k in np.flatnonzero(peaks <= s.budget):
                if best is None or costs[k] < best.cost_s:
                    best = self._plan(begin, end, slots[:, k], costs[k], peaks[k], False)
        if float(s.tables.layout.size) ** count <= s.enumerate_limit:
            return self._enumerate(count, begin, end, best)
        return best or _infeasible(begin, end, s.in_flight)

    def _every(self, count: int, begin: int, end: int) -> StagePlan:
        """Tiny stages: price every assignment at once (exact, and cheaper than the DP)."""
        s = self.s
        slots = np.indices((s.tables.layout.size,) * count).reshape(count, -1)
        peaks, costs = self._check(begin, slots)
        fits = np.flatnonzero((peaks <= s.budget) & np.isfinite(costs))
        if not fits.size:
            return _infeasible(begin, end, s.in_flight)
        k = fits[costs[fits].argmin()]
        return self._plan(begin, end, slots[:, k], costs[k], peaks[k], True)

    def _plan(self, begin: int, end: int, slots: np.ndarray, cost: float, peak: float, exact: bool) -> StagePlan:
        t = self.s.tables
        sts = tuple(t.strategies[x] for x in slots)
        if t.sequence is not None:
            sts = tuple(sequence_twin(st) if t.sequence[begin + j, t.layout[x]] else st
                        for j, (x, st) in enumerate(zip(slots, sts, strict=True)))
        recompute = float(t.recompute_s[np.arange(begin, end), slots].sum())
        return StagePlan(begin, end, self.s.in_flight, sts, float(cost), float(peak), exact,  # type: ignore[arg-type]
                         recompute)

    def _enumerate(self, count: int, begin: int, end: int, best: StagePlan | None) -> StagePlan:
        """Assignments in increasing DP value, best first: the kept tables are an exact A* heuristic (a partial
        assignment of the last layers plus the best completion of the rest). Each complete one is checked
        against the exact peak and cost; once the next DP value reaches the best exact cost found, nothing
        left can win (DP value <= exact cost), so the answer is optimal -- unless `expansions` ran out first.
        bounds.py sharpens it: a partial assignment whose exact peak cannot fit is never pushed, the grid budget
        left to the free layers is cut to what the fixed layers' exact bytes leave (PeakBound), and where the
        sync's exact overlap outprices the DP's w x sync the larger of two lower bounds orders the heap
        (CostBound)."""
        s = self.s
        layout, units, cost = s.tables.layout, s.units, s.cost
        bound, priced = PeakBound(self, count), CostBound(self, count)
        last = np.maximum(self.tables[count - 1][:, s.top], priced.completion(count - 1, s.top, 0.0, 0.0))
        mem, sof, tm, ok = bound.fix(count - 1, 0.0, 0.0, -INF)
        heap = [(float(f), k, count - 1, k, s.top, 0.0, (), mem[k], sof[k], tm[k], 0.0)
                for k, f in enumerate(last) if math.isfinite(f) and ok[k]]
        heapq.heapify(heap)
        tie, expansions = len(heap), 0
        while heap:
            f, _, j, slot, left, g, suffix, m_fixed, of_fixed, t_fixed, gx = heapq.heappop(heap)
            if best is not None and f >= best.cost_s * (1 + 1e-6):  # slack: the tables are float32
                return dataclasses.replace(best, exact=True)
            path = (slot, *suffix)
            if j == 0:
                slots = np.array(path if self.forward else path[::-1])[:, None]
                peaks, costs = self._check(begin, slots)
                if peaks[0] <= s.budget and (best is None or costs[0] < best.cost_s):
                    best = self._plan(begin, end, slots[:, 0], costs[0], peaks[0], False)
                continue
            if expansions >= s.expansions:
                break
            expansions += 1
            y = self.layers[j]
            left = min(left - units[y, slot], bound.units_left(j, m_fixed, t_fixed))
            if left < 0:
                continue
            g += cost[y, slot]
            gx += priced.extra(j, slot)
            step = self.steps[j]
            moves = np.full(layout.size, g) if step is None else g + step.pairs[:, slot]
            totals = np.maximum(moves + self.tables[j - 1][:, left], priced.completion(j - 1, left, moves, gx))
            mem, sof, tm, ok = bound.fix(j - 1, m_fixed, of_fixed, t_fixed)
            for k in np.flatnonzero(np.isfinite(totals) & ok):
                tie += 1
                heapq.heappush(heap, (float(totals[k]), tie, j - 1, int(k), left, float(moves[k]), path,
                                      mem[k], sof[k], tm[k], gx))
        if best is not None and not heap:
            return dataclasses.replace(best, exact=True)
        return best or _infeasible(begin, end, s.in_flight)


class _Spender:
    """For _walk in the sweep: layer j-1's table at the budget left once layer j took its units."""

    def __init__(self, p: _Pass, units: np.ndarray, budgets: np.ndarray) -> None:
        self.p, self.units, self.left = p, units, budgets

    def __call__(self, j: int, slots: np.ndarray) -> np.ndarray:
        self.left = self.left - self.units[self.p.layers[j], slots]
        return self.p.tables[j - 1][:, self.left]


class Arena:
    """Recycles the DP's (slots x budgets) tables between configurations of one search: memory a process has
    not touched yet costs a page fault per 4 KiB, which on small VMs is most of a DP step."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, ...], list[np.ndarray]] = {}
        self._lent: list[np.ndarray] = []

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        stock = self._free.get(shape)
        array = stock.pop() if stock else np.empty(shape, dtype=TABLE_DTYPE)
        self._lent.append(array)
        return array

    def reclaim(self) -> None:
        """Everything taken since the last call is free again (its solvers must be gone)."""
        for array in self._lent:
            self._free.setdefault(array.shape, []).append(array)
        self._lent.clear()


class StageSolver:
    """Eq. 4 + the forward-budget sweep for every stage range at one (tables, nm, in-flight count, budget).

    Ranges ending at the model's last layer share one backward pass; the others share a forward pass per
    first layer, so an exhaustive partition search or Algorithm 2's one-layer moves reuse whole tables.
    """

    def __init__(
        self,
        tables: LayerTables,
        *,
        num_micro_batches: int,
        in_flight: int,
        budget_bytes: int,
        granularity_bytes: int,
        enumerate_limit: int = ENUMERATE_LIMIT,
        expansions: int = EXPANSIONS,
        arena: Arena | None = None,
    ) -> None:
        if granularity_bytes < 1:
            raise ValueError(f"memory granularity must be positive, got {granularity_bytes}")
        if num_micro_batches < 1 or in_flight < 1:
            raise ValueError(f"need nm >= 1 and in-flight >= 1, got {num_micro_batches}, {in_flight}")
        self.tables, self.nm, self.in_flight, self.budget = tables, num_micro_batches, in_flight, budget_bytes
        self.enumerate_limit, self.expansions = enumerate_limit, expansions
        self.arena = arena or Arena()
        n, nl = tables.num_layers, tables.num_layouts
        avail = budget_bytes - tables.baseline_bytes
        # Rounded to the nearest unit, an assignment that fits exactly has at most avail / g + L / 2 units.
        self.top = int(avail // granularity_bytes) + (n + 1) // 2 if avail >= 0 else -1
        self.granularity = granularity_bytes
        self.budgets = np.arange(self.top + 1)
        self.cost = tables.layer_costs(num_micro_batches)
        self.cost32 = self.cost.astype(TABLE_DTYPE)
        self.units = forward_units(tables, 0, n, in_flight, granularity_bytes, num_micro_batches)
        self.passes: dict[tuple[int, bool], _Pass] = {}
        self.binding = False  # some range's memory-free optimum did not fit
        self._steps: dict[tuple[int, bool], _Step | None] = {}
        self._gathers: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.layouts = np.arange(nl)
        size = self.budgets.size
        # Scratch: the best reach per class at every budget, after `size` columns of inf; a window view of
        # it gives each slot its class's row shifted right by its units in one gather (no per-element index).
        self._pad = np.full((nl, 2 * size), INF, dtype=TABLE_DTYPE)
        self.reach = self._pad[:, size:]
        self._window = np.lib.stride_tricks.sliding_window_view(self._pad, size, axis=1)

    def step(self, layer: int, forward: bool) -> _Step | None:
        """The re-layout into `layer` for a pass direction (cached per identical layer); None when free."""
        key = (self.tables.transform_rep[layer], forward)
        if key not in self._steps:
            full = self.tables.transform_s[layer] * self.nm
            self._steps[key] = None if not full.any() else \
                _make_step(key, full if forward else full.T.copy(), self.tables.layout, self.budgets.size)
        return self._steps[key]

    def shifted(self, layer: int, step: _Step | None, out: np.ndarray) -> None:
        """out[s, e] = the reach of slot s's class at e - units(layer, s), inf below 0: a window view over the
        inf-padded reach rows, so each slot's row is one contiguous copy."""
        key = (self.tables.layer_rep[layer], None if step is None else step.key)
        if key not in self._gathers:
            size = self.budgets.size
            cls = np.zeros_like(self.tables.layout) if step is None else step.slot_class
            self._gathers[key] = (cls, size - np.minimum(self.units[layer], size))
        cls, offset = self._gathers[key]
        out[...] = self._window[cls, offset]

    def _pass(self, begin: int, end: int) -> tuple[_Pass, int]:
        n = self.tables.num_layers
        if not 0 <= begin < end <= n:
            raise ValueError(f"stage [{begin}, {end}) outside a {n}-layer model")
        key = (n, False) if end == n else (begin, True)
        if key not in self.passes:
            self.passes[key] = _Pass(self, *key)
        return self.passes[key], end - begin

    def lower_bound(self, begin: int, end: int) -> float:
        """A cost no assignment of the range that fits can beat: memory-aware once some range of this solver
        needed the memory sweep (`binding`), else the memory-free optimum (cheap)."""
        if self.top < 0:
            return INF
        p, count = self._pass(begin, end)
        return p.lower_bound(count, self.binding)

    def solve(self, begin: int, end: int) -> StagePlan:
        if self.top < 0:
            return _infeasible(begin, end, self.in_flight)
        p, count = self._pass(begin, end)
        return p.answer(count)


def stage_dp(
    tables: LayerTables,
    begin: int,
    end: int,
    *,
    num_micro_batches: int,
    in_flight: int,
    budget_bytes: int,
    granularity_bytes: int,
) -> StagePlan:
    """Cheapest strategies for layers [begin, end) whose exact peak fits `budget_bytes` (module docstring)."""
    solver = StageSolver(tables, num_micro_batches=num_micro_batches, in_flight=in_flight,
                         budget_bytes=budget_bytes, granularity_bytes=granularity_bytes)
    return solver.solve(begin, end)


__all__ = [
    "Arena",
    "LayerTables",
    "StagePlan",
    "StageSolver",
    "forward_units",
    "layer_tables",
    "scope_key",
    "stage_dp",
]
