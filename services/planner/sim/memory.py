"""Device memory of one stage over an iteration, from the tasks and swaps an engine recorded.

Model memory is resident throughout; a micro-batch's activations are held from its forward's start to its
backward's end (under swap: released when the swap-out ends, re-acquired when the swap-in starts); transient
memory is held from the recompute's start to the backward's end, during the backward alone without
recomputation, and from the forward's start when a checkpointing stage skips a micro-batch's recompute (it
kept that micro-batch's intermediates instead).
"""

from __future__ import annotations

import numpy as np

from services.planner.sim.core import SWAP_IN, B, F, R
from services.planner.sim.model import StageCost


def stage_memory(
    stage: StageCost,
    tasks: list[tuple[int, int, float, float]],
    swaps: list[tuple[int, int, float, float, int]],
    in_time_order: bool,
    timeline: bool,
) -> tuple[int, tuple[tuple[float, int], ...]]:
    """Peak bytes and, if asked, the (time, bytes) steps.

    `in_time_order` says the tasks ran on one device in list order with no activation swaps: deltas then come
    out ordered and need no sort. Otherwise they are sorted by time, releases before acquisitions at one instant
    (a device frees a backward's memory before its next task starts)."""
    act, tr = stage.activation_bytes, stage.transient_bytes
    rc = stage.recompute_s > 0
    with_r = {m for kind, m, _, _ in tasks if kind == R} if rc and tr else ()
    deltas: list[tuple[float, int]] = []
    add = deltas.append
    for kind, m, start, end in tasks:
        if kind == F:
            add((start, act + tr if rc and m not in with_r else act))
        elif kind == R:
            add((start, tr))
        else:
            if not rc:
                add((start, tr))
            add((end, -act - tr))
    moves = [x for x in swaps if x[1] >= 0]
    if moves or not in_time_order:
        deltas += [(start, act) if kind == SWAP_IN else (end, -act) for kind, _, start, end, _ in moves]
        deltas.sort(key=lambda x: (x[0], x[1] > 0))
    cur = peak = stage.model_memory_bytes
    if not timeline:
        for _, delta in deltas:
            cur += delta
            if cur > peak:
                peak = cur
        return peak, ()
    steps = [(0.0, cur)]
    for t, delta in deltas:
        if delta:
            cur += delta
            steps.append((t, cur))
            if cur > peak:
                peak = cur
    return peak, tuple(steps)


def peak_in_order(stage: StageCost, kinds: tuple[int, ...], mbs: tuple[int, ...], num_micro_batches: int) -> int:
    """Peak bytes of a stage whose tasks run on one device in this order, without activation swaps.

    Memory then changes only at task boundaries, so the peak follows from the order alone (no times), which is
    what makes the pricing path cheap; it equals the running maximum `stage_memory` finds on the timeline."""
    act, tr = stage.activation_bytes, stage.transient_bytes
    kind, mb = np.asarray(kinds), np.asarray(mbs)
    is_f, is_r, is_b = kind == F, kind == R, kind == B
    rc = stage.recompute_s > 0
    if rc and tr:
        has_r = np.zeros(num_micro_batches, dtype=bool)
        has_r[mb[is_r]] = True
        held_from_forward = is_f & ~has_r[mb]
    else:
        held_from_forward = np.zeros(len(kind), dtype=bool)
    on_start = np.where(is_f, act, 0) + np.where(held_from_forward | is_r | (is_b & (not rc)), tr, 0)
    on_end = np.where(is_b, -act - tr, 0)
    before = np.cumsum(on_start + on_end) - on_start - on_end
    during = before + on_start
    return int(stage.model_memory_bytes + max(0, int(during.max(initial=0))))
