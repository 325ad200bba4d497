"""The Store interface: it matches store.proto RPC for RPC, and RemoteStore (gRPC) and LocalStore (in-process)
both implement it, with the same domain errors."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Iterator
from datetime import UTC, datetime

import grpc
import pytest
from google.protobuf import message_factory

from ballast.client import open_channel
from ballast.transport import client_transport
from ballast.v1 import common_pb2, job_pb2, store_pb2
from services.runtime import store_client
from services.runtime.errors import NotFound, PermissionDenied, Unauthenticated, Unavailable
from services.runtime.servicer import snake
from services.runtime.store_api import SERVICE, Store, every_page
from services.runtime.store_client import READ_ONLY, RemoteStore, StoreAuthenticator, anonymous_store
from services.store import schema
from services.store.db import create_engine
from services.store.local import LocalStore
from services.store.repository import Repository
from services.store.service import build_server
from tests.harness import make_settings

ADMIN_TOKEN = "blt_store_api_admin"
RPCS = {snake(m.name): m for m in SERVICE.methods}


def protocol_methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def test_the_protocol_has_one_typed_method_per_rpc() -> None:
    assert protocol_methods(Store) == set(RPCS)
    for name, method in RPCS.items():
        hints = typing.get_type_hints(getattr(Store, name))
        assert list(inspect.signature(getattr(Store, name)).parameters) == ["self", "request"], name
        assert hints["request"] is message_factory.GetMessageClass(method.input_type), name
        assert hints["return"] is message_factory.GetMessageClass(method.output_type), name


@pytest.mark.parametrize("cls", [RemoteStore, LocalStore])
def test_implementations_define_every_method_with_the_protocols_signature(cls: type) -> None:
    assert protocol_methods(cls) >= set(RPCS)
    for name in RPCS:
        assert name in vars(cls), f"{cls.__name__}.{name} is inherited from the Protocol, not implemented"
        assert inspect.signature(getattr(cls, name)) == inspect.signature(getattr(Store, name))
        assert typing.get_type_hints(getattr(cls, name)) == typing.get_type_hints(getattr(Store, name))


def test_only_reads_are_retried() -> None:
    assert {"GetJob", "ListJobs", "Authenticate", "GetSchemaStatus", "Query"} <= READ_ONLY
    assert not any(name.startswith(("Create", "Transition", "Claim", "Renew", "Complete")) for name in READ_ONLY)


class Down(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "store restarting"


class FlakyStub:
    """Answers UNAVAILABLE `failures` times per method, then an empty reply of the right type."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        def call(request, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.calls[name] <= self.failures:
                raise Down()
            return message_factory.GetMessageClass(SERVICE.methods_by_name[name].output_type)()

        return call


def flaky(failures: int) -> tuple[RemoteStore, FlakyStub]:
    store = RemoteStore(grpc.insecure_channel("127.0.0.1:1"))
    store._stub = stub = FlakyStub(failures)
    return store, stub


def test_remote_reads_ride_out_a_short_outage_and_writes_fail_at_once() -> None:
    store, stub = flaky(2)
    assert store.get_job(store_pb2.GetRequest(id="job-1")) == job_pb2.Job()
    assert stub.calls["GetJob"] == 3
    with pytest.raises(Unavailable, match="store restarting"):
        store.create_job(store_pb2.CreateJobRequest())
    assert stub.calls["CreateJob"] == 1
    store, stub = flaky(10)
    with pytest.raises(Unavailable):
        store.list_jobs(store_pb2.ListJobsRequest())
    assert stub.calls["ListJobs"] == 4  # the first try and one per delay


class StoreDown:
    def authenticate(self, request: store_pb2.AuthenticateRequest) -> common_pb2.Principal:
        raise Unavailable("database unavailable")


def test_the_authenticator_tells_a_bad_token_from_a_store_it_cannot_reach() -> None:
    with pytest.raises(Unavailable, match="cannot reach the store to check the token: UNAVAILABLE"):
        StoreAuthenticator(StoreDown())("blt_somebody")


def test_a_read_that_already_took_its_budget_is_not_tried_again(monkeypatch) -> None:
    monkeypatch.setattr(store_client, "RETRY_BUDGET_S", 0.0)  # as if the channel's own retries took it all
    store, stub = flaky(1)
    with pytest.raises(Unavailable):
        store.get_job(store_pb2.GetRequest(id="job-1"))
    assert stub.calls["GetJob"] == 1


@pytest.fixture
def repo(tmp_path) -> Iterator[Repository]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    schema.upgrade(url)
    engine = create_engine(url)
    repo = Repository(engine, now=lambda: datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC))
    yield repo
    engine.dispose()


def test_local_store_runs_every_call_as_its_principal(repo: Repository) -> None:
    admin = LocalStore(repo, repo.ensure_admin(ADMIN_TOKEN))
    created = admin.create_tenant(store_pb2.CreateTenantRequest(name="team-a"))
    team = LocalStore(repo, repo.principal_for_token(created.token))
    assert team.authenticate(store_pb2.AuthenticateRequest(token=created.token)) == common_pb2.Principal(
        tenant_id=created.tenant.id, tenant_name="team-a", admin=False, role=common_pb2.TENANT_ROLE_MEMBER
    )
    with pytest.raises(Unauthenticated):
        team.authenticate(store_pb2.AuthenticateRequest(token="blt_nobody"))
    with pytest.raises(PermissionDenied, match="SQL queries are for the platform admin"):
        team.query(store_pb2.QueryRequest(sql="SELECT 1"))
    assert admin.query(store_pb2.QueryRequest(sql="SELECT name FROM tenants ORDER BY name")).rows[1][0] == "team-a"
    with pytest.raises(NotFound):
        team.get_tenant(store_pb2.GetRequest(id=admin.principal.tenant_id))
    status = team.get_schema_status(store_pb2.SchemaStatusRequest())
    assert status.current_revision == status.head_revision and status.dialect == "sqlite"
    assert status.now.ToDatetime(tzinfo=UTC) == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)  # the store's clock
    for name in ("team-b", "team-c"):
        admin.create_tenant(store_pb2.CreateTenantRequest(name=name))
    request = store_pb2.ListTenantsRequest(page=common_pb2.PageRequest(page_size=2))
    replies = list(every_page(admin.list_tenants, request))
    assert [len(r.tenants) for r in replies] == [2, 2]
    assert sorted(t.name for r in replies for t in r.tenants) == ["admin", "team-a", "team-b", "team-c"]


def test_remote_store_against_a_served_repository(tmp_path, repo: Repository) -> None:
    settings = make_settings(tmp_path, token=ADMIN_TOKEN)
    server = build_server(settings, repo.engine, "127.0.0.1:0", repo=repo).start()
    try:
        assert server.port > 0
        address = f"127.0.0.1:{server.port}"
        transport = client_transport(settings)
        admin = RemoteStore(open_channel(address, ADMIN_TOKEN, transport=transport))
        created = admin.create_tenant(store_pb2.CreateTenantRequest(name="team-a"))
        team = RemoteStore(open_channel(address, created.token, transport=transport))
        with pytest.raises(PermissionDenied, match="SQL queries are for the platform admin"):
            team.query(store_pb2.QueryRequest(sql="SELECT 1"))
        with pytest.raises(NotFound, match="tenant 'tnt-x' not found"):
            admin.get_tenant(store_pb2.GetRequest(id="tnt-x"))
        assert team.get_schema_status(store_pb2.SchemaStatusRequest()).now.seconds == int(repo.now().timestamp())

        check = StoreAuthenticator(anonymous_store(dataclasses.replace(settings, store_port=server.port)))
        assert check(created.token).tenant_name == "team-a"
        with pytest.raises(Unauthenticated, match="unknown bearer token"):
            check("blt_nobody")
    finally:
        server.stop(0)
    assert check(created.token).tenant_name == "team-a"  # cached
    with pytest.raises(ValueError, match="engine"):
        build_server(settings, create_engine(f"sqlite:///{tmp_path / 'other.db'}"), "127.0.0.1:0", repo=repo)
