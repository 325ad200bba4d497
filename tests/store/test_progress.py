"""A job's progress: idempotent metric batches (with the iteration breakdown and the stage's predictions, 0009),
layer migrations and (complete or partial) checkpoints."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from ballast.v1 import job_pb2, store_pb2
from services.runtime.errors import InvalidArgument, NotFound, PermissionDenied
from services.store import models as m
from services.store import schema
from services.store.db import create_engine
from tests.store_builders import page
from tests.store_fixtures import JS, Store, move, new_job, open_store


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


def test_a_window_row_round_trips_and_a_row_without_one_reads_as_one_iteration(store: Store):
    a = store.as_(store.a)
    job = new_job(store)
    window = job_pb2.IterationMetric(job_id=job.id, iteration=19, first_iteration=10, iterations=10, plan_version=1,
                                     iteration_time_s=1.2, iteration_time_p50_s=1.1, iteration_time_p95_s=1.9,
                                     iteration_time_max_s=2.5, loss=3.0, has_loss=True)
    single = job_pb2.IterationMetric(job_id=job.id, iteration=20, plan_version=1, iteration_time_s=0.9)
    assert a.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=[window, single])).written == 2
    got = a.list_iteration_metrics(store_pb2.ListIterationMetricsRequest(job_id=job.id)).metrics
    assert [(r.first_iteration, r.iteration, r.iterations) for r in got] == [(10, 19, 10), (20, 20, 1)]
    assert (got[0].iteration_time_p50_s, got[0].iteration_time_p95_s, got[0].iteration_time_max_s) == (1.1, 1.9, 2.5)
    assert (got[1].iteration_time_p50_s, got[1].iteration_time_max_s) == (0.9, 0.9)
    assert a.get_job(store_pb2.GetRequest(id=job.id)).iteration == 20


@pytest.mark.parametrize(("change", "field"), [
    ({"iterations": 5}, "metrics[0].iterations"),  # 10..19 is ten iterations
    ({"first_iteration": 20, "iterations": 1}, "metrics[0].iterations"),  # first after last
    ({"iteration_time_p95_s": 3.0}, "metrics[0].iteration_time_p95_s"),  # p95 above max
])
def test_a_window_that_cannot_be_is_refused_naming_the_field(store: Store, change: dict, field: str):
    a = store.as_(store.a)
    job = new_job(store)
    window = job_pb2.IterationMetric(job_id=job.id, iteration=19, first_iteration=10, iterations=10, plan_version=1,
                                     iteration_time_s=1.2, iteration_time_p50_s=1.1, iteration_time_p95_s=1.9,
                                     iteration_time_max_s=2.5)
    for name, value in change.items():
        setattr(window, name, value)
    with pytest.raises(InvalidArgument) as err:
        a.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=[window]))
    assert err.value.field == field and store.count("iteration_metrics") == 0


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
            job_pb2.LayerCheckpoint(layer_index=i, uri=file_of(job.id, it, i), bytes=10, sha256="ab")
            for i in (0, 1)
        ]
        c = job_pb2.Checkpoint(job_id=job.id, iteration=it, plan_version=1, complete=complete, layers=layers)
        return a.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=c))

    c10, c20, c30 = ckp(10, True), ckp(20, True), ckp(30, False)
    assert c10.id.startswith("ckp-") and [layer.uri for layer in c10.layers][1] == file_of(job.id, 10, 1)
    assert a.get_checkpoint(store_pb2.GetRequest(id=c20.id)) == c20

    def ids(**kw):
        return [c.id for c in a.list_checkpoints(store_pb2.ListCheckpointsRequest(job_id=job.id, **kw)).checkpoints]

    assert ids() == [c30.id, c20.id, c10.id]
    assert ids(complete_only=True) == [c20.id, c10.id]
    assert ckp(20, True) == c20 and ids() == [c30.id, c20.id, c10.id]  # a replayed report: the row it has
    moved = job_pb2.Checkpoint(job_id=job.id, iteration=20, plan_version=1, complete=True,
                               layers=[job_pb2.LayerCheckpoint(layer_index=0, uri=file_of(job.id, 20, 0, "/d"))])
    other = a.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=moved))
    assert other.id not in (c10.id, c20.id, c30.id)  # other files at the same iteration: another checkpoint
    rewritten = job_pb2.Checkpoint()
    rewritten.CopyFrom(c20)
    rewritten.id, rewritten.layers[0].sha256 = "", "cd"
    again = a.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=rewritten))
    assert again.id != c20.id and again.layers[0].sha256 == "cd"  # same paths, other contents: not a replay
    dup = job_pb2.Checkpoint(job_id=job.id, layers=[job_pb2.LayerCheckpoint(layer_index=0)] * 2)
    with pytest.raises(InvalidArgument):
        a.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=dup))
    with pytest.raises(NotFound):
        a.get_checkpoint(store_pb2.GetRequest(id="ckp-missing"))

    # Issue 40: a checkpoint names only its own job's files, where its workers write them ...
    other_job = new_job(store, name="other")
    for uri in ("/etc/passwd", file_of(other_job.id, 40, 0), f"/c/{job.id}/iter-00000040/../x/layer-00000.pt",
                file_of(job.id, 41, 0), f"c/{job.id}/iter-00000040/layer-00000.pt"):
        bad = job_pb2.Checkpoint(job_id=job.id, iteration=40, layers=[job_pb2.LayerCheckpoint(layer_index=0, uri=uri)])
        with pytest.raises(InvalidArgument) as err:
            a.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=bad))
        assert err.value.field == "checkpoint.layers[0].uri" and "own checkpoint file" in err.value.message, uri
    # ... and the services mark them deleted (retention) or exported, once each
    with pytest.raises(PermissionDenied):
        a.update_checkpoints(store_pb2.UpdateCheckpointsRequest(job_id=job.id, deleted_ids=[c10.id]))
    admin = store.as_(store.admin)
    marked = admin.update_checkpoints(store_pb2.UpdateCheckpointsRequest(job_id=job.id, deleted_ids=[c10.id],
                                                                         exported_ids=[c20.id]))
    by_id = {c.id: c for c in marked.checkpoints}
    assert by_id[c10.id].HasField("deleted_at") and not by_id[c10.id].HasField("exported_at")
    assert by_id[c20.id].HasField("exported_at") and not by_id[c20.id].HasField("deleted_at")
    first = by_id[c10.id].deleted_at
    again = admin.update_checkpoints(store_pb2.UpdateCheckpointsRequest(job_id=job.id, deleted_ids=[c10.id]))
    assert {c.id: c for c in again.checkpoints}[c10.id].deleted_at == first
    with pytest.raises(NotFound):
        admin.update_checkpoints(store_pb2.UpdateCheckpointsRequest(job_id=other_job.id, deleted_ids=[c20.id]))


def file_of(job_id: str, iteration: int, layer: int, root: str = "/c") -> str:
    return f"file://{root}/{job_id}/iter-{iteration:08d}/layer-{layer:05d}.pt"


BREAKDOWN = {"forward_s": 0.25, "backward_s": 0.5, "recompute_s": 0.125, "p2p_s": 0.375, "allreduce_s": 0.0625,
             "optimizer_s": 0.03125, "overhead_s": 0.03125}
PREDICTED = {"predicted_iteration_time_s": 1.0, "predicted_peak_memory_bytes": 6 << 30,
             "predicted_stage_compute_s": 0.625}


def test_iteration_breakdown_and_stage_predictions_round_trip(store: Store):
    a = store.as_(store.a)
    job = new_job(store)
    sent = job_pb2.IterationMetric(job_id=job.id, iteration=0, stage_index=1, plan_version=2, iteration_time_s=1.25,
                                   comm_s=0.4375, idle_s=0.03125, peak_memory_bytes=5 << 30, **BREAKDOWN, **PREDICTED)
    assert a.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=[sent])).written == 1
    (got,) = a.list_iteration_metrics(store_pb2.ListIterationMetricsRequest(job_id=job.id)).metrics
    for name, value in {**BREAKDOWN, **PREDICTED, "peak_memory_bytes": 5 << 30}.items():
        assert getattr(got, name) == value, name
    parts = sum(BREAKDOWN[k] for k in BREAKDOWN if k != "recompute_s")  # recompute is inside backward
    assert parts == got.iteration_time_s and got.comm_s == got.p2p_s + got.allreduce_s
    with store.engine.connect() as conn:  # plain columns, for `ballast sql`
        row = conn.execute(sa.text("SELECT p2p_s, predicted_peak_memory_bytes FROM iteration_metrics")).one()
    assert tuple(row) == (0.375, 6 << 30)


def _metric_before_0009(engine: sa.Engine) -> None:
    """A tenant, model, job and one iteration_metrics row as revision 0008 stores them."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenants (id, name, admin, token_hash, created_at) "  # as 0008 has it
                             "VALUES ('t-1', 'a', false, :hash, :now)"), {"hash": "x" * 64, "now": now})
        conn.execute(sa.text("INSERT INTO models (id, tenant_id, name, family, signature, parameter_count, spec, "
                             "created_at) VALUES ('m-1', 't-1', 'gpt', 'F', :signature, 0, '{}', :now)"),
                     {"signature": "s" * 64, "now": now})  # as 0008 has it (no version yet)
        conn.execute(sa.insert(m.Job.__table__).values(id="job-1", tenant_id="t-1", model_id="m-1", state="S",
                                                       spec={}, created_at=now, updated_at=now))
        old = {"job_id": "job-1", "iteration": 0, "stage_index": 0, "replica_index": 0, "plan_version": 1,
               "iteration_time_s": 1.5, "forward_s": 0.5, "backward_s": 0.75, "comm_s": 0.1, "idle_s": 0.15,
               "peak_memory_bytes": 2**33, "loss": None, "throughput_samples_per_s": 4.0,
               "predicted_iteration_time_s": 1.4, "recorded_at": now}  # the columns 0008 has
        conn.execute(sa.insert(sa.table("iteration_metrics", *(sa.column(k) for k in old))).values(**old))


def test_migration_0009_adds_and_drops_the_iteration_breakdown(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0008_degraded_hosts")
    engine = create_engine(url)
    added = set(BREAKDOWN) - {"forward_s", "backward_s"} | {"predicted_peak_memory_bytes", "predicted_stage_compute_s"}

    def columns() -> set[str]:
        return {c["name"] for c in sa.inspect(engine).get_columns("iteration_metrics")}

    def measured() -> tuple:
        with engine.connect() as conn:
            return tuple(conn.execute(sa.text("SELECT iteration_time_s, forward_s, peak_memory_bytes "
                                              "FROM iteration_metrics")).one())

    try:
        assert not added & columns()
        _metric_before_0009(engine)
        engine.dispose()
        schema.upgrade(url)
        engine.dispose()
        assert added <= columns()
        with engine.connect() as conn:  # an old row: not measured, not zero
            old = conn.execute(sa.text(f"SELECT {', '.join(sorted(added))} FROM iteration_metrics")).one()
        assert set(old) == {None} and measured() == (1.5, 0.5, 2**33)
        schema.downgrade(url, "0008_degraded_hosts")
        engine.dispose()
        assert not added & columns() and measured() == (1.5, 0.5, 2**33)  # the rows survive the rebuild
        inspector = sa.inspect(engine)
        assert "ix_iteration_metrics_job_iteration" in {ix["name"] for ix in inspector.get_indexes("iteration_metrics")}
        assert "uq_iteration_metrics_row" in {u["name"] for u in inspector.get_unique_constraints("iteration_metrics")}
        schema.upgrade(url)
        schema.check_schema(engine)
    finally:
        engine.dispose()


def test_evaluations_one_per_iteration_in_order(store: Store):
    a = store.as_(store.a)
    job = new_job(store)

    def record(iteration: int, loss: float) -> job_pb2.Evaluation:
        return a.record_evaluation(store_pb2.RecordEvaluationRequest(evaluation=job_pb2.Evaluation(
            job_id=job.id, iteration=iteration, plan_version=1, loss=loss, perplexity=2.718281828 ** loss,
            eval_s=0.25, samples=32)))

    later, first = record(20, 1.5), record(10, 2.0)
    assert first.id.startswith("evl-") and first.HasField("created_at") and later.samples == 32
    assert record(10, 9.0) == first  # a repeat answers the stored row
    listed = a.list_evaluations(store_pb2.ListEvaluationsRequest(job_id=job.id)).evaluations
    assert [(e.iteration, e.loss) for e in listed] == [(10, 2.0), (20, 1.5)]
    with pytest.raises(NotFound):
        store.as_(store.b).list_evaluations(store_pb2.ListEvaluationsRequest(job_id=job.id))
    with pytest.raises(NotFound):
        store.as_(store.b).record_evaluation(store_pb2.RecordEvaluationRequest(evaluation=job_pb2.Evaluation(
            job_id=job.id, iteration=30)))


def test_migration_0019_adds_and_drops_the_evaluations_table(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0018_checkpoint_lifecycle")
    engine = create_engine(url)
    try:
        assert "evaluations" not in sa.inspect(engine).get_table_names()
        engine.dispose()
        schema.upgrade(url)
        engine.dispose()
        assert "evaluations" in sa.inspect(engine).get_table_names()
        schema.check_schema(engine)
        schema.downgrade(url, "0018_checkpoint_lifecycle")
        engine.dispose()
        assert "evaluations" not in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


def columns(engine: sa.Engine, table: str) -> set[str]:
    """The table's columns as the database has them now (a fresh connection: migrations ran in another)."""
    engine.dispose()
    return {c["name"] for c in sa.inspect(engine).get_columns(table)}


def tables(engine: sa.Engine) -> set[str]:
    engine.dispose()
    return set(sa.inspect(engine).get_table_names())


def test_migration_0020_adds_and_drops_the_profile_fidelity_columns(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0019_evaluations")
    engine = create_engine(url)
    try:
        assert "composition_factor" not in columns(engine, "profiles")
        schema.upgrade(url)
        assert {"composition_factor", "host_noise", "noisy", "measure_passes"} <= columns(engine, "profiles")
        assert {"forward_spread", "backward_spread"} <= columns(engine, "profile_layer_samples")
        schema.check_schema(engine)
        schema.downgrade(url, "0019_evaluations")
        assert "host_noise" not in columns(engine, "profiles")
        assert "forward_spread" not in columns(engine, "profile_layer_samples")
    finally:
        engine.dispose()


def test_migration_0021_adds_and_drops_the_offload_scales(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0020_profile_fidelity")
    engine = create_engine(url)
    try:
        assert "harmony_scale" not in columns(engine, "calibrations")
        schema.upgrade(url)
        assert {"harmony_scale", "chunks_scale"} <= columns(engine, "calibrations")
        schema.check_schema(engine)
        schema.downgrade(url, "0020_profile_fidelity")
        assert not {"harmony_scale", "chunks_scale"} & columns(engine, "calibrations")
    finally:
        engine.dispose()


def test_migration_0023_adds_and_drops_a_profile_rows_off_line(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0022_job_placements")
    engine = create_engine(url)
    try:
        assert "off_line" not in columns(engine, "profile_layer_samples")
        schema.upgrade(url)
        assert "off_line" in columns(engine, "profile_layer_samples")
        schema.check_schema(engine)
        schema.downgrade(url, "0022_job_placements")
        assert "off_line" not in columns(engine, "profile_layer_samples")
    finally:
        engine.dispose()


def test_migration_0022_adds_and_drops_job_placements(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0021_offload_calibration")
    engine = create_engine(url)
    try:
        assert "job_placements" not in tables(engine) and "rank" not in columns(engine, "device_leases")
        schema.upgrade(url)
        assert "job_placements" in tables(engine) and {"placement_id", "rank"} <= columns(engine, "device_leases")
        schema.check_schema(engine)
        schema.downgrade(url, "0021_offload_calibration")
        assert "job_placements" not in tables(engine)
        assert not {"placement_id", "rank"} & columns(engine, "device_leases")
    finally:
        engine.dispose()


def test_migration_0024_gives_hosts_changed_at_from_their_registration_and_drops_it(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0023_profile_off_line")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO hosts (id, name, address, agent_port, agent_version, state, "
                                 "supported_parallelism, labels, registered_at) VALUES ('hst-old', 'old', '', 0, "
                                 "'', 'HOST_STATE_ONLINE', '[]', '{}', '2026-01-02 03:04:05+00')"))
        schema.upgrade(url)
        assert "changed_at" in columns(engine, "hosts")
        with engine.connect() as conn:
            changed, registered = conn.execute(sa.text(
                "SELECT changed_at, registered_at FROM hosts WHERE id = 'hst-old'")).one()
        assert changed == registered  # a host stored before reads as changed when it registered
        schema.check_schema(engine)
        schema.downgrade(url, "0023_profile_off_line")
        assert "changed_at" not in columns(engine, "hosts")
    finally:
        engine.dispose()


def test_migration_0025_indexes_what_changed_since_reads_filter_on_and_dates_each_jobs_first_run(
        empty_database_url, tmp_path):
    url = empty_database_url
    with open_store(url, "local", tmp_path) as st:
        ran, waits = new_job(st), new_job(st)
        for state in (JS.JOB_STATE_PROFILING, JS.JOB_STATE_PLANNING, JS.JOB_STATE_SCHEDULED, JS.JOB_STATE_RUNNING):
            move(st, ran.id, state)
        assert st.as_(st.a).get_job(store_pb2.GetRequest(id=waits.id)).HasField("started_at") is False
        first = st.as_(st.a).get_job(store_pb2.GetRequest(id=ran.id)).started_at
        engine = st.engine

        def indexes() -> set[str]:
            inspector = sa.inspect(engine)
            return {i["name"] for table in ("jobs", "device_leases") for i in inspector.get_indexes(table)}

        assert {"ix_jobs_updated_at", "ix_device_leases_ended_at"} <= indexes()
        engine.dispose()
        schema.downgrade(url, "0024_host_changed_at")
        assert not {"ix_jobs_updated_at", "ix_device_leases_ended_at"} & indexes()
        assert "started_at" not in columns(engine, "jobs")
        schema.upgrade(url)  # rows stored before take their first RUNNING event's time
        schema.check_schema(engine)
        assert st.as_(st.a).get_job(store_pb2.GetRequest(id=ran.id)).started_at == first
        assert not st.as_(st.a).get_job(store_pb2.GetRequest(id=waits.id)).HasField("started_at")


def test_migration_0026_makes_every_stored_row_a_window_of_one(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0008_degraded_hosts")
    engine = create_engine(url)
    try:
        _metric_before_0009(engine)
        engine.dispose()
        schema.upgrade(url)
        with engine.connect() as conn:
            row = conn.execute(sa.text("SELECT first_iteration, iterations, iteration_time_p50_s, "
                                       "iteration_time_p95_s, iteration_time_max_s FROM iteration_metrics")).one()
        assert tuple(row) == (0, 1, 1.5, 1.5, 1.5)
        schema.downgrade(url, "0025_queue_reads")
        engine.dispose()
        columns = {c["name"] for c in sa.inspect(engine).get_columns("iteration_metrics")}
        assert "first_iteration" not in columns and "iterations" not in columns
        schema.upgrade(url)
        schema.check_schema(engine)
    finally:
        engine.dispose()
