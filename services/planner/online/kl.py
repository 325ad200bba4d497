"""vPipe's global repartition over contiguous stage bounds: bottleneck migration, then Kernighan-Lin.

Both phases are searches over stage bounds only; what a partition costs is the caller's `evaluate(bounds)`
(srp.py: local swap/recompute, then the shared cost model and simulator, which price every cut with all
the tensors crossing it, T5's relayed encoder output included: cost.stage.cut_bytes over
ModelView.crossing). Deterministic: candidates are tried in a fixed order and ties keep the first.

Objective. A candidate is better when it fits memory and the other does not, else when its simulated
iteration time is lower by more than a relative 1e-9, else (equal time) when its largest stage compute is
lower, then its sum of squared stage computes: the secondary keys let the search cross plateaus where the
bottleneck stays put while another stage gets lighter, and they strictly decrease, so no cycle.

1. Migration (vPipe §4, "iteratively migrate layers from the intense stage to the adjacent stage"): take the
   stage with the most compute, try moving its first layer to the previous stage and its last layer to
   the next; keep the better if it improves; repeat.
2. Kernighan-Lin refinement (vPipe §4.2, on the coarsened sequential backbone): a pass moves each cut at
   most once, always taking the best remaining single-layer shift of an unlocked cut even when it is worse
   (KL's escape from local minima), then keeps the best prefix of the pass; passes repeat while one
   improves.

`max_moves` bounds the layers whose stage differs from the starting partition (a migration moves parameters
and optimizer state, so a decision moves a few layers, not the whole model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

Bounds = tuple[tuple[int, int], ...]


class Priced(Protocol):
    bounds: Bounds
    iteration_s: float
    busy_s: tuple[float, ...]
    fits: bool


@dataclass(frozen=True)
class SearchTrace:
    """What the search did: evaluated candidates and accepted steps per phase."""

    evaluated: int
    migrations: int
    kl_passes: int
    kl_moves: int


def stage_of(bounds: Bounds) -> tuple[int, ...]:
    return tuple(s for s, (b, e) in enumerate(bounds) for _ in range(b, e))


def moved_layers(old: Bounds, new: Bounds) -> int:
    return sum(a != b for a, b in zip(stage_of(old), stage_of(new), strict=True))


def shift(bounds: Bounds, cut: int, delta: int) -> Bounds | None:
    """Move the cut between stage `cut` and `cut + 1` by `delta` layers (None if a stage would empty)."""
    b = [list(x) for x in bounds]
    end = b[cut][1] + delta
    if not b[cut][0] < end < b[cut + 1][1]:
        return None
    b[cut][1] = b[cut + 1][0] = end
    return tuple((x, y) for x, y in b)


def key(c: Priced) -> tuple[int, float, float, float]:
    return (0 if c.fits else 1, c.iteration_s, max(c.busy_s, default=0.0), sum(x * x for x in c.busy_s))


def better(a: Priced, b: Priced) -> bool:
    """a strictly better than b (module docstring)."""
    if a.fits != b.fits:
        return a.fits
    tol = 1e-9 * max(abs(b.iteration_s), 1e-12)
    if a.iteration_s < b.iteration_s - tol:
        return True
    if a.iteration_s > b.iteration_s + tol:
        return False
    ka, kb = key(a)[2:], key(b)[2:]
    return ka[0] < kb[0] - 1e-12 or (abs(ka[0] - kb[0]) <= 1e-12 and ka[1] < kb[1] - 1e-18)


def repartition(
    start: Priced, evaluate: Callable[[Bounds], Priced], *, max_moves: int, kl: bool = True, max_steps: int = 1000,
    allowed: Callable[[Bounds], bool] | None = None,
) -> tuple[Priced, SearchTrace]:
    """Migration then KL refinement from `start` (its bounds are the origin for `max_moves`); `allowed` vetoes
    partitions the executors cannot migrate to (e.g. ones that move a tied weight to other stages)."""
    origin = start.bounds
    evaluated = 0

    def ok(bounds: Bounds | None) -> bool:
        return (bounds is not None and moved_layers(origin, bounds) <= max_moves
                and (allowed is None or allowed(bounds)))

    def ev(bounds: Bounds) -> Priced:
        nonlocal evaluated
        evaluated += 1
        return evaluate(bounds)

    best = start
    migrations = 0
    for _ in range(max_steps):
        s = max(range(len(best.busy_s)), key=lambda i: (best.busy_s[i], -i))
        options: Sequence[Bounds | None] = (
            shift(best.bounds, s - 1, +1) if s > 0 else None,  # first layer of s to s-1
            shift(best.bounds, s, -1) if s + 1 < len(best.bounds) else None,  # last layer of s to s+1
        )
        tried = [ev(b) for b in options if ok(b)]  # type: ignore[arg-type]
        step = _best(tried)
        if step is None or not better(step, best):
            break
        best, migrations = step, migrations + 1

    passes = kl_moves = 0
    while kl and passes < max_steps:
        passes += 1
        current, locked = best, set()
        prefix: list[Priced] = []
        while len(locked) < len(current.bounds) - 1:
            tried = []
            for cut in range(len(current.bounds) - 1):
                if cut in locked:
                    continue
                for delta in (-1, +1):
                    b = shift(current.bounds, cut, delta)
                    if ok(b):
                        tried.append((cut, ev(b)))  # type: ignore[arg-type]
            if not tried:
                break
            cut, step = min(tried, key=lambda t: key(t[1]))
            locked.add(cut)
            current = step
            prefix.append(step)
        top = _best(prefix)
        if top is None or not better(top, best):
            break
        kl_moves += prefix.index(top) + 1
        best = top
    return best, SearchTrace(evaluated, migrations, passes, kl_moves)


def _best(cands: Sequence[Priced]) -> Priced | None:
    out = None
    for c in cands:
        if out is None or better(c, out):
            out = c
    return out


__all__ = ["Bounds", "SearchTrace", "better", "moved_layers", "repartition", "shift", "stage_of"]
