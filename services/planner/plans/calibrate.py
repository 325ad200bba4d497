"""From stored runs to a fleet calibration (cost/calibration.py), and the host class a plan runs on.

A run is one plan version of a job as it trained: its iteration metrics (per iteration, stage and replica)
beside the cost model's *uncalibrated* stage costs for that plan (recomputed here, so a plan priced with an
earlier calibration is not compared with itself). Per stage, the medians over the steady iterations (after
WARMUP) are what `calibration.fit` reads. After the stage parts are fitted, each run is simulated with them
and what the measured iteration still exceeds the simulation by is split into a fixed cost per iteration and one
per micro-batch (`unexplained`): the part of the iteration no stage part explains. No I/O: protos in, dataclasses out.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ballast.v1 import fleet_pb2, job_pb2, plan_pb2, profile_pb2
from ballast.windows import first_iteration, weight, weighted_median
from services.planner.cost.calibration import MIN_SPREAD, Calibration, HostClass, Observation, apply, fit
from services.planner.cost.context import CostContext, CostOptions
from services.planner.cost.pipeline import build_pipeline
from services.planner.cost.profile_view import from_profile
from services.planner.cost.strategy import DpSharding, LayerStrategy
from services.planner.online.srp import RunningPlan
from services.planner.sim import Pipeline, SimOptions, simulate
from services.runtime.spread import robust_spread

PROBE_S = 1e-3  # a per-micro-batch cost added to every stage to see how much of it reaches a run's iteration
WARMUP = 3  # first iterations of a run left out: allocations, first-touch and the rendezvous make them slow
CORES_LABEL = "cpu_cores"  # host label the agents report their CPU core count under


@dataclass(frozen=True)
class Run:
    """One plan of one job with the metrics it reported under that plan."""

    job_id: str
    profile: profile_pb2.Profile
    plan: plan_pb2.Plan
    metrics: Sequence[job_pb2.IterationMetric]


def host_class(fleet: fleet_pb2.Fleet, hosts: Sequence[fleet_pb2.Host], devices: int) -> HostClass:
    """The class of host a plan for `devices` of `fleet` runs on: its device kind, the fewest CPU cores the
    online hosts of that kind report, and how many of its devices share one machine (agents reporting the
    same address share it: several CPU agents on one box compete for its cores)."""
    kind = fleet.device.kind
    same = [h for h in hosts if any(d.spec.kind == kind for d in h.devices)]
    cores = [int(h.labels[CORES_LABEL]) for h in same if h.labels.get(CORES_LABEL, "").isdigit()]
    per_machine: dict[str, int] = defaultdict(int)
    for h in same:
        per_machine[h.address or h.id] += sum(1 for d in h.devices if d.spec.kind == kind)
    biggest = max(per_machine.values(), default=fleet.devices_per_node or 1)
    return HostClass(kind, min(cores, default=0), max(1, min(devices or biggest, biggest)))


def uncalibrated(profile: profile_pb2.Profile, plan: plan_pb2.Plan) -> tuple[Pipeline, RunningPlan]:
    """The cost model's pipeline for `plan` as the executors run it (gradient sync after the last backward; a
    stage's D replicas on consecutive ranks, as its DP group; each layer's DP flavour, ZeRO-1/2 included),
    without any calibration. Raises ValueError for plans the executors do not run (TP, SDP)."""
    view = from_profile(profile)
    run = RunningPlan.from_plan(plan, len(view))
    flavour = {x.layer_index: LayerStrategy.from_proto(x).dp_sharding for x in plan.layers}
    strategies = [LayerStrategy(dp=run.replicas, dp_sharding=flavour.get(i, DpSharding.PLAIN), checkpoint=c, swap=s)
                  for i, (c, s) in enumerate(zip(run.checkpoint, run.swap, strict=True))]
    ctx = CostContext(view, plan.fleet, CostOptions(overlap_grad_sync=False, zero2_reduce_scatter_per_layer=False))
    pipe = build_pipeline(view, None, run.bounds, strategies, run.micro_batch_size * run.replicas,
                          run.num_micro_batches, context=ctx)
    return pipe, run


def steady_iteration_times(metrics: Iterable[job_pb2.IterationMetric], version: int, warmup: int = 0) -> list[float]:
    """Each iteration's time under plan `version` in iteration order (an iteration lasts as long as its slowest
    rank), its first `warmup` iterations left out. A row summarising a window of iterations stands for each of
    them at its mean (the agents send a run's first iterations one by one, so a warm-up of up to
    telemetry.WARMUP leaves out exactly those)."""
    by_iteration: dict[int, float] = defaultdict(float)
    weights: dict[int, int] = defaultdict(int)
    for m in metrics:
        if m.plan_version == version:
            by_iteration[m.iteration] = max(by_iteration[m.iteration], m.iteration_time_s)
            weights[m.iteration] = max(weights[m.iteration], weight(m))
    return [t for i, t in sorted(by_iteration.items()) for _ in range(weights[i])][warmup:]


def measured_iteration_s(metrics: Iterable[job_pb2.IterationMetric], version: int, warmup: int = 0) -> float:
    """The median of steady_iteration_times; 0 when none is left."""
    steady = steady_iteration_times(metrics, version, warmup)
    return statistics.median(steady) if steady else 0.0


def _median(rows: Sequence[job_pb2.IterationMetric], field: str) -> float:
    """The median over the iterations the rows cover (a window's row counts once per iteration)."""
    return weighted_median((float(getattr(r, field)), weight(r)) for r in rows)


def observations(run: Run) -> tuple[list[Observation], float]:
    """Per stage observations of one run, and its measured median iteration time (0: too few iterations)."""
    pipe, decoded = uncalibrated(run.profile, run.plan)
    steady = [m for m in run.metrics if m.plan_version == run.plan.version]
    first = min((first_iteration(m) for m in steady), default=0)
    steady = [m for m in steady if first_iteration(m) >= first + WARMUP]
    if not steady:
        return [], 0.0
    # the simulator's peaks, as the plan predicted them (the static rule assumes Varuna's worst case, every
    # micro-batch in flight, where a one-stage pipeline frees each after its backward)
    peaks = simulate(pipe, SimOptions(schedule=decoded.schedule, keep_timeline=False)).peak_memory_bytes
    out = []
    for s, stage in enumerate(pipe.stages):
        rows = [m for m in steady if m.stage_index == s]
        if not rows:
            return [], 0.0
        out.append(Observation(
            predicted=stage, num_micro_batches=decoded.num_micro_batches,
            forward_s=_median(rows, "forward_s"), backward_s=_median(rows, "backward_s"),
            allreduce_s=_median(rows, "allreduce_s"), optimizer_s=_median(rows, "optimizer_s"),
            # drawing the samples is per-iteration time the cost model prices nowhere else, as the rest is
            overhead_s=weighted_median((r.overhead_s + r.data_s, weight(r)) for r in rows),
            peak_memory_bytes=int(_median(rows, "peak_memory_bytes")),
            predicted_peak_memory_bytes=peaks[s], iterations=sum({m.iteration: weight(m) for m in rows}.values())))
    return out, measured_iteration_s(steady, run.plan.version)


def simulated_s(profile: profile_pb2.Profile, plan: plan_pb2.Plan, cal: Calibration | None) -> float:
    """The plan's iteration time with `cal` applied to its stages (None: the profile alone)."""
    pipe, decoded = uncalibrated(profile, plan)
    if cal is not None:
        pipe = replace(pipe, stages=tuple(apply(s, cal) for s in pipe.stages))
    return simulate(pipe, SimOptions(schedule=decoded.schedule, keep_timeline=False)).iteration_s


def unexplained(cal: Calibration, measured: Sequence[tuple[Run, float]]) -> Calibration:
    """`cal` with what the fitted stage parts leave of each measured iteration: a fixed cost per iteration and,
    where the runs differ in how many micro-batches cross their critical path, one per micro-batch (time in no
    measured part that grows with Nm: the schedule loop, the loss, posting receives).

    Each run's gap is measured - simulated; its sensitivity to a per-micro-batch cost is how much the simulation
    grows when every stage's forward gains one (Nm for one stage, about Nm + S - 1 for a pipeline). Two runs at
    Nm 2 and 8 then meet both measurements, where one median gap met neither (a 1x1 class fitted on those two
    alone priced its own Nm 8 run 10% high). The per-micro-batch part may be negative only down to the forward's
    own fixed part, so a calibrated micro-batch never costs less than its scaled compute."""
    base = [simulated_s(r.profile, r.plan, cal) for r, _ in measured]
    gaps = [m - b for (_, m), b in zip(measured, base, strict=True)]
    step = replace(cal, forward_fixed_s=cal.forward_fixed_s + PROBE_S)
    reach = [(simulated_s(r.profile, r.plan, step) - b) / PROBE_S for (r, _), b in zip(measured, base, strict=True)]
    per_iteration = max(statistics.median(gaps), 0.0)
    if len(measured) < 2 or max(reach) - min(reach) < MIN_SPREAD * max(reach):
        return replace(cal, iteration_fixed_s=per_iteration)
    mr, mg = statistics.fmean(reach), statistics.fmean(gaps)
    per_micro_batch = sum((k - mr) * (g - mg) for k, g in zip(reach, gaps, strict=True)) / sum(
        (k - mr) ** 2 for k in reach)
    per_micro_batch = max(per_micro_batch, -cal.forward_fixed_s)
    per_iteration = mg - per_micro_batch * mr
    if per_iteration < 0:  # the line crosses zero: all of it per micro-batch, through the origin
        per_iteration = 0.0
        per_micro_batch = max(sum(k * g for k, g in zip(reach, gaps, strict=True)) / sum(k * k for k in reach),
                              -cal.forward_fixed_s)
    return replace(cal, forward_fixed_s=cal.forward_fixed_s + per_micro_batch, iteration_fixed_s=per_iteration)


def calibrate(runs: Sequence[Run], cls: HostClass) -> tuple[Calibration, float, float]:
    """(the calibration, mean absolute relative error of the iteration time before it, after it) over `runs`."""
    stage_obs: list[Observation] = []
    measured: list[tuple[Run, float]] = []
    for run in runs:
        found, iteration_s = observations(run)
        if found and iteration_s > 0:
            stage_obs.extend(found)
            measured.append((run, iteration_s))
    cal = fit(stage_obs, cls)
    if not measured:
        return cal, 0.0, 0.0
    cal = unexplained(cal, measured)
    before = statistics.fmean(abs(simulated_s(r.profile, r.plan, None) - m) / m for r, m in measured)
    after = statistics.fmean(abs(simulated_s(r.profile, r.plan, cal) - m) / m for r, m in measured)
    return cal, before, after



def offload_kind(plan: plan_pb2.Plan) -> str:
    """"harmony" or "chunks" for a plan whose time is its offload estimator's (cost/harmony.py, cost/offload.py);
    "" for a pipeline plan, which the stage fit prices."""
    return "harmony" if plan.HasField("harmony") else "chunks" if plan.HasField("offload") else ""


def estimated_s(plan: plan_pb2.Plan) -> float:
    """The offload estimator's uncalibrated iteration time the plan recorded (0: a plan from before it did)."""
    return plan.harmony.predicted_iteration_s if plan.HasField("harmony") else plan.offload.predicted_iteration_s


def offload_ratios(runs: Sequence[Run]) -> list[tuple[float, float]]:
    """(the estimator's time, the measured median steady iteration) of each offload run that has both."""
    out = []
    for r in runs:
        measured = measured_iteration_s(r.metrics, r.plan.version, WARMUP)
        if estimated_s(r.plan) > 0 and measured > 0:
            out.append((estimated_s(r.plan), measured))
    return out


def offload_error(pairs: Sequence[tuple[float, float]], scale: float) -> float:
    """Mean absolute relative error of `scale` x the estimator's time over (estimate, measured) pairs."""
    return statistics.fmean(abs(scale * e - m) / m for e, m in pairs) if pairs else 0.0


def from_proto(found: plan_pb2.Calibration) -> Calibration:
    """The cost model's calibration from a stored one."""
    return Calibration(
        host_class=found.host_class, forward_scale=found.forward_scale, forward_fixed_s=found.forward_fixed_s,
        backward_scale=found.backward_scale, backward_fixed_s=found.backward_fixed_s,
        allreduce_scale=found.allreduce_scale, update_scale=found.update_scale,
        iteration_fixed_s=found.iteration_fixed_s, memory_scale=found.memory_scale,
        memory_fixed_bytes=found.memory_fixed_bytes, iterations=found.iterations, residual=found.residual,
        spread=found.run_spread, harmony_scale=found.harmony_scale, chunks_scale=found.chunks_scale)


def error_of(cal: Calibration | None, runs: Sequence[Run]) -> float:
    """Mean absolute relative error of `cal`'s iteration time over `runs` (None: uncalibrated); 0 without any."""
    measured = [(r, m) for r in runs if (m := observations(r)[1]) > 0]
    if not measured:
        return 0.0
    return statistics.fmean(abs(simulated_s(r.profile, r.plan, cal) - m) / m for r, m in measured)


def run_spread(runs: Sequence[Run]) -> float:
    """The median over `runs` of each one's robust coefficient of variation of its steady iteration times
    (1.4826 x MAD / median): how noisy the host was while they ran."""
    spreads = []
    for r in runs:
        times = steady_iteration_times(r.metrics, r.plan.version, WARMUP)
        if len(times) >= 3:
            spreads.append(robust_spread(times, statistics.median(times)))
    return statistics.median(spreads) if spreads else 0.0


def to_proto(cal: Calibration, cls: HostClass, job_ids: Sequence[str], before: float,
             after: float, spread: float = 0.0) -> plan_pb2.Calibration:
    """A stored calibration: `residual` is the iteration time's mean absolute relative error after it over the
    runs it was fitted on, `residual_before` the uncalibrated one."""
    return plan_pb2.Calibration(
        host_class=cls.key, device_kind=cls.device_kind, cores=cls.cores, colocated=cls.colocated,
        forward_scale=cal.forward_scale, forward_fixed_s=cal.forward_fixed_s, backward_scale=cal.backward_scale,
        backward_fixed_s=cal.backward_fixed_s, allreduce_scale=cal.allreduce_scale, update_scale=cal.update_scale,
        iteration_fixed_s=cal.iteration_fixed_s, memory_scale=cal.memory_scale,
        memory_fixed_bytes=cal.memory_fixed_bytes, iterations=cal.iterations, residual=after,
        residual_before=before, job_ids=list(job_ids), run_spread=spread, harmony_scale=cal.harmony_scale,
        chunks_scale=cal.chunks_scale,
        notes=f"fitted on {len(job_ids)} run(s) (their iteration times spread {spread:.1%}); iteration time error "
              f"{before:.1%} -> {after:.1%}")
