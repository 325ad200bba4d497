"""Windows of iterations from the agents (services/executor/telemetry.py) through the scheduler: each stands for
its iterations in the straggler watch and the grow check, and the rows of many heartbeats reach the store in one
call at the next tick. The store is real (SQLite and PostgreSQL); the heartbeats are the agents'."""

from __future__ import annotations

import pytest

from ballast.v1 import executor_pb2, store_pb2
from services.executor.telemetry import StatsWindow
from services.planner.jobs.running import GROW_WINDOW
from tests.harness import covered
from tests.planner.jobs.test_scheduler_calibration import running_job
from tests.planner.jobs.test_scheduler_checkpoints import scheduler_for
from tests.store_fixtures import Store


class Counting:
    """The platform's store, counting WriteIterationMetrics calls."""

    def __init__(self, store):
        self._store, self.writes = store, 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def write_iteration_metrics(self, request):
        self.writes += 1
        return self._store.write_iteration_metrics(request)


def test_windows_feed_the_straggler_watch_and_the_grow_check_and_reach_the_store_in_one_call(store: Store, tmp_path):
    job = running_job(store)
    platform = Counting(store.as_(store.admin))
    scheduler = scheduler_for(platform, tmp_path, job)
    running = scheduler._running[job.id]
    running.stutter_next = 10**9  # the watch is read here; what a verdict leads to is test_straggler's
    # two replicas of one stage, the second three times slower, each sending windows of 20 as its agent would
    agents = {replica: StatsWindow(20) for replica in (0, 1)}
    for iteration in range(40):
        for replica, compute in ((0, 0.1), (1, 0.3)):
            stats = executor_pb2.StageStats(job_id=job.id, iteration=iteration, replica_index=replica,
                                            plan_version=running.plan.version, forward_s=compute / 3,
                                            backward_s=2 * compute / 3, iteration_time_s=compute + 0.05)
            windows = agents[replica].add(stats)
            if windows:
                scheduler.on_message(f"host-{replica}", executor_pb2.AgentMessage(
                    heartbeat=executor_pb2.Heartbeat(stages=windows)))
    assert running.iteration == 40
    finding = running.watch.straggler()  # two windows of 17 and 20 iterations fill its 6-iteration history
    assert finding is not None and finding.replica == 1 and finding.ratio == pytest.approx(3.0)
    assert len(running.recent) == GROW_WINDOW and running.recent[-1] == pytest.approx(0.15)
    assert platform.writes == 0  # kept for the tick: one call for every heartbeat since
    scheduler._rows.flush()
    assert platform.writes == 1
    rows = store.as_(store.a).list_iteration_metrics(store_pb2.ListIterationMetricsRequest(job_id=job.id)).metrics
    assert len(rows) == 2 * 5 and all(its == list(range(40)) for its in covered(rows).values())


def test_a_verdict_waits_for_every_replica_of_the_iteration(store: Store, tmp_path, monkeypatch):
    """Rows of one iteration (raw metrics) come from each host in its own heartbeat: the watch is judged once the
    last replica's row is in, not as the first arrives (then it would find its peers one row behind, judge
    nothing, and wait a whole window for the next try: a straggler was never left out)."""
    job = running_job(store)
    scheduler = scheduler_for(Counting(store.as_(store.admin)), tmp_path, job)
    running = scheduler._running[job.id]
    verdicts = []
    monkeypatch.setattr(scheduler.stragglers, "check", lambda r: verdicts.append(r.watch.straggler()))
    for iteration in range(20):
        for replica, compute in ((0, 0.1), (1, 0.3)):
            scheduler.on_message(f"host-{replica}", executor_pb2.AgentMessage(heartbeat=executor_pb2.Heartbeat(
                stages=[executor_pb2.StageStats(job_id=job.id, iteration=iteration, replica_index=replica,
                                                plan_version=running.plan.version, forward_s=compute,
                                                iteration_time_s=compute)])))
    assert len(verdicts) >= 2 and all(v is not None and v.replica == 1 for v in verdicts)
