"""Checkpoint reports reach the store once, whatever the agents resend: a report lost with a broken stream
comes back in the agent's replay (workers.py), a restarted planner hears the parts again, and a store that
failed to answer is asked again. The store is real (SQLite and PostgreSQL); the reports are the agent's."""

from __future__ import annotations

import pytest

from ballast.v1 import executor_pb2, job_pb2, plan_pb2, store_pb2
from services.planner.jobs.running import Running
from services.planner.jobs.scheduler import Scheduler
from services.runtime.errors import Unavailable
from tests.store_fixtures import Store
from tests.test_scheduler_calibration import running_job

LAYERS = (0, 1, 2, 3)


class FailsOnce:
    """The platform's store whose first checkpoint write is refused (the store is away for a moment)."""

    def __init__(self, store):
        self._store, self.refused = store, 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def create_checkpoint(self, request):
        if not self.refused:
            self.refused += 1
            raise Unavailable("the store is away")
        return self._store.create_checkpoint(request)


def part(job_id: str, rank: int, layers: tuple[int, ...], iteration: int = 100) -> executor_pb2.AgentMessage:
    """Rank `rank`'s part of a checkpoint: the files of its stage's layers."""
    files = [job_pb2.LayerCheckpoint(layer_index=i, uri=f"file:///c/{iteration}/{i}.pt") for i in layers]
    return executor_pb2.AgentMessage(checkpoint_written=executor_pb2.CheckpointWritten(
        rank=rank, checkpoint=job_pb2.Checkpoint(job_id=job_id, iteration=iteration, plan_version=1, layers=files)))


def scheduler_for(platform, tmp_path, job: job_pb2.Job) -> Scheduler:
    scheduler = Scheduler(platform, lambda host, message: None, lambda: ["host-1"], tmp_path)
    plan = plan_pb2.Plan(layers=[plan_pb2.LayerStrategy(layer_index=i) for i in LAYERS])
    scheduler._running[job.id] = Running(job, plan, ["host-1"], 2)
    return scheduler


def stored(store: Store, job_id: str) -> list[tuple[int, list[int]]]:
    listed = store.as_(store.a).list_checkpoints(store_pb2.ListCheckpointsRequest(job_id=job_id)).checkpoints
    return [(c.iteration, [x.layer_index for x in c.layers]) for c in listed if c.complete]


def test_replayed_parts_store_one_checkpoint(store: Store, tmp_path):
    job = running_job(store)
    scheduler = scheduler_for(store.as_(store.admin), tmp_path, job)
    first = part(job.id, 0, (0, 1))
    scheduler.on_message("host-1", first)
    scheduler.on_message("host-1", first)  # replayed before the other stage's part came: no duplicate layer
    scheduler.on_message("host-1", part(job.id, 1, (2, 3)))
    assert stored(store, job.id) == [(100, [0, 1, 2, 3])]
    restarted = scheduler_for(store.as_(store.admin), tmp_path, job)  # a new planner hears the replay
    for message in (first, part(job.id, 1, (2, 3)), first):
        restarted.on_message("host-1", message)
    assert stored(store, job.id) == [(100, [0, 1, 2, 3])]


def test_a_checkpoint_the_store_refused_is_stored_when_the_report_comes_again(store: Store, tmp_path):
    job = running_job(store)
    platform = FailsOnce(store.as_(store.admin))
    scheduler = scheduler_for(platform, tmp_path, job)
    scheduler.on_message("host-1", part(job.id, 0, (0, 1)))
    with pytest.raises(Unavailable):  # ends the agent's stream (control.REPLAYED): its replay brings it back
        scheduler.on_message("host-1", part(job.id, 1, (2, 3)))
    assert stored(store, job.id) == []
    scheduler.on_message("host-1", part(job.id, 0, (0, 1)))
    scheduler.on_message("host-1", part(job.id, 1, (2, 3)))
    assert platform.refused == 1 and stored(store, job.id) == [(100, [0, 1, 2, 3])]
