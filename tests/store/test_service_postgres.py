"""The store service on real PostgreSQL: database outages and the read-only SQL RPC.

Database down: the store answers UNAVAILABLE (never a traceback), clients retry with backoff, and
service resumes by itself when the database comes back. SQL: writes, data-modifying CTEs and sequence
changes are refused by the database's read-only transaction and role, and change nothing."""

from __future__ import annotations

import threading

import grpc
import pytest
import sqlalchemy as sa

from ballast.v1 import store_pb2
from tests.conftest import PG_ADMIN_URL, create_postgres_database, drop_postgres_database, require_postgres
from tests.harness import make_settings, start_plane

pytestmark = pytest.mark.postgres


def set_connectable(url: str, allowed: bool) -> None:
    """Refuse (or allow) new connections to the database and drop the existing ones."""
    name = url.rsplit("/", 1)[1]
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {str(allowed).lower()}'))
        if not allowed:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                         {"n": name})
    admin.dispose()


@pytest.fixture
def pg_plane(tmp_path):
    require_postgres()
    url = create_postgres_database()
    plane = start_plane(make_settings(tmp_path, database_url=url), services=("store",))
    yield plane, url
    plane.stop()
    set_connectable(url, True)
    drop_postgres_database(url)


def test_database_down_is_unavailable_then_recovers(pg_plane) -> None:
    plane, url = pg_plane
    with plane.client() as client:
        client.store.CreateTenant(store_pb2.CreateTenantRequest(name="before-outage"))
        set_connectable(url, False)
        with pytest.raises(grpc.RpcError) as info:
            client.store.ListTenants(store_pb2.ListTenantsRequest())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "database" in info.value.details()

        # Bring it back while the client is still retrying: the call succeeds without the caller noticing.
        timer = threading.Timer(0.2, set_connectable, args=(url, True))
        timer.start()
        names = {t.name for t in client.store.ListTenants(store_pb2.ListTenantsRequest()).tenants}
        timer.join()
        assert "before-outage" in names


def test_sql_rpc_is_read_only_on_postgres(pg_plane) -> None:
    plane, _ = pg_plane
    with plane.client() as client:
        client.store.CreateTenant(store_pb2.CreateTenantRequest(name="keep-me"))
        count_sql = "SELECT count(*) FROM tenants"
        seq_sql = "SELECT last_value, is_called FROM iteration_metrics_id_seq"
        before = (client.store.Query(store_pb2.QueryRequest(sql=count_sql)).rows[0][0],
                  list(client.store.Query(store_pb2.QueryRequest(sql=seq_sql)).rows[0]))
        for sql in ("DELETE FROM tenants", "WITH d AS (DELETE FROM tenants RETURNING *) SELECT * FROM d",
                    "SELECT setval('iteration_metrics_id_seq', 42)", "SELECT nextval('iteration_metrics_id_seq')"):
            with pytest.raises(grpc.RpcError) as info:
                client.store.Query(store_pb2.QueryRequest(sql=sql))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, sql
            assert info.value.details().startswith("read-only"), info.value.details()
        after = (client.store.Query(store_pb2.QueryRequest(sql=count_sql)).rows[0][0],
                 list(client.store.Query(store_pb2.QueryRequest(sql=seq_sql)).rows[0]))
        assert after == before


def test_upgrade_sets_the_read_only_login_password(pg_plane) -> None:
    from services.store import schema

    _, url = pg_plane
    admin = sa.create_engine(PG_ADMIN_URL)
    query = "SELECT rolpassword IS NOT NULL FROM pg_authid WHERE rolname = 'ballast_readonly'"
    try:
        assert schema.set_readonly_password(url, "s3cret-pass") is True
        with admin.connect() as conn:
            assert conn.execute(sa.text(query)).scalar() is True
    finally:
        with admin.begin() as conn:  # the role is cluster-wide: leave it as the tests found it
            conn.execute(sa.text("ALTER ROLE ballast_readonly PASSWORD NULL"))
        admin.dispose()
    assert schema.set_readonly_password("sqlite:////tmp/none.db", "x") is False
