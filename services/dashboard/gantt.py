"""A plan's pipeline as a Gantt chart: when each stage runs each micro-batch's forward and backward.

Drawn from the plan's per-stage predictions (forward + backward per micro-batch), split one third forward
and two thirds backward (a backward pass costs about twice its forward). It is an illustration of the
schedule's shape and bubble, not the planner's simulator, which a service package may not import.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD_SHARE = 1 / 3
MAX_MICRO_BATCHES = 32  # beyond this the bars are too thin to read; the shape repeats


@dataclass(frozen=True)
class Op:
    stage: int
    kind: str  # "F" or "B"
    micro_batch: int
    start_s: float
    end_s: float


def order(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order one stage runs its passes in: GPipe all forwards then all backwards; 1F1B (and the
    others, which share its steady state) a warm-up of forwards, then one forward one backward."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(stages - 1 - stage, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warmup, m)]


def simulate(stage_times_s: list[float], micro_batches: int, schedule: str) -> list[Op]:
    """Start and end of every pass: a forward waits for the stage before it, a backward for the stage after
    it and its own forward, and each stage runs one pass at a time in its schedule's order."""
    if micro_batches < 1 or not stage_times_s:
        raise ValueError("a pipeline needs at least one stage and one micro-batch")
    stages, m = len(stage_times_s), min(micro_batches, MAX_MICRO_BATCHES)
    orders = [order(schedule, s, stages, m) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    nxt = [0] * stages
    ops: list[Op] = []
    while any(nxt[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if nxt[s] >= len(orders[s]):
                continue
            kind, mb = orders[s][nxt[s]]
            deps = [("F", s - 1, mb)] if kind == "F" and s > 0 else []
            if kind == "B":
                deps = [("F", s, mb)] + ([("B", s + 1, mb)] if s + 1 < stages else [])
            if any(d not in done for d in deps):
                continue
            start = max([free[s], *(done[d] for d in deps)])
            share = FORWARD_SHARE if kind == "F" else 1 - FORWARD_SHARE
            end = start + stage_times_s[s] * share
            done[(kind, s, mb)] = free[s] = end
            ops.append(Op(s, kind, mb, start, end))
            nxt[s] += 1
            progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} deadlocks")  # cannot happen for the orders above
    return ops


def bubble_fraction(ops: list[Op], stages: int) -> float:
    """Idle share of the stages' time until the last pass ends."""
    if not ops:
        return 0.0
    span = max(op.end_s for op in ops)
    busy = sum(op.end_s - op.start_s for op in ops)
    return 1 - busy / (span * stages) if span > 0 else 0.0
