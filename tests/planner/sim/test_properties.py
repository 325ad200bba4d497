"""Invariants of the simulator over generated pipelines (hypothesis): monotonicity, resource exclusivity,
dependencies, path and engine agreement."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from services.planner.sim import Event, LinkCost, Pipeline, Schedule, SimOptions, SimResult, StageCost, simulate
from services.planner.sim.harmony import wrap_around_devices

EPS = 1e-9  # vectorised recurrences use prefix sums: results agree with the sequential definition to rounding
FIXED = [Schedule.GPIPE, Schedule.ONE_F_ONE_B]
ALL = list(Schedule)
# Derandomised and without the example database: the same examples every run, nothing written to disk.
EXAMPLES = settings(max_examples=80, deadline=None, derandomize=True, database=None)


@st.composite
def stage_costs(draw, swaps: bool = False) -> StageCost:
    duration = st.floats(0.01, 2.0)
    return StageCost(
        forward_s=draw(duration),
        backward_s=draw(duration),
        recompute_s=draw(st.one_of(st.just(0.0), duration)),
        output_bytes=draw(st.integers(0, 1000)),
        allreduce_s=draw(st.floats(0.0, 1.0)),
        model_memory_bytes=draw(st.integers(0, 10_000)),
        activation_bytes=draw(st.integers(0, 500)),
        transient_bytes=draw(st.integers(0, 500)),
        swap_bytes=draw(st.integers(0, 300)) if swaps else 0,
        weight_swap_bytes=draw(st.integers(0, 300)) if swaps else 0,
    )


@st.composite
def pipelines(draw, swaps: bool = False, max_stages: int = 5) -> Pipeline:
    P = draw(st.integers(1, max_stages))
    links = tuple(LinkCost(draw(st.floats(0.0, 0.3)), draw(st.floats(100.0, 1e4))) for _ in range(P - 1))
    return Pipeline(
        stages=tuple(draw(stage_costs(swaps)) for _ in range(P)),
        num_micro_batches=draw(st.integers(1, 8)),
        replicas=draw(st.integers(1, 3)),
        boundary_links=links,
        host_link=LinkCost(draw(st.floats(0.0, 0.1)), draw(st.floats(100.0, 1e4))),
    )


def for_schedule(pipe: Pipeline, schedule: Schedule, devices: int) -> Pipeline:
    """Harmony needs the wrap-around binding; the others run one stage per device."""
    if schedule is not Schedule.HARMONY_WRAP:
        return pipe
    return dataclasses.replace(pipe, device_of_stage=wrap_around_devices(len(pipe.stages), devices))


def bump(pipe: Pipeline, stage: int, **scale: float) -> Pipeline:
    stages = list(pipe.stages)
    stages[stage] = dataclasses.replace(stages[stage], **{k: getattr(stages[stage], k) * v for k, v in scale.items()})
    return dataclasses.replace(pipe, stages=tuple(stages))


@EXAMPLES
@given(pipelines(), st.sampled_from(FIXED), st.data())
def test_iteration_time_never_decreases_when_a_stage_computes_longer(pipe, schedule, data) -> None:
    stage = data.draw(st.integers(0, len(pipe.stages) - 1))
    field = data.draw(st.sampled_from(["forward_s", "backward_s", "recompute_s"]))
    factor = data.draw(st.floats(1.0, 5.0))
    options = SimOptions(schedule=schedule, keep_timeline=False)
    before = simulate(pipe, options).iteration_s
    after = simulate(bump(pipe, stage, **{field: factor}), options).iteration_s
    assert after >= before - EPS * before


@EXAMPLES
@given(pipelines(swaps=True), st.sampled_from(ALL), st.integers(1, 3), st.data())
def test_peak_memory_never_decreases_when_activations_grow(pipe, schedule, devices, data) -> None:
    pipe = for_schedule(pipe, schedule, devices)
    stage = data.draw(st.integers(0, len(pipe.stages) - 1))
    factor = data.draw(st.integers(1, 4))
    options = SimOptions(schedule=schedule, keep_timeline=False)
    before = simulate(pipe, options).peak_memory_bytes
    after = simulate(bump(pipe, stage, activation_bytes=factor), options).peak_memory_bytes
    assert all(a >= b for a, b in zip(after, before, strict=True))


def check_events(pipe: Pipeline, result: SimResult) -> None:
    """No resource does two things at once; every backward follows its forward and its recompute."""
    resources: dict[tuple, list[Event]] = defaultdict(list)
    tasks: dict[tuple[int, int, int, str], Event] = {}
    for e in result.events:
        assert e.end_s >= e.start_s - EPS
        if e.kind in ("forward", "recompute", "backward"):
            resources[("compute", e.replica, e.device)].append(e)
            tasks[(e.replica, e.stage, e.micro_batch, e.kind)] = e
        elif e.kind in ("send_activation", "send_gradient"):
            resources[(e.kind, e.replica, e.stage)].append(e)
        elif e.kind in ("swap_in", "swap_out"):
            resources[(e.kind, e.replica, e.device)].append(e)
    for events in resources.values():
        events.sort(key=lambda e: (e.start_s, e.end_s))
        for a, b in zip(events, events[1:], strict=False):
            assert b.start_s >= a.end_s - EPS, (a, b)
    replicas = {e.replica for e in result.events}
    for r in replicas:
        for s in range(len(pipe.stages)):
            for m in range(pipe.num_micro_batches):
                back, fwd = tasks[(r, s, m, "backward")], tasks[(r, s, m, "forward")]
                assert back.start_s >= fwd.end_s - EPS
                recompute = tasks.get((r, s, m, "recompute"))
                if recompute is not None:
                    assert recompute.start_s >= fwd.end_s - EPS
                    assert back.start_s >= recompute.end_s - EPS
                if s + 1 < len(pipe.stages):  # the gradient comes from the next stage's backward
                    assert back.start_s >= tasks[(r, s + 1, m, "backward")].end_s - EPS
                    assert fwd.end_s <= tasks[(r, s + 1, m, "forward")].start_s + EPS


@EXAMPLES
@given(pipelines(swaps=True), st.sampled_from(ALL), st.integers(1, 3), st.floats(0.0, 0.5), st.integers(0, 99))
def test_resources_are_exclusive_and_dependencies_hold(pipe, schedule, devices, jitter, seed) -> None:
    pipe = for_schedule(pipe, schedule, devices)
    options = SimOptions(schedule=schedule, compute_jitter=jitter, comm_jitter=jitter, seed=seed)
    result = simulate(pipe, options)
    check_events(pipe, result)
    assert {e.replica for e in result.events} == set(range(pipe.replicas if jitter > 0 else 1))
    assert 0.0 <= result.bubble_fraction < 1.0
    assert all(e.end_s <= result.iteration_s + EPS for e in result.events)


@EXAMPLES
@given(pipelines(swaps=True), st.sampled_from(ALL), st.integers(1, 3), st.floats(0.0, 0.5), st.integers(0, 99))
def test_pricing_and_full_paths_agree(pipe, schedule, devices, jitter, seed) -> None:
    pipe = for_schedule(pipe, schedule, devices)
    options = SimOptions(schedule=schedule, compute_jitter=jitter, comm_jitter=jitter, seed=seed)
    full = simulate(pipe, options)
    pricing = simulate(pipe, dataclasses.replace(options, keep_timeline=False))
    assert pricing.iteration_s == full.iteration_s
    assert pricing.peak_memory_bytes == full.peak_memory_bytes
    assert pricing.busy_s == full.busy_s
    assert pricing.events == () and pricing.memory_timeline == ()
    for peak, steps in zip(full.peak_memory_bytes, full.memory_timeline, strict=True):
        top = max(b for _, b in steps)
        assert top <= peak
        if jitter == 0 or pipe.replicas == 1:  # the timeline is replica 0's; the peak is the worst replica's
            assert top == peak


@EXAMPLES
@given(pipelines(), st.sampled_from(FIXED), st.floats(0.0, 0.5), st.integers(0, 99))
def test_vector_recurrence_and_event_engines_agree(pipe, schedule, jitter, seed) -> None:
    options = SimOptions(schedule=schedule, compute_jitter=jitter, comm_jitter=jitter, seed=seed)
    results = [simulate(pipe, options, engine=engine) for engine in ("vector", "recurrence", "events")]
    times = [r.iteration_s for r in results]
    assert max(times) - min(times) <= EPS * max(times)
    assert results[0].peak_memory_bytes == results[1].peak_memory_bytes == results[2].peak_memory_bytes
    keys = [sorted((e.kind, e.replica, e.stage, e.micro_batch) for e in r.events) for r in results]
    assert keys[0] == keys[1] == keys[2]
