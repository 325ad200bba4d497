"""Transport security on real loopback servers: TLS round trips, plaintext refused on a TLS port, the plaintext
opt-out kept to loopback, the local CA made once, and hosts registered only with a matching client certificate."""

from __future__ import annotations

import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ballast.client import open_channel
from ballast.config import load_settings
from ballast.tls import alt_names, common_name, ensure_server_files, init_bundle, tls_files
from ballast.transport import ClientTransport, client_transport, is_loopback
from ballast.v1 import executor_pb2, executor_pb2_grpc, fleet_pb2, store_pb2, store_pb2_grpc
from services.runtime.server import Server, ServerSpec
from tests.harness import make_settings, start_plane


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("tls"), sweep_interval_s=60.0)
    plane = start_plane(settings, services=("store", "planner"), send=lambda request_id: None)
    yield plane
    plane.stop()


def hello(name: str) -> executor_pb2.AgentMessage:
    return executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(host=fleet_pb2.Host(name=name)))


def test_a_tls_client_round_trips(plane) -> None:
    with plane.client() as client:
        assert client.store.ListModels(store_pb2.ListModelsRequest(), timeout=5) is not None


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    """The status of one health check on a raw channel (no retries: the handshake's own failure shows)."""
    with channel, pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return info.value.code()


def test_a_plaintext_client_is_refused_on_a_tls_port(plane) -> None:
    assert refused(grpc.insecure_channel(plane.settings.address("store"))) == grpc.StatusCode.UNAVAILABLE
    # ... and the SDK's channel without a transport is plaintext too
    channel = open_channel(plane.settings.address("store"), plane.token, timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        store_pb2_grpc.StoreServiceStub(channel).ListModels(store_pb2.ListModelsRequest())
    channel.close()
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_a_client_trusting_another_ca_is_refused(plane, tmp_path) -> None:
    other = make_settings(tmp_path / "other")
    ensure_server_files(other)  # a second, unrelated local CA
    credentials = client_transport(other).credentials()
    assert refused(grpc.secure_channel(plane.settings.address("store"), credentials)) == grpc.StatusCode.UNAVAILABLE


def test_an_agent_with_its_certificate_registers(plane) -> None:
    with plane.agent_control("host-a") as control:
        stream = control.Connect(iter([hello("host-a")]), timeout=10)
        assert next(stream).WhichOneof("body") == "registered"
        stream.cancel()


def test_a_token_alone_no_longer_registers_a_host(plane) -> None:
    """The admin token over the public planner port (TLS, no client certificate) cannot register."""
    with plane.client() as admin:
        stream = admin.executor_control.Connect(iter([hello("intruder")]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(stream)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "client certificate" in info.value.details()


def test_a_certificate_for_another_host_cannot_register_this_one(plane) -> None:
    with plane.agent_control("host-b") as control:
        stream = control.Connect(iter([hello("host-c")]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(stream)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "host-b" in info.value.details()


def test_the_servers_own_certificate_does_not_pass_for_an_agent(plane) -> None:
    """Every service's host holds the server certificate the CA signed; it is not issued for client use
    (extended key usage serverAuth only), so the handshake on the agent port refuses it: it registers nothing."""
    files = ensure_server_files(plane.settings)
    server = ClientTransport(ca=files.ca.read_bytes(), cert=files.identity.cert.read_bytes(),
                             key=files.identity.key.read_bytes())
    channel = open_channel(plane.settings.address("planner_agent"), plane.token, timeout=10, transport=server)
    stream = executor_pb2_grpc.ExecutorControlStub(channel).Connect(
        iter([hello(common_name(files.identity.cert))]), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    channel.close()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value  # "unsupported certificate purpose"


def test_the_agent_port_refuses_a_client_without_a_certificate(plane) -> None:
    credentials = client_transport(plane.settings).credentials()  # verifies the server, presents no certificate
    channel = grpc.secure_channel(plane.settings.address("planner_agent"), credentials)
    assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_the_local_ca_is_made_once_with_private_keys_0600(tmp_path) -> None:
    settings = make_settings(tmp_path)
    files = ensure_server_files(settings)
    first = {p: p.read_bytes() for p in (files.ca, files.identity.cert, files.identity.key)}
    assert ensure_server_files(settings) == files
    assert {p: p.read_bytes() for p in first} == first  # reused, not regenerated
    for key in (files.identity.key, files.ca.with_name("ca.key")):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert common_name(files.identity.cert) == "ballast-server"


def test_tls_init_keeps_the_server_certificate_until_a_new_service_name_needs_one(tmp_path) -> None:
    ca_dir, out = tmp_path / "ca", tmp_path / "tls"
    written = init_bundle(ca_dir, out, ["store", "planner"], ["executor"])
    assert out / "server.crt" in written and {"store", "planner", "localhost"} <= alt_names(out / "server.crt")
    assert init_bundle(ca_dir, out, ["store", "planner"], ["executor"]) == []  # all there: nothing rewritten
    before = (out / "ca.crt").read_bytes()
    # an upgrade that adds a service (compose's store-read): its name joins the server certificate, same CA
    assert init_bundle(ca_dir, out, ["store", "store-read", "planner"], ["executor"]) == [out / "server.crt"]
    assert {"store", "store-read", "planner"} <= alt_names(out / "server.crt")
    assert (out / "ca.crt").read_bytes() == before


def test_explicit_certificate_paths_must_exist(tmp_path) -> None:
    settings = make_settings(tmp_path, tls_cert=str(tmp_path / "missing.crt"))
    assert not tls_files(settings).local
    with pytest.raises(ValueError, match="tls_ca.*BALLAST_TLS_CA"):
        ensure_server_files(settings)


def test_plaintext_is_loopback_only(tmp_path) -> None:
    assert is_loopback("127.0.0.1:1") and is_loopback("localhost:1") and is_loopback("[::1]:1")
    assert not is_loopback("0.0.0.0:1") and not is_loopback("10.0.0.5:1") and not is_loopback("[::]:1")
    spec = ServerSpec(name="t", address="0.0.0.0:0", register=lambda s: None, services=[])
    with pytest.raises(ValueError, match="plaintext.*BALLAST_HOST=127.0.0.1"):
        Server(spec)


def test_plaintext_is_an_explicit_boolean_setting() -> None:
    assert load_settings({"BALLAST_PLAINTEXT": "1"}, data_dir="/tmp/x").plaintext is True
    assert load_settings({}, data_dir="/tmp/x").plaintext is False
    with pytest.raises(ValueError, match="plaintext"):
        load_settings({"BALLAST_PLAINTEXT": "maybe"}, data_dir="/tmp/x")
