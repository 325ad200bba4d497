"""Lower bounds that keep the per-stage DP's exact enumeration short (dp.py, answer step 4).

The enumeration walks assignments best-first by the memory DP's value, an admissible A* heuristic. That value
constrains only the forward memory Oms + n x Of on a rounded grid and charges the sync at w x sync, so where
Eq. 2's backward transient or the sync's exact overlap binds, many assignments share values below the best
exact cost and the proof runs out of expansions -- most of all when near-equal alternatives multiply them,
as the DP flavours (plain, ZeRO-1, ZeRO-2 of one layout) do. Each bound here is a lower bound on what
LayerTables.check would give every completion of a partial assignment, so taking the larger one or dropping
what cannot fit leaves the enumeration exact. Pure numpy, no I/O.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Protocol

import numpy as np

INF = math.inf


class Pass(Protocol):
    """What the bounds read of dp._Pass (structural, so this module does not import dp.py, which imports it)."""

    s: Any  # dp.StageSolver: tables, cost, units, budget, granularity, in_flight, nm
    anchor: int
    forward: bool
    layers: list[int]  # model layer of each processed index

    def extend(self, count: int) -> None: ...


class PeakBound:
    """A lower bound on the exact peak (LayerTables.check) of every completion of a partial assignment in
    `dp._Pass._enumerate`, in bytes. The DP's grid holds Oms + n x Of only, so where Eq. 2's backward transient binds
    (a checkpointed layer's recompute, a ZeRO-2 layer's full gradient, SDP's gathered weights) it admits many
    assignments the exact check refuses; this refuses them, and every partial assignment leading only to
    them, before they are enumerated.

    peak = sum Oms + n sum Of + max(0, max_i T_i), T_i = Ob_i - sum of Of after layer i (ceilings aside, which
    only add). Processed index j is layer begin + j in a forward pass, end - 1 - j in a backward one; a node
    at j has fixed the processed j .. count-1 and leaves 0 .. j-1 free.

    * Forward pass: the fixed layers are the range's last ones, so their T_i are exact: bound = fixed
      Oms + n Of + each free layer's least + max(0, max over fixed T_i).
    * Backward pass: the fixed layers are the first ones. The same peak reads sum (Oms + (n-1) Of) +
      max(sum Of, max_i (Of of layers <= i + Ob_i)), and the second term of a fixed layer is exact:
      bound = fixed Oms + (n-1) Of + each free layer's least of it + max(fixed Of + each free layer's
      least Of, max over fixed i of (Of up to i + Ob_i)); and at least the forward memory alone.
    """

    def __init__(self, p: Pass, count: int) -> None:
        s = p.s
        rows = np.asarray(p.layers[:count])
        oms, ob = s.tables.memory(s.nm)
        n = s.in_flight
        oms, of, ob = oms[rows], s.tables.forward_activation_bytes[rows], ob[rows]
        feasible = np.isfinite(s.cost[rows])

        def free_sum(x: np.ndarray) -> np.ndarray:  # [j]: sum over processed 0 .. j-1 of each layer's least
            return np.concatenate(([0.0], np.cumsum(np.where(feasible, x, INF).min(axis=1))))

        self.ef, self.of, self.ob, self.forward = oms + n * of, of, ob, p.forward
        self.free_ef, self.free_a, self.free_of = free_sum(self.ef), free_sum(oms + (n - 1) * of), free_sum(of)
        self.limit = s.budget - s.tables.baseline_bytes + 1.0  # a byte of slack for the order of float sums
        self.granularity = s.granularity

    def units_left(self, j: int, mem: float, t: float) -> int:
        """Grid units the j free layers (processed 0 .. j-1) may take in any completion that fits exactly, given
        the fixed layers' Oms + n Of (`mem`) and transient statistic: their bytes are at most the budget less
        `mem` (less the fixed T_i in a forward pass) and each layer's rounding adds at most half a unit."""
        spare = self.limit - 1.0 - mem - (max(t, 0.0) if self.forward else 0.0)
        return math.floor(spare / self.granularity + j / 2 + 1e-9)

    def fix(
        self, j: int, mem: float, sof: float, t: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per slot of processed layer j, given the fixed layers' sum of Oms + n Of, sum of Of and transient
        statistic t (forward: max T_i; backward: max of Of up to i + Ob_i; -inf for none): the same three
        with that slot fixed too, and whether a completion may still fit."""
        mem_k, sof_k = mem + self.ef[j], sof + self.of[j]
        lower = mem_k + self.free_ef[j]
        if self.forward:  # layer j precedes the fixed ones: their T_i stand, its own sees all their Of
            t_k = np.maximum(t, self.ob[j] - sof)
            lower = lower + np.maximum(t_k, 0.0)
        else:  # layer j follows the fixed ones: all its Of-so-far are fixed
            t_k = np.maximum(t, sof_k + self.ob[j])
            lower = np.maximum(lower, mem_k - sof_k + self.free_a[j] + np.maximum(sof_k + self.free_of[j], t_k))
        return mem_k, sof_k, t_k, lower <= self.limit


class CostBound:
    """A second lower bound on the exact cost of every completion in `dp._Pass._enumerate`, for when the DP's is loose.

    The DP charges w x sync (w = k - 1 for an overlap slowdown 1 < k < 2), exact while the stage's sync S fits
    under its last backward B; past it the exposed sync is S - (2 - k) B, up to (2 - k) B more, and assignments
    trading sync for other time (plain DP against ZeRO, whose reduce-scatter halves the sync and whose
    all-gather comes after it) then tie the DP for many steps. Exposed >= S - (2 - k) B for every S and B,
    and B <= B_max (each layer's largest backward), so cost >= sum over layers of the DP's c(l, s) +
    (1 - w) sync + the re-layouts, less (2 - k) B_max. The same memory DP over that per-layer cost (a twin of
    the pass, same grid units) bounds the free layers at the grid budget left; the fixed ones add their own.
    Inactive (always -inf) where it cannot beat the DP's.
    """

    def __init__(self, p: Pass, count: int) -> None:
        s, t = p.s, p.s.tables
        self.active = bool(t.overlap_grad_sync and 1.0 < t.overlap_slowdown < 2.0 and t.grad_sync_s.any())
        if not self.active:
            return
        rows = np.asarray(p.layers[:count])
        more = (1.0 - t.sync_weight) * t.grad_sync_s
        self.more = more[rows]  # by processed index
        feasible = np.isfinite(s.cost[rows])
        self.credit = (2.0 - t.overlap_slowdown) * np.where(feasible, t.backward_compute_s[rows], 0.0).max(axis=1).sum()
        twin = copy.copy(s)  # same tables, grid, steps and scratch; only the per-layer cost differs
        twin.cost = s.cost + more
        twin.cost32 = twin.cost.astype(s.cost32.dtype)
        twin.passes = {}
        self.twin = type(p)(twin, p.anchor, p.forward)
        self.twin.extend(count)

    def extra(self, j: int, slot: int) -> float:
        """What processed layer j in `slot` adds to this bound beyond its DP cost."""
        return float(self.more[j, slot]) if self.active else 0.0

    def completion(self, j: int, left: int, fixed: float | np.ndarray, extra: float) -> np.ndarray | float:
        """Per slot of processed layer j: the bound given the fixed layers' DP cost (and re-layout into them)
        `fixed`, their `extra`, and `left` grid units for processed 0 .. j; -inf when inactive."""
        if not self.active:
            return -INF
        return fixed + extra + self.twin.tables[j][:, left] - self.credit


__all__ = ["CostBound", "PeakBound"]
