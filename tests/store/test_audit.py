"""The audit log in the store, on every backend: a batch sent twice is stored once, a member reads only its
own tenant's calls, the admin and viewers everyone's, and only the platform records."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from ballast.v1 import common_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import InvalidArgument, PermissionDenied
from services.store import schema
from services.store.db import create_engine
from tests.store_fixtures import Store


def record(who: Principal | None, method: str, target: str = "", code: str = "OK") -> store_pb2.AuditRecord:
    rec = store_pb2.AuditRecord(
        uid=uuid.uuid4().hex, tenant_id=who.tenant_id if who else "", tenant_name=who.tenant_name if who else "",
        role=common_pb2.TenantRole.Value(who.role) if who else 0, service="ballast.v1.JobService", method=method,
        target=target, code=code, duration_ms=1.5, peer="ipv4:127.0.0.1:1", server="planner")
    rec.at.FromSeconds(1_900_000_000)
    return rec


def methods(reply: store_pb2.ListAuditResponse) -> list[str]:
    return [r.method for r in reply.records]


def test_records_are_stored_once_and_read_newest_first(store: Store) -> None:
    admin = store.as_(store.admin)
    batch = [record(store.a, "Submit", "job-1"), record(store.b, "Cancel", "job-2", "NOT_FOUND"),
             record(None, "Submit", code="UNAUTHENTICATED")]
    assert admin.record_audit(store_pb2.RecordAuditRequest(records=batch)).recorded == 3
    # a retried batch (its reply was lost) adds nothing
    assert admin.record_audit(store_pb2.RecordAuditRequest(records=batch)).recorded == 0
    assert store.count("audit_log") == 3
    listed = admin.list_audit(store_pb2.ListAuditRequest()).records
    assert [(r.method, r.tenant_name, r.code) for r in listed] == [
        ("Submit", "", "UNAUTHENTICATED"), ("Cancel", "team-b", "NOT_FOUND"), ("Submit", "team-a", "OK")]
    first = listed[-1]
    assert (first.target, first.role, first.server, first.duration_ms, first.at.seconds) == (
        "job-1", common_pb2.TENANT_ROLE_MEMBER, "planner", 1.5, 1_900_000_000)
    assert listed[0].id > listed[1].id > listed[2].id


def test_a_member_reads_its_own_calls_and_a_viewer_everyones(store: Store) -> None:
    admin = store.as_(store.admin)
    admin.record_audit(store_pb2.RecordAuditRequest(records=[
        record(store.a, "Submit"), record(store.b, "Submit"), record(store.b, "Cancel"), record(None, "Cancel")]))
    made = admin.create_tenant(store_pb2.CreateTenantRequest(name="dash", role=common_pb2.TENANT_ROLE_VIEWER))
    viewer = store.repo.principal_for_token(made.token)
    store.tokens[viewer.tenant_id] = made.token
    assert viewer.viewer and not viewer.admin and viewer.reads_all
    a, b, dash = store.as_(store.a), store.as_(store.b), store.as_(viewer)
    assert methods(a.list_audit(store_pb2.ListAuditRequest())) == ["Submit"]
    assert methods(b.list_audit(store_pb2.ListAuditRequest())) == ["Cancel", "Submit"]
    # asking for another tenant's calls gives none of them
    assert not a.list_audit(store_pb2.ListAuditRequest(tenant_id=store.b.tenant_id)).records
    assert len(dash.list_audit(store_pb2.ListAuditRequest()).records) == 4
    assert methods(dash.list_audit(store_pb2.ListAuditRequest(tenant_id=store.b.tenant_id, method="Cancel"))) == [
        "Cancel"]
    since = store_pb2.ListAuditRequest()
    since.since.FromSeconds(1_900_000_001)
    assert not dash.list_audit(since).records
    # pages over one tenant's calls: the remote store audits the admin's own CreateTenant in the background, so
    # the unfiltered list may or may not hold that record yet
    one = admin.list_audit(store_pb2.ListAuditRequest(tenant_id=store.b.tenant_id,
                                                      page=common_pb2.PageRequest(page_size=1)))
    rest = admin.list_audit(store_pb2.ListAuditRequest(tenant_id=store.b.tenant_id, page=common_pb2.PageRequest(
        page_size=1, page_token=one.next_page_token)))
    assert (methods(one) + methods(rest), rest.next_page_token) == (["Cancel", "Submit"], "")


def test_only_the_platform_records_and_bad_records_name_their_field(store: Store) -> None:
    with pytest.raises(PermissionDenied):
        store.as_(store.a).record_audit(store_pb2.RecordAuditRequest(records=[record(store.a, "Submit")]))
    admin = store.as_(store.admin)
    no_uid = record(store.a, "Submit")
    no_uid.uid = ""
    with pytest.raises(InvalidArgument) as err:
        admin.record_audit(store_pb2.RecordAuditRequest(records=[record(store.a, "Submit"), no_uid]))
    assert err.value.field == "records[1].uid"
    with pytest.raises(InvalidArgument) as err:
        admin.record_audit(store_pb2.RecordAuditRequest(records=[record(store.a, "x" * 101)]))
    assert err.value.field == "records[0].method"
    assert store.count("audit_log") == 0  # nothing half-written


def test_roles_on_create(store: Store) -> None:
    admin = store.as_(store.admin)
    viewer = admin.create_tenant(store_pb2.CreateTenantRequest(name="v", role=common_pb2.TENANT_ROLE_VIEWER))
    assert (viewer.tenant.role, viewer.tenant.admin) == (common_pb2.TENANT_ROLE_VIEWER, False)
    legacy = admin.create_tenant(store_pb2.CreateTenantRequest(name="ops", admin=True))
    assert (legacy.tenant.role, legacy.tenant.admin) == (common_pb2.TENANT_ROLE_ADMIN, True)
    member = admin.create_tenant(store_pb2.CreateTenantRequest(name="m"))
    assert member.tenant.role == common_pb2.TENANT_ROLE_MEMBER
    with pytest.raises(InvalidArgument) as err:
        admin.create_tenant(store_pb2.CreateTenantRequest(name="x", admin=True, role=common_pb2.TENANT_ROLE_VIEWER))
    assert err.value.field == "role"
    with pytest.raises(InvalidArgument) as err:
        admin.create_tenant(store_pb2.CreateTenantRequest(name="y", role=42))
    assert err.value.field == "role"
    found = admin.authenticate(store_pb2.AuthenticateRequest(token=viewer.token))
    assert (found.role, found.admin) == (common_pb2.TENANT_ROLE_VIEWER, False)


def test_migration_0011_gives_every_tenant_the_role_it_had(empty_database_url) -> None:
    url = empty_database_url
    schema.upgrade(url, "0010_calibrations")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for n, admin in enumerate((True, False)):
                conn.execute(sa.text("INSERT INTO tenants (id, name, admin, token_hash, created_at) "
                                     "VALUES (:id, :name, :admin, :hash, :at)"),
                             {"id": f"t-{n}", "name": f"n{n}", "admin": admin, "hash": str(n) * 64,
                              "at": "2026-01-01 00:00:00"})
        engine.dispose()
        schema.upgrade(url)
        with engine.connect() as conn:
            roles = dict(conn.execute(sa.text("SELECT id, role FROM tenants ORDER BY id")).all())
            assert conn.execute(sa.text("SELECT count(*) FROM audit_log")).scalar_one() == 0
        assert roles == {"t-0": "TENANT_ROLE_ADMIN", "t-1": "TENANT_ROLE_MEMBER"}
        schema.downgrade(url, "0010_calibrations")
        engine.dispose()
        inspector = sa.inspect(engine)
        assert "audit_log" not in inspector.get_table_names()
        assert "role" not in {c["name"] for c in inspector.get_columns("tenants")}
    finally:
        engine.dispose()
