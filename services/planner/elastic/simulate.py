"""Event-driven fleet simulator: a trace replayed through the allocation policies and the scaling curves,
no training. Events are arrivals, job finishes and, for elastic, a periodic re-allocation tick; a resize
pauses the job's progress for the morph cost while it holds its new devices. Every policy replays the same
trace, so their results compare side by side; a trace some job of which could never run is refused before
anything is simulated, and a replay that stalls raises instead of reporting part of a result.

It predicts what the live scheduler would do: a job holding n devices runs the plan for n
(ScalingCurve.rate_on), pays what a plane measures outside its iterations (JobCosts), and `elastic` is
replayed as the live scheduler runs it: its admission engine starts queued jobs on their request, or on the
most free devices of their range (re-planned), and the elastic pass (policy.allocate) decides only when the
engine started nobody. benchmarks/fleet_fidelity.py holds the predictions against a real plane.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.planner.elastic.curves import ScalingCurve
from services.planner.elastic.policy import ELASTIC, POLICIES, Curves, ElasticPolicy, JobState, allocate, backfill
from services.planner.elastic.trace import TraceJob
from services.runtime.errors import FailedPrecondition, InvalidArgument

DEFAULT_MORPH_COST_S = 60.0  # re-plan, checkpoint per layer, restart on the new devices (assumed)


@dataclass(frozen=True)
class JobCosts:
    """Seconds a job spends outside its iterations. Negligible against hours of training (the default), not
    against the minutes of a test plane's jobs, where a plane measures them (benchmarks/fleet_fidelity.py)."""

    prepare_s: float = 0.0  # submission to queued (profiled, planned): before it may be given devices
    start_s: float = 0.0  # given devices to its first iteration (workers, process group, model), holding them
    end_s: float = 0.0  # its last iteration to its end, still holding its devices
    replan_s: float = 0.0  # elastic: started on another count than its plan asks for, the re-plan first

    def __post_init__(self) -> None:
        for name in ("prepare_s", "start_s", "end_s", "replan_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise InvalidArgument(f"{name} {getattr(self, name)} is not a finite number of seconds >= 0",
                                      field=name, fix="measure it on the plane, or leave it 0")


@dataclass
class PolicyResult:
    """One policy's replay: per-job figures keyed by job name, and the fleet's use over time."""

    policy: str
    jct_s: dict[str, float]
    wait_s: dict[str, float]
    fairness: dict[str, float]  # JCT / the job's run time alone on its requested devices
    makespan_s: float
    utilisation: float  # device-seconds held / (devices x makespan)
    morphs: int
    utilisation_series: list[tuple[float, int]] = field(default_factory=list)  # (time, devices held from then)

    @property
    def average_jct_s(self) -> float:
        return sum(self.jct_s.values()) / len(self.jct_s)

    @property
    def p99_jct_s(self) -> float:
        ordered = sorted(self.jct_s.values())
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    @property
    def average_wait_s(self) -> float:
        return sum(self.wait_s.values()) / len(self.wait_s)

    @property
    def worst_fairness(self) -> float:
        return max(self.fairness.values())

    @property
    def peak_devices(self) -> int:
        return max(n for _, n in self.utilisation_series)


@dataclass
class _Job:
    """A submitted job's progress in one replay."""

    spec: TraceJob
    remaining: float
    devices: int = 0
    paused_until: float = -math.inf
    started: float | None = None
    last_resize: float = -math.inf


def simulate(
    trace: Sequence[TraceJob],
    devices: int,
    policies: Sequence[str | ElasticPolicy] = POLICIES,
    curves: Curves | None = None,
    *,
    morph_cost_s: float = DEFAULT_MORPH_COST_S,
    costs: JobCosts = JobCosts(),
) -> dict[str, PolicyResult]:
    """Each policy's replay of `trace` on `devices` devices, keyed by policy name; `costs` are each job's
    seconds outside its iterations. A job holding n devices runs the plan for n (ScalingCurve.rate_on)."""
    curves = curves or {}
    chosen = [p if isinstance(p, ElasticPolicy) else ElasticPolicy(name=p) for p in policies]
    _check(trace, devices, curves)
    return {p.name: _replay(trace, devices, p, curves, morph_cost_s, costs) for p in chosen}


def _check(trace: Sequence[TraceJob], devices: int, curves: Curves) -> None:
    if not trace:
        raise InvalidArgument("the trace has no jobs", field="trace", fix="pass at least one job")
    names = [j.name for j in trace]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise InvalidArgument(f"job name {twice!r} appears twice", field="name", fix="give every job a unique name")
    for j in trace:
        curve = curves.get((j.model, j.global_batch_size))
        if curve is None:
            raise InvalidArgument(f"job {j.name}: no scaling curve for {j.model} at global batch {j.global_batch_size}",
                                  field="curves", fix="build a curve for every (model, global_batch_size) in the trace")
        if j.requested_devices > devices or curve.rate(j.requested_devices) <= 0:
            raise InvalidArgument(f"job {j.name} cannot run on its {j.requested_devices} requested devices "
                                  f"(fleet {devices}, fewest its curve runs on {curve.min_devices or 'none'})",
                                  field="requested_devices", fix="request a count its plan fits and the fleet has")


def _replay(trace: Sequence[TraceJob], devices: int, policy: ElasticPolicy, curves: Curves,
            morph_cost_s: float, costs: JobCosts) -> PolicyResult:
    arrivals = sorted(trace, key=lambda j: (j.submit_time_s, j.name))  # each joins the queue once prepared
    ticking = policy.name == ELASTIC
    jobs: dict[str, _Job] = {}
    done: dict[str, float] = {}
    started: dict[str, float] = {}
    now, nxt, busy, morphs = arrivals[0].submit_time_s + costs.prepare_s, 0, 0.0, 0
    next_tick = now + policy.tick_s
    series: list[tuple[float, int]] = [(now, 0)]
    while nxt < len(arrivals) or jobs:
        ends = {name: _finish(j, now, curves) for name, j in jobs.items() if j.devices}
        t = min(ends.values(), default=math.inf)
        if nxt < len(arrivals):
            t = min(t, arrivals[nxt].submit_time_s + costs.prepare_s)
        if ticking and ends:  # with nothing running a tick changes nothing: only an arrival can
            t = min(t, next_tick)
        if math.isinf(t):
            stuck = next(iter(jobs))
            raise FailedPrecondition(f"policy {policy.name}: job {stuck} waits forever on {devices} devices",
                                     field="trace", fix="give every job a device range the fleet can run")
        busy += series[-1][1] * (t - now)
        for j in jobs.values():
            if j.devices:
                active = t - max(now, j.paused_until)
                if active > 0:
                    j.remaining -= active / _job_curve(j, curves).iteration_s_on(j.devices)
        now = t
        for name, end in ends.items():
            if end <= now:
                done[name] = now
                del jobs[name]
        while nxt < len(arrivals) and arrivals[nxt].submit_time_s + costs.prepare_s <= now:
            spec = arrivals[nxt]
            jobs[spec.name] = _Job(spec, float(spec.iterations))
            nxt += 1
        if next_tick <= now:
            next_tick = now + policy.tick_s
        current = {name: j.devices for name, j in jobs.items() if j.devices}
        states = [_state(j) for j in jobs.values()]
        waiting = len(current) < len(jobs) and sum(current.values()) < devices
        if ticking:  # as the live scheduler: the admission engine first (a request, or re-planned within a range)
            out = backfill(devices, states, curves, now, policy, current, ranges=True) if waiting else current
            if out == current:  # the elastic pass only when the engine started nobody
                out = allocate(devices, states, curves, now, policy, current, morph_cost_s)
        elif waiting:
            out = allocate(devices, states, curves, now, policy, current, morph_cost_s)
        else:
            out = current  # a static policy keeps running jobs as they are: only free devices and a queue change it
        morphs += _apply(jobs, out, now, devices, policy.name, morph_cost_s, costs)
        started.update((name, now) for name, j in jobs.items() if j.devices and name not in started)
        held = sum(j.devices for j in jobs.values())
        if held != series[-1][1]:
            series.append((now, held))
    return _result(policy.name, trace, curves, devices, done, started, busy, morphs, series)


def _result(policy: str, trace: Sequence[TraceJob], curves: Curves, devices: int, done: dict[str, float],
            started: dict[str, float], busy: float, morphs: int, series: list[tuple[float, int]]) -> PolicyResult:
    makespan = max(done.values()) - min(j.submit_time_s for j in trace)
    jct = {j.name: done[j.name] - j.submit_time_s for j in trace}
    alone = {j.name: j.iterations * curves[(j.model, j.global_batch_size)].iteration_s_on(j.requested_devices)
             for j in trace}
    return PolicyResult(
        policy=policy, jct_s=jct, wait_s={j.name: started[j.name] - j.submit_time_s for j in trace},
        fairness={name: jct[name] / alone[name] for name in jct}, makespan_s=makespan,
        utilisation=busy / (devices * makespan) if makespan > 0 else 0.0, morphs=morphs, utilisation_series=series)


def _job_curve(j: _Job, curves: Curves) -> ScalingCurve:
    return curves[(j.spec.model, j.spec.global_batch_size)]


def _finish(j: _Job, now: float, curves: Curves) -> float:
    """When a running job finishes if nothing changes: after its morph pause, its remaining iterations."""
    return max(now, j.paused_until) + max(0.0, j.remaining) * _job_curve(j, curves).iteration_s_on(j.devices)


def _state(j: _Job) -> JobState:
    s = j.spec
    return JobState(s.name, s.tenant, s.priority, s.submit_time_s, s.model, s.global_batch_size, max(0.0, j.remaining),
                    s.requested_devices, s.min_devices, s.max_devices, j.last_resize, s.iterations)


def _apply(jobs: dict[str, _Job], out: dict[str, int], now: float, devices: int, policy: str,
           morph_cost_s: float, costs: JobCosts = JobCosts()) -> int:
    """Take the new allocation: starts, and resizes that pause for the morph; the number of morphs. A start
    pauses for the start and end costs (the job holds its devices for both; folding the end in at the start
    changes neither its completion nor, unless it is resized later, its device-seconds), and for a re-plan when
    an elastic job starts on another count than it asked for.
    A policy that oversubscribes the fleet, stops a running job or exceeds a job's range is a bug, and
    raises rather than producing a result."""
    if sum(out.values()) > devices:
        raise FailedPrecondition(f"policy {policy} allocated {sum(out.values())} of {devices} devices",
                                 field="policy", fix="a bug in the policy: report it with the trace")
    morphs = 0
    for name, j in jobs.items():
        new = out.get(name, 0)
        if j.devices and not new:
            raise FailedPrecondition(f"policy {policy} stopped running job {name}", field="policy",
                                     fix="a bug in the policy: report it with the trace")
        if new > max(j.spec.max_devices, j.spec.requested_devices):
            raise FailedPrecondition(f"policy {policy} gave job {name} {new} devices, above its range",
                                     field="policy", fix="a bug in the policy: report it with the trace")
        if new == j.devices:
            continue
        if j.devices:  # a resize (starting is not one: the interval between resizes counts from the first)
            j.paused_until = max(now, j.paused_until) + morph_cost_s
            j.last_resize = now
            morphs += 1
        else:
            replan = costs.replan_s if policy == ELASTIC and new != j.spec.requested_devices else 0.0
            j.paused_until = now + costs.start_s + costs.end_s + replan
        j.devices = new
    return morphs
