"""Service runtime in isolation: interceptor chain (auth, deadline, errors), server lifecycle, client caps."""

from __future__ import annotations

import time

import grpc
import pytest

from ballast.client import open_channel
from ballast.health import check
from ballast.v1 import store_pb2, store_pb2_grpc
from services.runtime.auth import Principal
from services.runtime.context import remaining_time
from services.runtime.errors import InvalidArgument, Unauthenticated
from services.runtime.server import Server, ServerSpec
from services.runtime.servicer import UnmappedRpcError, delegate, snake

SERVICE = store_pb2.DESCRIPTOR.services_by_name["StoreService"]


class Target:
    """Our own logic under test sits in the interceptors; this target only reports what it saw."""

    def get_schema_status(self, principal: Principal, request) -> store_pb2.SchemaStatus:
        left = remaining_time()
        return store_pb2.SchemaStatus(dialect=principal.tenant_name,
                                      current_revision="none" if left is None else f"{left:.3f}")

    def list_tenants(self, principal: Principal, request) -> store_pb2.ListTenantsResponse:
        time.sleep(1.0)  # slower than the propagated deadline below
        return store_pb2.ListTenantsResponse()

    def get_tenant(self, principal: Principal, request):
        raise RuntimeError("secret internals")

    def get_model(self, principal: Principal, request):
        raise InvalidArgument("must start with mdl-", field="id", fix="pass a model id")


def authenticate(token: str) -> Principal:
    if token != "good":
        raise Unauthenticated("unknown token")
    return Principal("tnt-1", "team", False)


@pytest.fixture
def server():
    missing = {m.name: "not under test" for m in SERVICE.methods if not hasattr(Target, snake(m.name))}
    servicer = delegate(SERVICE, Target(), missing={**missing, "Query": "the SQL issue"})()
    srv = Server(ServerSpec(name="t", address="127.0.0.1:0", services=[SERVICE.full_name], authenticate=authenticate,
                            register=lambda s: store_pb2_grpc.add_StoreServiceServicer_to_server(servicer, s)))
    srv.start()
    yield srv
    srv.stop(0)


def stub(server: Server, token: str = "good", **kw) -> store_pb2_grpc.StoreServiceStub:
    return store_pb2_grpc.StoreServiceStub(open_channel(f"127.0.0.1:{server.port}", token, **kw))


def test_principal_and_deadline_reach_the_logic(server) -> None:
    reply = stub(server).GetSchemaStatus(store_pb2.SchemaStatusRequest(), timeout=5)
    assert reply.dialect == "team"
    # The remaining time is finite and about what was sent (gRPC rounds the timeout header up, a few ms at most).
    assert 0 < float(reply.current_revision) <= 5.05
    reply = stub(server, timeout=None).GetSchemaStatus(store_pb2.SchemaStatusRequest())
    assert reply.current_revision == "none"


def test_propagated_deadline_caps_downstream_calls(server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub(server, deadline_source=lambda: 0.1).ListTenants(store_pb2.ListTenantsRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_domain_errors_map_to_status_codes_naming_the_field(server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub(server).GetModel(store_pb2.GetRequest(id="x"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "id: must start with mdl- (pass a model id)"
    with pytest.raises(grpc.RpcError) as info:
        stub(server).Query(store_pb2.QueryRequest(sql="SELECT 1"))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "the SQL issue" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub(server).GetTenant(store_pb2.GetRequest(id="x"))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError" in info.value.details() and "secret" not in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub(server, token="bad").GetSchemaStatus(store_pb2.SchemaStatusRequest())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_graceful_stop_flips_health_first(server) -> None:
    address = f"127.0.0.1:{server.port}"
    assert check(address) == "SERVING"
    server.set_serving(False)
    assert check(address) == "NOT_SERVING"
    server.stop(0)
    assert check(address).startswith("UNREACHABLE")


def test_streams_must_leave_threads_for_unary_calls() -> None:
    with pytest.raises(ValueError, match="max_streams"):
        Server(ServerSpec(name="t", address="127.0.0.1:0", services=[], register=lambda s: None,
                          max_workers=4, max_streams=4))


def test_snake_case_mapping() -> None:
    assert snake("WriteIterationMetrics") == "write_iteration_metrics"
    assert snake("Query") == "query"


def test_an_rpc_without_a_handler_fails_the_build() -> None:
    with pytest.raises(UnmappedRpcError, match=r"ballast\.v1\.StoreService\.CreateTenant has no handler"):
        delegate(SERVICE, Target(), missing={"Query": "the SQL issue"})
    with pytest.raises(UnmappedRpcError, match="has no RPC Qeury"):
        delegate(SERVICE, Target(), missing={"Qeury": "a typo"})
