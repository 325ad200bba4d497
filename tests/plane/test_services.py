"""The services over real gRPC on loopback: auth, tenancy, errors, reflection, health, streams, SQL."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ballast.health import check
from ballast.transport import agent_transport, client_transport
from ballast.v1 import executor_pb2, fleet_pb2, job_pb2, model_pb2, services_pb2, store_pb2
from tests.harness import make_settings, start_plane, wait_for

SERVICES = {
    "store": {"ballast.v1.StoreService"},
    "profiler": {"ballast.v1.ProfilerService"},
    "planner": {"ballast.v1.PlannerService", "ballast.v1.JobService", "ballast.v1.FleetService"},
    "planner_agent": {"ballast.v1.ExecutorControl"},  # its own port and event loop (services/runtime/aio_port.py)
}


def gpt_spec(name: str = "gpt-tiny", layers: int = 2) -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(
        name=name, family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=layers, hidden_size=64, num_heads=4, vocab_size=128,
                                                seq_length=32),
    )


def job_spec(name: str = "job") -> job_pb2.JobSpec:
    return job_pb2.JobSpec(name=name, model=gpt_spec(), global_batch_size=8, iterations=10)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("plane"), sweep_interval_s=60.0)
    plane = start_plane(settings, send=lambda request_id: None)
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def tenants(plane):
    with plane.client() as admin:
        a = admin.store.CreateTenant(store_pb2.CreateTenantRequest(name="team-a"))
        b = admin.store.CreateTenant(store_pb2.CreateTenantRequest(name="team-b"))
    return a.token, b.token


def transport_for(settings, service: str):
    """TLS with the data dir's CA; on the agent port also an agent's client certificate (mutual TLS)."""
    return agent_transport(settings, "probe") if service == "planner_agent" else client_transport(settings)


def list_services(settings, service: str) -> set[str]:
    """Only server reflection, with a plain grpcio channel and no token."""
    with grpc.secure_channel(settings.address(service), transport_for(settings, service).credentials()) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        return {s.name for reply in replies for s in reply.list_services_response.service}


def test_reflection_lists_every_ballast_service(plane) -> None:
    found = set()
    for name, expected in SERVICES.items():
        services = list_services(plane.settings, name)
        assert expected <= services
        assert "grpc.health.v1.Health" in services
        found |= {s for s in services if s.startswith("ballast.v1.")}
    assert found == set().union(*SERVICES.values())


def test_health_is_serving_without_a_token(plane) -> None:
    for name in SERVICES:
        transport = transport_for(plane.settings, name)
        assert check(plane.settings.address(name), transport=transport) == "SERVING"
        for service in SERVICES[name]:
            assert check(plane.settings.address(name), service, transport=transport) == "SERVING"


@pytest.mark.parametrize("service", ["store", "planner", "profiler"])
def test_calls_without_a_valid_token_are_unauthenticated(plane, service: str) -> None:
    for token in ("", "blt_not-a-real-token"):
        with plane.client(token=token) as client:
            with pytest.raises(grpc.RpcError) as info:
                if service == "store":
                    client.store.ListModels(store_pb2.ListModelsRequest())
                elif service == "planner":
                    client.jobs.List(store_pb2.ListJobsRequest())
                else:
                    client.profiler.ListDeviceKinds(services_pb2.ListDeviceKindsRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "token" in info.value.details()


def test_another_tenants_rows_are_invisible(plane, tenants) -> None:
    token_a, token_b = tenants
    with plane.client(token=token_a) as a, plane.client(token=token_b) as b:
        model = a.store.CreateModel(store_pb2.CreateModelRequest(spec=gpt_spec("private")))
        job = a.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec("a-job")))
        for call in (lambda: b.store.GetModel(store_pb2.GetRequest(id=model.id)),
                     lambda: b.jobs.Get(store_pb2.GetRequest(id=job.id)),
                     lambda: b.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job.id))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert model.id not in {m.id for m in b.store.ListModels(store_pb2.ListModelsRequest()).models}
        assert job.id not in {j.id for j in b.jobs.List(store_pb2.ListJobsRequest()).jobs}
        assert job.id in {j.id for j in a.jobs.List(store_pb2.ListJobsRequest()).jobs}


def test_malformed_spec_names_the_field(plane) -> None:
    bad = job_spec()
    bad.model.transformer.num_heads = 3  # 64 is not divisible by 3
    with plane.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.jobs.Submit(services_pb2.SubmitJobRequest(spec=bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_heads" in info.value.details()


def test_unknown_id_is_not_found(plane) -> None:
    with plane.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.jobs.Get(store_pb2.GetRequest(id="job-doesnotexist"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_empty_plan_and_profile_requests_name_the_missing_field(plane) -> None:
    with plane.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.planner.Plan(services_pb2.PlanRequest(profile_id="prf-x"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "fleet" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.profiler.Profile(services_pb2.ProfileRequest())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model_id" in info.value.details()


def test_watch_replays_and_follows_until_terminal(plane) -> None:
    with plane.client() as client:
        job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec("watched")))
        events: list[job_pb2.JobEvent] = []
        stream = client.jobs.Watch(services_pb2.WatchJobRequest(job_id=job.id), timeout=30)
        reader = threading.Thread(target=lambda: events.extend(stream))
        reader.start()
        cancelled = client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=job.id, reason="test"))
        reader.join(30)
        assert not reader.is_alive(), "Watch did not end at the terminal state"
    assert cancelled.state == job_pb2.JOB_STATE_CANCELLED
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].type == "SUBMITTED" and events[-1].state == job_pb2.JOB_STATE_CANCELLED


def test_open_streams_never_starve_unary_calls_or_lock_out_agents(plane, tenants) -> None:
    token_a, token_b = tenants
    per_tenant = plane.servers["planner"].spec.streams_per_tenant
    with plane.client(token=token_a) as a, plane.client(token=token_b) as b:
        job = a.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec("many-watchers")))
        streams = [a.jobs.Watch(services_pb2.WatchJobRequest(job_id=job.id), timeout=60) for _ in range(per_tenant)]
        try:
            for s in streams:
                assert next(s).type == "SUBMITTED"  # every stream is open and holds a server thread
            for _ in range(10):  # unary calls still get threads
                assert a.jobs.Get(store_pb2.GetRequest(id=job.id), timeout=5).id == job.id
            # The tenant's next stream is refused instead of queueing behind the others...
            with pytest.raises(grpc.RpcError) as info:
                next(a.jobs.Watch(services_pb2.WatchJobRequest(job_id=job.id), timeout=10))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant" in info.value.details()
            # ...while another tenant still gets one, and an executor agent still connects.
            own = b.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec("b-watch")))
            watch_b = b.jobs.Watch(services_pb2.WatchJobRequest(job_id=own.id), timeout=10)
            assert next(watch_b).type == "SUBMITTED"
            watch_b.cancel()
            hello = executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(
                host=fleet_pb2.Host(name="agent-under-load")))
            with plane.agent_control("agent-under-load") as control:
                connect = control.Connect(iter([hello]), timeout=10)
                assert next(connect).WhichOneof("body") == "registered"
                connect.cancel()
        finally:
            for s in streams:
                s.cancel()


def test_health_watchers_hold_no_threads(plane) -> None:
    channel = plane.tls_channel("store")
    watchers = [health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
                for _ in range(plane.servers["store"].spec.max_workers + 8)]
    try:
        for w in watchers:
            assert next(w).status == health_pb2.HealthCheckResponse.SERVING
        with plane.client() as client:
            assert client.store.ListModels(store_pb2.ListModelsRequest(), timeout=5) is not None
    finally:
        for w in watchers:
            w.cancel()
        channel.close()


def test_sql_is_admin_only_and_read_only(plane, tenants) -> None:
    token_a, _ = tenants
    with plane.client(token=token_a) as tenant:
        with pytest.raises(grpc.RpcError) as info:
            tenant.store.Query(store_pb2.QueryRequest(sql="SELECT 1"))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with plane.client() as admin:
        admin.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec("keep-me")))
        count = admin.store.Query(store_pb2.QueryRequest(sql="SELECT count(*) AS n FROM jobs")).rows[0][0]
        assert count >= 1
        for sql in ("DELETE FROM jobs", "WITH d AS (DELETE FROM jobs RETURNING *) SELECT * FROM d"):
            with pytest.raises(grpc.RpcError) as info:
                admin.store.Query(store_pb2.QueryRequest(sql=sql))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "read-only" in info.value.details()
        assert admin.store.Query(store_pb2.QueryRequest(sql="SELECT count(*) FROM jobs")).rows[0][0] == count
        # ListValue numbers are doubles: integers past 2**53 come back as exact strings.
        big, small = admin.store.Query(store_pb2.QueryRequest(sql="SELECT 9007199254740993, 7")).rows[0]
        assert (big, small) == ("9007199254740993", 7)


def test_store_refuses_a_stale_schema(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.harness import settings_env

    settings = make_settings(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ballast", "serve", "store"], env=settings_env(settings),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "ballast db upgrade" in proc.stderr


def test_store_refuses_a_schema_newer_than_the_build(tmp_path: Path) -> None:
    import subprocess
    import sys

    import sqlalchemy as sa

    from services.store import schema
    from tests.harness import settings_env

    settings = make_settings(tmp_path / "fresh" / "nested")
    upgrade = subprocess.run([sys.executable, "-m", "ballast", "db", "upgrade"], env=settings_env(settings),
                             capture_output=True, text=True, timeout=60)
    assert upgrade.returncode == 0, upgrade.stderr  # the data directory did not exist yet
    assert schema.current_revision(settings.database_url) == schema.head_revision()
    engine = sa.create_engine(settings.database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
    engine.dispose()
    proc = subprocess.run([sys.executable, "-m", "ballast", "serve", "store"], env=settings_env(settings),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "newer than this build" in proc.stderr


def test_reconnecting_agent_keeps_its_host_online(plane) -> None:
    hello = executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(host=fleet_pb2.Host(name="flappy")))
    with plane.client() as admin, plane.agent_control("flappy") as control:
        first = control.Connect(iter([hello]), timeout=20)
        host_id = next(first).registered.host_id
        second_inbound: queue.Queue = queue.Queue()
        second_inbound.put(hello)
        second = control.Connect(iter(second_inbound.get, None), timeout=20)
        assert next(second).registered.host_id == host_id
        assert list(first) == []  # the planner ended the replaced stream
        host = admin.store.GetHost(store_pb2.GetRequest(id=host_id))
        assert host.state == fleet_pb2.HOST_STATE_ONLINE
        second_inbound.put(None)  # the agent hangs up for real: now it is offline
        assert list(second) == []
        wait_for(lambda: admin.store.GetHost(store_pb2.GetRequest(id=host_id)).state == fleet_pb2.HOST_STATE_OFFLINE,
                 timeout=10, what="the host to be marked offline")
