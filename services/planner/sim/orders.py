"""Fixed per-device task orders for GPipe, 1F1B and Harmony's wrap-around pipeline.

An order entry is (kind, stage, micro_batch, flags). Flags mark the host-link work a task implies, decided
once from the order alone so the engine's hot loop only tests a bit:
WEIGHT_IN before the first task of a Harmony visit, WEIGHT_OUT after the last task of a backward visit
(just-in-time update), SWAP_OUT after a forward whose activations are swapped, SWAP_IN before the first task
of the matching backward chain (recompute, else backward).
"""

from __future__ import annotations

from services.planner.sim.core import B, F, Prepared, R
from services.planner.sim.model import Schedule

WEIGHT_IN, WEIGHT_OUT, SWAP_OUT_AFTER, SWAP_IN_BEFORE = 1, 2, 4, 8

Entry = tuple[int, int, int, int]


def _chain(s: int, m: int, recompute: bool) -> list[Entry]:
    return [(R, s, m, 0), (B, s, m, 0)] if recompute else [(B, s, m, 0)]


def gpipe_stage(prep: Prepared, s: int) -> list[Entry]:
    """All forwards, then backwards newest first; the last stage runs the newest backward straight after its
    forward, so only it skips that one recompute."""
    rc = prep.dur[R][s] > 0
    order = [(F, s, m, 0) for m in range(prep.Nm)]
    for m in reversed(range(prep.Nm)):
        order += _chain(s, m, rc and not (s == prep.P - 1 and m == prep.Nm - 1))
    return order


def one_f_one_b_stage(prep: Prepared, s: int) -> list[Entry]:
    """PipeDream-flush: P-s-1 warm-up forwards, then alternate, then drain; stage s holds at most P-s micro-batches.
    The last stage's backward always follows its forward, so it never recomputes."""
    P, Nm = prep.P, prep.Nm
    rc = prep.dur[R][s] > 0 and s != P - 1
    warm = min(P - s - 1, Nm)
    order = [(F, s, m, 0) for m in range(warm)]
    for i in range(Nm - warm):
        order.append((F, s, warm + i, 0))
        order += _chain(s, i, rc)
    for m in range(Nm - warm, Nm):
        order += _chain(s, m, rc)
    return order


def harmony_device_orders(prep: Prepared) -> list[list[Entry]]:
    """Wrap-around: PFB = forward packs + reversed backward packs, task i on device i mod N; each visit runs
    all micro-batches back to back (input-batch grouping), so weights move once per visit."""
    P, Nm = prep.P, prep.Nm
    n = len(prep.device_ids)
    orders: list[list[Entry]] = [[] for _ in range(n)]
    for i in range(2 * P):
        if i < P:
            s = i
            visit = [(F, s, m, 0) for m in range(Nm)]
        else:
            s = 2 * P - 1 - i
            visit = [e for m in range(Nm) for e in _chain(s, m, prep.dur[R][s] > 0)]
        if prep.weight_bytes[s] > 0:
            visit[0] = (*visit[0][:3], WEIGHT_IN)
            if i >= P:
                visit[-1] = (*visit[-1][:3], visit[-1][3] | WEIGHT_OUT)
        orders[i % n] += visit
    return orders


def device_orders(prep: Prepared, schedule: Schedule) -> list[list[Entry]]:
    """Orders per compact device index, with activation-swap flags added."""
    if schedule is Schedule.HARMONY_WRAP:
        orders = harmony_device_orders(prep)
    elif schedule is Schedule.GPIPE:
        orders = [gpipe_stage(prep, s) for s in range(prep.P)]
    elif schedule is Schedule.ONE_F_ONE_B:
        orders = [one_f_one_b_stage(prep, s) for s in range(prep.P)]
    else:
        raise ValueError(f"{schedule.value} has no fixed order")
    if any(prep.swap_bytes):
        _mark_swaps(prep, orders)
    return orders


def _mark_swaps(prep: Prepared, orders: list[list[Entry]]) -> None:
    """Swap a micro-batch's activations out after its forward unless its backward chain runs next on that device."""
    where = {(kind, s, m): (d, k) for d, order in enumerate(orders) for k, (kind, s, m, _) in enumerate(order)}
    for (kind, s, m), (d, k) in list(where.items()):
        if kind != F or prep.swap_bytes[s] <= 0:
            continue
        cd, ck = where.get((R, s, m)) or where[(B, s, m)]
        if cd == d and ck == k + 1:
            continue
        e = orders[d][k]
        orders[d][k] = (*e[:3], e[3] | SWAP_OUT_AFTER)
        c = orders[cd][ck]
        orders[cd][ck] = (*c[:3], c[3] | SWAP_IN_BEFORE)
