"""Checkpoint retention (issue 40, planner/jobs/retention.py): the newest `keep` complete checkpoints and every
exported one stay; older files are deleted and their rows marked; nothing outside the job's own checkpoint
directory is ever touched."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from ballast.v1 import job_pb2, store_pb2
from services.planner.jobs.retention import Retention, retired
from tests.store_fixtures import Store, new_job


def checkpoint(iteration: int, complete: bool = True, **marks: Timestamp) -> job_pb2.Checkpoint:
    return job_pb2.Checkpoint(id=f"ckp-{iteration}", iteration=iteration, complete=complete, **marks)


def test_the_newest_complete_and_the_exported_checkpoints_are_kept():
    rows = [checkpoint(i) for i in (5, 10, 15, 20, 25)] + [checkpoint(30, complete=False),
                                                          checkpoint(12, complete=False)]
    rows[0].exported_at.GetCurrentTime()  # iteration 5 was exported: kept
    assert sorted(c.iteration for c in retired(rows, 3)) == [10, 12]  # 15, 20, 25 kept; 30 is being written
    assert sorted(c.iteration for c in retired(rows, 1)) == [10, 12, 15, 20]
    assert sorted(c.iteration for c in retired(rows, 0)) == [10, 12, 15, 20]  # the newest is never deleted
    rows[1].deleted_at.GetCurrentTime()
    assert 10 not in {c.iteration for c in retired(rows, 1)}  # already gone
    assert retired([checkpoint(3, complete=False)], 3) == []  # nothing complete yet: nothing to resume instead


def test_retention_deletes_the_files_and_marks_the_rows(store: Store, tmp_path):
    job = new_job(store)
    admin = store.as_(store.admin)
    root = tmp_path / "checkpoints"
    outside = tmp_path / "elsewhere" / job.id / "iter-00000005"
    outside.mkdir(parents=True)
    for iteration in (5, 10, 15, 20, 25):
        folder = root / job.id / f"iter-{iteration:08d}"
        folder.mkdir(parents=True)
        (folder / "layer-00000.pt").write_bytes(b"x")
        admin.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=job_pb2.Checkpoint(
            job_id=job.id, iteration=iteration, plan_version=1, complete=True, layers=[job_pb2.LayerCheckpoint(
                layer_index=0, uri=(folder / "layer-00000.pt").as_uri())])))
    (root / job.id / "iter-00000007").mkdir()  # a lost worker's incomplete write, never recorded
    (root / job.id / "iter-00000030").mkdir()  # being written now
    (root / job.id / "notes").mkdir()  # not a checkpoint directory
    spec = job_pb2.JobSpec()
    spec.CopyFrom(job.spec)
    spec.keep_checkpoints = 2
    removed = Retention(admin, root).apply(job_pb2.Job(id=job.id, spec=spec))
    assert removed == 4  # iterations 5, 7, 10, 15
    assert sorted(p.name for p in (root / job.id).iterdir()) == ["iter-00000020", "iter-00000025", "iter-00000030",
                                                                  "notes"]
    assert outside.is_dir()
    rows = admin.list_checkpoints(store_pb2.ListCheckpointsRequest(job_id=job.id)).checkpoints
    assert sorted(c.iteration for c in rows if c.HasField("deleted_at")) == [5, 10, 15]
    assert Retention(admin, root).apply(job_pb2.Job(id=job.id, spec=spec)) == 0  # nothing more to do
