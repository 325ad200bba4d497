"""Job morphs: recorded with the metrics they retrain dropped in the same transaction, recovery set once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from google.protobuf import timestamp_pb2

from ballast.v1 import fleet_pb2, job_pb2, store_pb2
from services.runtime.errors import InvalidArgument, NotFound, PermissionDenied
from services.store import schema
from services.store.db import create_engine
from tests.store_builders import host, page
from tests.store_fixtures import Store, new_job

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> timestamp_pb2.Timestamp:
    out = timestamp_pb2.Timestamp()
    out.FromDatetime(T0 + timedelta(seconds=seconds))
    return out


def morph(job_id: str, **kw) -> job_pb2.Morph:
    fields = dict(job_id=job_id, cause="worker_lost", detail="rank 1 killed by SIGKILL on host h2",
                  from_stages=2, from_replicas=2, from_plan_version=1, to_stages=2, to_replicas=1,
                  to_plan_version=2, failed_iteration=7, checkpoint_iteration=5,
                  detected_at=at(0), resumed_at=at(3))
    fields.update(kw)
    return job_pb2.Morph(**fields)


def record(store: Store, mp: job_pb2.Morph) -> job_pb2.Morph:
    return store.as_(store.admin).record_morph(store_pb2.RecordMorphRequest(morph=mp))


def resumed(store: Store, id_: str, seconds: float) -> job_pb2.Morph:
    req = store_pb2.MorphResumedRequest(id=id_, first_iteration_at=at(seconds))
    return store.as_(store.admin).morph_resumed(req)


def write_metrics(store: Store, job_id: str, iterations: range, version: int = 1) -> int:
    rows = [job_pb2.IterationMetric(job_id=job_id, iteration=i, stage_index=s, plan_version=version,
                                    iteration_time_s=1.0) for i in iterations for s in range(2)]
    return store.as_(store.a).write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=rows)).written


def iterations(store: Store, job_id: str) -> list[int]:
    req = store_pb2.ListIterationMetricsRequest(job_id=job_id, stage_index=0)
    return [x.iteration for x in store.as_(store.admin).list_iteration_metrics(req).metrics]


def sql_row(store: Store, id_: str) -> dict:
    with store.engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT * FROM job_morphs WHERE id = :id"), {"id": id_}).mappings().one())


def test_a_morph_drops_the_metrics_it_trains_again(store: Store):
    job, other = new_job(store, name="lost"), new_job(store, name="other")
    write_metrics(store, job.id, range(8))
    write_metrics(store, other.id, range(8))
    made = record(store, morph(job.id, lost_iterations=99))  # the caller's count is ignored
    # the caller saw 7 iterations done, the stored metrics 8 (a survivor's stats in flight): 8 - 5 run again
    assert made.failed_iteration == 8 and made.lost_iterations == 3
    assert made.id.startswith("mph-") and made.cause == "worker_lost"
    assert (made.to_stages, made.to_replicas, made.to_plan_version) == (2, 1, 2)
    assert made.resumed_at == at(3) and not made.HasField("first_iteration_at") and made.recovery_s == 0
    assert iterations(store, job.id) == [0, 1, 2, 3, 4]  # iterations 5.. run again on the new layout
    assert iterations(store, other.id) == list(range(8))
    row = sql_row(store, made.id)
    assert row["tenant_id"] == store.a.tenant_id and row["lost_iterations"] == 3
    assert row["first_iteration_at"] is None and row["recovery_s"] is None
    write_metrics(store, job.id, range(5, 7), version=2)  # the resumed run reports its own iterations 5 and 6
    assert iterations(store, job.id) == list(range(7)) and store.count("iteration_metrics") == 2 * 7 + 2 * 8
    # a window of the replaced incarnation arriving late (a survivor's last, a lost host's agent back) is not
    # stored: those iterations were trained again; the replaced run's rows before the checkpoint still are
    assert write_metrics(store, job.id, range(6, 8), version=1) == 0
    assert write_metrics(store, job.id, range(4, 5), version=1) == 0  # already held
    assert iterations(store, job.id) == list(range(7)) and store.count("iteration_metrics") == 2 * 7 + 2 * 8


def test_only_the_admin_records_morphs(store: Store):
    job = new_job(store)
    write_metrics(store, job.id, range(8))
    a = store.as_(store.a)
    with pytest.raises(PermissionDenied):
        a.record_morph(store_pb2.RecordMorphRequest(morph=morph(job.id)))
    made = record(store, morph(job.id))
    with pytest.raises(PermissionDenied):
        a.morph_resumed(store_pb2.MorphResumedRequest(id=made.id, first_iteration_at=at(9)))
    assert store.count("job_morphs") == 1 and iterations(store, job.id) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("change", "field"), [
    ({"cause": "oom"}, "morph.cause"),
    ({"checkpoint_iteration": 8}, "morph.checkpoint_iteration"),
    ({"to_stages": 0}, "morph.to_stages"),
    ({"to_replicas": 0}, "morph.to_replicas"),
    ({"detected_at": None}, "morph.detected_at"),
    ({"resumed_at": None}, "morph.resumed_at"),
    ({"resumed_at": at(-1)}, "morph.resumed_at"),
    ({"failed_iteration": 1 << 31}, "morph.failed_iteration"),
])
def test_a_bad_morph_names_the_field_and_writes_nothing(store: Store, change: dict, field: str):
    job = new_job(store)
    write_metrics(store, job.id, range(8))
    with pytest.raises(InvalidArgument) as err:
        record(store, morph(job.id, **change))
    assert err.value.field == field
    if field == "morph.cause":
        assert "worker_lost, host_lost, straggler, grow" in err.value.fix
    assert store.count("job_morphs") == 0 and store.count("iteration_metrics") == 16


def test_a_morph_of_an_unknown_job_is_not_found(store: Store):
    with pytest.raises(NotFound) as err:
        record(store, morph("job-nope"))
    assert err.value.field == "morph.job_id" and store.count("job_morphs") == 0


def test_recovery_is_set_once(store: Store):
    made = record(store, morph(new_job(store).id))
    with pytest.raises(InvalidArgument) as err:
        store.as_(store.admin).morph_resumed(store_pb2.MorphResumedRequest(id=made.id))
    assert err.value.field == "first_iteration_at"
    with pytest.raises(InvalidArgument) as err:
        resumed(store, made.id, -5)
    assert err.value.field == "first_iteration_at"
    with pytest.raises(NotFound) as err:
        resumed(store, "mph-nope", 10)
    assert err.value.field == "id"
    first = resumed(store, made.id, 12.5)
    assert first.recovery_s == 12.5 and first.first_iteration_at == at(12.5)
    assert resumed(store, made.id, 99) == first  # a repeated report changes nothing
    assert sql_row(store, made.id)["recovery_s"] == 12.5


def test_tenants_list_only_their_own_jobs_morphs(store: Store):
    one, two, theirs = new_job(store, name="one"), new_job(store, name="two"), new_job(store, store.b, name="b")
    late = record(store, morph(one.id, detected_at=at(50), resumed_at=at(55)))
    early = record(store, morph(two.id, cause="host_lost"))
    other = record(store, morph(theirs.id, cause="grow", detected_at=at(20), resumed_at=at(21)))
    a = store.as_(store.a)

    def listed(who=a, **kw) -> list[str]:
        return [x.id for x in who.list_morphs(store_pb2.ListMorphsRequest(**kw)).morphs]

    assert listed() == [early.id, late.id]  # by detected_at
    assert listed(job_id=one.id) == [late.id]
    assert listed(job_id=theirs.id) == []
    assert listed(store.as_(store.b)) == [other.id]
    assert listed(store.as_(store.admin)) == [early.id, other.id, late.id]
    first = a.list_morphs(store_pb2.ListMorphsRequest(page=page(1)))
    assert [x.id for x in first.morphs] == [early.id] and first.next_page_token
    rest = a.list_morphs(store_pb2.ListMorphsRequest(page=page(1, first.next_page_token)))
    assert [x.id for x in rest.morphs] == [late.id] and not rest.next_page_token


def test_a_morph_gives_devices_back_with_its_own_lease_end_reason(store: Store):
    admin, job = store.as_(store.admin), new_job(store)
    h1 = admin.register_host(store_pb2.RegisterHostRequest(host=host("h1", ["cpu"] * 2)))
    refs = [fleet_pb2.DeviceRef(host_id=h1.id, device_index=i) for i in (0, 1)]
    admin.acquire_leases(store_pb2.AcquireLeasesRequest(job_id=job.id, devices=refs))
    reason = fleet_pb2.LEASE_END_REASON_MORPHED
    assert admin.end_leases(store_pb2.EndLeasesRequest(job_id=job.id, reason=reason)).ended == 2
    leases = store.as_(store.a).list_leases(store_pb2.ListLeasesRequest(job_id=job.id)).leases
    assert [x.end_reason for x in leases] == [reason, reason]
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT DISTINCT end_reason FROM device_leases")).scalars().all() == [
            "LEASE_END_REASON_MORPHED"]


def test_migration_0007_adds_and_drops_job_morphs(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0006_shared_fleet")
    engine = create_engine(url)
    try:
        assert "job_morphs" not in sa.inspect(engine).get_table_names()
        schema.upgrade(url)
        engine.dispose()
        inspector = sa.inspect(engine)
        assert "job_morphs" in inspector.get_table_names()
        assert {ix["name"]: ix["column_names"] for ix in inspector.get_indexes("job_morphs")} == {
            "ix_job_morphs_job_id": ["job_id"]}
        schema.downgrade(url, "0006_shared_fleet")
        engine.dispose()
        assert "job_morphs" not in sa.inspect(engine).get_table_names()
        schema.upgrade(url)
        schema.check_schema(engine)
    finally:
        engine.dispose()
