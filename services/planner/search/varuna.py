"""Varuna's auto-configuration: pipeline depth P, replicas D, micro-batch size m and count Nm (Varuna §4.1-4.4).

For G devices and a fixed global batch B (§4.2: B never changes when the fleet does):

* Candidates (§4.1, §4.4): every P from 1 to min(G, layers) with D = G // P replicas, so P x D <= G and a P
  that does not divide G leaves G - P*D devices idle (the paper's 9 x 11 on 100 GPUs). O(G) candidates.
* A stage is one device: Varuna uses no intra-layer parallelism (§3 Obs. 1). Every stage but the last
  recomputes its activations (§3.1, Fig. 5) when options.checkpoint allows it; the last stage recomputes only
  when options.checkpoint forbids running without.
* m (§4.4): the smallest size, in doubling steps, after which forward time per sample F(m)/m improves by less
  than KNEE_TOLERANCE (§4.1: BERT-large runs 26% faster per sample at m = 8 than at 4), capped at B / D and
  lowered to the largest divisor of B / D so Nm = B / (m D) is an integer. A P whose D does not divide B has no
  such m and is skipped. When m runs out of memory the next smaller divisor is tried (§4.2: Varuna raises Nm
  when m does not fit).
* Nm >= 6 P keeps pipeline bubbles under 10% (§3.2, Fig. 4): when m leaves fewer micro-batches, the largest m
  giving at least 6 P is priced too and the faster of the two is kept (at most two simulations per P).
* Partition (§4.4: one cut-point assignment per P, balanced): contiguous stages minimising the slowest stage's
  per-micro-batch compute F + B + recompute (the last stage without recompute), solved exactly
  with the same min-max DP the hybrid search uses (`balanced_bounds`, partition.balanced).
* Price (§4.4 parametrized simulation): `price()` on the Varuna schedule; out-of-memory configurations are
  dropped and the rest returned best throughput first.

Pure: no I/O, deterministic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from services.planner.cost import CostContext, LayerStrategy, ModelView, build_pipeline, layer_cost
from services.planner.search import partition as part
from services.planner.search.problem import PricedPlan, SearchOptions, price
from services.planner.sim import Schedule
from services.planner.sim.bound import iteration_floor
from services.runtime.errors import InvalidArgument

KNEE_TOLERANCE = 0.05  # "stops improving": doubling m gains less than 5% per sample
MICRO_BATCHES_PER_STAGE = 6  # §3.2: Nm >= 6 P keeps the bubble below 10%


def knee_micro_batch_size(view: ModelView, limit: int, tolerance: float = KNEE_TOLERANCE) -> int:
    """Smallest m in 1, 2, 4, ... (at most `limit`) after which doubling m cuts F(m)/m by less than `tolerance`."""
    def per_sample(m: int) -> float:
        return sum(layer.forward_s(m) for layer in view.layers) / m

    m = 1
    while 2 * m <= limit:
        now, nxt = per_sample(m), per_sample(2 * m)
        if now <= 0 or nxt > (1.0 - tolerance) * now:
            break
        m *= 2
    return m


def balanced_bounds(
    weights: Sequence[float], num_stages: int, last_weights: Sequence[float] | None = None
) -> tuple[tuple[int, int], ...]:
    """Contiguous non-empty stages minimising the largest stage sum (exact; partition.balanced's DP).

    `last_weights` price the layers when they sit on the last stage (Varuna's last stage does not recompute).
    """
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty stages")
    last = weights if last_weights is None else last_weights
    if len(last) != n or any(w < 0 for w in (*weights, *last)):
        raise ValueError("weights must be non-negative, one per layer in both lists")
    rows = np.array([list(weights)] * (num_stages - 1) + [list(last)], dtype=float)
    return part.balanced(rows)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _nearest_valid(batch: int, widths: Sequence[int]) -> list[int]:
    def ok(b: int) -> bool:
        return any(b % d == 0 for d in widths)

    below = next((b for b in range(batch - 1, 0, -1) if ok(b)), None)
    above = next(b for b in range(batch + 1, batch + max(widths) + 1) if ok(b))
    return [b for b in (below, above) if b is not None]


def _positive(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"must be a positive integer, got {value!r}", field=field, fix="pass at least 1")
    return value


def _layout(ctx: CostContext, p: int, m: int, ckpt: tuple[bool, bool]) -> tuple[tuple[tuple[int, int], ...],
                                                                                  list[LayerStrategy]]:
    """Depth p's balanced cut points at micro-batch size m, and every layer's strategy (one device each)."""
    n = len(ctx.view)
    inner, outer = LayerStrategy(checkpoint=ckpt[0]), LayerStrategy(checkpoint=ckpt[1])
    weights = [layer_cost(ctx, i, inner, m).per_micro_batch_s for i in range(n)]
    last = [layer_cost(ctx, i, outer, m).per_micro_batch_s for i in range(n)]
    bounds = balanced_bounds(weights, p, last)
    return bounds, [inner] * bounds[-1][0] + [outer] * (n - bounds[-1][0])


def _price_depth(
    ctx: CostContext, p: int, d: int, m: int, batch: int, options: SearchOptions, schedule: Schedule,
    ckpt: tuple[bool, bool], note: str,
) -> PricedPlan:
    bounds, strategies = _layout(ctx, p, m, ckpt)
    nm = batch // (m * d)
    plan = price(ctx, bounds, strategies, m, nm, schedule, options.memory_budget_bytes,
                 replicas=d, engine="varuna", name="Varuna")
    text = f"P={p} x D={d} on {p * d} devices, m={m} ({note}), Nm={nm}"
    return dataclasses.replace(plan, reason=f"{text}; {plan.reason}" if plan.reason else text)


def _pipeline_bound(ctx: CostContext, p: int, d: int, m: int, batch: int, ckpt: tuple[bool, bool],
                    schedule: Schedule) -> float:
    """No plan of depth p at micro-batch size m simulates more samples/s (sim.bound.iteration_floor on the
    pipeline _price_depth would price)."""
    bounds, strategies = _layout(ctx, p, m, ckpt)
    pipe = build_pipeline(ctx.view, None, bounds, strategies, m, batch // (m * d), replicas=d, context=ctx)
    iteration = iteration_floor(pipe, schedule) * (1 - 1e-9)  # slack: never skip on a rounding difference
    return math.inf if iteration <= 0 else batch / iteration


def _configure_depth(
    ctx: CostContext, p: int, d: int, batch: int, options: SearchOptions, schedule: Schedule, ckpt: tuple[bool, bool]
) -> tuple[PricedPlan | None, PricedPlan | None]:
    """(best fitting plan, least-memory OOM plan) for depth p."""
    per_replica = batch // d
    if options.micro_batches:  # pinned Nm: one micro-batch size, or none at this width
        if per_replica % options.micro_batches:
            return None, None
        plan = _price_depth(ctx, p, d, per_replica // options.micro_batches, batch, options, schedule, ckpt,
                            "Nm pinned")
        return (None, plan) if plan.out_of_memory else (plan, None)
    knee = knee_micro_batch_size(ctx.view, per_replica)
    sizes = [m for m in _divisors(per_replica) if m <= knee][::-1]
    oom: PricedPlan | None = None
    best: PricedPlan | None = None
    for m in sizes:  # largest divisor <= knee first; smaller ones only when memory says so
        if m == knee:
            note = "the knee"
        else:
            note = f"knee {knee}, " + ("larger sizes out of memory" if oom else "largest divisor of B/D below it")
        plan = _price_depth(ctx, p, d, m, batch, options, schedule, ckpt, note)
        if not plan.out_of_memory:
            best = plan
            break
        oom = plan
    if best is not None and per_replica // best.micro_batch_size < MICRO_BATCHES_PER_STAGE * p:
        deep = [m for m in sizes if m < best.micro_batch_size and per_replica // m >= MICRO_BATCHES_PER_STAGE * p]
        if deep:
            alt = _price_depth(ctx, p, d, deep[0], batch, options, schedule, ckpt, f"Nm >= 6P, knee {knee}")
            if not alt.out_of_memory and alt.throughput > best.throughput:
                best = alt
    return best, oom


def _depth_bound(ctx: CostContext, p: int, d: int, batch: int, options: SearchOptions,
                 ckpt: tuple[bool, bool], schedule: Schedule) -> float:
    """No plan of depth p simulates more samples/s: _pipeline_bound at every micro-batch size _configure_depth
    may choose."""
    per_replica = batch // d
    if options.micro_batches:
        sizes = [per_replica // options.micro_batches] if per_replica % options.micro_batches == 0 else []
    else:
        knee = knee_micro_batch_size(ctx.view, per_replica)
        sizes = [m for m in _divisors(per_replica) if m <= knee]
    return max((_pipeline_bound(ctx, p, d, m, batch, ckpt, schedule) for m in sizes), default=0.0)


def configure(
    ctx: CostContext,
    num_devices: int,
    global_batch_size: int,
    options: SearchOptions,
    *,
    schedule: Schedule = Schedule.VARUNA,
    floor: float = 0.0,
) -> list[PricedPlan]:
    """Varuna's P x D configurations for `num_devices` and a fixed global batch, best throughput first.

    Only configurations that fit options.memory_budget_bytes are returned, the options.top_k best (depths are
    priced in decreasing order of a throughput bound, and those that cannot enter the top k are not priced);
    when none fits, the result is the single least-memory configuration, out_of_memory=True, with the reason.
    Raises InvalidArgument when no replica count D divides the global batch (the message names the nearest
    sizes that work). `floor`: samples/s a plan must reach to be wanted (another engine's k-th best); depths
    whose bound is below it are not priced, and the result is [] when none can reach it.
    """
    g = _positive(num_devices, "num_devices")
    batch = _positive(global_batch_size, "global_batch_size")
    if g > ctx.fleet.devices:
        raise InvalidArgument(f"{g} devices asked, the fleet has {ctx.fleet.devices}", field="num_devices",
                              fix=f"use at most {ctx.fleet.devices}")
    depths = [p for p in range(1, min(g, len(ctx.view)) + 1) if options.pipeline_stages in (0, p)]
    widths = sorted({g // p for p in depths})
    if not any(batch % d == 0 for d in widths):
        near = " or ".join(str(b) for b in _nearest_valid(batch, widths))
        raise InvalidArgument(
            f"{batch} is not a multiple of any data-parallel width D in {widths} (P x D on {g} devices, "
            f"{len(ctx.view)} layers), so Nm = B / (m D) cannot be an integer",
            field="global_batch_size", fix=f"nearest valid sizes: {near}",
        )
    # (non-last stages, last stage): Varuna recomputes everywhere but the last stage (§3.1).
    ckpt = (True in options.checkpoint, False not in options.checkpoint)
    k = max(1, options.top_k)
    fitting: list[PricedPlan] = []
    least: PricedPlan | None = None
    bounds = [(_depth_bound(ctx, p, g // p, batch, options, ckpt, schedule), p) for p in depths
              if batch % (g // p) == 0]
    for bound, p in sorted(bounds, key=lambda x: (-x[0], x[1])):
        if bound < floor or (len(fitting) >= k and bound < sorted(plan.throughput for plan in fitting)[-k]):
            break  # neither this depth nor any after it can enter the top k
        best, oom = _configure_depth(ctx, p, g // p, batch, options, schedule, ckpt)
        if best is not None:
            fitting.append(best)
        elif oom is not None and (least is None or max(oom.peak_memory_bytes) < max(least.peak_memory_bytes)):
            least = oom
    if fitting:
        return sorted(fitting, key=lambda plan: (-plan.throughput, len(plan.stage_bounds)))[:k]
    if least is None and floor > 0:
        return []  # nothing fitting was priced: no depth could reach the floor
    if least is None:  # only a pinned Nm leaves every width without a micro-batch size
        raise InvalidArgument(
            f"{options.micro_batches} micro-batches split no replica's share of the global batch {batch} (P x D "
            f"on {g} devices, D in {widths})", field="micro_batches",
            fix="use a count that divides B / D for some D, or 0 to let the search choose")
    return [dataclasses.replace(least, reason=f"no P x D configuration fits the memory budget; least memory: "
                                              f"{least.reason}")]


__all__ = [
    "KNEE_TOLERANCE",
    "MICRO_BATCHES_PER_STAGE",
    "balanced_bounds",
    "configure",
    "knee_micro_batch_size",
]
