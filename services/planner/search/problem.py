"""What every search engine takes and returns, and the one pricing function they all share.

Galvatron-BMW's hybrid search, Varuna's P x D configurator and the baselines all answer with
`PricedPlan`s priced by `price()`: cost model (services.planner.cost) -> Pipeline -> simulator
(services.planner.sim, pricing path). Same physics, so their numbers compare.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.planner.cost import CostContext, CostOptions, DpSharding, LayerStrategy, build_pipeline
from services.planner.search.space import Candidate
from services.planner.sim import Schedule, SimOptions, simulate

MiB = 1 << 20


@dataclass(frozen=True)
class SearchOptions:
    """The knobs of a search request (engines ignore what does not apply to them)."""

    # Per-device memory budget (Galvatron's E), bytes.
    memory_budget_bytes: int
    # Fixed global batch (Varuna; Galvatron's B0). None: search the batch size for the best throughput.
    global_batch_size: int | None = None
    # Galvatron Algorithm 2's r: also try B0 - r .. B0 + r (only with global_batch_size).
    batch_radius: int = 0
    # Largest global batch the throughput sweep tries when global_batch_size is None.
    max_global_batch_size: int = 1024
    # Schedules to price; the first is the default (1F1B).
    schedules: tuple[Schedule, ...] = (Schedule.ONE_F_ONE_B,)
    # Non-pipeline dims the fleet's executors can run ("dp", "sdp", "tp"), the DP flavours they run ("zero1",
    # "zero2": space.FLAVOURS), and "sp" (sequence parallelism on TP layers, used per layer where it is no slower
    # than plain TP: dp.layer_tables); PP is always allowed. The default is Galvatron-BMW's space (no ZeRO-1/2)
    # with sequence parallelism.
    dims: tuple[str, ...] = ("dp", "sdp", "tp", "sp")
    # Only what Ballast's workers run (space.executable, dp.layer_tables): TP innermost with DP outside it, SDP
    # alone, TP only at degrees dividing a layer's profile `tensor_parallel`, neither on a layer holding a tied
    # weight, no ZeRO-1/2 on a TP or SDP layer.
    # make_plan sets it for every plan but a what-if.
    executable_only: bool = False
    # Checkpointing choices per layer.
    checkpoint: tuple[bool, ...] = (False, True)
    # Galvatron Takeaway 3: drop DP+SDP mixes.
    takeaway3: bool = True
    # Memory granularity of the dynamic program (Galvatron sweeps budgets in MB steps).
    memory_granularity_bytes: int = 64 * MiB
    # Alternatives kept for the explanation.
    top_k: int = 5
    # Only plans with this many pipeline stages (0: any depth).
    pipeline_stages: int = 0
    # Only plans with this many micro-batches per replica (0: any; the Varuna engine plans it).
    micro_batches: int = 0
    # Prove small stages' strategies optimal by enumeration (dp.ENUMERATE_LIMIT) after the budget sweep; False keeps
    # the sweep's answer. Scaling curves turn it off: they need each count's throughput, and on the benchmark's
    # models the sweep's curves equal the proved ones at a quarter of the time (BENCHMARKS.md, issue 44).
    exact_stages: bool = True
    cost: CostOptions = field(default_factory=CostOptions)


@dataclass(frozen=True)
class PricedPlan:
    """A complete candidate plan and its price on the shared cost model."""

    engine: str  # "galvatron", "varuna", "baseline"
    name: str  # "Ballast", "DDP", "ZeRO-3", "Megatron TP", "GPipe", "DeepSpeed 3D", "DP+TP", "DP+PP", ...
    stage_bounds: tuple[tuple[int, int], ...]  # [begin, end) layers per stage
    strategies: tuple[LayerStrategy, ...]  # one per layer
    replicas: int  # pipeline replicas (Varuna's D); Galvatron keeps DP inside strategies and uses 1
    micro_batch_size: int  # samples per micro-batch per pipeline replica
    num_micro_batches: int
    schedule: Schedule
    global_batch_size: int
    iteration_s: float
    peak_memory_bytes: tuple[int, ...]  # per stage, per device
    out_of_memory: bool
    bubble_fraction: float = 0.0
    reason: str = ""  # why infeasible, or a note

    @property
    def throughput(self) -> float:
        """Samples per second (0 when out of memory)."""
        return 0.0 if self.out_of_memory or self.iteration_s <= 0 else self.global_batch_size / self.iteration_s

    @property
    def devices(self) -> int:
        per_stage = [self.strategies[b].devices for b, _ in self.stage_bounds]
        return sum(per_stage) * self.replicas


@functools.lru_cache(maxsize=4096)
def to_strategy(candidate: Candidate) -> LayerStrategy:
    """The cost model's LayerStrategy for a strategy-space Candidate (its PP degree lives in the stages); both
    are frozen, and a search asks for the same few thousand again and again."""
    return LayerStrategy(
        dp=candidate.dp, sdp=candidate.sdp, tp=candidate.tp, order=candidate.order, checkpoint=candidate.checkpoint,
        dp_sharding=DpSharding(candidate.dp_sharding),
    )


def time_floor(ctx: CostContext) -> float:
    """What a search's lower bounds on time, taken from uncalibrated layer costs, are multiplied by: the
    simulator prices a calibrated plan, and a calibration's scales below 1 make it faster than the layer costs
    say (its fixed terms only add)."""
    cal = ctx.calibration
    if cal is None:
        return 1.0
    return min(1.0, cal.forward_scale, cal.backward_scale, cal.allreduce_scale, cal.update_scale)


def fill_fits(fill: np.ndarray, own: np.ndarray, stages: int, limit: float) -> bool:
    """Whether some split of the layers into at most `stages` contiguous stages keeps every stage's pipeline
    bound within `limit`: stage b from layer i to layer j ends no earlier than W(i) + E(j) - E(i), W (`fill`)
    and E (`own`) prefix sums (0 first) of each layer's least forward + backward per micro-batch, and of its
    least time as the stage's own (nm of them plus what follows the stage's last backward). The first
    micro-batch's forward must cross the stages before b and its last gradient cross them back
    (Planner.throughput_bound's inequality, checked against the simulator for every schedule).

    Greedy is exact: stage b may end at the last j with E(j) <= limit - W(i) + E(i), an allowance that grows
    with i (E - W does: a layer's own time is at least its share of the fill), so ending every stage as late
    as it can reaches furthest; splitting a stage only loosens the bound, so fewer stages suffice."""
    layers = len(fill) - 1
    end = 0
    for _ in range(stages):
        reach = int(np.searchsorted(own, limit - fill[end] + own[end], side="right")) - 1
        if reach <= end:
            return False
        end = reach
        if end >= layers:
            return True
    return False


def price(
    ctx: CostContext,
    stage_bounds: Sequence[tuple[int, int]],
    strategies: Sequence[LayerStrategy],
    micro_batch_size: int,
    num_micro_batches: int,
    schedule: Schedule,
    memory_budget_bytes: int,
    *,
    replicas: int = 1,
    engine: str = "galvatron",
    name: str = "Ballast",
) -> PricedPlan:
    """Build the pipeline on the cost model, simulate one iteration (pricing path), check memory.

    Every strategy's dp x sdp must divide the micro-batch (whole samples per device): engines filter
    those out before pricing, so one here is a bug in the caller (ValueError)."""
    if bad := next((st for st in strategies if micro_batch_size % st.batch_split), None):
        raise ValueError(f"a micro-batch of {micro_batch_size} does not split over dp x sdp = {bad.batch_split}")
    pipe = build_pipeline(
        ctx.view, None, stage_bounds, strategies, micro_batch_size, num_micro_batches,
        replicas=replicas, context=ctx,
    )
    result = simulate(pipe, SimOptions(schedule=schedule, keep_timeline=False))
    peaks = tuple(int(p) for p in result.peak_memory_bytes)
    worst = max(peaks)
    oom = worst > memory_budget_bytes
    return PricedPlan(
        engine=engine,
        name=name,
        stage_bounds=tuple((int(b), int(e)) for b, e in stage_bounds),
        strategies=tuple(strategies),
        replicas=replicas,
        micro_batch_size=micro_batch_size,
        num_micro_batches=num_micro_batches,
        schedule=schedule,
        # A stage's DP/SDP split a micro-batch across its devices (cost.layer), they do not multiply it.
        global_batch_size=micro_batch_size * num_micro_batches * replicas,
        iteration_s=result.iteration_s,
        peak_memory_bytes=peaks,
        out_of_memory=oom,
        bubble_fraction=result.bubble_fraction,
        reason=f"peak {worst / 2**30:.2f} GiB > budget {memory_budget_bytes / 2**30:.2f} GiB" if oom else "",
    )


__all__ = ["MiB", "PricedPlan", "SearchOptions", "fill_fits", "price", "time_floor", "to_strategy"]
