"""Fail-stutter detection's pure part: who is a straggler, and whether leaving it out is faster."""

from __future__ import annotations

import pytest

from services.planner.jobs.state import SchedulerState
from services.planner.jobs.stragglers import Stragglers
from services.planner.jobs.stutter import Finding, StutterWatch, faster_without


def fill(watch: StutterWatch, times: dict[tuple[int, int], float], count: int) -> None:
    for _ in range(count):
        for (stage, replica), t in times.items():
            watch.observe(stage, replica, t)


def test_a_replica_twice_as_slow_as_its_peers_is_found_once_its_window_is_full():
    watch = StutterWatch(window=10, threshold=0.2)
    times = {(0, 0): 0.10, (0, 1): 0.20, (0, 2): 0.10}
    fill(watch, times, 9)
    assert watch.straggler() is None  # not a full window yet
    fill(watch, times, 1)
    found = watch.straggler()
    assert (found.stage, found.replica) == (0, 1) and found.ratio == pytest.approx(2.0)
    assert found.evidence()["window"] == 10 and found.evidence()["peers_compute_s"] == pytest.approx(0.1)


def test_noise_below_the_threshold_and_a_lone_replica_are_not_stragglers():
    watch = StutterWatch(window=5, threshold=0.2)
    fill(watch, {(0, 0): 0.10, (0, 1): 0.115, (1, 0): 0.5}, 5)  # stage 1 has no peer to compare with
    assert watch.straggler() is None


def test_one_slow_iteration_in_a_window_is_not_persistent():
    watch = StutterWatch(window=5, threshold=0.2)
    for i in range(5):
        watch.observe(0, 0, 0.1)
        watch.observe(0, 1, 0.5 if i == 2 else 0.1)
    assert watch.straggler() is None


def test_the_simulators_re_plan_corrected_by_its_error_on_the_healthy_layout_decides():
    slow = Finding(stage=0, replica=2, ratio=2.0, own_s=0.2, peers_s=0.1, window=10)
    # measured 0.22 s: everyone waits for the straggler's 0.2 s of compute; healthy it would be 0.12 s.
    # The simulator predicted 0.10 s for the current plan (20% optimistic) and 0.14 s re-planned on the rest.
    assert faster_without(0.22, slow, 0.10, 0.14) == pytest.approx(0.168)  # < 0.22 s: worth leaving it out
    assert faster_without(0.22, slow, 0.10, 0.20) == pytest.approx(0.24)  # the rest too few: no better
    assert faster_without(0.22, slow, 0.10, 0.0) is None  # no plan fits the devices left
    assert faster_without(0.22, slow, 0.0, 0.14) is None


class _Store:
    """A job's plans and iteration rows, as the store lists them (one page)."""

    def __init__(self, plans: list, metrics: list):
        self.plans, self.metrics = plans, metrics

    def list_plans(self, request):
        from ballast.v1 import store_pb2
        return store_pb2.ListPlansResponse(plans=self.plans)

    def list_iteration_metrics(self, request):
        from ballast.v1 import store_pb2
        return store_pb2.ListIterationMetricsResponse(metrics=self.metrics)


def _never_drained(r, cause, detail, to_devices=0):
    raise AssertionError("judging a layout drains no job")


def _plan(version: int, replicas: int):
    from ballast.v1 import plan_pb2
    return plan_pb2.Plan(id=f"pln-{version}", version=version, micro_batch_size=replicas,
                         stages=[plan_pb2.Stage(devices=replicas)],
                         layers=[plan_pb2.LayerStrategy(layer_index=0, dp=replicas)])


def _rows(version: int, seconds: float, count: int = 10) -> list:
    from ballast.v1 import job_pb2
    return [job_pb2.IterationMetric(plan_version=version, iteration=i, iteration_time_s=seconds) for i in range(count)]


def test_a_layout_the_job_already_ran_is_judged_by_its_measurement_not_the_simulator():
    """A job that grew from one device to two has measured itself on one: a co-located worker that reads slow
    is kept when the job ran slower on one device than it does now (no grow, shrink, grow loop)."""
    from ballast.v1 import job_pb2
    from services.planner.jobs.running import Running

    def probe(store) -> Stragglers:
        def replanned_s(r, devices):
            raise AssertionError("a measured layout needs no re-plan")

        stragglers = Stragglers(SchedulerState(store), drain=_never_drained)
        stragglers._replanned_s = replanned_s
        return stragglers

    one, two = _plan(1, 1), _plan(2, 2)
    store = _Store([one, two], _rows(1, 0.30) + _rows(2, 0.20))
    running = Running(job=job_pb2.Job(id="job-1"), plan=two, hosts=["a", "b"], world=2)
    slow = Finding(stage=0, replica=1, ratio=1.4, own_s=0.14, peers_s=0.10, window=6)
    without, source, _ = probe(store)._time_without(running, slow, 1, now=0.20)
    assert without == pytest.approx(0.30)  # slower than the 0.20 s now: keeping the worker is faster
    assert "measured" in source and "plan v1" in source
    store.metrics = []  # cached per device count: the rows are read once
    assert probe(store)._measured_on(running, 1) == (pytest.approx(0.30), 1)
    assert probe(_Store([one, two], _rows(2, 0.2)))._measured_on(Running(
        job=job_pb2.Job(id="job-1"), plan=two, hosts=["a", "b"], world=2), 1) == (0.0, 0)  # never ran on one


def test_cpu_workers_sharing_a_machine_are_judged_with_the_wider_threshold():
    """Two CPU agents on one box compete for its cores: a 40% skew there is the OS scheduler, not a slow host;
    a 2x slow worker is still found. GPUs, or CPU workers each on a machine of their own, keep 25%."""
    from ballast.v1 import fleet_pb2, plan_pb2

    stragglers = Stragglers(SchedulerState(_Store([], [])), drain=_never_drained, thresholds=(0.25, 0.5))

    def plan(kind: str):
        return plan_pb2.Plan(fleet=fleet_pb2.Fleet(device=fleet_pb2.DeviceSpec(kind=kind)))

    shared = stragglers.watch_for(plan("cpu"), ["127.0.0.1", "127.0.0.1"])
    apart = stragglers.watch_for(plan("cpu"), ["10.0.0.1", "10.0.0.2"])
    gpus = stragglers.watch_for(plan("h100"), ["10.0.0.1", "10.0.0.1"])
    assert (shared.threshold, apart.threshold, gpus.threshold) == (0.5, 0.25, 0.25)
    for watch, skew, found in ((shared, 0.14, False), (shared, 0.20, True), (apart, 0.14, True)):
        fill(watch, {(0, 0): 0.10, (0, 1): skew}, watch.window)
        assert (watch.straggler() is not None) is found, (watch.threshold, skew)


def test_replicas_are_judged_on_the_same_iterations():
    """Windows of iterations arrive from each host in its own time: a replica whose newest window is in is not
    compared with a peer still at the window before (a workload that changed between them is no straggler)."""
    watch = StutterWatch(window=3, threshold=0.2)
    for _ in range(3):
        watch.observe(0, 0, 0.1, iteration=19)
        watch.observe(0, 1, 0.1, iteration=19)
    for _ in range(3):
        watch.observe(0, 1, 0.5, iteration=39)  # the next window, a heavier one, from replica 1 only so far
    assert watch.straggler() is None
    for _ in range(3):
        watch.observe(0, 0, 0.5, iteration=39)  # replica 0's arrives: as heavy, so nobody straggles
    assert watch.straggler() is None
    for _ in range(3):
        watch.observe(0, 1, 1.5, iteration=59)
        watch.observe(0, 0, 0.5, iteration=59)
    assert watch.straggler().replica == 1
