"""An abandoned `ballast sql` query stops on the database (issue 41, item 1): the store cancels it when its
caller's deadline passes or its caller goes away, over a real store server and PostgreSQL."""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
import sqlalchemy as sa

from ballast.client import open_channel
from ballast.config import load_settings
from ballast.transport import client_transport
from ballast.v1 import store_pb2, store_pb2_grpc
from services.specs.user_inputs import UserInputs
from services.store import schema
from services.store.db import create_engine
from services.store.repository import Repository
from services.store.service import build_server
from services.store.sql import readonly_url
from tests.conftest import PG_ADMIN_URL, create_postgres_database, drop_postgres_database, require_postgres

TOKEN = "blt_sql-cancel-admin"
ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


def running(marker: str) -> int:
    """How many sessions run a query carrying `marker`, as the database sees it."""
    admin = sa.create_engine(PG_ADMIN_URL)
    try:
        with admin.connect() as conn:
            return conn.execute(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() "
                "AND query LIKE :pattern"), {"pattern": f"%{marker}%"}).scalar_one()
    finally:
        admin.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("leave", ["deadline", "cancel"])
def test_an_abandoned_query_stops_on_the_database(tmp_path, leave: str) -> None:
    require_postgres()
    url = create_postgres_database()
    engine = query_engine = server = channel = None
    try:
        schema.upgrade(url)
        engine, query_engine = create_engine(url), create_engine(readonly_url(url))
        repo = Repository(engine, user_inputs=UserInputs.of([]), sql_engine=query_engine)
        repo.ensure_admin(TOKEN)
        settings = load_settings({}, data_dir=tmp_path, store_metrics_port=0)
        server = build_server(settings, engine, "127.0.0.1:0", repo=repo).start()
        channel = open_channel(f"127.0.0.1:{server.port}", TOKEN, transport=client_transport(settings), timeout=None)
        stub = store_pb2_grpc.StoreServiceStub(channel)
        marker = f"abandoned-{uuid.uuid4().hex[:8]}"
        request = store_pb2.QueryRequest(sql=f"/* {marker} */ {ENDLESS}", timeout_s=300)
        if leave == "deadline":
            with pytest.raises(grpc.RpcError) as err:
                stub.Query(request, timeout=1.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            future = stub.Query.future(request)
            for _ in range(100):  # until the database runs it
                if running(marker):
                    break
                time.sleep(0.1)
            assert running(marker) == 1
            future.cancel()
        for _ in range(300):  # its own timeout is 300 s: gone well before that, or it ran on for nobody
            if not running(marker):
                break
            time.sleep(0.1)
        assert running(marker) == 0
        # The store goes on answering.
        reply = stub.Query(store_pb2.QueryRequest(sql="SELECT count(*) FROM tenants"), timeout=30)
        assert reply.rows[0].values[0].number_value == 1
    finally:
        if channel is not None:
            channel.close()
        if server is not None:
            server.stop(0)
        for e in (query_engine, engine):
            if e is not None:
                e.dispose()
        drop_postgres_database(url)
