"""From a profile and a fleet to a stored-ready Plan: run the engines, pick, compare, explain.

Every engine (Galvatron-BMW's hybrid search, Varuna's P x D configurator) and every baseline answers
with PricedPlans priced by the same cost model and simulator (search.problem.price), so choosing is
a comparison of numbers on one physics: the plan with the highest predicted throughput that fits the
memory budget wins, whichever produced it (a baseline can win; the plan then says so). Pure: no I/O.

Runnable dims: executors declare the parallelisms their runtime executes (Host.supported_parallelism),
DP flavours included (PARALLEL_DIM_ZERO1 / ZERO2: a layer's dp replicas may run ZeRO-1 or ZeRO-2); the
search is confined to what every online executor declares unless `what_if` is set, in which case the full
space is searched (every dim and flavour) and the plan says which of its strategies no executor can run yet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ballast.v1 import common_pb2, fleet_pb2, plan_pb2, profile_pb2
from services.planner.cost import (
    CostContext,
    CostOptions,
    DpSharding,
    FleetView,
    build_pipeline,
    from_profile,
    stage_layer_costs,
)
from services.planner.cost.calibration import Calibration
from services.planner.plans import offload
from services.planner.search import baselines as baseline_engine
from services.planner.search import galvatron, varuna
from services.planner.search.dp import plan_runs_on_workers
from services.planner.search.problem import PricedPlan, SearchOptions, price
from services.planner.search.space import CAPABILITIES, global_batch_fits, nearest_global_batches
from services.planner.sim import Schedule
from services.runtime.errors import FailedPrecondition, InvalidArgument

ENGINE = {
    "galvatron": plan_pb2.PLAN_ENGINE_GALVATRON,
    "varuna": plan_pb2.PLAN_ENGINE_VARUNA,
    "baseline": plan_pb2.PLAN_ENGINE_BASELINE,
}
SCHEDULE = {
    Schedule.GPIPE: plan_pb2.SCHEDULE_GPIPE,
    Schedule.ONE_F_ONE_B: plan_pb2.SCHEDULE_1F1B,
    Schedule.VARUNA: plan_pb2.SCHEDULE_VARUNA,
    Schedule.HARMONY_WRAP: plan_pb2.SCHEDULE_HARMONY_WRAP,
}
SCHEDULE_FROM_PROTO = {v: k for k, v in SCHEDULE.items()}
DIM_NAMES = {common_pb2.PARALLEL_DIM_DP: "dp", common_pb2.PARALLEL_DIM_SDP: "sdp", common_pb2.PARALLEL_DIM_TP: "tp",
             common_pb2.PARALLEL_DIM_ZERO1: "zero1", common_pb2.PARALLEL_DIM_ZERO2: "zero2",
             common_pb2.PARALLEL_DIM_SP: "sp"}
ALL_DIMS = CAPABILITIES  # the strategy space's non-pipeline dims and DP flavours: what --what-if searches
OFFLOAD = "chunks"  # in a dims tuple: every executor runs chunk offload (PlanInputs.offload)
HARMONY = "harmony"  # in a dims tuple: every executor runs Harmony's swap schedule (PlanInputs.harmony)
ZERO_NAMES = {  # DP flavour: (name, what its dp replicas shard)
    DpSharding.ZERO1: ("ZeRO-1", "optimizer states"),
    DpSharding.ZERO2: ("ZeRO-2", "optimizer states and gradients"),
}


@dataclass(frozen=True)
class PlanInputs:
    """What a plan request asks for (PlanRequest's fields, decoded)."""

    global_batch_size: int = 0  # 0: the search chooses
    memory_budget_bytes: int = 0  # 0: the fleet device's memory
    engine: int = plan_pb2.PLAN_ENGINE_UNSPECIFIED  # unspecified: every engine, best wins
    schedule: int = plan_pb2.SCHEDULE_UNSPECIFIED  # unspecified: 1F1B (GPipe also priced)
    runnable_dims: tuple[str, ...] = ("dp",)  # what the fleet's executors can run, besides PP (dims and flavours)
    what_if: bool = False  # search the full space; say what is not executable yet
    # Galvatron prices the gradient sync overlapped with the last backward (DDP buckets); Ballast's executors
    # allreduce after the last micro-batch (Varuna §4.4), so plans for them are priced that way (jobs pass False).
    overlap_grad_sync: bool = True
    # How ZeRO-2 layers' reduce-scatters are timed on the executors (CostOptions.zero2_reduce_scatter_per_layer).
    zero2_reduce_scatter_per_layer: bool = True
    pipeline_stages: int = 0  # 0: any depth
    micro_batches: int = 0  # Varuna's Nm pinned (the Varuna engine alone plans it); 0: the search chooses
    max_global_batch_size: int = 512
    top_k: int = 5
    # Learnt from earlier runs on this fleet's host class (cost/calibration.py); None: the profile alone.
    calibration: Calibration | None = None
    calibration_note: str = ""  # which calibration that is, for the explanation
    # Every executor runs chunk offload (PARALLEL_DIM_CHUNKS): a model that fits no plan in device memory is
    # planned with its model data in chunks moving between device and host (PatrickStar) instead of refused.
    offload: bool = False
    # Every executor runs Harmony's swap schedule (PARALLEL_DIM_HARMONY): such a model may also be planned as a
    # wrap-around pipeline over one server's devices; the faster of the two wins.
    harmony: bool = False
    exact_stages: bool = True  # SearchOptions.exact_stages: scaling curves keep the budget sweep's stage plans


@dataclass(frozen=True)
class Breakdown:
    """Where one plan's iteration time goes, on its bottleneck stage (for explanations)."""

    compute_s: float  # forward + backward + recompute compute of all micro-batches
    recompute_s: float
    tp_comm_s: float
    sdp_comm_s: float
    grad_sync_s: float
    bubble_fraction: float


def search_dims(dims: Sequence[str]) -> tuple[tuple[str, ...], bool, bool]:
    """(the dims the search spans, whether chunk offload runs, whether Harmony runs) from executor_dims' tuple."""
    return tuple(d for d in dims if d not in (OFFLOAD, HARMONY)), OFFLOAD in dims, HARMONY in dims


def offload_runnable(hosts_parallelism: Sequence[Sequence[int]], dim: int = common_pb2.PARALLEL_DIM_CHUNKS) -> bool:
    """Whether every host runs `dim` (chunk offload, or PARALLEL_DIM_HARMONY) (no host known: no)."""
    return bool(hosts_parallelism) and all(dim in dims for dims in hosts_parallelism)


def runnable_dims(hosts_parallelism: Sequence[Sequence[int]]) -> tuple[str, ...]:
    """Dims and DP flavours every host can run (ParallelDim values per host; a flavour counts only where every
    host declares it); no host known: pipeline x plain data parallel."""
    if not hosts_parallelism:
        return ("dp",)
    common = set(ALL_DIMS)
    for dims in hosts_parallelism:
        common &= {DIM_NAMES[d] for d in dims if d in DIM_NAMES}
    return tuple(d for d in ALL_DIMS if d in common)


def make_plan(profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, inputs: PlanInputs) -> plan_pb2.Plan:
    """The best plan for `profile` on `fleet`, with alternatives, baselines and an explanation.

    Raises InvalidArgument for a bad request (batch no configuration divides, unknown schedule) and
    FailedPrecondition when nothing fits, stating the smallest per-device memory or device count that would.
    """
    _check(profile, fleet, inputs)
    devices = fleet.nodes * fleet.devices_per_node
    _check_batch(inputs, devices, len(profile.layers))
    budget = inputs.memory_budget_bytes or fleet.device.memory_bytes
    ctx = CostContext(from_profile(profile), fleet, CostOptions(
        overlap_grad_sync=inputs.overlap_grad_sync, calibration=inputs.calibration,
        zero2_reduce_scatter_per_layer=inputs.zero2_reduce_scatter_per_layer))
    options = _options(inputs, budget)
    if inputs.engine in (plan_pb2.PLAN_ENGINE_HARMONY, plan_pb2.PLAN_ENGINE_PATRICKSTAR):
        return _pinned_offload(ctx, profile, fleet, inputs, budget)
    engines = _run_engines(ctx, devices, options, inputs)
    base = baseline_engine.baselines(ctx, devices, options)
    # Baselines are priced whatever they need (the table compares them); only runnable ones may be chosen, and
    # only when no engine was asked for: a job that names Varuna gets Varuna's P x D, never a pure-SDP baseline.
    def runs(p: PricedPlan) -> bool:
        return _runnable(ctx, options, p)

    choosable = [*engines, *base] if inputs.engine == plan_pb2.PLAN_ENGINE_UNSPECIFIED else engines
    feasible = sorted(filter(runs, choosable), key=lambda p: -p.throughput)
    if not feasible:
        why = _nothing_fits(ctx, fleet, options)
        if fits := next(filter(runs, base), None):
            raise FailedPrecondition(f"engine {plan_pb2.PlanEngine.Name(inputs.engine)} was asked for and none of "
                                     f"its plans fits; the {fits.name} baseline would", field="engine",
                                     fix="leave the engine unset to let the planner choose among every strategy")
        if inputs.offload or inputs.harmony or inputs.what_if:
            batch = inputs.global_batch_size or devices
            chosen = offload.plan(ctx, profile, fleet, batch, budget, why,
                                  chunks=inputs.offload or inputs.what_if, harmony=inputs.harmony or inputs.what_if,
                                  calibration_note=inputs.calibration_note)
            if isinstance(chosen, plan_pb2.Plan):
                return chosen
            why += chosen
        else:
            why += ("; the executors run neither chunk offload (PARALLEL_DIM_CHUNKS) nor Harmony's swap schedule "
                    "(PARALLEL_DIM_HARMONY), which would not need it to fit")
        raise FailedPrecondition(why, field="memory_budget_bytes",
                                 fix="raise the budget, add devices, or plan for a larger device")
    best = feasible[0]
    runners = _distinct([p for p in feasible[1:] if p.engine != "baseline"], best)[: max(0, inputs.top_k - 1)]
    plan = _to_proto(ctx, profile, fleet, best, budget)
    for rank, alt in enumerate(runners, 1):
        plan.alternatives.append(_alternative(alt, f"runner-up {rank}: {_label(alt)}"))
    for b in base:
        plan.alternatives.append(_alternative(b, b.name))
    plan.explanation = explain(ctx, best, runners[0] if runners else None, base, budget, inputs)
    if note := profile_note(profile):
        plan.explanation += "\n" + note
    return with_interval(plan, ctx.calibration)


CALIBRATED = "Calibrated from earlier runs"  # the explanation's line for a plan priced with a calibration
UNCALIBRATED_ERROR = 1.0  # the first job on an uncalibrated host class measured 2.5x its prediction (issue 45)
MIN_ERROR = 0.05


def error_bound(cal: Calibration | None) -> tuple[float, str]:
    """(how far an iteration time may be off, why): the calibration's residual or its runs' spread, whichever is
    larger (at least MIN_ERROR); UNCALIBRATED_ERROR without one."""
    if cal is None:
        return UNCALIBRATED_ERROR, "uncalibrated"
    if cal.spread > cal.residual:
        return max(cal.spread, MIN_ERROR), "the spread of the runs the calibration was fitted on"
    return max(cal.residual, MIN_ERROR), "the calibration's residual on its runs"


def with_interval(plan: plan_pb2.Plan, cal: Calibration | None) -> plan_pb2.Plan:
    """The plan with its prediction's upper bound set and said in the explanation."""
    bound, why = error_bound(cal)
    plan.prediction.iteration_time_high_s = plan.prediction.iteration_time_s * (1 + bound)
    plan.explanation += (f"\nInterval: up to {plan.prediction.iteration_time_high_s:.4g} s/iteration (+{bound:.0%}, "
                         f"{why}); admission backfills only if the job ends in time at this bound.")
    return plan


def profile_note(profile: profile_pb2.Profile) -> str:
    """How far the profile's own figures can be trusted (issue 45): the spread of its layer times over their
    repeats, and whether the host was busy while it was measured; "" for a profile that recorded neither."""
    spreads = sorted(max(s.forward_spread, s.backward_spread) for layer in profile.layers for s in layer.samples
                     if s.measured and (s.forward_spread or s.backward_spread))
    parts = []
    if spreads:
        parts.append(f"its layer times spread {spreads[len(spreads) // 2]:.1%} (median; worst {spreads[-1]:.1%}) "
                     "over their repeats")
    rows = [s for layer in profile.layers if layer.measured_as == layer.index for s in layer.samples if s.measured]
    if off := sorted(s.off_line for s in rows if s.off_line):
        parts.append(f"{len(off)} of {len(rows)} measured rows still off their layer's line after re-measuring "
                     f"(worst {off[-1]:.0%})")
    if profile.measure_passes:
        busy = (" -- the host stayed busy through a second pass: prefer a calibration from real runs to it"
                if profile.noisy else " (busy during the first pass, so measured twice)"
                if profile.measure_passes > 1 else "")
        parts.append(f"a fixed workload moved {profile.host_noise:.0%} over its measurement{busy}")
    return ("Profile: " + "; ".join(parts) + ".") if parts else ""


def _runnable(ctx: CostContext, options: SearchOptions, p: PricedPlan) -> bool:
    """Whether make_plan may choose `p`: it fits, the executors run its dims and layers, and it keeps a pinned
    depth or micro-batch count."""
    return (not p.out_of_memory and _runs_on(p, options.dims)
            and (not options.executable_only or plan_runs_on_workers(ctx, p))
            and options.pipeline_stages in (0, len(p.stage_bounds))
            and options.micro_batches in (0, p.num_micro_batches))


def _runs_on(plan: PricedPlan, dims: Sequence[str]) -> bool:
    """Every layer uses only dims and DP flavours the executors run (pipeline stages always run)."""
    return all(need in dims for st in plan.strategies for need in st.requires)


def _distinct(plans: Sequence[PricedPlan], best: PricedPlan) -> list[PricedPlan]:
    """Drop alternatives that repeat the chosen plan or one another (engines find the same plan twice)."""
    def key(p: PricedPlan) -> tuple:
        return (p.stage_bounds, p.strategies, p.replicas, p.micro_batch_size, p.num_micro_batches, p.schedule)

    seen = {key(best)}
    out = []
    for p in plans:
        if key(p) not in seen:
            seen.add(key(p))
            out.append(p)
    return out


def _check(profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, inputs: PlanInputs) -> None:
    if not profile.layers:
        raise InvalidArgument("profile has no layers", field="profile_id", fix="profile the model first")
    if fleet.nodes < 1 or fleet.devices_per_node < 1:
        raise InvalidArgument("fleet has no devices", field="fleet", fix="set nodes and devices_per_node >= 1")
    if not fleet.device.memory_bytes and not inputs.memory_budget_bytes:
        raise InvalidArgument("no device memory and no budget", field="memory_budget_bytes",
                              fix="set fleet.device.memory_bytes or memory_budget_bytes")
    if inputs.schedule and inputs.schedule not in SCHEDULE_FROM_PROTO:
        raise InvalidArgument(f"unknown schedule {inputs.schedule}", field="schedule", fix="GPIPE, 1F1B or VARUNA")
    devices = fleet.nodes * fleet.devices_per_node
    if inputs.pipeline_stages > min(devices, len(profile.layers)):
        raise InvalidArgument(f"{inputs.pipeline_stages} pipeline stages asked for {devices} device(s) and "
                              f"{len(profile.layers)} layers", field="pipeline_stages",
                              fix=f"use at most {min(devices, len(profile.layers))}, or 0 to let the search choose")
    if inputs.micro_batches and (not inputs.global_batch_size or inputs.engine == plan_pb2.PLAN_ENGINE_GALVATRON):
        raise InvalidArgument("a pinned micro-batch count is planned by the Varuna engine at a fixed global batch",
                              field="micro_batches", fix="set global_batch_size and leave the engine unset or "
                              "VARUNA, or set micro_batches to 0")
    if inputs.schedule == plan_pb2.SCHEDULE_HARMONY_WRAP:
        raise InvalidArgument("Harmony's wrap-around schedule is priced by the simulator but not yet searched",
                              field="schedule", fix="GPIPE, 1F1B or VARUNA")


def _check_batch(inputs: PlanInputs, devices: int, num_layers: int) -> None:
    """A fixed global batch must split into whole samples per device under some runnable configuration."""
    batch = inputs.global_batch_size
    dims = ("pp", *(ALL_DIMS if inputs.what_if else inputs.runnable_dims))
    if not batch or global_batch_fits(batch, devices, num_layers=num_layers, dims=dims):
        return
    near = nearest_global_batches(batch, devices, num_layers=num_layers, dims=dims)
    raise InvalidArgument(
        f"no configuration of {devices} devices running {'/'.join(dims)} splits a global batch of {batch} into "
        f"whole samples per device", field="global_batch_size",
        fix="use " + " or ".join(str(b) for b in near) if near else "use another fleet")


def _options(inputs: PlanInputs, budget: int) -> SearchOptions:
    if inputs.schedule:
        schedules: tuple[Schedule, ...] = (SCHEDULE_FROM_PROTO[inputs.schedule],)
    else:
        schedules = (Schedule.ONE_F_ONE_B, Schedule.GPIPE)
    return SearchOptions(
        memory_budget_bytes=budget,
        global_batch_size=inputs.global_batch_size or None,
        max_global_batch_size=inputs.max_global_batch_size,
        schedules=schedules,
        dims=ALL_DIMS if inputs.what_if else inputs.runnable_dims,
        executable_only=not inputs.what_if,
        top_k=inputs.top_k,
        pipeline_stages=inputs.pipeline_stages,
        micro_batches=inputs.micro_batches,
        exact_stages=inputs.exact_stages,
    )


def _pinned_offload(ctx: CostContext, profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, inputs: PlanInputs,
                    budget: int) -> plan_pb2.Plan:
    """The engine asked for is an offload one (PatrickStar's chunks, Harmony's swap schedule): plan with it alone,
    whether or not the model would fit in device memory."""
    harmony = inputs.engine == plan_pb2.PLAN_ENGINE_HARMONY
    name = "Harmony's swap schedule (PARALLEL_DIM_HARMONY)" if harmony else "chunk offload (PARALLEL_DIM_CHUNKS)"
    if not (inputs.what_if or (inputs.harmony if harmony else inputs.offload)):
        raise FailedPrecondition(f"engine {plan_pb2.PlanEngine.Name(inputs.engine)}: the executors do not run "
                                 f"{name}", field="engine", fix="leave the engine unset, or plan with --what-if")
    batch = inputs.global_batch_size or fleet.nodes * fleet.devices_per_node
    why = f"engine {plan_pb2.PlanEngine.Name(inputs.engine)} was asked for"
    chosen = offload.plan(ctx, profile, fleet, batch, budget, why, chunks=not harmony, harmony=harmony,
                          calibration_note=inputs.calibration_note, pinned=True)
    if isinstance(chosen, plan_pb2.Plan):
        return with_interval(chosen, ctx.calibration)
    raise FailedPrecondition(why + chosen, field="engine", fix="raise the budget or leave the engine unset")


def _run_engines(ctx: CostContext, devices: int, options: SearchOptions, inputs: PlanInputs) -> list[PricedPlan]:
    want = inputs.engine
    plans: list[PricedPlan] = []
    if want in (plan_pb2.PLAN_ENGINE_UNSPECIFIED, plan_pb2.PLAN_ENGINE_GALVATRON) and not options.micro_batches:
        plans += galvatron.search(ctx, devices, options)  # a pinned Nm is Varuna's to plan
    if want in (plan_pb2.PLAN_ENGINE_UNSPECIFIED, plan_pb2.PLAN_ENGINE_VARUNA):
        batch = options.global_batch_size or next((p.global_batch_size for p in plans if not p.out_of_memory), 0)
        if batch:
            schedule = Schedule.VARUNA if not inputs.schedule else SCHEDULE_FROM_PROTO[inputs.schedule]
            # Varuna's plans below the hybrid search's k-th best runnable one would never be shown: not priced.
            ahead = sorted((p.throughput for p in plans if _runnable(ctx, options, p)), reverse=True)
            floor = ahead[options.top_k - 1] if len(ahead) >= max(1, options.top_k) else 0.0
            try:
                plans += varuna.configure(ctx, devices, batch, options, schedule=schedule, floor=floor)
            except InvalidArgument:
                # Varuna needs D to divide the batch; the hybrid search may still have split it.
                if want == plan_pb2.PLAN_ENGINE_VARUNA or not any(not p.out_of_memory for p in plans):
                    raise
        elif want == plan_pb2.PLAN_ENGINE_VARUNA:
            raise InvalidArgument("Varuna configures a fixed global batch", field="global_batch_size",
                                  fix="set global_batch_size")
    if want not in (plan_pb2.PLAN_ENGINE_UNSPECIFIED, plan_pb2.PLAN_ENGINE_GALVATRON, plan_pb2.PLAN_ENGINE_VARUNA):
        raise InvalidArgument(f"engine {plan_pb2.PlanEngine.Name(want)} is not a search engine", field="engine",
                              fix="GALVATRON, VARUNA, HARMONY, PATRICKSTAR or unspecified")
    return plans


def _nothing_fits(ctx: CostContext, fleet: fleet_pb2.Fleet, options: SearchOptions) -> str:
    """Name the smallest per-device memory, or device count, at which the leanest plan fits."""
    devices = fleet.nodes * fleet.devices_per_node
    lean = replace(options, global_batch_size=devices, batch_radius=0, max_global_batch_size=devices, dims=ALL_DIMS,
                   checkpoint=(True,), memory_budget_bytes=1 << 62)
    need = [p for p in baseline_engine.baselines(ctx, devices, lean) if p.peak_memory_bytes]
    smallest = min((max(p.peak_memory_bytes) for p in need), default=0)
    text = (f"no plan fits {_size(options.memory_budget_bytes)} per device on {devices} devices "
            f"even fully sharded and checkpointed at one sample per device")
    if smallest:
        text += f"; the leanest plan needs {_size(smallest)} per device"
    more = _devices_needed(ctx, fleet, lean, options.memory_budget_bytes)
    if more:
        text += f", or about {more} devices at this budget"
    return text


def _devices_needed(ctx: CostContext, fleet: fleet_pb2.Fleet, lean: SearchOptions, budget: int) -> int:
    """Smallest multiple of a node (up to 64 nodes) at which a ZeRO-3 checkpointed plan fits `budget`."""
    per_node = fleet.devices_per_node
    for nodes in range(fleet.nodes + 1, 65):
        bigger = fleet_pb2.Fleet()
        bigger.CopyFrom(fleet)
        bigger.nodes = nodes
        if not bigger.HasField("inter_node") or not bigger.inter_node.bandwidth_bytes_per_s:
            bigger.inter_node.CopyFrom(fleet_pb2.Link(kind=fleet_pb2.LINK_KIND_INFINIBAND,
                                                      bandwidth_bytes_per_s=25e9, latency_s=5e-6))
        wide = CostContext(ctx.view, FleetView.from_fleet(bigger), ctx.options)
        one_each = replace(lean, global_batch_size=nodes * per_node, max_global_batch_size=nodes * per_node)
        zero = baseline_engine.best_baseline(wide, "ZeRO-3", nodes * per_node, one_each)
        if zero.peak_memory_bytes and max(zero.peak_memory_bytes) <= budget:
            return nodes * per_node
    return 0


def breakdown(ctx: CostContext, plan: PricedPlan) -> Breakdown:
    """Cost terms of the plan's slowest stage over one iteration."""
    pipe = build_pipeline(ctx.view, None, plan.stage_bounds, plan.strategies, plan.micro_batch_size,
                          plan.num_micro_batches, replicas=plan.replicas, context=ctx)
    nm = plan.num_micro_batches
    last = len(plan.stage_bounds) - 1
    terms = []
    for s, ((b, e), stage) in enumerate(zip(plan.stage_bounds, pipe.stages, strict=True)):
        costs = stage_layer_costs(ctx, b, e, plan.strategies, plan.micro_batch_size)
        # The last stage runs a micro-batch's backward right after its forward and skips the recompute
        # (every micro-batch under 1F1B and Varuna, the last one under GPipe), as the simulator does.
        recomputed = nm if s != last else (nm - 1 if plan.schedule is Schedule.GPIPE else 0)
        terms.append(Breakdown(
            compute_s=nm * sum(c.forward_compute_s + c.backward_compute_s for c in costs)
            + recomputed * sum(c.recompute_compute_s for c in costs),
            recompute_s=recomputed * sum(c.recompute_compute_s for c in costs),
            tp_comm_s=nm * sum(c.tp_comm_s for c in costs),
            sdp_comm_s=nm * sum(c.sdp_comm_s for c in costs),
            grad_sync_s=stage.allreduce_s,  # in-stage DP/SDP sync and the sync across pipeline replicas
            bubble_fraction=plan.bubble_fraction,
        ))
    return max(terms, key=lambda t: t.compute_s + t.tp_comm_s + t.sdp_comm_s + t.grad_sync_s)


def explain(
    ctx: CostContext,
    best: PricedPlan,
    runner_up: PricedPlan | None,
    base: Sequence[PricedPlan],
    budget: int,
    inputs: PlanInputs,
) -> str:
    """Why this plan: what it is, what it costs, what made it beat the runner-up, and the baselines."""
    lines = [
        f"Chosen: {_label(best)} ({best.engine}{'' if best.engine != 'baseline' else ': ' + best.name}), "
        f"global batch {best.global_batch_size} = {best.micro_batch_size} x {best.num_micro_batches} micro-batches"
        f"{f' x {best.replicas} replicas' if best.replicas > 1 else ''}, {best.schedule.value}.",
        f"Predicted {best.iteration_s:.4g} s per iteration, {best.throughput:.4g} samples/s, "
        f"peak {_size(max(best.peak_memory_bytes))} of a {_size(budget)} budget.",
    ]
    terms = breakdown(ctx, best)
    lines.append("Slowest stage per iteration: " + _terms(terms) + ".")
    if runner_up is not None:
        gain = best.throughput / runner_up.throughput - 1 if runner_up.throughput else math.inf
        other = breakdown(ctx, runner_up)
        lines.append(
            f"Runner-up: {_label(runner_up)} ({runner_up.engine}) at {runner_up.throughput:.4g} samples/s "
            f"({gain:+.1%} for the chosen plan); its slowest stage: {_terms(other)}."
        )
        lines.append("What decided it: " + _decisive(terms, other, best, runner_up) + ".")
    fits = [b for b in base if not b.out_of_memory]
    if fits:
        top = max(fits, key=lambda b: b.throughput)
        lines.append(f"Best baseline: {top.name} at {top.throughput:.4g} samples/s "
                     f"(chosen plan {best.throughput / top.throughput:.2f}x).")
    oom = [b.name for b in base if b.out_of_memory]
    if oom:
        lines.append("Out of memory at this budget: " + ", ".join(oom) + ".")
    flavours = _flavour_note(ctx, best, budget)
    if flavours:
        lines.append(flavours)
    hybrid = _hybrid_note(ctx, best, budget, not inputs.what_if)
    if hybrid:
        lines.append(hybrid)
    blocked = _not_executable(best, inputs)
    if blocked:
        lines.append(blocked)
    if ctx.calibration is not None:
        lines.append(f"{CALIBRATED}: {inputs.calibration_note or ctx.calibration.host_class} "
                     f"({ctx.calibration.describe()}).")
    elif inputs.calibration is not None:
        lines.append(f"Not calibrated: {inputs.calibration_note or 'the calibration'} is for host class "
                     f"{inputs.calibration.host_class}, not {ctx.fleet.device_kind}.")
    return "\n".join(lines)


_size = offload.human_bytes


def _terms(t: Breakdown) -> str:
    return (f"compute {t.compute_s:.4g} s (recompute {t.recompute_s:.4g} s), TP comm {t.tp_comm_s:.4g} s, "
            f"SDP comm {t.sdp_comm_s:.4g} s, gradient sync {t.grad_sync_s:.4g} s, bubble {t.bubble_fraction:.1%}")


def _decisive(a: Breakdown, b: Breakdown, pa: PricedPlan, pb: PricedPlan) -> str:
    """The cost term with the largest difference in the chosen plan's favour (or the batch size)."""
    diffs = {
        "less compute on the slowest stage": b.compute_s - a.compute_s,
        "less recompute": b.recompute_s - a.recompute_s,
        "less tensor-parallel communication": b.tp_comm_s - a.tp_comm_s,
        "less sharded-data-parallel communication": b.sdp_comm_s - a.sdp_comm_s,
        "less gradient synchronisation": b.grad_sync_s - a.grad_sync_s,
    }
    name, saved = max(diffs.items(), key=lambda kv: kv[1])
    material = 1e-3 * max(a.compute_s, b.compute_s, 1e-12)  # below 0.1% of compute is rounding, not a reason
    reasons = [f"{name} ({saved:.4g} s)"] if saved > material else []
    if pa.global_batch_size != pb.global_batch_size:
        reasons.append(f"batch {pa.global_batch_size} against {pb.global_batch_size}")
    if a.bubble_fraction < b.bubble_fraction - 1e-3:
        reasons.append(f"bubble {a.bubble_fraction:.1%} against {b.bubble_fraction:.1%}")
    if not reasons:
        return "nothing material: the two price within rounding of each other (either would do)"
    return "; ".join(reasons)


def _flavour_note(ctx: CostContext, plan: PricedPlan, budget: int) -> str:
    """Which layers run a ZeRO flavour, what each shards, and the plan's peak with those layers as plain DP."""
    sharded = [st for st in plan.strategies if st.sharded]
    if not sharded:
        return ""
    parts = [f"{name} on {n} of {len(plan.strategies)} layers ({what} sharded over their dp replicas)"
             for zero, (name, what) in ZERO_NAMES.items() if (n := sum(st.dp_sharding is zero for st in sharded))]
    plain = price(ctx, plan.stage_bounds, [replace(st, dp_sharding=DpSharding.PLAIN) for st in plan.strategies],
                  plan.micro_batch_size, plan.num_micro_batches, plan.schedule, budget, replicas=plan.replicas)
    return (f"DP flavours: {', '.join(parts)}, updated parameters all-gathered after each step; as plain DP it "
            f"would peak at {_size(max(plain.peak_memory_bytes))} ({'over' if plain.out_of_memory else 'within'} "
            f"the budget) against {_size(max(plan.peak_memory_bytes))}, at {plain.iteration_s:.4g} s per iteration.")


def _hybrid_note(ctx: CostContext, plan: PricedPlan, budget: int, executable_only: bool) -> str:
    """Which layers run TP or SDP, what the plan would cost with them as plain DP over the same devices, and
    which layers the workers could not split (the reason the search left them DP)."""
    hybrid = [(i, st) for i, st in enumerate(plan.strategies) if st.tp > 1 or st.sdp > 1]
    if not hybrid:
        return ""
    names = ctx.view.layers
    by_kind: dict[str, list[str]] = {}
    for i, st in hybrid:
        by_kind.setdefault(st.describe(), []).append(names[i].name)
    parts = [f"{kind} on {_layer_names(found)}" for kind, found in by_kind.items()]
    as_dp = [replace(st, dp=st.devices, sdp=1, tp=1, order=(), dp_sharding=DpSharding.PLAIN)
             if st.tp > 1 or st.sdp > 1 else st for st in plan.strategies]
    dp = price(ctx, plan.stage_bounds, as_dp, plan.micro_batch_size, plan.num_micro_batches, plan.schedule,
               budget, replicas=plan.replicas)
    text = (f"Hybrid layers: {'; '.join(parts)}. With those layers as plain DP over the same devices the plan "
            f"would peak at {_size(max(dp.peak_memory_bytes))} ({'over' if dp.out_of_memory else 'within'} the "
            f"budget) at {dp.iteration_s:.4g} s per iteration, against {_size(max(plan.peak_memory_bytes))} at "
            f"{plan.iteration_s:.4g} s.")
    if any(st.sequence_parallel for st in plan.strategies):
        plain_tp = price(ctx, plan.stage_bounds, [replace(st, sequence_parallel=False) for st in plan.strategies],
                         plan.micro_batch_size, plan.num_micro_batches, plan.schedule, budget, replicas=plan.replicas)
        text += (f" Sequence parallelism (+sp) splits those TP layers' activations by sequence: without it the plan "
                 f"would peak at {_size(max(plain_tp.peak_memory_bytes))} at {plain_tp.iteration_s:.4g} s.")
    if executable_only:
        kept = [lv.name for lv in names if lv.tied_with or not lv.tensor_parallel]
        if kept:
            text += (f" Not offered TP (the workers split attention + MLP blocks only, and no tied weight): "
                     f"{_layer_names(kept)}.")
    return text


def _layer_names(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]} ({len(names)} layers)"


def _not_executable(plan: PricedPlan, inputs: PlanInputs) -> str:
    needed = sorted({d for s in plan.strategies for d in s.requires} - set(inputs.runnable_dims))
    if not needed:
        return ""
    return (f"Not yet executable on this fleet: {', '.join(d.upper() for d in needed)} "
            f"(executors run {', '.join(d.upper() for d in inputs.runnable_dims) or 'pipeline only'}); "
            "what-if plan.")


def _label(p: PricedPlan) -> str:
    kinds = sorted({s.describe() for s in p.strategies})
    shown = ", ".join(kinds[:3]) + (f" (+{len(kinds) - 3} more)" if len(kinds) > 3 else "")
    return f"PP{len(p.stage_bounds)} [{shown}]"


def _prediction(p: PricedPlan) -> plan_pb2.Prediction:
    return plan_pb2.Prediction(
        iteration_time_s=p.iteration_s if math.isfinite(p.iteration_s) else 0.0,
        throughput_samples_per_s=p.throughput,
        peak_memory_bytes=max(p.peak_memory_bytes, default=0),
        bubble_fraction=p.bubble_fraction,
        out_of_memory=p.out_of_memory,
    )


def _alternative(p: PricedPlan, name: str) -> plan_pb2.PlanAlternative:
    return plan_pb2.PlanAlternative(
        name=name, engine=ENGINE[p.engine], prediction=_prediction(p), global_batch_size=p.global_batch_size,
        reason=p.reason,
    )


def _to_proto(
    ctx: CostContext, profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, p: PricedPlan, budget: int
) -> plan_pb2.Plan:
    plan = plan_pb2.Plan(
        model_id=profile.model_id, profile_id=profile.id, engine=ENGINE[p.engine], version=1,
        global_batch_size=p.global_batch_size, micro_batch_size=p.micro_batch_size,
        num_micro_batches=p.num_micro_batches, schedule=SCHEDULE[p.schedule], prediction=_prediction(p),
        memory_budget_bytes=budget,
    )
    plan.fleet.CopyFrom(fleet)
    # Varuna's D pipeline replicas are, per stage, a D-way data-parallel group: the plan states them as
    # dp x D on every layer with the micro-batch of all D replicas, which is how executors build them.
    # (Varuna's strategies are plain DP, so no ZeRO flavour is stretched over the D replicas here.)
    strategies = [
        replace(st, dp=st.dp * p.replicas, order=st.order if st.dp > 1 or p.replicas == 1 else ("dp", *st.order))
        for st in p.strategies
    ]
    plan.micro_batch_size = p.micro_batch_size * p.replicas
    for s, (b, e) in enumerate(p.stage_bounds):
        costs = stage_layer_costs(ctx, b, e, p.strategies, p.micro_batch_size)
        plan.stages.append(plan_pb2.Stage(
            index=s, layer_begin=b, layer_end=e, devices=strategies[b].devices,
            predicted_time_s=sum(c.per_micro_batch_s for c in costs),
            predicted_peak_memory_bytes=p.peak_memory_bytes[s],
        ))
        for i in range(b, e):
            plan.layers.append(strategies[i].to_proto(i, s))
    return plan
