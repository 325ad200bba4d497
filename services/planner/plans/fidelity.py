"""How well the planner predicted what runs measured (issue 17, `ballast fidelity`): per model, layout and host
class, the predicted iteration time and peak memory beside the measured ones, with the signed error and the
mean absolute error over groups.

A run is one plan version of one job as it trained. Its first WARMUP iterations are left out, as the
calibration loop leaves them out: allocations, first-touch and the rendezvous make them slow, and after a
morph the version starts again from a checkpoint, so each version warms up anew. An iteration lasts as long as
its slowest rank; a run's measured time is the *mean* of that over its steady iterations (the calibration
uses the median, but the user guide's SQL has no portable median, and this report must equal it). The host
class is the one the calibration loop files the run under (plans/calibrate.py `host_class`, over the hosts
the job leased). No I/O: protos in, dataclasses out.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ballast.v1 import fleet_pb2, job_pb2, plan_pb2
from ballast.windows import first_iteration, weight, weighted_mean
from services.planner.plans.calibrate import WARMUP, host_class
from services.planner.plans.make import CALIBRATED


@dataclass(frozen=True)
class Run:
    """One plan version of one job, reduced to its steady iterations."""

    job_id: str
    plan_version: int
    model: str
    stages: int
    replicas: int
    micro_batches: int
    host_class: str
    calibrated: bool
    iterations: int  # steady iterations
    predicted_s: float
    measured_s: float
    peaks: tuple[tuple[int, int], ...] = ()  # (predicted, measured) peak bytes of each stage with a prediction

    @property
    def error(self) -> float:
        return signed_error(self.predicted_s, self.measured_s)


@dataclass(frozen=True)
class Group:
    """The runs of one model on one layout and host class; errors are (predicted - measured) / measured."""

    model: str
    stages: int
    replicas: int
    micro_batches: int
    host_class: str
    runs: int
    calibrated: int  # runs whose plan a calibration priced
    iterations: int
    predicted_s: float  # means over runs (each run counts once, however long it trained)
    measured_s: float
    error: float
    predicted_peak_bytes: float | None  # means over (run, stage); None when no stage had a prediction
    measured_peak_bytes: float | None
    memory_error: float | None

    @property
    def layout(self) -> str:
        """Stages x replicas, micro-batches: '2x1 m4'."""
        return f"{self.stages}x{self.replicas} m{self.micro_batches}"


@dataclass(frozen=True)
class Report:
    groups: tuple[Group, ...]
    mae: float  # mean |error| of the iteration time over groups
    memory_mae: float | None  # the same for peak memory, over the groups that have it


def signed_error(predicted: float, measured: float) -> float:
    """Positive when the plan promised more time (or memory) than the run took."""
    return (predicted - measured) / measured


def run_of(job_id: str, model: str, plan: plan_pb2.Plan, metrics: Sequence[job_pb2.IterationMetric],
           hosts: Sequence[fleet_pb2.Host], warmup: int = WARMUP) -> Run | None:
    """The run of `plan` from its version's metrics; None when no steady iteration is left."""
    rows = [m for m in metrics if m.plan_version == plan.version]
    if not rows:
        return None
    first = min(first_iteration(m) for m in rows)
    steady = [m for m in rows if first_iteration(m) >= first + warmup]
    slowest: dict[int, float] = defaultdict(float)
    covers: dict[int, int] = defaultdict(int)  # iterations the rows ending at an iteration stand for
    peaks: dict[int, tuple[int, int]] = {}
    for m in steady:
        slowest[m.iteration] = max(slowest[m.iteration], m.iteration_time_s)
        covers[m.iteration] = max(covers[m.iteration], weight(m))
        if m.predicted_peak_memory_bytes > 0:  # 0: recorded before per-stage predictions existed
            predicted, measured = peaks.get(m.stage_index, (0, 0))
            peaks[m.stage_index] = (max(predicted, m.predicted_peak_memory_bytes),
                                    max(measured, m.peak_memory_bytes))
    measured_s = weighted_mean((t, covers[i]) for i, t in slowest.items())
    if measured_s <= 0:
        return None
    stages = max(m.stage_index for m in steady) + 1
    replicas = max(m.replica_index for m in steady) + 1
    return Run(job_id=job_id, plan_version=plan.version, model=model, stages=stages, replicas=replicas,
               micro_batches=plan.num_micro_batches, host_class=host_class(plan.fleet, hosts, stages * replicas).key,
               calibrated=CALIBRATED in plan.explanation, iterations=sum(covers.values()),
               predicted_s=statistics.fmean(m.predicted_iteration_time_s for m in steady), measured_s=measured_s,
               peaks=tuple(peaks[s] for s in sorted(peaks)))


def runs_of_job(job_id: str, model: str, plans: Iterable[plan_pb2.Plan], metrics: Sequence[job_pb2.IterationMetric],
                hosts: Sequence[fleet_pb2.Host], warmup: int = WARMUP) -> list[Run]:
    """A job's runs, one per plan version it reported metrics under (a version without its plan is left out)."""
    found = (run_of(job_id, model, plan, metrics, hosts, warmup) for plan in sorted(plans, key=lambda p: p.version))
    return [run for run in found if run is not None]


def _group(runs: Sequence[Run]) -> Group:
    first = runs[0]
    predicted = statistics.fmean(r.predicted_s for r in runs)
    measured = statistics.fmean(r.measured_s for r in runs)
    peaks = [p for r in runs for p in r.peaks]
    peak_p = statistics.fmean(p for p, _ in peaks) if peaks else None
    peak_m = statistics.fmean(m for _, m in peaks) if peaks else None
    return Group(model=first.model, stages=first.stages, replicas=first.replicas, micro_batches=first.micro_batches,
                 host_class=first.host_class, runs=len(runs), calibrated=sum(r.calibrated for r in runs),
                 iterations=sum(r.iterations for r in runs), predicted_s=predicted, measured_s=measured,
                 error=signed_error(predicted, measured), predicted_peak_bytes=peak_p, measured_peak_bytes=peak_m,
                 memory_error=signed_error(peak_p, peak_m) if peak_p is not None and peak_m else None)


def report(runs: Iterable[Run]) -> Report:
    """Runs grouped by (model, stages, replicas, micro-batches, host class), in that order."""
    by_key: dict[tuple[str, int, int, int, str], list[Run]] = defaultdict(list)
    for r in runs:
        by_key[(r.model, r.stages, r.replicas, r.micro_batches, r.host_class)].append(r)
    groups = tuple(_group(by_key[key]) for key in sorted(by_key))
    memory = [abs(g.memory_error) for g in groups if g.memory_error is not None]
    return Report(groups=groups, mae=statistics.fmean(abs(g.error) for g in groups) if groups else 0.0,
                  memory_mae=statistics.fmean(memory) if memory else None)
