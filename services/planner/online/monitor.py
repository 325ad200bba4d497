"""The training monitor (vPipe §3: runtime statistics of every stage feed the global planner).

Pure and deterministic: it consumes `executor_pb2.StageStats` messages (one per worker per iteration) and
answers with an `Observation` of one job at one plan version. No I/O, no clocks, no grpc.

Rules:

* Versions. Each job has a current plan version: the highest seen in its stats, or the one set by
  `expect()`. Stats of older versions are ignored (counted in `ignored`); stats of a newer version make it
  current and drop the older history (timings of another partition say nothing about this one).
* Complete iterations. An iteration counts once every (stage, replica) of the plan has reported it. The
  shape comes from `expect(job, version, num_stages, replicas)`; without it, it is inferred from the stats
  of that version (1 + highest stage index, 1 + highest replica index), evaluated when asked, so an
  iteration that only some stages reported never counts.
* Warm-up. The first `warmup` iterations of a version (counted from the lowest iteration index seen at that
  version) are skipped: they include the migration, allocator warm-up and first-iteration effects.
* Window. The observation uses the last `window` complete iterations after warm-up. Per iteration, a
  stage's times are the mean over its replicas and its peak memory the largest replica's; the measured
  iteration time is the slowest worker's. Times are then the median over the window (robust to a slow
  iteration); peak memory the largest over the window (the worst is what runs out of memory).
* Active layers. A stage's `active_layers` are the layers that computed (a layer switched off by a toggle
  costs nothing); the union over replicas is used. An empty list means none computed, as the executor
  runtime reports it (it always fills the field); `MonitorOptions.empty_active_means_all` reads an empty
  list as "all held layers" instead, for senders that leave the field unset.
* Imbalance: ``max_s compute_s / mean_s compute_s - 1`` over stages, compute = forward + backward (backward
  includes recompute); 0 for a perfectly balanced pipeline, P - 1 when one stage does all the work. The
  bottleneck stage is the argmax (lowest index on ties).
* Workload change: per stage, the compute of the newest `recent` complete iterations against the median
  of up to `window` complete iterations before them; when every one of the recent iterations is above
  (or every one below) that median by more than `change_threshold` and by at least `change_floor` of the
  busiest stage's compute (a layer switched on or off; one straggling iteration, or jitter of a stage that
  does almost nothing, is not a change), or the active-layer set differs, the stage is flagged. When any stage
  changed, the observation's medians use the newest `recent` iterations only, so a planner sees the new
  workload rather than a mix of old and new.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ballast.v1 import executor_pb2


@dataclass(frozen=True)
class MonitorOptions:
    """How much history the monitor keeps and how it judges it."""

    window: int = 5  # complete iterations the medians run over
    warmup: int = 1  # iterations skipped at the start of each plan version
    recent: int = 2  # newest complete iterations compared against the window before them
    change_threshold: float = 0.25  # relative compute change of a stage that counts as a workload change
    # ... and it must also move by this fraction of the busiest stage's compute: a light stage's jitter (an
    # embedding at 2% of the iteration) is not a workload change.
    change_floor: float = 0.05
    # Iterations kept per job beyond window + recent (older ones are dropped, complete or not).
    slack: int = 8
    # Read an empty StageStats.active_layers as "every held layer computed" (senders that leave it unset).
    empty_active_means_all: bool = False

    def __post_init__(self) -> None:
        if self.window < 1 or self.recent < 1 or self.warmup < 0 or self.slack < 0:
            raise ValueError("window and recent must be >= 1, warmup and slack >= 0")
        if self.change_threshold <= 0 or self.change_floor < 0:
            raise ValueError("change_threshold must be positive and change_floor >= 0")


@dataclass(frozen=True)
class WorkerSample:
    """One worker's stats for one iteration (the fields the monitor reads)."""

    forward_s: float
    backward_s: float
    recompute_s: float
    comm_s: float
    idle_s: float
    iteration_time_s: float
    peak_memory_bytes: int
    swapped_bytes: int
    layers: tuple[int, ...]
    active_layers: tuple[int, ...]

    @classmethod
    def from_stats(cls, stats: executor_pb2.StageStats, empty_active_means_all: bool = False) -> WorkerSample:
        layers = tuple(int(i) for i in stats.layers)
        active = tuple(sorted(int(i) for i in stats.active_layers))
        if not active and empty_active_means_all:
            active = layers
        return cls(
            forward_s=stats.forward_s, backward_s=stats.backward_s, recompute_s=stats.recompute_s,
            comm_s=stats.comm_s, idle_s=stats.idle_s, iteration_time_s=stats.iteration_time_s,
            peak_memory_bytes=int(stats.peak_memory_bytes), swapped_bytes=int(stats.swapped_bytes),
            layers=layers, active_layers=active,
        )


@dataclass(frozen=True)
class StageObservation:
    """One stage over the window: replica means, medians over iterations (peak memory: the worst)."""

    stage_index: int
    layers: tuple[int, ...]
    active_layers: tuple[int, ...]
    replicas: int
    compute_s: float  # forward + backward (backward includes recompute), per iteration
    forward_s: float
    backward_s: float
    recompute_s: float
    comm_s: float
    idle_s: float
    peak_memory_bytes: int
    swapped_bytes: int

    @property
    def inactive_layers(self) -> tuple[int, ...]:
        active = set(self.active_layers)
        return tuple(i for i in self.layers if i not in active)


@dataclass(frozen=True)
class WorkloadChange:
    """A stage whose compute moved by more than the threshold against its own history."""

    stage_index: int
    before_s: float  # median compute over the iterations before the newest `recent`
    after_s: float  # median compute over the newest `recent`
    active_before: tuple[int, ...]
    active_after: tuple[int, ...]

    @property
    def ratio(self) -> float:
        return self.after_s / self.before_s if self.before_s > 0 else float("inf")

    def describe(self) -> str:
        text = f"stage {self.stage_index} compute {self.before_s:.4g} s -> {self.after_s:.4g} s"
        if self.active_before != self.active_after:
            text += f" (active layers {list(self.active_before)} -> {list(self.active_after)})"
        return text


@dataclass(frozen=True)
class Observation:
    """What the monitor knows about one job at one plan version."""

    job_id: str
    plan_version: int
    iterations: tuple[int, ...]  # the iterations the medians are over, ascending
    stages: tuple[StageObservation, ...]
    iteration_time_s: float  # median over the window of the slowest worker's iteration time
    imbalance: float  # max stage compute / mean stage compute - 1
    bottleneck_stage: int
    workload_changes: tuple[WorkloadChange, ...] = ()
    complete_iterations: int = 0  # complete post-warm-up iterations held (>= len(iterations))
    # Largest half-range of a stage's compute over the window, over its median: how far a median may be off,
    # so a predicted gain below it is noise (srp.propose raises its margin to it).
    noise: float = 0.0

    @property
    def workload_change(self) -> bool:
        return bool(self.workload_changes)

    @property
    def samples(self) -> int:
        return len(self.iterations)

    @property
    def active_layers(self) -> frozenset[int]:
        return frozenset(i for s in self.stages for i in s.active_layers)

    @property
    def inactive_layers(self) -> tuple[int, ...]:
        return tuple(i for s in self.stages for i in s.inactive_layers)

    @property
    def stage_layers(self) -> tuple[tuple[int, ...], ...]:
        return tuple(s.layers for s in self.stages)


@dataclass
class _Version:
    version: int
    num_stages: int = 0  # 0: infer
    replicas: int = 0  # 0: infer
    first_iteration: int | None = None
    iterations: dict[int, dict[tuple[int, int], WorkerSample]] = field(default_factory=dict)


class TrainingMonitor:
    """Per-job windows of StageStats; see the module docstring for every rule."""

    def __init__(self, options: MonitorOptions | None = None) -> None:
        self.options = options or MonitorOptions()
        self._jobs: dict[str, _Version] = {}
        self.ignored = 0  # stats dropped as stale (an older plan version)

    def expect(self, job_id: str, plan_version: int, num_stages: int, replicas: int = 1) -> None:
        """Declare the plan now running (its version and shape); older stats are ignored from now on."""
        if num_stages < 1 or replicas < 1:
            raise ValueError(f"need num_stages >= 1 and replicas >= 1, got {num_stages}, {replicas}")
        current = self._jobs.get(job_id)
        if current is not None and current.version > plan_version:
            raise ValueError(f"job {job_id} already runs plan version {current.version} > {plan_version}")
        if current is None or current.version < plan_version:
            current = self._jobs[job_id] = _Version(plan_version)
        current.num_stages, current.replicas = num_stages, replicas

    def observe(self, stats: executor_pb2.StageStats) -> bool:
        """Record one worker's stats; False when ignored (an older plan version)."""
        job = stats.job_id
        current = self._jobs.get(job)
        if current is not None and stats.plan_version < current.version:
            self.ignored += 1
            return False
        if current is None or stats.plan_version > current.version:
            current = self._jobs[job] = _Version(stats.plan_version)
        it = int(stats.iteration)
        if current.first_iteration is None or it < current.first_iteration:
            current.first_iteration = it
        current.iterations.setdefault(it, {})[(int(stats.stage_index), int(stats.replica_index))] = (
            WorkerSample.from_stats(stats, self.options.empty_active_means_all))
        self._prune(current)
        return True

    def observe_all(self, stats: Iterable[executor_pb2.StageStats]) -> int:
        return sum(self.observe(s) for s in stats)

    def current_version(self, job_id: str) -> int | None:
        current = self._jobs.get(job_id)
        return None if current is None else current.version

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def complete_iterations(self, job_id: str) -> int:
        """Complete post-warm-up iterations held for the job's current version."""
        current = self._jobs.get(job_id)
        return 0 if current is None else len(self._complete(current))

    def ready(self, job_id: str) -> bool:
        """A full window of complete iterations, or a workload change with its `recent` iterations."""
        obs = self.observation(job_id)
        if obs is None:
            return False
        return obs.complete_iterations >= self.options.window or (
            obs.workload_change and obs.samples >= self.options.recent)

    def observation(self, job_id: str, plan_version: int | None = None) -> Observation | None:
        """The job's observation at its current version (None when nothing complete, or another version)."""
        current = self._jobs.get(job_id)
        if current is None or (plan_version is not None and plan_version != current.version):
            return None
        complete = self._complete(current)
        if not complete:
            return None
        opt = self.options
        per_iter = [self._merge(current.iterations[i]) for i in complete]  # per iteration: per stage
        changes = self._changes(per_iter)
        use = opt.recent if changes else opt.window
        chosen, rows = complete[-use:], per_iter[-use:]
        num_stages = len(rows[0])
        stages = []
        for s in range(num_stages):
            col = [r[s] for r in rows]
            last = col[-1]
            stages.append(StageObservation(
                stage_index=s, layers=last["layers"], active_layers=last["active"], replicas=last["replicas"],
                compute_s=_median(c["compute"] for c in col), forward_s=_median(c["forward"] for c in col),
                backward_s=_median(c["backward"] for c in col), recompute_s=_median(c["recompute"] for c in col),
                comm_s=_median(c["comm"] for c in col), idle_s=_median(c["idle"] for c in col),
                peak_memory_bytes=max(c["peak"] for c in col), swapped_bytes=int(_median(c["swapped"] for c in col)),
            ))
        times = [max(w.iteration_time_s for w in current.iterations[i].values()) for i in chosen]
        compute = [s.compute_s for s in stages]
        spread = [_spread([r[s]["compute"] for r in rows]) for s in range(num_stages)]
        noise = max((d / 2 / m for d, m in zip(spread, compute, strict=True) if m > 0), default=0.0)
        mean = sum(compute) / len(compute)
        bottleneck = max(range(len(compute)), key=lambda s: (compute[s], -s))
        return Observation(
            job_id=job_id, plan_version=current.version, iterations=tuple(chosen), stages=tuple(stages),
            iteration_time_s=_median(times), imbalance=(compute[bottleneck] / mean - 1.0) if mean > 0 else 0.0,
            bottleneck_stage=bottleneck, workload_changes=tuple(changes), complete_iterations=len(complete),
            noise=noise,
        )

    # --- internals -------------------------------------------------------------------------------------

    def _shape(self, v: _Version) -> tuple[int, int]:
        if v.num_stages:
            return v.num_stages, v.replicas
        keys = [k for workers in v.iterations.values() for k in workers]
        return 1 + max(s for s, _ in keys), 1 + max(r for _, r in keys)

    def _complete(self, v: _Version) -> list[int]:
        if not v.iterations or v.first_iteration is None:
            return []
        stages, replicas = self._shape(v)
        need = {(s, r) for s in range(stages) for r in range(replicas)}
        start = v.first_iteration + self.options.warmup
        return sorted(i for i, workers in v.iterations.items() if i >= start and need <= workers.keys())

    def _prune(self, v: _Version) -> None:
        keep = self.options.window + self.options.recent + self.options.slack
        if len(v.iterations) > keep:
            for i in sorted(v.iterations)[: len(v.iterations) - keep]:
                del v.iterations[i]

    @staticmethod
    def _merge(workers: dict[tuple[int, int], WorkerSample]) -> list[dict]:
        """Per stage (in order): replica means of times, worst peak, union of active layers."""
        by_stage: dict[int, list[WorkerSample]] = {}
        for (s, _), w in sorted(workers.items()):
            by_stage.setdefault(s, []).append(w)
        out = []
        for s in sorted(by_stage):
            ws = by_stage[s]
            n = len(ws)

            def mean(attr: str, ws: list[WorkerSample] = ws, n: int = n) -> float:
                return sum(getattr(w, attr) for w in ws) / n

            out.append({
                "forward": mean("forward_s"), "backward": mean("backward_s"), "recompute": mean("recompute_s"),
                "compute": mean("forward_s") + mean("backward_s"), "comm": mean("comm_s"), "idle": mean("idle_s"),
                "peak": max(w.peak_memory_bytes for w in ws), "swapped": mean("swapped_bytes"),
                "layers": ws[0].layers, "active": tuple(sorted({i for w in ws for i in w.active_layers})),
                "replicas": n,
            })
        return out

    def _changes(self, per_iter: list[list[dict]]) -> list[WorkloadChange]:
        opt = self.options
        if len(per_iter) <= opt.recent:
            return []
        recent, before = per_iter[-opt.recent:], per_iter[-opt.recent - opt.window: -opt.recent]
        out = []
        busiest = max(_median(r[s]["compute"] for r in before) for s in range(len(before[0])))
        for s in range(len(recent[0])):
            a = _median(r[s]["compute"] for r in before)
            now = [r[s]["compute"] for r in recent]
            b = _median(now)
            act_a, act_b = before[-1][s]["active"], recent[-1][s]["active"]
            t = opt.change_threshold
            jumped = min(now) > a * (1 + t) or max(now) < a * (1 - t) if a > 0 else min(now) > 0
            jumped = jumped and abs(b - a) >= opt.change_floor * busiest
            if jumped or act_a != act_b:
                out.append(WorkloadChange(s, a, b, act_a, act_b))
        return out


def _spread(values: list[float]) -> float:
    """Range of the values, without the lowest and highest once there are 5 (one straggler is not noise)."""
    ordered = sorted(values)
    if len(ordered) >= 5:
        ordered = ordered[1:-1]
    return ordered[-1] - ordered[0]


def _median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


__all__ = ["MonitorOptions", "Observation", "StageObservation", "TrainingMonitor", "WorkerSample", "WorkloadChange"]
