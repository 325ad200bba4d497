"""Pipeline partitions for P stages (Galvatron-BMW §IV-B: Eq. 5-7, Algorithm 2, Appendix B).

A partition is P contiguous, non-empty layer ranges. Each range is priced by a `Solve` callback (the
per-stage DP, dp.StageSolver, cached by the caller) and the partition by Eq. 5,

    J = (nm - 1) x max_i u_i + sum_i u_i,    u_i = C_i / nm,

where C_i is stage i's exact cost on the shared cost model (nm micro-batches of its forward, backward and
recompute, plus its exposed gradient sync), so u_i is the stage's per-micro-batch time with its allreduce
amortised over the micro-batches (Eq. 5 "per-stage allreduce included"; for P = 1, J is the stage's whole
iteration). J is non-decreasing in every C_i, so the best stage answers make the best partition answer:
given exact stages, `exhaustive` is exact for J. Boundary sends, tied weights and the schedule's real order
are left to the simulator, which re-prices the winner (galvatron.py).

Two modes: `exhaustive` enumerates every partition (C(L-1, P-1) of them); `adjust` is
Algorithm 2: start from the memory-balanced partition p_m (in-flight counts of the schedule), move the
slowest stage's boundary layer to a neighbour, and queue the result only if (1) no stage is slower than the
previous maximum, (2) every stage fits the budget, (3) no stage needs more memory than the time-balanced
partition p_t's largest stage. Every partition looked at is a candidate; the best J wins.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from services.planner.search.dp import StagePlan

Bounds = tuple[tuple[int, int], ...]
Solve = Callable[[int, int, int], StagePlan]  # (begin, end, stage index) -> the stage's DP answer
Bound = Callable[[int, int, int], float]  # (begin, end, stage index) -> a lower bound on the stage's DP cost

EXHAUSTIVE_LIMIT = 256  # partitions; beyond this Algorithm 2 runs


@dataclass(frozen=True)
class PartitionResult:
    bounds: Bounds
    stages: tuple[StagePlan, ...]
    objective: float  # Eq. 5's J in seconds (inf when some stage does not fit)
    evaluated: int  # partitions priced

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.objective)


def pipeline_objective(stage_costs: Sequence[float], num_micro_batches: int) -> float:
    """Eq. 5 with u_i = C_i / nm (module docstring)."""
    if not stage_costs or any(not math.isfinite(c) for c in stage_costs):
        return math.inf
    nm = num_micro_batches
    return ((nm - 1) * max(stage_costs) + sum(stage_costs)) / nm


def count_partitions(num_layers: int, num_stages: int) -> int:
    return math.comb(num_layers - 1, num_stages - 1) if 1 <= num_stages <= num_layers else 0


def all_partitions(num_layers: int, num_stages: int) -> Iterator[Bounds]:
    """Every split of [0, num_layers) into num_stages non-empty contiguous ranges, lexicographic by cut."""
    for cuts in combinations(range(1, num_layers), num_stages - 1):
        edges = (0, *cuts, num_layers)
        yield tuple((edges[i], edges[i + 1]) for i in range(num_stages))


def _evaluate(bounds: Bounds, solve: Solve, nm: int) -> tuple[tuple[StagePlan, ...], float]:
    stages = tuple(solve(b, e, s) for s, (b, e) in enumerate(bounds))
    return stages, pipeline_objective([p.cost_s for p in stages], nm)


def exhaustive(
    num_layers: int, num_stages: int, num_micro_batches: int, solve: Solve, bound: Bound | None = None
) -> PartitionResult:
    """The partition of least J over all of them (first in cut order on ties).

    With `bound` (a lower bound on a stage's cost), partitions are visited by their bound on J and the
    search stops once the bound exceeds the best J found: the same answer with far fewer stage DPs. Bounds
    are read again after the first evaluation, since they may tighten once a stage DP has run.
    """
    nm = num_micro_batches
    every = list(all_partitions(num_layers, num_stages))
    if not every:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")

    def order(skip: set[int]) -> list[tuple[float, int]]:
        if bound is None:
            return [(0.0, i) for i in range(len(every)) if i not in skip]
        lows = ((pipeline_objective([bound(b, e, s) for s, (b, e) in enumerate(p)], nm), i)
                for i, p in enumerate(every) if i not in skip)
        return sorted(x for x in lows if math.isfinite(x[0]))

    queue = order(set())
    if not queue:  # no bound is finite: nothing fits anywhere
        stages, j = _evaluate(every[0], solve, nm)
        return PartitionResult(every[0], stages, j, 1)
    first = queue[0][1]
    stages, j = _evaluate(every[first], solve, nm)
    best, count = (j, first, stages), 1
    for low, i in order({first}):
        if low > best[0]:
            break
        stages, j = _evaluate(every[i], solve, nm)
        count += 1
        if (j, i) < (best[0], best[1]):
            best = (j, i, stages)
    return PartitionResult(every[best[1]], best[2], best[0], count)


def balanced(weights: np.ndarray) -> Bounds:
    """Min-max contiguous partition where layer l weighs weights[s, l] on stage s (P x L, non-negative).

    Exact DP over (stage, end): best[s][e] = min_b max(best[s-1][b], W_s(b, e)); ties take the earliest cut.
    """
    num_stages, n = weights.shape
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages")
    pre = np.concatenate([np.zeros((num_stages, 1)), np.cumsum(weights, axis=1)], axis=1)  # (P, L+1)
    best = np.full(n + 1, math.inf)
    best[1:] = pre[0, 1:]
    cuts = []
    b_idx, e_idx = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    for s in range(1, num_stages):
        span = pre[s][None, :] - pre[s][:, None]  # (b, e)
        cand = np.maximum(best[:, None], span)
        cand = np.where((b_idx < e_idx) & (b_idx >= s), cand, math.inf)
        arg = cand.argmin(axis=0)
        best = cand[arg, np.arange(n + 1)]
        cuts.append(arg)
    edges = [n]
    for s in range(num_stages - 1, 0, -1):
        edges.append(int(cuts[s - 1][edges[-1]]))
    edges.append(0)
    edges.reverse()
    return tuple((edges[i], edges[i + 1]) for i in range(num_stages))


def memory_balanced(state_bytes: np.ndarray, activation_bytes: np.ndarray, in_flight: Sequence[int]) -> Bounds:
    """PP_Partition_Init: balance Oms + n_s x Of per stage (n_s: the schedule's in-flight count of stage s)."""
    weights = state_bytes[None, :] + np.asarray(in_flight, dtype=float)[:, None] * activation_bytes[None, :]
    return balanced(weights)


def time_balanced(layer_times: np.ndarray, num_stages: int) -> Bounds:
    """The time-balanced partition p_t: balance the layers' times."""
    return balanced(np.broadcast_to(layer_times, (num_stages, layer_times.size)))


def _moves(bounds: Bounds, stage: int) -> Iterator[Bounds]:
    """Give the stage's first layer to the stage before, or its last layer to the stage after."""
    b, e = bounds[stage]
    if e - b < 2:
        return
    if stage > 0:
        pb, _ = bounds[stage - 1]
        yield bounds[: stage - 1] + ((pb, b + 1), (b + 1, e)) + bounds[stage + 1:]
    if stage < len(bounds) - 1:
        _, ne = bounds[stage + 1]
        yield bounds[:stage] + ((b, e - 1), (e - 1, ne)) + bounds[stage + 2:]


def adjust(
    start: Bounds,
    time_balanced_bounds: Bounds,
    num_micro_batches: int,
    budget_bytes: float,
    solve: Solve,
    *,
    max_evaluations: int = 512,
) -> PartitionResult:
    """Algorithm 2 from `start` (p_m); p_t sets check (3) and is a candidate itself (module docstring)."""
    nm = num_micro_batches
    seen: dict[Bounds, tuple[tuple[StagePlan, ...], float]] = {}

    def look(bounds: Bounds) -> tuple[tuple[StagePlan, ...], float]:
        if bounds not in seen:
            seen[bounds] = _evaluate(bounds, solve, nm)
        return seen[bounds]

    pt_stages, _ = look(time_balanced_bounds)
    memory_cap = max(p.memory_bytes for p in pt_stages)
    queue = deque([start])
    look(start)
    while queue and len(seen) < max_evaluations:
        bounds = queue.popleft()
        stages, _ = look(bounds)
        slowest = max(range(len(stages)), key=lambda s: (stages[s].cost_s, -s))
        c_max = stages[slowest].cost_s
        for moved in _moves(bounds, slowest):
            if moved in seen:
                continue
            new, _ = look(moved)
            if (
                max(p.cost_s for p in new) <= c_max
                and all(p.memory_bytes <= budget_bytes for p in new)
                and all(p.memory_bytes <= memory_cap for p in new)
            ):
                queue.append(moved)
    best = min(enumerate(seen), key=lambda item: (seen[item[1]][1], item[0]))[1]  # first seen on ties
    return PartitionResult(best, seen[best][0], seen[best][1], len(seen))


__all__ = [
    "EXHAUSTIVE_LIMIT",
    "Bound",
    "Bounds",
    "PartitionResult",
    "Solve",
    "adjust",
    "all_partitions",
    "balanced",
    "count_partitions",
    "exhaustive",
    "memory_balanced",
    "pipeline_objective",
    "time_balanced",
]
