"""Checkpoint reports reach the store once, whatever the agents resend, and none is lost while the store is
away: a report lost with a broken stream comes back in the agent's replay (workers.py), a restarted planner
hears the parts again, and a checkpoint the store refused is owed and written by later ticks, in order,
without ending the agent's stream. The store is real (SQLite and PostgreSQL); the reports are the agents'."""

from __future__ import annotations

from ballast.v1 import executor_pb2, job_pb2, plan_pb2, store_pb2
from services.planner.jobs.running import Running
from services.planner.jobs.scheduler import Scheduler
from services.runtime.errors import Unavailable
from tests.planner.jobs.test_scheduler_calibration import running_job
from tests.store_fixtures import Store

LAYERS = (0, 1, 2, 3)


class Away:
    """The platform's store, refusing checkpoint writes with Unavailable while `away` is set."""

    def __init__(self, store):
        self._store, self.away, self.refused = store, False, 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def create_checkpoint(self, request):
        if self.away:
            self.refused += 1
            raise Unavailable("the store is away")
        return self._store.create_checkpoint(request)


def report(job_id: str, rank: int, layers: tuple[int, ...], iteration: int = 100,
           complete: bool = False) -> executor_pb2.AgentMessage:
    """Rank `rank`'s report: its stage's layer files, or (rank 0, `complete`) every layer's."""
    files = [job_pb2.LayerCheckpoint(layer_index=i, uri=f"file:///c/{job_id}/iter-{iteration:08d}/layer-{i:05d}.pt",
                                     sha256="ab") for i in layers]
    return executor_pb2.AgentMessage(checkpoint_written=executor_pb2.CheckpointWritten(
        rank=rank, checkpoint=job_pb2.Checkpoint(job_id=job_id, iteration=iteration, plan_version=1, layers=files,
                                                 complete=complete)))


def scheduler_for(platform, tmp_path, job: job_pb2.Job) -> Scheduler:
    scheduler = Scheduler(platform, lambda host, message: None, lambda: ["host-1", "host-2"], tmp_path)
    plan = plan_pb2.Plan(layers=[plan_pb2.LayerStrategy(layer_index=i) for i in LAYERS])
    scheduler._running[job.id] = Running(job, plan, ["host-1", "host-2"], 3)
    return scheduler


def stored(store: Store, job_id: str) -> list[tuple[int, list[int]]]:
    listed = store.as_(store.a).list_checkpoints(store_pb2.ListCheckpointsRequest(job_id=job_id)).checkpoints
    return sorted((c.iteration, [x.layer_index for x in c.layers]) for c in listed if c.complete)


def test_a_replayed_complete_report_stores_one_checkpoint(store: Store, tmp_path):
    job = running_job(store)
    whole = report(job.id, 0, LAYERS, complete=True)
    scheduler = scheduler_for(store.as_(store.admin), tmp_path, job)
    scheduler.on_message("host-1", whole)
    scheduler.on_message("host-1", whole)  # the agent reconnected and replayed it
    scheduler_for(store.as_(store.admin), tmp_path, job).on_message("host-1", whole)  # a restarted planner
    assert stored(store, job.id) == [(100, [0, 1, 2, 3])]


def test_parts_from_two_hosts_replayed_store_one_checkpoint(store: Store, tmp_path):
    job = running_job(store)
    scheduler = scheduler_for(store.as_(store.admin), tmp_path, job)
    first = report(job.id, 1, (0, 1))
    scheduler.on_message("host-1", first)
    scheduler.on_message("host-1", first)  # replayed before the other stage's part came: no duplicate layer
    scheduler.on_message("host-2", report(job.id, 2, (2, 3)))
    assert stored(store, job.id) == [(100, [0, 1, 2, 3])]
    restarted = scheduler_for(store.as_(store.admin), tmp_path, job)  # a new planner hears both replays
    second = report(job.id, 2, (2, 3))
    for host, message in (("host-2", second), ("host-1", first), ("host-2", second)):
        restarted.on_message(host, message)
    assert stored(store, job.id) == [(100, [0, 1, 2, 3])]


def test_a_checkpoint_the_store_refused_is_owed_and_written_in_order_without_ending_the_stream(
        store: Store, tmp_path):
    job = running_job(store)
    platform = Away(store.as_(store.admin))
    scheduler = scheduler_for(platform, tmp_path, job)
    platform.away = True
    scheduler.on_message("host-1", report(job.id, 0, LAYERS, complete=True))  # no error: the stream goes on
    scheduler.on_message("host-1", report(job.id, 0, LAYERS, iteration=200, complete=True))
    scheduler.tick()  # while the store is still away
    assert stored(store, job.id) == [] and scheduler._checkpoints.retained == 2
    platform.away = False
    scheduler.tick()
    assert stored(store, job.id) == [(100, [0, 1, 2, 3]), (200, [0, 1, 2, 3])]
    assert scheduler._checkpoints.retained == 0 and platform.refused == 3  # each try began with the oldest
    scheduler.on_message("host-1", report(job.id, 0, LAYERS, complete=True))  # a replay once it is back
    assert stored(store, job.id) == [(100, [0, 1, 2, 3]), (200, [0, 1, 2, 3])]
