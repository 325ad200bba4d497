"""How the scheduler reads a worker that ended before its job: a stop it did not ask for (an agent shutting down
stops its workers, which exit 143) is the infrastructure going away and morphs the job; an error in the model's
code fails it. And each admission pass is timed for the planner's metrics."""

from __future__ import annotations

import pytest

from ballast.v1 import executor_pb2, job_pb2, plan_pb2, store_pb2
from services.planner.jobs.running import Running
from services.planner.jobs.scheduler import Scheduler
from tests.planner.jobs.test_scheduler_calibration import running_job
from tests.store_fixtures import Store

S = job_pb2.JobState


@pytest.mark.parametrize("code, message, state", [
    (143, "stopped", S.JOB_STATE_MORPHING),  # its agent shut down: not the model's doing
    (-9, "", S.JOB_STATE_MORPHING),
    (1, "ValueError: the model raised", S.JOB_STATE_FAILED),
])
def test_a_worker_that_ends_unasked_morphs_the_job_unless_the_model_raised(store: Store, tmp_path, code: int,
                                                                           message: str, state: int) -> None:
    sent: list = []
    scheduler = Scheduler(store.as_(store.admin), lambda host, m: sent.append((host, m)), lambda: ["host-1"],
                          tmp_path)
    job = running_job(store)
    scheduler._running[job.id] = Running(job, plan_pb2.Plan(), ["host-1"], 2)
    scheduler._exited("host-1", executor_pb2.WorkerExit(job_id=job.id, rank=1, exit_code=code, iteration=4,
                                                        message=message))
    assert store.as_(store.a).get_job(store_pb2.GetRequest(id=job.id)).state == state


def test_every_admission_pass_is_timed_for_the_metrics(store: Store, tmp_path, monkeypatch) -> None:
    """benchmarks/fleet_scale.py replay reads the pass's p50/p99 off the planner's histogram (a recorder stands in
    for it: other planes in this process may be observing passes of their own)."""
    from services.planner.jobs import scheduler as module

    seen: list[float] = []

    class Recorder:
        def observe(self, seconds: float) -> None:
            seen.append(seconds)

    monkeypatch.setattr(module, "ADMISSION_PASS_SECONDS", Recorder())
    scheduler = Scheduler(store.as_(store.admin), lambda host, m: None, lambda: [], tmp_path)
    scheduler.tick()
    scheduler.tick()
    assert len(seen) == 2 and all(0 <= s < 60 for s in seen)
