"""Database down: the store answers UNAVAILABLE (never a traceback), clients retry with backoff,
and service resumes by itself when the database comes back. Real PostgreSQL, connections refused."""

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
