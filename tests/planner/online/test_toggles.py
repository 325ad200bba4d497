"""Layer toggles as known workload changes: the switches they make, and the online planner waiting for one
rather than deciding on a window the switch will end (services/planner/online/toggles.py, jobs/rebalance.py)."""

from __future__ import annotations

import pytest

from ballast.v1 import executor_pb2, job_pb2, plan_pb2
from services.planner.jobs.rebalance import Rebalancer
from services.planner.online import MonitorOptions
from services.planner.online.toggles import Switch, switches, unsettled


def toggle(layer: int, iteration: int, active: bool) -> job_pb2.LayerToggle:
    return job_pb2.LayerToggle(layer_index=layer, iteration=iteration, active=active)


def test_switches_are_the_real_state_changes_in_order() -> None:
    toggles = [toggle(4, 30, True), toggle(3, 0, False), toggle(4, 0, False), toggle(3, 30, True),
               toggle(5, 10, True),  # never off: switching it on changes nothing
               toggle(3, 50, True)]  # already on since 30
    assert switches(toggles) == [Switch(0, off=(3, 4)), Switch(30, on=(3, 4))]
    assert switches([]) == []


def test_the_last_toggle_of_a_layer_at_one_iteration_wins_as_on_the_workers() -> None:
    assert switches([toggle(2, 5, False), toggle(2, 5, True)]) == []
    assert switches([toggle(2, 5, True), toggle(2, 5, False), toggle(1, 5, False)]) == [Switch(5, off=(1, 2))]


def test_unsettled_takes_switches_after_the_window_start_up_to_the_horizon() -> None:
    toggles = [toggle(3, 0, False), toggle(3, 30, True), toggle(2, 40, False)]
    assert unsettled(toggles, 0, 29) == []  # the switch at 0 is before every measured iteration
    assert unsettled(toggles, 20, 30) == [Switch(30, on=(3,))]
    assert unsettled(toggles, 30, 39) == []  # a window from the switch on measures the new workload
    assert unsettled(toggles, 25, 45) == [Switch(30, on=(3,)), Switch(40, off=(2,))]
    assert (Switch(30, on=(3, 4), off=(2,)).describe()
            == "layer(s) 3, 4 switch on and layer(s) 2 switch off at iteration 30")


class Proposed(Exception):
    """Raised by the fake store where the rebalancer goes on to price a proposal (it reads the profile first)."""


class FakeStore:
    """Records the events the rebalancer appends; reading the profile means it did not defer."""

    def __init__(self) -> None:
        self.events: list[job_pb2.JobEvent] = []

    def append_job_event(self, request) -> job_pb2.JobEvent:
        self.events.append(request.event)
        return request.event

    def get_profile(self, request):
        raise Proposed


WINDOW = MonitorOptions(window=5, warmup=1, recent=2)


def online_job(toggles: list[job_pb2.LayerToggle]) -> tuple[job_pb2.Job, plan_pb2.Plan]:
    spec = job_pb2.JobSpec(iterations=60, online_repartition=True, pipeline_stages=2, layer_toggles=toggles)
    plan = plan_pb2.Plan(id="pln-1", version=1, profile_id="prf-1",
                         stages=[plan_pb2.Stage(devices=1), plan_pb2.Stage(devices=1)])
    return job_pb2.Job(id="job-1", spec=spec, state=job_pb2.JOB_STATE_RUNNING, plan_id=plan.id, plan_version=1), plan


def feed(rebalancer: Rebalancer, first: int, last: int) -> None:
    """Both stages report iterations first..last (stage 0 does most of the work: worth a decision)."""
    for it in range(first, last + 1):
        for stage, layers, compute in ((0, [0, 1, 2], 0.05), (1, [3, 4, 5], 0.01)):
            rebalancer.observe(executor_pb2.StageStats(
                job_id="job-1", stage_index=stage, iteration=it, plan_version=1, forward_s=compute / 3,
                backward_s=compute * 2 / 3, layers=layers, active_layers=layers, iteration_time_s=0.07))


def rebalancer_for(toggles: list[job_pb2.LayerToggle]) -> tuple[Rebalancer, FakeStore, job_pb2.Job]:
    store = FakeStore()
    rebalancer = Rebalancer(store, send=lambda host, message: None, transition=lambda *a, **k: None,
                            monitor=WINDOW)
    job, plan = online_job(toggles)
    rebalancer.track(job, plan, ["hst-a", "hst-b"])
    return rebalancer, store, job


def test_a_switch_within_the_next_measured_iterations_defers_the_decision_once() -> None:
    rebalancer, store, job = rebalancer_for([toggle(3, 0, False), toggle(3, 30, True)])
    feed(rebalancer, 0, 26)  # the next iteration is 27: a move needs 27..32, past the switch at 30
    assert rebalancer.consider(job) is None
    assert [e.type for e in store.events] == ["REPARTITION_SKIPPED"]
    assert store.events[0].attributes["switch_iteration"] == "30"
    assert "layer(s) 3 switch on at iteration 30" in store.events[0].message
    feed(rebalancer, 27, 31)  # a window straddling the switch: deferred again, told once
    assert rebalancer.consider(job) is None and len(store.events) == 1
    feed(rebalancer, 32, 37)  # measured after the switch: the rebalancer goes on to price a proposal
    with pytest.raises(Proposed):
        rebalancer.consider(job)


def test_a_switch_far_enough_ahead_or_none_leaves_the_decision_to_the_planner() -> None:
    for toggles in ([toggle(3, 0, False), toggle(3, 40, True)], []):
        rebalancer, store, job = rebalancer_for(toggles)
        feed(rebalancer, 0, 26)  # a move decided now is measured by iteration 32, before 40
        with pytest.raises(Proposed):
            rebalancer.consider(job)
        assert store.events == []
