"""A read-only store beside the store, over the same database (docs/architecture.md, "Store reads"): services
send it the read-only RPCs, every write still goes to the store, a read sees every write committed before it, the reader
refuses writes naming the store, a read it cannot serve goes to the store, and a rotated token stops working
there within its short cache. Real gRPC servers on loopback, SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ballast.client import open_channel
from ballast.config import Settings
from ballast.transport import client_transport, server_credentials
from ballast.v1 import common_pb2, store_pb2
from services.runtime import store_client
from services.runtime.errors import FailedPrecondition, Unauthenticated
from services.runtime.server import Server, ServerSpec
from services.runtime.store_client import READ_ONLY, READER_SERVES, RemoteStore, remote_stores
from services.store.db import create_engine
from services.store.service import READER_TTL_S, build_server
from tests.harness import make_settings, wait_for
from tests.store_builders import job_spec
from tests.store_fixtures import ADMIN_TOKEN


@dataclasses.dataclass
class Pair:
    settings: Settings  # what a service of this plane reads: the store's port and the reader's address
    store: Server
    reader: Server

    def remote(self, token: str, address: str) -> RemoteStore:
        return RemoteStore(open_channel(address, token, transport=client_transport(self.settings)))


@pytest.fixture
def pair(database_url: str, tmp_path: Path) -> Iterator[Pair]:
    settings = make_settings(tmp_path, token=ADMIN_TOKEN, database_url=database_url)
    engines = [create_engine(database_url), create_engine(database_url)]
    store = build_server(settings, engines[0], "127.0.0.1:0").start()
    settings = dataclasses.replace(settings, store_port=store.port)
    reader = build_server(settings, engines[1], "127.0.0.1:0", read_only=True).start()
    try:
        yield Pair(dataclasses.replace(settings, store_read_address=f"127.0.0.1:{reader.port}"), store, reader)
    finally:
        for server in (reader, store):
            server.stop(0)


def test_every_read_only_rpc_but_token_checks_and_sql_goes_to_the_reader():
    assert READER_SERVES == READ_ONLY - {"Authenticate", "Query"}
    assert {"GetJob", "ListJobs", "ListJobEvents", "ListHosts", "GetPlan"} <= READER_SERVES
    assert not READER_SERVES & {"CreateQueuedJob", "TransitionJob", "CreatePlan", "RecordAudit"}


def test_reads_go_to_the_reader_and_see_each_write_committed_before_them(pair: Pair):
    as_caller, as_platform = remote_stores(pair.settings)
    for i in range(15):  # a write (the reader refuses those, so the store took it), then at once a read
        made = as_platform.create_queued_job(store_pb2.CreateQueuedJobRequest(spec=job_spec(f"rw-{i}"),
                                                                              kind="jobs.prepare"))
        assert as_caller.get_job(store_pb2.GetRequest(id=made.job.id)).spec.name == f"rw-{i}"
        listed = as_platform.list_jobs(store_pb2.ListJobsRequest())
        assert made.job.id in {j.id for j in listed.jobs}
    pair.store.stop(0)  # the store gone: the reads still answer, so they were the reader's
    assert len(as_caller.list_jobs(store_pb2.ListJobsRequest(page=common_pb2.PageRequest(page_size=100))).jobs) == 15


def test_the_reader_refuses_a_write_naming_the_store_and_writes_nothing(pair: Pair):
    direct = pair.remote(ADMIN_TOKEN, pair.settings.store_read_address)
    with pytest.raises(FailedPrecondition) as refused:
        direct.create_tenant(store_pb2.CreateTenantRequest(name="via-the-reader"))
    assert "serves only reads" in str(refused.value)
    assert refused.value.fix == f"send it to the store at {pair.settings.address('store')}"
    names = {t.name for t in direct.list_tenants(store_pb2.ListTenantsRequest()).tenants}
    assert "via-the-reader" not in names


def test_a_read_the_reader_cannot_serve_goes_to_the_store_at_once(pair: Pair):
    as_caller, _ = remote_stores(pair.settings)
    made = as_caller.create_tenant(store_pb2.CreateTenantRequest(name="still-read"))
    pair.reader.stop(0)
    started = time.monotonic()
    for _ in range(3):
        assert made.tenant.name in {t.name for t in as_caller.list_tenants(store_pb2.ListTenantsRequest()).tenants}
    assert time.monotonic() - started < 5  # not the reader channel's retries (seconds each): it has none


def test_a_rotated_token_stops_working_on_the_reader_within_its_cache(pair: Pair):
    _, admin = remote_stores(pair.settings)
    made = admin.create_tenant(store_pb2.CreateTenantRequest(name="rotating"))
    old = pair.remote(made.token, pair.settings.store_read_address)
    assert old.list_jobs(store_pb2.ListJobsRequest()).jobs == []  # resolved, so cached on the reader now
    admin.rotate_tenant_token(store_pb2.RotateTenantTokenRequest(tenant_id=made.tenant.id))

    def refused() -> bool:
        try:
            old.list_jobs(store_pb2.ListJobsRequest())
        except Unauthenticated:
            return True
        return False

    wait_for(refused, timeout=READER_TTL_S + 4, what="the old token refused by the reader")


def test_a_hung_reader_is_left_after_one_short_attempt_and_benched(pair: Pair, monkeypatch):
    monkeypatch.setattr(store_client, "READER_ATTEMPT_S", 0.5)
    with socket.socket() as hung:  # takes the connection, never answers (not even the TLS handshake)
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        settings = dataclasses.replace(pair.settings, store_read_address=f"127.0.0.1:{hung.getsockname()[1]}")
        as_caller, _ = remote_stores(settings)
        made = as_caller.create_tenant(store_pb2.CreateTenantRequest(name="past-a-hung-reader"))
        first = time.monotonic()
        assert made.tenant.name in {t.name for t in as_caller.list_tenants(store_pb2.ListTenantsRequest()).tenants}
        took = time.monotonic() - first
        second = time.monotonic()
        as_caller.list_tenants(store_pb2.ListTenantsRequest())
        assert took >= 0.5 and time.monotonic() - second < 0.5 <= took  # waited once; benched after


def test_a_reader_without_the_rpc_sends_the_read_to_the_store(pair: Pair):
    health_only = Server(ServerSpec(name="old-reader", address="127.0.0.1:0", register=lambda s: None, services=[],
                                    credentials=server_credentials(pair.settings))).start()
    try:  # a reader older than the call answers UNIMPLEMENTED (a rolling upgrade): the store answers instead
        as_caller, _ = remote_stores(dataclasses.replace(pair.settings,
                                                         store_read_address=f"127.0.0.1:{health_only.port}"))
        made = as_caller.create_tenant(store_pb2.CreateTenantRequest(name="past-an-old-reader"))
        assert made.tenant.name in {t.name for t in as_caller.list_tenants(store_pb2.ListTenantsRequest()).tenants}
    finally:
        health_only.stop(0)
