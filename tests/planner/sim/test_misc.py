"""Jitter, links, replicas, Varuna's opportunism, validation and the Gantt chart."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from services.planner.sim import LinkCost, Pipeline, Schedule, SimOptions, StageCost, simulate
from services.planner.sim.core import F, Noise, R, prepare
from services.planner.sim.gantt import plot_timeline
from services.planner.sim.varuna import execute, generate

STAGE = StageCost(forward_s=1.0, recompute_s=0.5, backward_s=2.0, output_bytes=1_000_000, allreduce_s=0.3,
                  model_memory_bytes=10_000, activation_bytes=100, transient_bytes=50)


FAST_LINK = LinkCost(1e-3, 1e9)


def pipe(P: int = 4, Nm: int = 8, replicas: int = 1, link: LinkCost = FAST_LINK) -> Pipeline:
    return Pipeline(stages=(STAGE,) * P, num_micro_batches=Nm, replicas=replicas, boundary_links=(link,) * (P - 1))


@pytest.mark.parametrize("schedule", list(Schedule))
def test_jitter_is_deterministic_for_a_seed(schedule: Schedule) -> None:
    p = pipe(replicas=2)
    options = SimOptions(schedule=schedule, compute_jitter=0.2, comm_jitter=0.3, seed=7)
    a, b = simulate(p, options), simulate(p, options)
    assert a == b
    other = simulate(p, dataclasses.replace(options, seed=8))
    assert other.iteration_s != a.iteration_s
    still = simulate(p, SimOptions(schedule=schedule))
    assert still == simulate(p, SimOptions(schedule=schedule, seed=8))  # no jitter: the seed is irrelevant


def test_jittered_replicas_are_simulated_separately_and_allreduce_waits_for_the_slowest() -> None:
    p = pipe(replicas=3)
    result = simulate(p, SimOptions(schedule=Schedule.ONE_F_ONE_B, compute_jitter=0.3, seed=1))
    assert {e.replica for e in result.events} == {0, 1, 2}
    for s in range(4):
        last_backward = max(e.end_s for e in result.events if e.stage == s and e.kind == "backward")
        allreduces = [e for e in result.events if e.stage == s and e.kind == "allreduce"]
        assert len(allreduces) == 3
        assert all(e.start_s == pytest.approx(last_backward) for e in allreduces)
    single = simulate(pipe(replicas=1), SimOptions(schedule=Schedule.ONE_F_ONE_B, compute_jitter=0.3, seed=1))
    assert {e.replica for e in single.events} == {0}
    # Without jitter replicas are identical: one is simulated, swaps and events are not multiplied.
    calm = simulate(p, SimOptions(schedule=Schedule.ONE_F_ONE_B))
    assert {e.replica for e in calm.events} == {0}


@pytest.mark.parametrize("schedule", list(Schedule))
def test_slow_links_lengthen_the_iteration(schedule: Schedule) -> None:
    fast = simulate(pipe(link=LinkCost(1e-4, 1e10)), SimOptions(schedule=schedule))
    slow = simulate(pipe(link=LinkCost(0.05, 1e6)), SimOptions(schedule=schedule))  # 1.05 s per transfer
    assert slow.iteration_s > fast.iteration_s
    sends = [e for e in slow.events if e.kind.startswith("send")]
    assert sends and all(e.end_s - e.start_s == pytest.approx(1.05) for e in sends)


def test_allreduce_ends_the_iteration() -> None:
    base = simulate(pipe(), SimOptions(schedule=Schedule.GPIPE))
    longer = pipe()
    longer = dataclasses.replace(longer, stages=(dataclasses.replace(STAGE, allreduce_s=5.0),) + longer.stages[1:])
    result = simulate(longer, SimOptions(schedule=Schedule.GPIPE))
    last_backward_0 = max(e.end_s for e in result.events if e.stage == 0 and e.kind == "backward")
    assert result.iteration_s == pytest.approx(max(base.iteration_s, last_backward_0 + 5.0))


def test_varuna_runs_the_next_forward_when_a_gradient_is_late() -> None:
    prep = prepare(pipe(P=3, Nm=8), Schedule.VARUNA)
    static = generate(prep)
    planned = static[0]
    assert planned.index((R, 0)) < planned.index((F, 6))  # the rules put stage 0's first recompute before F6
    strict = execute(prep, static, Noise(), record=False, opportunistic=False)
    eager = execute(prep, static, Noise(), record=False, opportunistic=True)
    assert [(k, m) for k, m, _, _ in strict.tasks[0]] == planned
    ran = [(k, m) for k, m, _, _ in eager.tasks[0]]
    # When R0 comes up its gradient has not arrived, so stage 0 runs its remaining forwards first.
    assert ran.index((F, 7)) < ran.index((R, 0)) and sorted(ran) == sorted(planned)
    assert eager.last_backward_end[0] < strict.last_backward_end[0]
    # A gradient delayed by jitter is absorbed the same way, and the run still completes.
    grad = np.ones((3, 8))
    grad[0, 1] = 5000.0
    late = execute(prep, static, Noise(grad=grad), record=False, opportunistic=True)
    assert late.last_backward_end[0] > eager.last_backward_end[0]


def test_invalid_pipelines_are_rejected() -> None:
    with pytest.raises(ValueError, match="boundary_links"):
        simulate(Pipeline(stages=(STAGE,) * 3, num_micro_batches=2, boundary_links=(LinkCost(),)), SimOptions())
    with pytest.raises(ValueError, match="repeats a device"):
        simulate(Pipeline(stages=(STAGE,) * 2, num_micro_batches=2, device_of_stage=(0, 0)), SimOptions())
    with pytest.raises(ValueError, match="wrap-around"):
        simulate(Pipeline(stages=(STAGE,) * 3, num_micro_batches=2, device_of_stage=(0, 1, 1)),
                 SimOptions(schedule=Schedule.HARMONY_WRAP))
    with pytest.raises(ValueError, match="at least one"):
        simulate(Pipeline(stages=(STAGE,), num_micro_batches=0), SimOptions())
    with pytest.raises(ValueError, match="negative"):
        simulate(Pipeline(stages=(dataclasses.replace(STAGE, forward_s=-1.0),), num_micro_batches=1), SimOptions())


def test_gantt_writes_a_png(tmp_path) -> None:
    p = dataclasses.replace(pipe(P=3, Nm=4, replicas=2), host_link=LinkCost(0.0, 1e3),
                            stages=(dataclasses.replace(STAGE, swap_bytes=100),) * 3)
    result = simulate(p, SimOptions(schedule=Schedule.ONE_F_ONE_B, compute_jitter=0.1, seed=3))
    out = plot_timeline(result, tmp_path / "gantt.png", title="1F1B, 3 stages")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    with pytest.raises(ValueError):
        plot_timeline(simulate(p, SimOptions(keep_timeline=False)), tmp_path / "empty.png")


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.VARUNA])
def test_the_optimizer_step_follows_the_gradient_sync(schedule: Schedule) -> None:
    stages = tuple(StageCost(forward_s=1.0, backward_s=2.0, allreduce_s=0.5) for _ in range(2))
    base = simulate(Pipeline(stages=stages, num_micro_batches=4), SimOptions(schedule=schedule)).iteration_s
    stepped = tuple(dataclasses.replace(s, update_s=0.25) for s in stages)
    after = simulate(Pipeline(stages=stepped, num_micro_batches=4), SimOptions(schedule=schedule)).iteration_s
    assert after == pytest.approx(base + 0.25)
