"""vPipe's SRP planner: swap, recompute and repartition of a running plan (pure: no I/O, deterministic).

`propose(profile, fleet, plan, observation, options)` answers whether the running plan should change, and
to what, from what the training monitor measured. vPipe §4 decomposes the problem: a global partition
problem (which layers on which stage) and, for a fixed partition, a local memory problem per stage
(which layers swap or recompute their activations). Here:

Calibration (measured against modelled). The profile is priced through the shared cost model as the
planner prices plans (CostContext/build_pipeline with the plan's micro-batch, micro-batches, replicas and
schedule; the gradient sync after the last backward, as executors run it). Two corrections come from
the observation:

* Layers not in the observation's active set (switched off on the executor) cost nothing: zero forward,
  backward and recompute, no activations; they keep their parameters, gradients and optimizer state, and
  their output still crosses a cut (the next layer reads it).
* Per stage, factor_s = measured compute_s / modelled busy_s, both per iteration: measured is the
  monitor's forward + backward (backward includes recompute), modelled is the simulator's compute on the
  stage's device for the current partition with the inactive layers zeroed. Every layer's forward,
  backward and recompute are multiplied by the factor of the stage it was measured on, and keep it when
  it moves (a moved layer is priced with its source factor: a slow layer stays slow wherever it goes;
  this is the conservative choice against flapping, since a factor that really belongs to the device
  would make the move look less good, not better). Factors are clamped to [1/max_calibration,
  max_calibration]; a stage with no modelled or measured compute gets the mean factor of the others.
* Memory: per stage, the measured peak beyond the modelled peak (allocator slack, workspaces the profile
  missed) is kept as a resident offset of that stage's devices (it stays with the device, whatever
  layers it then holds); a model that over-predicts is not lowered.

The calibrated current plan, simulated, is `predicted_before_s`; the decision also reports `measured_s`
(the monitor's median iteration time) so a caller can see how well the calibration reproduces it
(communication and bubbles are not calibrated, only compute).

Local swap/recompute (vPipe Algorithm 2, Harmony §4 for the swap cost). For a stage over the memory
budget (stage peak by the cost model's formula, cost.pipeline.stage_peak_memory, plus its offset), layers
are ranked by the memory they free: a swap when its transfer (activation bytes over the fleet's host link,
out after the forward and in before the backward: PCIe is full duplex, so the stage's total swapped bytes
per micro-batch in each direction) stays within `swap_hide_fraction` of the stage's compute per
micro-batch (it hides; largest gain first), else the recompute with the most bytes freed per second of
recompute per iteration, else a swap that does not hide (largest gain). Flags are added until the stage
fits. A stage that fits with room may drop flags (`relax_memory_policy`): the recompute (or swap) that
costs the most time first, while the stage still fits. The simulator prices swaps for real (host-link
queues and prefetch, sim.fixed), so the ranking rule is only a heuristic; the price is the simulator's.

Global repartition: kl.repartition (bottleneck migration, then Kernighan-Lin passes) over stage bounds,
every candidate partition being local-policy'd and priced by build_pipeline + simulate. Cuts are priced
with every tensor crossing them (cost.stage.cut_bytes over ModelView.crossing: T5's relayed encoder
output as well as the neighbour's output).

Acceptance: the best candidate must fit the budget and predict at least `margin` more throughput than the
calibrated current plan (raised to the window's measurement noise, Observation.noise, when that is larger;
and save `min_gain_s` per iteration), unless the current plan is over budget,
in which case any fitting candidate is taken (a fix, not an optimisation). A pipeline whose measured
imbalance is under `imbalance_threshold`, with no workload change and no memory problem, is left alone
without searching. The margin is what stops flapping: the plan a decision produces is a local optimum of
the same search on the same physics, so its own predicted stats propose nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ballast.v1 import fleet_pb2, plan_pb2, profile_pb2
from services.planner.cost import (
    CostContext,
    CostOptions,
    LayerStrategy,
    ModelView,
    build_pipeline,
    from_profile,
    stage_cost,
    stage_peak_memory,
)
from services.planner.cost.pipeline import check_bounds
from services.planner.cost.profile_view import LayerTable, LayerView
from services.planner.online.kl import Bounds, moved_layers, repartition, stage_of
from services.planner.online.monitor import Observation
from services.planner.sim import Pipeline, Schedule, SimOptions, StageCost, simulate

GiB = float(1 << 30)
SCHEDULES = {
    plan_pb2.SCHEDULE_GPIPE: Schedule.GPIPE,
    plan_pb2.SCHEDULE_1F1B: Schedule.ONE_F_ONE_B,
    plan_pb2.SCHEDULE_VARUNA: Schedule.VARUNA,
}


@dataclass(frozen=True)
class OnlineOptions:
    """Knobs of the online repartitioner (module docstring)."""

    margin: float = 0.05  # predicted throughput gain needed over the calibrated current plan
    # Raise the margin to the observation's noise (a stage's compute half-range over its median): a gain the
    # measurements cannot tell from jitter would move layers back and forth on a busy host.
    noise_margin: bool = True
    min_gain_s: float = 0.0  # and at least this much less time per iteration
    max_moves: int = 4  # layers whose stage may change in one decision
    memory_budget_bytes: int = 0  # 0: the plan's budget, else the fleet device's memory
    imbalance_threshold: float = 0.05  # below it (no workload change, no memory problem): no search
    kl: bool = True  # Kernighan-Lin refinement after the bottleneck migration
    # Keep every tied weight on the stages holding it now: the executors cannot move one live (a partition that
    # needs it takes a restart from a checkpoint). False prices such partitions too.
    keep_tied_stages: bool = True
    relax_memory_policy: bool = True  # drop recompute/swap flags a stage no longer needs
    swap_hide_fraction: float = 0.8  # a swap may hide when its transfer fits in this share of the stage's compute
    swap_slowdown_tolerance: float = 0.01  # ... and it does when the simulated iteration grows by at most this
    calibrate_memory: bool = True  # keep measured-over-modelled peak memory as a per-stage offset
    max_calibration: float = 10.0  # clamp of per-stage compute factors
    cost: CostOptions = field(default_factory=lambda: CostOptions(overlap_grad_sync=False))

    def __post_init__(self) -> None:
        if self.margin < 0 or self.min_gain_s < 0 or self.max_moves < 0 or self.max_calibration < 1:
            raise ValueError("margin, min_gain_s and max_moves must be >= 0 and max_calibration >= 1")
        if not 0 < self.swap_hide_fraction or self.swap_slowdown_tolerance < 0:
            raise ValueError("swap_hide_fraction must be positive and swap_slowdown_tolerance >= 0")


@dataclass(frozen=True)
class Move:
    """One layer migrating between stages."""

    layer: int
    from_stage: int
    to_stage: int


@dataclass(frozen=True)
class Calibration:
    """How measurements corrected the cost model (module docstring)."""

    stage_factors: tuple[float, ...]  # measured / modelled compute, per current stage
    layer_factors: tuple[float, ...]  # per layer: its source stage's factor
    inactive_layers: tuple[int, ...]
    memory_offsets_bytes: tuple[int, ...]  # per stage, measured peak beyond the modelled one
    modelled_compute_s: tuple[float, ...]  # per stage per iteration, before calibration
    measured_compute_s: tuple[float, ...]


@dataclass(frozen=True)
class Candidate:
    """One priced configuration: partition, per-layer flags, simulated iteration."""

    bounds: Bounds
    checkpoint: tuple[bool, ...]
    swap: tuple[bool, ...]
    iteration_s: float
    busy_s: tuple[float, ...]  # per stage compute per iteration
    peak_memory_bytes: tuple[int, ...]
    fits: bool
    bubble_fraction: float
    stages: tuple[StageCost, ...]


@dataclass(frozen=True)
class Decision:
    """What the SRP planner proposes (or why it proposes nothing)."""

    accepted: bool
    reason: str
    stage_bounds: tuple[tuple[int, int], ...]  # proposed (the current ones when rejected)
    checkpoint_layers: tuple[int, ...]
    swap_layers: tuple[int, ...]
    moves: tuple[Move, ...]
    predicted_before_s: float  # the calibrated current plan, simulated
    predicted_after_s: float  # the proposal (the best candidate found, also when rejected)
    measured_s: float  # the monitor's median iteration time
    predicted_peak_memory_bytes: tuple[int, ...] = ()  # per stage, of the proposal
    memory_budget_bytes: int = 0
    calibration: Calibration | None = None
    new_plan: plan_pb2.Plan | None = None  # only when accepted

    @property
    def speedup(self) -> float:
        if self.predicted_after_s <= 0 or not math.isfinite(self.predicted_before_s):
            return 1.0
        return self.predicted_before_s / self.predicted_after_s


@dataclass(frozen=True)
class RunningPlan:
    """A plan as the executors run it: P stages x D replicas (DP x PP), per-layer flags."""

    bounds: Bounds
    checkpoint: tuple[bool, ...]
    swap: tuple[bool, ...]
    replicas: int
    micro_batch_size: int  # per replica
    num_micro_batches: int
    schedule: Schedule

    @classmethod
    def from_plan(cls, plan: plan_pb2.Plan, num_layers: int) -> RunningPlan:
        """Decode; ValueError names what the online planner cannot handle."""
        if not plan.stages:
            raise ValueError("the plan has no stages")
        bounds = check_bounds([(s.layer_begin, s.layer_end) for s in sorted(plan.stages, key=lambda s: s.index)],
                              num_layers)
        devices = {int(s.devices) or 1 for s in plan.stages}
        if len(devices) != 1:
            raise ValueError(f"stages use different device counts {sorted(devices)}")
        d = devices.pop()
        ck, sw = [False] * num_layers, [False] * num_layers
        for layer in plan.layers:
            if layer.tp > 1 or layer.sdp > 1 or (layer.dp or 1) != d:
                raise ValueError(f"layer {layer.layer_index} uses dp={layer.dp} sdp={layer.sdp} tp={layer.tp}; "
                                 f"the online planner handles pipeline x data parallel plans (dp = {d})")
            if layer.layer_index < num_layers:
                ck[layer.layer_index], sw[layer.layer_index] = layer.checkpoint, layer.swap_activations
        if plan.schedule not in SCHEDULES and plan.schedule != plan_pb2.SCHEDULE_UNSPECIFIED:
            raise ValueError(f"schedule {plan_pb2.Schedule.Name(plan.schedule)} is not repartitioned online")
        if plan.micro_batch_size < 1 or plan.micro_batch_size % d or plan.num_micro_batches < 1:
            raise ValueError(f"micro-batch {plan.micro_batch_size} x {plan.num_micro_batches} does not split "
                             f"over {d} replicas")
        return cls(bounds, tuple(ck), tuple(sw), d, plan.micro_batch_size // d, plan.num_micro_batches,
                   SCHEDULES.get(plan.schedule, Schedule.ONE_F_ONE_B))

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.replicas * self.num_micro_batches


# --- calibration -----------------------------------------------------------------------------------------


def scaled_view(view: ModelView, factors: Sequence[float], inactive: Sequence[int] = ()) -> ModelView:
    """`view` with each layer's times multiplied by its factor; inactive layers compute and stash nothing."""
    off = set(inactive)
    layers = []
    for layer, f in zip(view.layers, factors, strict=True):
        t = layer.table
        if layer.index in off:
            zero = (0.0,) * len(t.micro_batch_sizes)
            table = replace(t, forward_s=zero, backward_s=zero, recompute_s=zero if t.recompute_s else (),
                            boundary_bytes=zero if t.boundary_bytes else (),
                            stashed_bytes=zero if t.stashed_bytes else (), peak_bytes=zero if t.peak_bytes else ())
        elif f != 1.0:
            table = replace(t, forward_s=_scale(t.forward_s, f), backward_s=_scale(t.backward_s, f),
                            recompute_s=_scale(t.recompute_s, f))
        else:
            table = t
        layers.append(_with_table(layer, table))
    return replace(view, layers=tuple(layers))


def _scale(col: tuple[float, ...], f: float) -> tuple[float, ...]:
    return tuple(v * f for v in col)


def _with_table(layer: LayerView, table: LayerTable) -> LayerView:
    return layer if table is layer.table else replace(layer, table=table)


# --- pricing ---------------------------------------------------------------------------------------------


class Pricer:
    """Prices configurations of one running plan on one (calibrated) context; memoised, deterministic."""

    def __init__(self, ctx: CostContext, run: RunningPlan, budget: float, offsets: Sequence[int] = (),
                 options: OnlineOptions | None = None) -> None:
        self.ctx, self.run, self.budget = ctx, run, budget
        self.options = options or OnlineOptions()
        self.offsets = tuple(offsets) or (0,) * len(run.bounds)
        self.host = ctx.fleet.host_link
        self._cache: dict[tuple, Candidate] = {}
        self._stage_cache: dict[tuple, StageCost] = {}

    def strategies(self, ck: Sequence[bool], sw: Sequence[bool]) -> list[LayerStrategy]:
        return [LayerStrategy(checkpoint=c, swap=s) for c, s in zip(ck, sw, strict=True)]

    def pipeline(self, bounds: Bounds, ck: Sequence[bool], sw: Sequence[bool]) -> Pipeline:
        r = self.run
        pipe = build_pipeline(self.ctx.view, None, bounds, self.strategies(ck, sw), r.micro_batch_size,
                              r.num_micro_batches, replicas=r.replicas, context=self.ctx)
        if any(self.offsets):
            pipe = replace(pipe, stages=tuple(replace(st, model_memory_bytes=st.model_memory_bytes + o)
                                              for st, o in zip(pipe.stages, self.offsets, strict=True)))
        return pipe

    def price(self, bounds: Bounds, ck: Sequence[bool], sw: Sequence[bool]) -> Candidate:
        k = (bounds, tuple(ck), tuple(sw))
        hit = self._cache.get(k)
        if hit is None:
            pipe = self.pipeline(bounds, ck, sw)
            res = simulate(pipe, SimOptions(schedule=self.run.schedule, keep_timeline=False))
            peaks = tuple(int(p) for p in res.peak_memory_bytes)
            hit = self._cache[k] = Candidate(
                bounds=bounds, checkpoint=tuple(ck), swap=tuple(sw), iteration_s=res.iteration_s,
                busy_s=tuple(res.busy_s), peak_memory_bytes=peaks, fits=max(peaks) <= self.budget,
                bubble_fraction=res.bubble_fraction, stages=pipe.stages)
        return hit

    def evaluate(self, bounds: Bounds, ck: Sequence[bool], sw: Sequence[bool]) -> Candidate:
        """Local swap/recompute for every stage of `bounds`, then the simulator's price."""
        ck, sw = list(ck), list(sw)
        for s in range(len(bounds)):
            self.local_policy(bounds, s, ck, sw)
        return self.price(bounds, ck, sw)

    # Local problem (vPipe Algorithm 2): one stage's flags, in place.

    def _stage(self, bounds: Bounds, s: int, ck: Sequence[bool], sw: Sequence[bool]) -> tuple[StageCost, int]:
        """Stage cost and peak: the cost model's formula without swaps, the simulator's with (when a swapped
        micro-batch's backward comes soon, as on early 1F1B stages, its activation is back before it left)."""
        b, e = bounds[s]
        k = (b, e, tuple(ck[b:e]), tuple(sw[b:e]))
        st = self._stage_cache.get(k)
        if st is None:
            st = self._stage_cache[k] = stage_cost(self.ctx, b, e, self.strategies(ck[b:e], sw[b:e]),
                                                   self.run.micro_batch_size)
        if any(sw[b:e]):
            return st, self.price(bounds, ck, sw).peak_memory_bytes[s]
        peak = stage_peak_memory(st, self.run.schedule, len(bounds), s, self.run.num_micro_batches)
        return st, peak + self.offsets[s]

    def local_policy(self, bounds: Bounds, s: int, ck: list[bool], sw: list[bool]) -> None:
        b, e = bounds[s]
        nm = self.run.num_micro_batches
        st, peak = self._stage(bounds, s, ck, sw)
        if peak <= self.budget:
            if self.options.relax_memory_policy:
                self._relax(bounds, s, ck, sw)
            return
        while peak > self.budget:
            # Harmony's pre-filter: the stage's swapped bytes per micro-batch, each direction, within a share
            # of its compute; the simulator then says whether it frees memory and hides (time within tolerance).
            compute = (st.forward_s + st.backward_s) * self.options.swap_hide_fraction
            now = self.price(bounds, ck, sw).iteration_s if self.host is not None else 0.0
            hiding, recompute, exposed = [], [], []
            for i in range(b, e):
                if not sw[i] and self.host is not None:
                    sw[i] = True
                    st2, p2 = self._stage(bounds, s, ck, sw)
                    t = self.price(bounds, ck, sw).iteration_s
                    sw[i] = False
                    if p2 < peak:
                        fast = self.host.time(st2.swap_bytes) <= compute
                        if fast and t <= now * (1.0 + self.options.swap_slowdown_tolerance):
                            hiding.append((peak - p2, -i))
                        else:
                            exposed.append(((peak - p2) / max(t - now, 1e-12), -i))
                if not ck[i]:
                    ck[i] = True
                    st2, p2 = self._stage(bounds, s, ck, sw)
                    ck[i] = False
                    if p2 < peak:
                        extra = max(nm * (st2.recompute_s - st.recompute_s), 1e-12)
                        recompute.append(((peak - p2) / extra, -i))
            if hiding:
                sw[-max(hiding)[1]] = True
            elif recompute:
                ck[-max(recompute)[1]] = True
            elif exposed:
                sw[-max(exposed)[1]] = True
            else:
                return  # nothing left to free: the candidate stays over budget
            st, peak = self._stage(bounds, s, ck, sw)

    def _relax(self, bounds: Bounds, s: int, ck: list[bool], sw: list[bool]) -> None:
        """Drop flags the stage no longer needs: recomputes, most costly first, then swaps."""
        b, e = bounds[s]
        costs = []
        for i in range(b, e):
            if ck[i]:
                rec = self.ctx.view.point(i, self.run.micro_batch_size).recompute_s
                costs.append((rec, 1, -i))
            if sw[i]:
                costs.append((0.0, 0, -i))  # a swap that hides costs no time, but frees the host link
        for _, kind, neg in sorted(costs, reverse=True):
            i = -neg
            flags = ck if kind == 1 else sw
            flags[i] = False
            if self._stage(bounds, s, ck, sw)[1] > self.budget:
                flags[i] = True


def calibrate(
    view: ModelView, fleet: fleet_pb2.Fleet, run: RunningPlan, observation: Observation, options: OnlineOptions
) -> tuple[Calibration, ModelView]:
    """Measured-over-modelled factors (module docstring) and the calibrated view."""
    n = len(view)
    active = observation.active_layers
    inactive = tuple(i for i in range(n) if i not in active) if active else ()
    base = scaled_view(view, (1.0,) * n, inactive)
    pricer = Pricer(CostContext(base, fleet, options.cost), run, math.inf)
    current = pricer.price(run.bounds, run.checkpoint, run.swap)
    measured = tuple(s.compute_s for s in observation.stages)
    lo, hi = 1.0 / options.max_calibration, options.max_calibration
    raw = [min(hi, max(lo, m / c)) if m > 0 and c > 0 else None for m, c in zip(measured, current.busy_s, strict=True)]
    known = [f for f in raw if f is not None]
    fallback = sum(known) / len(known) if known else 1.0
    factors = tuple(f if f is not None else fallback for f in raw)
    layer_factors = tuple(factors[s] for s in stage_of(run.bounds))
    offsets = tuple(
        max(0, int(o.peak_memory_bytes) - p) if options.calibrate_memory and o.peak_memory_bytes > 0 else 0
        for o, p in zip(observation.stages, current.peak_memory_bytes, strict=True))
    cal = Calibration(factors, layer_factors, inactive, offsets, current.busy_s, measured)
    return cal, scaled_view(view, layer_factors, inactive)


# --- the decision ----------------------------------------------------------------------------------------


def tied_stages(view: ModelView, bounds: Bounds) -> tuple[tuple[int, ...], ...]:
    """For every layer sharing weights, the stages holding it or a layer it shares with (the executors keep
    these fixed while training: services/executor/train/migration.py)."""
    where = stage_of(bounds)
    return tuple(tuple(sorted({where[layer.index], *(where[j] for j in layer.tied_with)}))
                 for layer in view.layers if layer.tied_with)


def propose(
    profile: profile_pb2.Profile,
    fleet: fleet_pb2.Fleet,
    plan: plan_pb2.Plan,
    observation: Observation,
    options: OnlineOptions | None = None,
) -> Decision:
    """Swap/recompute/repartition proposal for the running `plan` given what was measured (module docstring)."""
    opt = options or OnlineOptions()
    view = from_profile(profile)
    n = len(view)
    budget = opt.memory_budget_bytes or plan.memory_budget_bytes or fleet.device.memory_bytes or 0
    limit = float(budget) if budget else math.inf
    try:
        run = RunningPlan.from_plan(plan, n)
    except ValueError as err:
        return _rejected(f"not repartitioned online: {err}", plan, observation, budget)
    if observation.plan_version != plan.version:
        return _rejected(f"the observation is of plan version {observation.plan_version}, the plan is version "
                         f"{plan.version}; wait for stats of the running plan", plan, observation, budget, run)
    want = tuple(tuple(range(b, e)) for b, e in run.bounds)
    if len(observation.stages) != len(run.bounds) or any(
            o.layers and o.layers != w for o, w in zip(observation.stages, want, strict=False)):
        return _rejected("the observed stages hold other layers than the plan says; wait for stats of the "
                         "running partition", plan, observation, budget, run)

    cal, calibrated = calibrate(view, fleet, run, observation, opt)
    pricer = Pricer(CostContext(calibrated, fleet, opt.cost), run, limit, cal.memory_offsets_bytes, opt)
    before = pricer.price(run.bounds, run.checkpoint, run.swap)
    measured_over = [s for s, o in enumerate(observation.stages) if limit < o.peak_memory_bytes]
    over = sorted({*measured_over, *(s for s, p in enumerate(before.peak_memory_bytes) if p > limit)})
    common = dict(predicted_before_s=before.iteration_s, measured_s=observation.iteration_time_s,
                  memory_budget_bytes=int(budget), calibration=cal)

    if not over and not observation.workload_change and observation.imbalance < opt.imbalance_threshold:
        return _decision(False, f"balanced: stage compute imbalance {observation.imbalance:.1%} is under "
                         f"{opt.imbalance_threshold:.0%}, no workload change, memory fits; nothing to do",
                         run, before, before, **common)

    start = pricer.evaluate(run.bounds, run.checkpoint, run.swap)

    def evaluate(bounds: Bounds) -> Candidate:
        return pricer.evaluate(bounds, run.checkpoint, run.swap)

    holders = tied_stages(view, run.bounds)

    def allowed(bounds: Bounds) -> bool:  # the workers refuse to move a tied weight to another set of stages
        return not opt.keep_tied_stages or tied_stages(view, bounds) == holders

    best, _ = repartition(start, evaluate, max_moves=opt.max_moves, kl=opt.kl,  # type: ignore[assignment]
                          allowed=allowed)
    if not best.fits:
        worst = max(range(len(best.bounds)), key=lambda s: best.peak_memory_bytes[s])
        return _decision(False, f"no partition with swap/recompute fits the {_size(limit)} budget (best found: "
                         f"stage {worst} at {_size(best.peak_memory_bytes[worst])}); a re-plan with more devices "
                         "is needed", run, before, best, **common)
    same = best.bounds == run.bounds and best.checkpoint == run.checkpoint and best.swap == run.swap
    what = _describe(run, before, best, observation)
    if same:
        return _decision(False, f"the current plan is already the best the SRP search finds "
                         f"({before.iteration_s:.4g} s/iter predicted, {observation.iteration_time_s:.4g} s measured)",
                         run, before, best, **common)
    gain = before.iteration_s / best.iteration_s - 1.0 if best.iteration_s > 0 else math.inf
    if over:
        reason = (f"stage{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} over the {_size(limit)} "
                  f"budget (predicted peak {_size(max(before.peak_memory_bytes))}); {what}")
        return _decision(True, reason, run, before, best, plan=plan, **common)
    margin = max(opt.margin, observation.noise) if opt.noise_margin else opt.margin
    if gain < margin or before.iteration_s - best.iteration_s < opt.min_gain_s:
        why = f"the {margin:.0%} margin" + (" (the measurements' noise)" if margin > opt.margin else "")
        return _decision(False, f"{what}: a {gain:+.1%} gain is under {why}; keeping the current plan",
                         run, before, best, **common)
    return _decision(True, what, run, before, best, plan=plan, **common)


def _describe(run: RunningPlan, before: Candidate, best: Candidate, obs: Observation) -> str:
    busy = before.busy_s
    s = max(range(len(busy)), key=lambda i: (busy[i], -i))
    others = [b for i, b in enumerate(busy) if i != s]
    head = f"stage {s} is the bottleneck ({busy[s]:.3g} s of compute vs {sum(others) / len(others):.3g} s on " \
           "the others)" if others else f"stage {s} holds all the compute ({busy[s]:.3g} s)"
    parts = []
    for (frm, to), layers in _group(_moves(run.bounds, best.bounds)).items():
        parts.append(f"moving layer{'s' if len(layers) > 1 else ''} {','.join(map(str, layers))} "
                     f"from stage {frm} to stage {to}")
    ck_on = [i for i in range(len(best.checkpoint)) if best.checkpoint[i] and not run.checkpoint[i]]
    ck_off = [i for i in range(len(best.checkpoint)) if run.checkpoint[i] and not best.checkpoint[i]]
    sw_on = [i for i in range(len(best.swap)) if best.swap[i] and not run.swap[i]]
    sw_off = [i for i in range(len(best.swap)) if run.swap[i] and not best.swap[i]]
    for label, layers in (("recomputing", ck_on), ("no longer recomputing", ck_off), ("swapping", sw_on),
                          ("no longer swapping", sw_off)):
        if layers:
            parts.append(f"{label} layer{'s' if len(layers) > 1 else ''} {','.join(map(str, layers))}")
    change = "; ".join(parts) or "no change"
    inactive = f" ({len(obs.inactive_layers)} inactive layers)" if obs.inactive_layers else ""
    return (f"{head}{inactive}; {change} predicts {best.iteration_s:.4g} s/iter against {before.iteration_s:.4g} s "
            f"({before.iteration_s / best.iteration_s:.2f}x; measured {obs.iteration_time_s:.4g} s)")


def _moves(old: Bounds, new: Bounds) -> tuple[Move, ...]:
    return tuple(Move(i, a, b) for i, (a, b) in enumerate(zip(stage_of(old), stage_of(new), strict=True)) if a != b)


def _group(moves: Sequence[Move]) -> dict[tuple[int, int], list[int]]:
    out: dict[tuple[int, int], list[int]] = {}
    for m in moves:
        out.setdefault((m.from_stage, m.to_stage), []).append(m.layer)
    return out


def _decision(accepted: bool, reason: str, run: RunningPlan, before: Candidate, after: Candidate, *,
              plan: plan_pb2.Plan | None = None, **common) -> Decision:
    chosen = after if accepted else before
    return Decision(
        accepted=accepted, reason=reason, stage_bounds=chosen.bounds,
        checkpoint_layers=tuple(i for i, c in enumerate(chosen.checkpoint) if c),
        swap_layers=tuple(i for i, c in enumerate(chosen.swap) if c),
        moves=_moves(run.bounds, chosen.bounds), predicted_after_s=after.iteration_s,
        predicted_peak_memory_bytes=after.peak_memory_bytes,
        new_plan=new_plan(plan, run, after, reason) if accepted and plan is not None else None, **common)


def _rejected(reason: str, plan: plan_pb2.Plan, obs: Observation, budget: int,
              run: RunningPlan | None = None) -> Decision:
    bounds = run.bounds if run else tuple((s.layer_begin, s.layer_end) for s in plan.stages)
    return Decision(
        accepted=False, reason=reason, stage_bounds=bounds,
        checkpoint_layers=tuple(i for i, c in enumerate(run.checkpoint) if c) if run else (),
        swap_layers=tuple(i for i, c in enumerate(run.swap) if c) if run else (), moves=(),
        predicted_before_s=plan.prediction.iteration_time_s, predicted_after_s=plan.prediction.iteration_time_s,
        measured_s=obs.iteration_time_s, memory_budget_bytes=int(budget))


def new_plan(plan: plan_pb2.Plan, run: RunningPlan, c: Candidate, reason: str) -> plan_pb2.Plan:
    """The running plan with the candidate's partition and flags: version + 1, derived from `plan`."""
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    out.id = ""
    out.parent_plan_id = plan.id
    out.version = plan.version + 1
    out.engine = plan_pb2.PLAN_ENGINE_VPIPE
    out.ClearField("created_at")
    del out.stages[:]
    del out.layers[:]
    del out.alternatives[:]
    d = run.replicas
    # A layer keeps its DP flavour (ZeRO-1/2) wherever it moves: repartitioning moves layers, it does not
    # re-shard their optimizer states. (Its pricing here treats them as plain DP: memory on the safe side.)
    flavour = {x.layer_index: x.dp_sharding for x in plan.layers}
    for s, (b, e) in enumerate(c.bounds):
        st = c.stages[s]
        out.stages.append(plan_pb2.Stage(
            index=s, layer_begin=b, layer_end=e, devices=d,
            predicted_time_s=st.forward_s + st.backward_s + st.recompute_s,
            predicted_peak_memory_bytes=c.peak_memory_bytes[s]))
        for i in range(b, e):
            layer = LayerStrategy(dp=d, checkpoint=c.checkpoint[i], swap=c.swap[i]).to_proto(i, s)
            layer.dp_sharding = flavour.get(i, 0) if d > 1 else 0
            out.layers.append(layer)
    out.prediction.CopyFrom(plan_pb2.Prediction(
        iteration_time_s=c.iteration_s, throughput_samples_per_s=run.global_batch_size / c.iteration_s,
        peak_memory_bytes=max(c.peak_memory_bytes), bubble_fraction=c.bubble_fraction, out_of_memory=not c.fits))
    out.explanation = f"vPipe online repartition of version {plan.version}: {reason}"
    return out


def _size(n: float) -> str:
    if not math.isfinite(n):
        return "unlimited"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


__all__ = [
    "Calibration",
    "Candidate",
    "Decision",
    "Move",
    "OnlineOptions",
    "Pricer",
    "RunningPlan",
    "calibrate",
    "moved_layers",
    "new_plan",
    "propose",
    "scaled_view",
]
