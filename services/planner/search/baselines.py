"""The fixed strategies Ballast's plans are compared with (Galvatron-BMW §VII-A, Tables II-VI).

Each baseline is priced on the shared cost model and simulator (`price()`), at its best global batch size
(the tables' numbers in parentheses), or reported out of memory with the reason (the tables' "OOM"):

* DDP (PyTorch DDP): one stage, every layer dp = N.
* ZeRO-3 (FairScale FSDP / DeepSpeed ZeRO-3): one stage, sdp = N.
* Megatron TP: tp = N while N fits a node; beyond a node, TP over the largest divisor of N that fits a node and
  DP across nodes (Megatron-LM keeps TP inside a server; TP over the network would be priced, but nobody runs it).
* GPipe (PyTorch GPipe): N stages of one device, GPipe schedule, activation checkpointing on every stage
  (torchgpipe / torch Pipe default checkpoint="except_last": all micro-batches but the last recompute; the
  cost model checkpoints all of them, a slight over-estimate of one micro-batch's recompute).
* DeepSpeed 3D: the officially suggested 2-way DP (Galvatron-BMW §VII-B) x TP x PP with TP inside a node, DP
  and TP inside each stage's device block (DeepSpeed's pipe-data-model topology), 1F1B (DeepSpeed's
  TrainSchedule), no checkpointing; among the TP x PP splits with both >= 2 (any split when N < 8), the fastest.
* DP+TP: the best uniform dp x tp split of one stage (Galvatron (DP+TP) searches DP and TP only; here every
  layer gets the same split), no checkpointing (Galvatron without CKPT).
* DP+PP: the best pp x dp split, dp inside each stage, 1F1B, no checkpointing (Galvatron (DP+PP)).

Batch sweep: powers of two up to options.max_global_batch_size, or options.global_batch_size +- batch_radius.
Single-stage baselines run one micro-batch per iteration (no gradient accumulation, as in the tables);
pipelined ones try Nm in {P, 2P, 4P, 8P} (GPipe: Nm >= 4P makes the bubble negligible; Galvatron tunes Nm
by hand), balanced by per-micro-batch compute (varuna.balanced_bounds). With Nm capped, memory grows with the
batch, so the sweep stops at the first batch where nothing fits.

Baselines are priced even where this fleet's executors cannot run them (options.dims, options.checkpoint);
the reason says so. Pure: no I/O, deterministic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.planner.cost import CostContext, LayerStrategy, layer_cost
from services.planner.search.problem import PricedPlan, SearchOptions, price
from services.planner.search.varuna import balanced_bounds
from services.planner.sim import Schedule
from services.runtime.errors import InvalidArgument

BASELINES = ("DDP", "ZeRO-3", "Megatron TP", "GPipe", "DeepSpeed 3D", "DP+TP", "DP+PP")
MICRO_BATCH_FACTORS = (1, 2, 4, 8)  # Nm = P x factor for pipelined baselines


@dataclass(frozen=True)
class Shape:
    """One uniform layout a baseline may take: P stages, one strategy for every layer, a schedule."""

    stages: int
    strategy: LayerStrategy
    schedule: Schedule
    note: str = ""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in _divisors(n) if d <= cap)


def shapes(name: str, num_devices: int, devices_per_node: int, num_layers: int) -> list[Shape]:
    """Every layout baseline `name` may take on `num_devices` (empty when it cannot run at all)."""
    n, dpn = num_devices, devices_per_node
    one_f = Schedule.ONE_F_ONE_B
    if name == "DDP":
        return [Shape(1, LayerStrategy(dp=n), one_f, f"dp {n}")]
    if name == "ZeRO-3":
        return [Shape(1, LayerStrategy(sdp=n), one_f, f"sdp {n}")]
    if name == "Megatron TP":
        tp = _largest_divisor_at_most(n, dpn)
        note = f"tp {n}" if tp == n else f"tp {tp} inside a node x dp {n // tp} across nodes"
        return [Shape(1, LayerStrategy(dp=n // tp, tp=tp), one_f, note)]
    if name == "GPipe":
        gpipe = Shape(n, LayerStrategy(checkpoint=True), Schedule.GPIPE, f"pp {n}, checkpointing on")
        return [gpipe] if n <= num_layers else []
    if name == "DeepSpeed 3D":
        dp = 2 if n % 2 == 0 else 1
        splits = [(tp, n // dp // tp) for tp in _divisors(n // dp) if dpn % tp == 0 and n // dp // tp <= num_layers]
        three_d = [(tp, pp) for tp, pp in splits if tp >= 2 and pp >= 2]
        return [Shape(pp, LayerStrategy(dp=dp, tp=tp), one_f, f"dp {dp} x tp {tp} x pp {pp}")
                for tp, pp in (three_d or splits)]
    if name == "DP+TP":
        return [Shape(1, LayerStrategy(dp=n // tp, tp=tp), one_f, f"dp {n // tp} x tp {tp}") for tp in _divisors(n)]
    if name == "DP+PP":
        return [Shape(pp, LayerStrategy(dp=n // pp), one_f, f"pp {pp} x dp {n // pp}")
                for pp in _divisors(n) if pp <= num_layers]
    raise InvalidArgument(f"unknown baseline {name!r}", field="name", fix=f"one of {', '.join(BASELINES)}")


def batch_sizes(options: SearchOptions) -> list[int]:
    """Global batches the sweep tries, ascending."""
    if options.global_batch_size is not None:
        b0, r = options.global_batch_size, max(0, options.batch_radius)
        return list(range(max(1, b0 - r), b0 + r + 1))
    out, b = [], 1
    while b <= options.max_global_batch_size:
        out.append(b)
        b *= 2
    return out


def _micro_batch_counts(shape: Shape, batch: int) -> list[int]:
    """Micro-batch counts to price; only those whose micro-batch splits into whole samples over dp x sdp."""
    if shape.stages == 1:
        counts = [1]
    else:
        counts = [shape.stages * f for f in MICRO_BATCH_FACTORS if batch % (shape.stages * f) == 0]
        counts = counts or [_largest_divisor_at_most(batch, shape.stages * MICRO_BATCH_FACTORS[-1])]
    return [nm for nm in counts if (batch // nm) % shape.strategy.batch_split == 0]


def _price_shape(ctx: CostContext, name: str, shape: Shape, batch: int, nm: int, budget: int) -> PricedPlan:
    n, m = len(ctx.view), batch // nm
    if shape.stages == 1:
        bounds: tuple[tuple[int, int], ...] = ((0, n),)
    else:
        bounds = balanced_bounds([layer_cost(ctx, i, shape.strategy, m).per_micro_batch_s for i in range(n)],
                                 shape.stages)
    return price(ctx, bounds, [shape.strategy] * n, m, nm, shape.schedule, budget, engine="baseline", name=name)


def _flags(shape: Shape, options: SearchOptions) -> str:
    missing = [d for d in ("dp", "sdp", "tp") if getattr(shape.strategy, d) > 1 and d not in options.dims]
    if shape.strategy.checkpoint and True not in options.checkpoint:
        missing.append("checkpointing")
    return f"not executable on this fleet (needs {', '.join(missing)}); priced for comparison" if missing else ""


def _with_reason(plan: PricedPlan, *parts: str) -> PricedPlan:
    return dataclasses.replace(plan, reason="; ".join(p for p in parts if p))


def best_baseline(ctx: CostContext, name: str, num_devices: int, options: SearchOptions) -> PricedPlan:
    """Baseline `name` at its best global batch size, or out of memory with the reason."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or not 1 <= num_devices <= ctx.fleet.devices:
        raise InvalidArgument(f"{num_devices!r} devices on a fleet of {ctx.fleet.devices}", field="num_devices",
                              fix=f"pass 1 to {ctx.fleet.devices}")
    found = shapes(name, num_devices, ctx.fleet.devices_per_node, len(ctx.view))
    if not found:
        reason = f"needs {num_devices} pipeline stages, the model has {len(ctx.view)} layers"
        return PricedPlan("baseline", name, (), (), 1, 0, 0, Schedule.GPIPE, 0, 0.0, (), True, reason=reason)
    best: tuple[PricedPlan, Shape] | None = None
    least: tuple[PricedPlan, Shape] | None = None
    tried = batch_sizes(options)
    for batch in tried:
        priced = fitted = False
        for shape in found:
            for nm in _micro_batch_counts(shape, batch):
                priced = True
                plan = _price_shape(ctx, name, shape, batch, nm, options.memory_budget_bytes)
                if not plan.out_of_memory:
                    fitted = True
                    if best is None or plan.throughput > best[0].throughput:
                        best = plan, shape
                elif least is None or max(plan.peak_memory_bytes) < max(least[0].peak_memory_bytes):
                    least = plan, shape
        if priced and not fitted:
            break  # memory grows with the batch (module docstring): larger ones cannot fit either
    if best is not None:
        return _with_reason(best[0], best[1].note, _flags(best[1], options))
    if least is None:  # no tried batch splits into whole samples over this baseline's devices
        split = found[0].strategy.batch_split
        reason = f"no global batch tried ({tried[0]}..{tried[-1]}) splits over its dp x sdp = {split}"
        return PricedPlan("baseline", name, (), (), 1, 0, 0, Schedule.GPIPE, 0, 0.0, (), True, reason=reason)
    plan, shape = least
    where = f"the smallest global batch tried ({plan.global_batch_size})"
    return _with_reason(plan, f"out of memory at {where}; least memory: {plan.reason}", shape.note,
                        _flags(shape, options))


def baselines(ctx: CostContext, num_devices: int, options: SearchOptions) -> list[PricedPlan]:
    """Every baseline in BASELINES order, each at its best batch size (engine "baseline")."""
    return [best_baseline(ctx, name, num_devices, options) for name in BASELINES]


__all__ = ["BASELINES", "Shape", "baselines", "batch_sizes", "best_baseline", "shapes"]
