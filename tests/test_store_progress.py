"""A job's progress: idempotent metric batches, layer migrations and (complete or partial) checkpoints."""

from __future__ import annotations

import pytest

from ballast.v1 import job_pb2, store_pb2
from services.runtime.errors import InvalidArgument, NotFound
from tests.store_builders import page
from tests.store_fixtures import Store, new_job


def test_iteration_metrics_bulk_write_is_idempotent(store: Store):
    a = store.as_(store.a)
    job = new_job(store)

    def row(it: int, stage: int, loss: float | None = None) -> job_pb2.IterationMetric:
        r = job_pb2.IterationMetric(
            job_id=job.id,
            iteration=it,
            stage_index=stage,
            plan_version=1,
            iteration_time_s=1.5,
            peak_memory_bytes=5 << 30,
            predicted_iteration_time_s=1.4,
        )
        if loss is not None:
            r.loss, r.has_loss = loss, True
        return r

    batch = [row(it, st, loss=2.0 - it if st == 1 else None) for it in range(3) for st in range(2)]
    assert a.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=batch)).written == 6
    again = [*batch, row(3, 0), row(3, 0)]
    assert a.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=again)).written == 1
    assert store.count("iteration_metrics") == 7
    assert a.get_job(store_pb2.GetRequest(id=job.id)).iteration == 3

    def listed(**kw):
        return list(a.list_iteration_metrics(store_pb2.ListIterationMetricsRequest(job_id=job.id, **kw)).metrics)

    everything = listed()
    assert [(m.iteration, m.stage_index) for m in everything] == [(i, s) for i in range(3) for s in range(2)] + [
        (3, 0)
    ]
    assert everything[1].has_loss and everything[1].loss == 2.0 and not everything[0].has_loss
    assert everything[0].peak_memory_bytes == 5 << 30 and everything[0].recorded_at.seconds > 0
    assert [(m.iteration, m.stage_index) for m in listed(from_iteration=1, to_iteration=3, stage_index=1)] == [
        (1, 1),
        (2, 1),
    ]
    assert [m.iteration for m in listed(stage_index=0, page=page(2))] == [0, 1]

    other = new_job(store, who=store.b)
    mixed = [row(9, 0), job_pb2.IterationMetric(job_id=other.id)]
    with pytest.raises(NotFound) as err:
        a.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=mixed))
    assert err.value.field == "metrics[1].job_id" and store.count("iteration_metrics") == 7
    assert a.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest()).written == 0


def test_layer_migrations_and_checkpoints(store: Store):
    a = store.as_(store.a)
    job = new_job(store)
    sent = job_pb2.LayerMigration(
        job_id=job.id, layer_index=3, from_stage=0, to_stage=1, bytes=1 << 33, duration_s=0.2, iteration=5
    )
    mig = a.record_layer_migration(store_pb2.RecordLayerMigrationRequest(migration=sent))
    assert mig.id.startswith("mig-") and mig.bytes == 1 << 33
    listed = a.list_layer_migrations(store_pb2.ListLayerMigrationsRequest(job_id=job.id)).migrations
    assert list(listed) == [mig]

    def ckp(it: int, complete: bool) -> job_pb2.Checkpoint:
        layers = [
            job_pb2.LayerCheckpoint(layer_index=i, uri=f"file:///c/{it}/{i}.pt", bytes=10, sha256="ab")
            for i in (0, 1)
        ]
        c = job_pb2.Checkpoint(job_id=job.id, iteration=it, plan_version=1, complete=complete, layers=layers)
        return a.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=c))

    c10, c20, c30 = ckp(10, True), ckp(20, True), ckp(30, False)
    assert c10.id.startswith("ckp-") and [layer.uri for layer in c10.layers][1] == "file:///c/10/1.pt"
    assert a.get_checkpoint(store_pb2.GetRequest(id=c20.id)) == c20

    def ids(**kw):
        return [c.id for c in a.list_checkpoints(store_pb2.ListCheckpointsRequest(job_id=job.id, **kw)).checkpoints]

    assert ids() == [c30.id, c20.id, c10.id]
    assert ids(complete_only=True) == [c20.id, c10.id]
    dup = job_pb2.Checkpoint(job_id=job.id, layers=[job_pb2.LayerCheckpoint(layer_index=0)] * 2)
    with pytest.raises(InvalidArgument):
        a.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=dup))
    with pytest.raises(NotFound):
        a.get_checkpoint(store_pb2.GetRequest(id="ckp-missing"))
