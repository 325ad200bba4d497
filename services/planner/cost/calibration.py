"""Calibration from runs (issue 17): what the profile never sees, learnt from the iterations jobs report.

A profile times each layer alone; a training worker also pays a fixed cost per micro-batch (its schedule loop,
launching the layer kernels, posting receives), a different speed for the same layers run back to back beside
other busy workers, collectives slower or faster than their fit, and an optimizer step. Harmony's estimator
and Varuna's simulator come within 5% of real runs because they calibrate on the real runtime; Ballast learns
the same corrections from every run it stores, per host class (device kind, host cores, workers sharing the
host), so a calibration is only ever applied to the kind of host it was measured on.

The model, per stage and micro-batch, on top of the profile's uncalibrated StageCost (cost/stage.py):

    forward'  = forward_scale  x forward  + forward_fixed_s
    backward' = backward_scale x backward + backward_fixed_s        (recompute scales like backward: the
                                                                     workers time it inside backward)
    allreduce' = allreduce_scale x allreduce
    update'   = update_scale x update + iteration_fixed_s        (once per iteration, after the sync)

The workers' overhead (time in no measured part: building each micro-batch, seeding its dropout) is mostly
per micro-batch and comes right before each forward, so it is fitted into the forward line. What the fitted
stages still leave unexplained of the measured iteration is split by the caller, after simulating the
calibrated runs (plans/calibrate.unexplained), into `iteration_fixed_s` and a part per micro-batch added to
`forward_fixed_s`: `fit` leaves the first 0.
    memory'   = memory_scale x (model + activations + transient) + memory_fixed_bytes

Each (scale, fixed) pair is a least-squares line through the stages' per-micro-batch measurements against
their predictions; with fewer than two distinct predictions the fixed part is 0 and the scale is the median
ratio. Pure: observations in, a Calibration out; `apply` maps a StageCost to its calibrated one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.planner.sim.model import StageCost

MIN_SPREAD = 0.2  # predictions must differ by this fraction to fit a fixed part beside the scale
SCALE_BOUNDS = (0.2, 5.0)  # a fitted scale outside these is a broken measurement, not a slower machine


@dataclass(frozen=True)
class HostClass:
    """What a calibration is valid for: the same device kind, host size and crowding."""

    device_kind: str
    cores: int  # CPU cores of the host (0: unknown)
    colocated: int  # devices of the plan sharing one host (workers competing for its cores and memory bus)

    @property
    def key(self) -> str:
        return f"{self.device_kind}/{self.cores}c/{self.colocated}w"


@dataclass(frozen=True)
class Calibration:
    """Corrections for one host class (the module docstring's model); the identity when nothing is known."""

    host_class: str = ""
    forward_scale: float = 1.0
    forward_fixed_s: float = 0.0
    backward_scale: float = 1.0
    backward_fixed_s: float = 0.0
    allreduce_scale: float = 1.0
    update_scale: float = 1.0
    iteration_fixed_s: float = 0.0
    memory_scale: float = 1.0
    memory_fixed_bytes: int = 0
    iterations: int = 0  # measured iterations it was fitted on
    residual: float = 0.0  # mean absolute relative error of the calibrated stage times on its own data
    spread: float = 0.0  # how noisy the runs it was fitted on were (robust CV of their iteration times)
    harmony_scale: float = 0.0  # measured / the estimator's time of Harmony runs (0: none fitted, x1)
    chunks_scale: float = 0.0  # the same for chunk offload runs

    @property
    def identity(self) -> bool:
        """Whether it changes no pipeline cost (the offload scales apply to offload plans only: offload())."""
        return self == Calibration(host_class=self.host_class, iterations=self.iterations, residual=self.residual,
                                   spread=self.spread, harmony_scale=self.harmony_scale,
                                   chunks_scale=self.chunks_scale)

    def offload(self, harmony: bool) -> float:
        """What an offload plan's estimated iteration time is multiplied by: Harmony's or chunk offload's scale."""
        return (self.harmony_scale if harmony else self.chunks_scale) or 1.0

    def describe(self) -> str:
        """One line for explanations: what the calibration changes."""
        return (f"forward x{self.forward_scale:.2f} + {self.forward_fixed_s * 1e3:.2f} ms/micro-batch, backward "
                f"x{self.backward_scale:.2f} + {self.backward_fixed_s * 1e3:.2f} ms/micro-batch, all-reduce "
                f"x{self.allreduce_scale:.2f}, optimizer x{self.update_scale:.2f}, "
                f"+ {self.iteration_fixed_s * 1e3:.1f} ms/iteration, memory x{self.memory_scale:.2f} "
                f"+ {self.memory_fixed_bytes / 2**20:.0f} MiB"
                + (f", Harmony x{self.harmony_scale:.2f}" if self.harmony_scale else "")
                + (f", chunk offload x{self.chunks_scale:.2f}" if self.chunks_scale else ""))


@dataclass(frozen=True)
class Observation:
    """One stage of one run: its uncalibrated prediction and the medians of what it measured per iteration."""

    predicted: StageCost
    num_micro_batches: int
    forward_s: float  # measured forward compute, whole iteration (all micro-batches)
    backward_s: float  # measured backward compute including recompute, whole iteration
    allreduce_s: float
    optimizer_s: float
    overhead_s: float  # measured time in none of the parts above nor p2p waits: mostly per micro-batch Python
    peak_memory_bytes: int
    predicted_peak_memory_bytes: int
    iterations: int


def apply(stage: StageCost, cal: Calibration | None) -> StageCost:
    """The calibrated StageCost (the identity for None)."""
    if cal is None or cal.identity:
        return stage
    m = cal.memory_scale
    return replace(
        stage,
        forward_s=cal.forward_scale * stage.forward_s + cal.forward_fixed_s,
        backward_s=cal.backward_scale * stage.backward_s + cal.backward_fixed_s,
        recompute_s=cal.backward_scale * stage.recompute_s,  # workers time recompute inside backward
        allreduce_s=cal.allreduce_scale * stage.allreduce_s,
        update_s=cal.update_scale * stage.update_s + cal.iteration_fixed_s,
        model_memory_bytes=int(m * stage.model_memory_bytes) + cal.memory_fixed_bytes,
        activation_bytes=int(m * stage.activation_bytes),
        transient_bytes=int(m * stage.transient_bytes),
    )


def line(x: Sequence[float], y: Sequence[float], offset: bool = False) -> tuple[float, float]:
    """(scale, fixed) of y = scale x + fixed by least squares, fixed >= 0 and scale within SCALE_BOUNDS.

    Predictions too alike to separate the two (one balanced run) give the median ratio as the scale, or, when
    that ratio is beyond SCALE_BOUNDS (sub-millisecond predictions under a runtime's fixed cost) or `offset`
    says the gap is a fixed amount (memory: the runtime's own), scale 1 and the median difference."""
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if a > 0 and b >= 0]
    if not pairs:
        return 1.0, 0.0
    xs, ys = [a for a, _ in pairs], [b for _, b in pairs]
    lo, hi = SCALE_BOUNDS
    ratio = statistics.median(b / a for a, b in pairs)
    fallback = ((ratio, 0.0) if lo <= ratio <= hi and not offset
                else (1.0, max(statistics.median(b - a for a, b in pairs), 0.0)))
    if len(pairs) < 2 or (max(xs) - min(xs)) < MIN_SPREAD * max(xs):
        return fallback
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((a - mx) ** 2 for a in xs)
    scale = sum((a - mx) * (b - my) for a, b in pairs) / sxx
    fixed = my - scale * mx
    if fixed < 0 or not lo <= scale <= hi:  # the line says no fixed cost, or nonsense: the fallback is safer
        return fallback
    return scale, fixed


def fit(observations: Sequence[Observation], host_class: HostClass) -> Calibration:
    """The calibration for `host_class` from its runs' stage observations (see the module docstring)."""
    if not observations:
        return Calibration(host_class=host_class.key)
    per_mb = [max(o.num_micro_batches, 1) for o in observations]
    # the workers' per-micro-batch Python (building the batch, seeding dropout) runs right before each forward
    fwd = line([o.predicted.forward_s for o in observations],
               [(o.forward_s + max(o.overhead_s, 0.0)) / n for o, n in zip(observations, per_mb, strict=True)])
    bwd = line([o.predicted.backward_s + o.predicted.recompute_s for o in observations],
               [o.backward_s / n for o, n in zip(observations, per_mb, strict=True)])
    synced = [o for o in observations if o.predicted.allreduce_s > 0 and o.allreduce_s > 0]
    allreduce = statistics.median(o.allreduce_s / o.predicted.allreduce_s for o in synced) if synced else 1.0
    stepped = [o for o in observations if o.predicted.update_s > 0 and o.optimizer_s > 0]
    update = statistics.median(o.optimizer_s / o.predicted.update_s for o in stepped) if stepped else 1.0
    # a process's memory is its runtime (interpreter, libraries, allocator pools: ~300 MB of RSS on a CPU) plus
    # what the plan holds: without two distinct predictions the gap is that runtime, not a ratio
    mem = line([float(o.predicted_peak_memory_bytes) for o in observations],
               [float(o.peak_memory_bytes) for o in observations], offset=True)
    cal = Calibration(
        host_class=host_class.key, forward_scale=fwd[0], forward_fixed_s=fwd[1], backward_scale=bwd[0],
        backward_fixed_s=bwd[1], allreduce_scale=allreduce, update_scale=update,
        memory_scale=mem[0], memory_fixed_bytes=int(mem[1]),
        iterations=min(o.iterations for o in observations))
    return replace(cal, residual=residual(observations, cal))


def residual(observations: Sequence[Observation], cal: Calibration) -> float:
    """Mean absolute relative error of the calibrated per-iteration compute (forward, its overhead, backward)."""
    errors = []
    for o in observations:
        c = apply(o.predicted, cal)
        predicted = o.num_micro_batches * (c.forward_s + c.backward_s + c.recompute_s)
        measured = o.forward_s + o.backward_s + max(o.overhead_s, 0.0)
        if measured > 0:
            errors.append(abs(predicted - measured) / measured)
    return statistics.fmean(errors) if errors else 0.0
