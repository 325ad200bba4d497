"""A succeeded job's calibration is queued even when the SUCCEEDED transition's answer was lost (the agent
replays its workers' exits and the job is already terminal) or the queue refused it for a moment (owed and
queued again on the next tick). The store is real (SQLite and PostgreSQL); only the queue callback is ours."""

from __future__ import annotations

import pytest

from ballast.v1 import executor_pb2, job_pb2, plan_pb2, store_pb2
from services.planner.jobs.running import Running
from services.planner.jobs.scheduler import Scheduler
from services.runtime.errors import Unavailable
from tests.store_fixtures import Store, move, new_job

S = job_pb2.JobState


class LosesOneAnswer:
    """The platform's store whose first SUCCEEDED transition is stored but answered with Unavailable."""

    def __init__(self, store):
        self._store, self.lost = store, 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def transition_job(self, request):
        done = self._store.transition_job(request)
        if request.state == S.JOB_STATE_SUCCEEDED and not self.lost:
            self.lost += 1
            raise Unavailable("the store restarted before answering")
        return done


def running_job(store: Store) -> job_pb2.Job:
    job = new_job(store)
    for state in (S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING, S.JOB_STATE_SCHEDULED, S.JOB_STATE_RUNNING):
        job = move(store, job.id, state)
    return job


def finish(scheduler: Scheduler, job: job_pb2.Job, ranks: int) -> None:
    for rank in range(ranks):
        scheduler._exited("host-1", executor_pb2.WorkerExit(job_id=job.id, rank=rank, finished=True))


def test_a_replayed_exit_after_a_lost_answer_still_queues_the_calibration(store: Store, tmp_path):
    platform = LosesOneAnswer(store.as_(store.admin))
    queued: list[str] = []
    scheduler = Scheduler(platform, lambda host, message: None, lambda: ["host-1"], tmp_path,
                          calibrate=queued.append)
    job = running_job(store)
    scheduler._running[job.id] = Running(job, plan_pb2.Plan(), ["host-1"], 2)
    with pytest.raises(Unavailable):  # reaches the agent's stream, which ends: the agent replays the exits
        finish(scheduler, job, 2)
    assert platform.lost == 1 and queued == []
    assert store.as_(store.a).get_job(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_SUCCEEDED
    finish(scheduler, job, 2)  # the agent reconnects and sends its workers' exits again
    assert queued == [job.id]


def test_a_calibration_the_queue_refused_is_queued_on_a_later_tick(store: Store, tmp_path):
    refusals, queued = [1], []

    def calibrate(job_id: str) -> None:
        if refusals[0]:
            refusals[0] -= 1
            raise Unavailable("the store is away")
        queued.append(job_id)

    scheduler = Scheduler(store.as_(store.admin), lambda host, message: None, lambda: [], tmp_path,
                          calibrate=calibrate)
    job = running_job(store)
    scheduler._running[job.id] = Running(job, plan_pb2.Plan(), ["host-1"], 1)
    finish(scheduler, job, 1)
    assert queued == [] and scheduler._owed_calibrations() == [job.id]
    scheduler.tick()
    assert queued == [job.id] and scheduler._owed_calibrations() == []
    scheduler.tick()
    assert queued == [job.id]  # queued once


def test_a_job_cancelled_meanwhile_is_not_calibrated(store: Store, tmp_path):
    queued: list[str] = []
    scheduler = Scheduler(store.as_(store.admin), lambda host, message: None, lambda: [], tmp_path,
                          calibrate=queued.append)
    job = running_job(store)
    scheduler._running[job.id] = Running(job, plan_pb2.Plan(), ["host-1"], 1)
    move(store, job.id, S.JOB_STATE_CANCELLING)
    move(store, job.id, S.JOB_STATE_CANCELLED)
    finish(scheduler, job, 1)  # its worker had finished its last iteration as the cancel landed
    assert store.as_(store.a).get_job(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_CANCELLED
    assert queued == [] and scheduler._owed_calibrations() == []
