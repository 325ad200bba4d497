"""Scaling curves: a job's predicted throughput on every device count it may be given.

Ballast keeps a job's global batch fixed (its convergence must not change) and adapts only devices and
plan, so one curve per (model, global batch) says what each extra device is worth. Two readings:
- `rate(n)`, what n devices are worth to an allocator: the best throughput at or below n, so the curve never
  drops as devices are added and a count no plan fits gives 0 (the job cannot run on it);
- `rate_on(n)`, what a job holding n devices runs at: the planner plans for every device a job holds, so a
  count past the curve's best is slower there (a model whose gradients outweigh its compute). A job is priced
  on it; the allocator only steps up to counts where the two agree (policy.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from ballast.v1 import fleet_pb2, profile_pb2
from services.planner.cost.fleet_cut import cut_shape
from services.planner.plans.make import PlanInputs, make_plan
from services.runtime.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True)
class ScalingCurve:
    """Predicted samples/s per device count for one (model, global batch); absent counts are unplanned."""

    model: str
    global_batch_size: int
    throughput: Mapping[int, float]
    _best: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        top = max(self.throughput, default=0)
        best, level = [0.0], 0.0
        for n in range(1, top + 1):
            level = max(level, self.throughput.get(n, 0.0))
            best.append(level)
        object.__setattr__(self, "_best", tuple(best))

    @property
    def max_devices(self) -> int:
        """Beyond this count the curve knows nothing, so extra devices are worth nothing."""
        return len(self._best) - 1

    @property
    def min_devices(self) -> int:
        """The fewest devices any plan runs on (0: none does)."""
        return next((n for n, r in enumerate(self._best) if r > 0), 0)

    def rate(self, devices: int) -> float:
        """Samples/s with `devices` devices: the best plan using at most that many."""
        if devices <= 0:
            return 0.0
        return self._best[min(devices, len(self._best) - 1)]

    def iteration_s(self, devices: int) -> float:
        """Seconds per iteration with the best plan on at most `devices` devices (infinite where nothing runs)."""
        r = self.rate(devices)
        return self.global_batch_size / r if r > 0 else math.inf

    def rate_on(self, devices: int) -> float:
        """Samples/s of the plan for exactly `devices` devices; the best below for a count the curve did not
        price or no plan fits (the job runs a smaller plan)."""
        exact = self.throughput.get(devices, 0.0) if devices > 0 else 0.0
        return exact if exact > 0 else self.rate(devices)

    def iteration_s_on(self, devices: int) -> float:
        """Seconds per iteration of a job that holds `devices` devices (infinite where nothing runs)."""
        r = self.rate_on(devices)
        return self.global_batch_size / r if r > 0 else math.inf


def amdahl_curve(
    model: str,
    global_batch_size: int,
    max_devices: int,
    single_device_samples_per_s: float,
    serial_fraction: float,
    comm_fraction: float = 0.0,
) -> ScalingCurve:
    """A synthetic curve for tests and benchmarks: Amdahl's law with a per-doubling communication cost,
    time(n) = s + (1 - s) / n + c * log2(n) in units of the one-device time."""
    if not 0 <= serial_fraction <= 1 or comm_fraction < 0 or single_device_samples_per_s <= 0:
        raise InvalidArgument("serial_fraction in [0, 1], comm_fraction >= 0, throughput > 0", field="serial_fraction",
                              fix="e.g. amdahl_curve('gpt', 64, 64, 100.0, 0.05)")
    rates = {n: single_device_samples_per_s / (serial_fraction + (1 - serial_fraction) / n
                                               + comm_fraction * math.log2(n))
             for n in range(1, max_devices + 1)}
    return ScalingCurve(model, global_batch_size, rates)


# Synthetic shapes of the example zoo models (examples/*.yaml): samples/s on one device, serial share at global
# batch 64, communication share per doubling. Invented to span good to poor scaling, not measured: for the
# benchmark and `ballast fleet simulate --curves synthetic`, where pricing every count with the planner is not
# wanted. A larger global batch splits into more work per device, so both shares shrink in proportion.
SYNTHETIC_SHAPES: dict[str, tuple[float, float, float]] = {
    "gpt-tiny": (400.0, 0.25, 0.02),  # small layers: communication dominates past a few devices
    "t5-large-32": (50.0, 0.10, 0.01),
    "vit-huge-32": (60.0, 0.05, 0.006),
    "bert-huge-32": (40.0, 0.03, 0.004),
    "swin-huge-32": (45.0, 0.02, 0.002),
}
DEFAULT_SHAPE = (50.0, 0.05, 0.005)  # any other model: a middling scaler


def synthetic_curve(model: str, global_batch_size: int, max_devices: int) -> ScalingCurve:
    """`model`'s synthetic Amdahl curve (SYNTHETIC_SHAPES, DEFAULT_SHAPE for others) at `global_batch_size`."""
    rate, serial, comm = SYNTHETIC_SHAPES.get(model, DEFAULT_SHAPE)
    scale = 64 / global_batch_size
    return amdahl_curve(model, global_batch_size, max_devices, rate, min(1.0, serial * scale), comm * scale)


def fleet_of(template: fleet_pb2.Fleet, devices: int) -> fleet_pb2.Fleet:
    """`template`'s device, links and precision with `devices` devices: one node when they fit in one, else
    the uniform fleet cost.fleet_cut.cut_shape gives (whole nodes, or 12 of 8-device nodes as 3 x 4)."""
    fleet = fleet_pb2.Fleet()
    fleet.CopyFrom(template)
    fleet.nodes, fleet.devices_per_node = cut_shape(devices, max(1, template.devices_per_node))
    return fleet


def planner_curve(
    profile: profile_pb2.Profile,
    fleet_template: fleet_pb2.Fleet,
    global_batch_size: int,
    devices: Iterable[int],
    *,
    model: str = "",
    inputs: PlanInputs | None = None,
) -> ScalingCurve:
    """The curve the planner predicts: make_plan's best throughput for each count in `devices` (with
    the calibration in `inputs`), the global batch pinned, every count priced (fleet_of); counts no plan fits
    are left out. Stage plans are the budget sweep's, not proved optimal (SearchOptions.exact_stages). Costs
    one plan search per count: tens of ms for small GPTs, about a second for a 15B model on tens of devices, so
    callers cache curves and ask for few counts."""
    base = inputs or PlanInputs()
    pinned = replace(base, global_batch_size=global_batch_size,
                     max_global_batch_size=max(global_batch_size, base.max_global_batch_size), top_k=1,
                     exact_stages=False)  # the sweep's stage plans: the same curves, a quarter of the time
    rates: dict[int, float] = {}
    for n in sorted(set(devices)):
        if n < 1:
            continue
        try:
            plan = make_plan(profile, fleet_of(fleet_template, n), pinned)
        except (FailedPrecondition, InvalidArgument):
            continue  # nothing fits this count, or the batch does not split over it
        rates[n] = plan.prediction.throughput_samples_per_s
    return ScalingCurve(model or profile.model_id, global_batch_size, rates)


class CurveCache:
    """Planner curves kept until what they were priced on changes: the key holds the profile, the fleet
    template, the batch, the counts and the plan inputs (calibration included), so a new calibration or
    a changed fleet builds a new curve instead of serving a stale one."""

    def __init__(self) -> None:
        self._curves: dict[tuple, ScalingCurve] = {}
        self.built = 0  # plan searches run for curves (hits run none)

    def get(self, profile: profile_pb2.Profile, fleet_template: fleet_pb2.Fleet, global_batch_size: int,
            devices: Iterable[int], *, model: str = "", inputs: PlanInputs | None = None) -> ScalingCurve:
        counts = tuple(sorted(set(devices)))
        key = (_digest(profile), _digest(fleet_template), global_batch_size, counts, model, inputs or PlanInputs())
        if key not in self._curves:
            self._curves[key] = planner_curve(profile, fleet_template, global_batch_size, counts, model=model,
                                              inputs=inputs)
            self.built += 1
        return self._curves[key]


def _digest(message: profile_pb2.Profile | fleet_pb2.Fleet) -> str:
    return hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()
