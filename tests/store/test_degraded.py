"""Degraded hosts: marked with evidence by the admin, kept through heartbeats and re-registration, cleared only
by ClearHostDegraded, the history left in host_degradations for `ballast sql`."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from ballast.v1 import fleet_pb2, store_pb2
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from services.store import schema
from services.store.db import create_engine
from tests.store_builders import host
from tests.store_fixtures import Store, new_job

EVIDENCE = {"job_id": "", "rank": 1, "ratio": 2.04, "window": 10, "own_s": [0.41, 0.42], "peer_s": [0.2, 0.21]}
SLOW = "rank 1 computed 2.0x its peers' time over 10 iterations"


def register(store: Store, name: str = "vm-1") -> fleet_pb2.Host:
    return store.as_(store.admin).register_host(store_pb2.RegisterHostRequest(host=host(name, ["cpu"] * 2)))


def mark(store: Store, host_id: str, reason: str = SLOW, evidence: dict | str | None = None,
         job_id: str = "") -> fleet_pb2.Host:
    text = evidence if isinstance(evidence, str) else json.dumps(evidence if evidence is not None else EVIDENCE)
    req = store_pb2.MarkHostDegradedRequest(id=host_id, reason=reason, evidence_json=text, job_id=job_id)
    return store.as_(store.admin).mark_host_degraded(req)


def clear(store: Store, host_id: str, reason: str = "replaced the GPU") -> fleet_pb2.Host:
    return store.as_(store.admin).clear_host_degraded(store_pb2.ClearHostDegradedRequest(id=host_id, reason=reason))


def rows(store: Store, host_id: str) -> list[dict]:
    with store.engine.connect() as conn:
        found = conn.execute(sa.text("SELECT * FROM host_degradations WHERE host_id = :h ORDER BY marked_at"),
                             {"h": host_id}).mappings().all()
    return [{**r, "evidence": r["evidence"] if isinstance(r["evidence"], dict) else json.loads(r["evidence"])}
            for r in found]


def get(store: Store, host_id: str) -> fleet_pb2.Host:
    return store.as_(store.a).get_host(store_pb2.GetRequest(id=host_id))


def test_a_mark_shows_on_the_host_and_keeps_its_evidence(store: Store):
    h, other, job = register(store), register(store, "vm-2"), new_job(store)
    marked = mark(store, h.id, job_id=job.id)
    assert marked.degraded_reason == SLOW and marked.HasField("degraded_at")
    assert marked.degraded_at.ToDatetime() > h.registered_at.ToDatetime()
    assert get(store, h.id) == marked  # any tenant reads the mark, without a join
    listed = {x.name: x for x in store.as_(store.b).list_hosts(store_pb2.ListHostsRequest()).hosts}
    assert listed["vm-1"].degraded_reason == SLOW and not listed["vm-2"].HasField("degraded_at")
    assert not get(store, other.id).degraded_reason
    [row] = rows(store, h.id)
    assert row["id"].startswith("hdg-") and row["job_id"] == job.id and row["reason"] == SLOW
    assert row["evidence"] == EVIDENCE and row["cleared_at"] is None and row["cleared_by"] is None

    store.clock.advance(30)
    again = mark(store, h.id, reason="rank 1 still 1.9x", evidence={"ratio": 1.9})
    assert again.degraded_at == marked.degraded_at and again.degraded_reason == "rank 1 still 1.9x"
    assert [(r["reason"], r["evidence"], r["job_id"]) for r in rows(store, h.id)] == [
        (SLOW, EVIDENCE, job.id), ("rank 1 still 1.9x", {"ratio": 1.9}, None)]


def test_heartbeats_and_registration_keep_the_mark(store: Store):
    h = register(store)
    marked = mark(store, h.id, evidence="")
    admin = store.as_(store.admin)
    store.clock.advance(5)
    beat = admin.update_host_state(store_pb2.UpdateHostStateRequest(id=h.id, state=fleet_pb2.HOST_STATE_ONLINE,
                                                                    heartbeat=True))
    assert beat.last_heartbeat_at.ToDatetime() > marked.last_heartbeat_at.ToDatetime()
    lost = admin.update_host_state(store_pb2.UpdateHostStateRequest(id=h.id, state=fleet_pb2.HOST_STATE_LOST))
    # an agent restarting registers again; one echoing an old reply's empty mark erases nothing either
    again = admin.register_host(store_pb2.RegisterHostRequest(host=host("vm-1", ["cpu"], degraded_reason="")))
    for seen in (beat, lost, again, get(store, h.id)):
        assert (seen.degraded_reason, seen.degraded_at) == (SLOW, marked.degraded_at)
    assert again.state == fleet_pb2.HOST_STATE_ONLINE and len(again.devices) == 1
    assert rows(store, h.id)[0]["evidence"] == {}


def test_clear_gives_the_host_back_and_closes_every_mark(store: Store):
    h, other = register(store), register(store, "vm-2")
    first = mark(store, h.id)
    mark(store, h.id, reason="again")
    mark(store, other.id)
    store.clock.advance(60)
    cleared = clear(store, h.id)
    assert not cleared.degraded_reason and not cleared.HasField("degraded_at")
    assert get(store, h.id) == cleared and get(store, other.id).degraded_reason == SLOW
    closed = rows(store, h.id)
    assert len(closed) == 2 and all(r["cleared_at"] is not None for r in closed)
    assert {(r["cleared_reason"], r["cleared_by"]) for r in closed} == {("replaced the GPU", store.admin.tenant_id)}
    assert rows(store, other.id)[0]["cleared_at"] is None

    with pytest.raises(FailedPrecondition) as err:  # nothing left to clear
        clear(store, h.id)
    assert err.value.field == "id" and "not marked degraded" in err.value.fix
    marked = mark(store, h.id, reason="slow once more")  # a fresh mark starts a fresh degraded_at
    assert marked.degraded_at.ToDatetime() > first.degraded_at.ToDatetime()
    assert [r["cleared_at"] is None for r in rows(store, h.id)] == [False, False, True]


def test_only_the_admin_marks_and_clears(store: Store):
    h = register(store)
    a = store.as_(store.a)
    with pytest.raises(PermissionDenied):
        a.mark_host_degraded(store_pb2.MarkHostDegradedRequest(id=h.id, reason=SLOW))
    mark(store, h.id)
    with pytest.raises(PermissionDenied):
        a.clear_host_degraded(store_pb2.ClearHostDegradedRequest(id=h.id, reason="fine"))
    assert get(store, h.id).degraded_reason == SLOW and rows(store, h.id)[0]["cleared_at"] is None


@pytest.mark.parametrize(("change", "error", "field"), [
    ({"reason": ""}, InvalidArgument, "reason"),
    ({"reason": "  "}, InvalidArgument, "reason"),
    ({"reason": "a\x00b"}, InvalidArgument, "reason"),
    ({"evidence": "{not json"}, InvalidArgument, "evidence_json"),
    ({"evidence": "[1, 2]"}, InvalidArgument, "evidence_json"),
    ({"evidence": '{"ratio": NaN}'}, InvalidArgument, "evidence_json"),
    ({"evidence": '{"note": "a\\u0000b"}'}, InvalidArgument, "evidence_json"),
    ({"host_id": "hst-nope"}, NotFound, "id"),
    ({"job_id": "job-nope"}, NotFound, "job_id"),
])
def test_a_bad_mark_names_the_field_and_writes_nothing(store: Store, change: dict, error: type, field: str):
    h, change = register(store), dict(change)  # a copy: the parameters are shared by every backend
    with pytest.raises(error) as err:
        mark(store, change.pop("host_id", h.id), **change)
    assert err.value.field == field
    if field == "evidence_json":
        assert "JSON object" in err.value.fix or "\\u0000" in err.value.fix
    assert store.count("host_degradations") == 0 and not get(store, h.id).HasField("degraded_at")


def test_clearing_an_unknown_or_healthy_host_is_refused(store: Store):
    h = register(store)
    with pytest.raises(NotFound) as err:
        clear(store, "hst-nope")
    assert err.value.field == "id"
    with pytest.raises(FailedPrecondition) as err:
        clear(store, h.id)
    assert err.value.field == "id" and "vm-1" in err.value.message and "not marked degraded" in err.value.fix


def test_a_job_deleted_or_a_host_removed_keeps_the_table_consistent(store: Store):
    """job_id is SET NULL with its job (the evidence stays), the rows go with their host."""
    h, job = register(store), new_job(store)
    mark(store, h.id, job_id=job.id)
    with store.engine.begin() as conn:  # the store's engine enforces foreign keys on SQLite too
        conn.execute(sa.text("DELETE FROM jobs WHERE id = :j"), {"j": job.id})
    assert rows(store, h.id)[0]["job_id"] is None
    with store.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM hosts WHERE id = :h"), {"h": h.id})
    assert store.count("host_degradations") == 0


def test_migration_0008_adds_and_drops_degraded_hosts(empty_database_url):
    url = empty_database_url
    schema.upgrade(url, "0007_job_morphs")
    engine = create_engine(url)

    def host_columns() -> set[str]:
        return {c["name"] for c in sa.inspect(engine).get_columns("hosts")}

    try:
        assert "host_degradations" not in sa.inspect(engine).get_table_names()
        with engine.begin() as conn:  # a host registered before the upgrade reads as healthy after it
            conn.execute(sa.text("INSERT INTO hosts (id, name, address, agent_port, agent_version, state, "
                                 "supported_parallelism, labels, registered_at) VALUES ('hst-1', 'vm-1', '', 0, '', "
                                 "'HOST_STATE_ONLINE', '[]', '{}', CURRENT_TIMESTAMP)"))
        engine.dispose()
        schema.upgrade(url)
        engine.dispose()
        inspector = sa.inspect(engine)
        assert {"degraded_reason", "degraded_at"} <= host_columns()
        assert {ix["name"]: ix["column_names"] for ix in inspector.get_indexes("host_degradations")} == {
            "ix_host_degradations_host_id": ["host_id"]}
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT degraded_reason, degraded_at FROM hosts")).one() == (None, None)
        schema.downgrade(url, "0007_job_morphs")
        engine.dispose()
        assert "host_degradations" not in sa.inspect(engine).get_table_names()
        assert not {"degraded_reason", "degraded_at"} & host_columns()
        with engine.connect() as conn:  # the host survives the rebuild
            assert conn.execute(sa.text("SELECT name FROM hosts")).scalar_one() == "vm-1"
        schema.upgrade(url)
        schema.check_schema(engine)
    finally:
        engine.dispose()


def test_a_degraded_host_still_online_rejoins_on_trial_after_its_parole(store: Store, tmp_path):
    """The planner clears the mark once the parole is served (doubling for each earlier catch); the evidence
    stays in host_degradations and the reason says it was a parole, not a repair."""
    from services.planner.jobs.running import PAROLE_CHECK_S
    from services.planner.jobs.scheduler import Scheduler

    online = register(store, "vm-p")
    admin = store.as_(store.admin)
    admin.update_host_state(store_pb2.UpdateHostStateRequest(id=online.id, state=fleet_pb2.HOST_STATE_ONLINE))
    mark(store, online.id)
    scheduler = Scheduler(admin, lambda host, message: None, lambda: [online.id], tmp_path, degraded_parole_s=60.0)
    at = get(store, online.id).degraded_at.ToSeconds()
    scheduler.stragglers.parole(now=at + 59.0)
    assert get(store, online.id).degraded_reason == SLOW  # 59 s of a 60 s parole: still out
    scheduler.stragglers.parole(now=at + 60.0)  # read again only PAROLE_CHECK_S later
    assert get(store, online.id).degraded_reason == SLOW
    scheduler.stragglers.parole(now=at + 59.0 + PAROLE_CHECK_S)
    back = get(store, online.id)
    assert not back.degraded_reason
    assert rows(store, online.id)[-1]["cleared_reason"].startswith("parole: degraded")

    scheduler.stragglers.caught[online.id] = 2  # caught a second time: the parole doubles
    mark(store, online.id)
    at = get(store, online.id).degraded_at.ToSeconds()
    scheduler.stragglers.parole(now=at + 100.0 + PAROLE_CHECK_S)
    assert get(store, online.id).degraded_reason == SLOW  # 100 s of 120 s
    scheduler.stragglers.parole(now=at + 121.0 + 2 * PAROLE_CHECK_S)
    assert not get(store, online.id).degraded_reason and "caught 2 time(s)" in rows(store, online.id)[-1][
        "cleared_reason"]


def test_parole_doubles_per_catch_up_to_a_day():
    from services.planner.jobs.running import MAX_PAROLE_S, parole_s

    assert [parole_s(600.0, n) for n in (1, 2, 3)] == [600.0, 1200.0, 2400.0]
    assert parole_s(600.0, 30) == MAX_PAROLE_S
