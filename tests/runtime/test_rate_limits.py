"""Per-tenant rate limits over real servers on loopback (issue 22, item 5): a tenant flooding a service is
refused with RESOURCE_EXHAUSTED and retry advice while another tenant's calls go through; the platform admin
is never throttled; the store does not count again what the planner forwards; the SDK waits out the advice.

Deterministic on a loaded machine: the bucket refills one token per 1000 s, so only the burst gets through,
however slowly the calls run.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ballast.client import Client
from ballast.transport import client_transport
from ballast.v1 import services_pb2, services_pb2_grpc, store_pb2, store_pb2_grpc
from services.runtime.ratelimit import FORWARDED_BY
from tests.harness import Plane, make_settings, start_plane

BURST = 4
Code = grpc.StatusCode


@dataclass(frozen=True)
class Rpc:
    server: str
    call: Callable[[grpc.Channel, list], object]


def _list_jobs(channel: grpc.Channel, metadata: list) -> object:
    return store_pb2_grpc.StoreServiceStub(channel).ListJobs(store_pb2.ListJobsRequest(), metadata=metadata,
                                                            timeout=30)


RPCS = {
    "StoreService/ListJobs": Rpc("store", _list_jobs),
    "JobService/List": Rpc("planner", lambda ch, md: services_pb2_grpc.JobServiceStub(ch).List(
        store_pb2.ListJobsRequest(), metadata=md, timeout=30)),
    "ProfilerService/ListDeviceKinds": Rpc("profiler", lambda ch, md: services_pb2_grpc.ProfilerServiceStub(
        ch).ListDeviceKinds(services_pb2.ListDeviceKindsRequest(), metadata=md, timeout=30)),
}


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Plane:
    settings = make_settings(tmp_path_factory.mktemp("ratelimit"), rate_limit_rps=0.001, rate_limit_burst=BURST)
    plane = start_plane(settings)
    yield plane
    plane.stop()


def tenant(plane: Plane) -> str:
    """A fresh tenant's token (fresh buckets)."""
    return plane.store().create_tenant(store_pb2.CreateTenantRequest(name=f"rl-{uuid.uuid4().hex[:8]}")).token


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def assert_throttled(exc: grpc.RpcError) -> None:
    """RESOURCE_EXHAUSTED naming the limit and the fix, with RetryInfo and retry-after-ms."""
    assert exc.code() == Code.RESOURCE_EXHAUSTED, exc.details()
    assert f"burst {BURST}" in exc.details() and "BALLAST_RATE_LIMIT_RPS" in exc.details()
    status = rpc_status.from_call(exc)
    infos = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
    assert len(infos) == 1
    info = error_details_pb2.RetryInfo()
    infos[0].Unpack(info)
    delay_ms = info.retry_delay.ToMilliseconds()
    assert delay_ms > 0
    assert dict(exc.trailing_metadata())["retry-after-ms"] == str(delay_ms)


@pytest.mark.parametrize("name", sorted(RPCS))
def test_a_flooding_tenant_is_throttled_while_another_goes_on(plane: Plane, name: str) -> None:
    rpc = RPCS[name]
    channel = plane.tls_channel(rpc.server)
    a, b = tenant(plane), tenant(plane)
    for _ in range(BURST):
        rpc.call(channel, bearer(a))
    for _ in range(3):  # refused calls take no token: every one is refused the same way
        assert_throttled(refusal(lambda: rpc.call(channel, bearer(a))))
    for _ in range(BURST):
        rpc.call(channel, bearer(b))
    for _ in range(3 * BURST):
        rpc.call(channel, bearer(plane.token))  # the platform admin is never throttled
    channel.close()


def test_a_throttled_tenant_cannot_open_a_stream_either(plane: Plane) -> None:
    channel = plane.tls_channel("planner")
    jobs = services_pb2_grpc.JobServiceStub(channel)
    a = tenant(plane)
    for _ in range(BURST):
        jobs.List(store_pb2.ListJobsRequest(), metadata=bearer(a), timeout=30)
    stream = jobs.Watch(services_pb2.WatchJobRequest(job_id="job-none"), metadata=bearer(a), timeout=30)
    assert_throttled(refusal(lambda: next(stream)))
    channel.close()


def test_the_store_does_not_count_again_what_a_service_forwards(plane: Plane) -> None:
    """The planner reads the store as its caller for JobService.List; that is not charged to the caller's
    store budget (its JobService budget paid), and a tenant cannot forge the forwarding header."""
    store_channel, planner_channel = plane.tls_channel("store"), plane.tls_channel("planner")
    a = tenant(plane)
    for _ in range(BURST):
        _list_jobs(store_channel, bearer(a))
    assert_throttled(refusal(lambda: _list_jobs(store_channel, bearer(a))))
    forged = [*bearer(a), (FORWARDED_BY, a)]
    assert_throttled(refusal(lambda: _list_jobs(store_channel, forged)))
    jobs = services_pb2_grpc.JobServiceStub(planner_channel)
    for _ in range(BURST):
        jobs.List(store_pb2.ListJobsRequest(), metadata=bearer(a), timeout=30)
    store_channel.close()
    planner_channel.close()


def test_the_sdk_waits_the_advised_delay_and_retries(tmp_path) -> None:
    """At 2 calls/s a refused call is advised to wait at most 0.5 s; a raw call is refused, the SDK's
    call right after it succeeds by waiting (were it not to retry, it would be refused like the raw one)."""
    settings = make_settings(tmp_path, rate_limit_rps=2.0, rate_limit_burst=1)
    plane = start_plane(settings, services=("store",))
    try:
        token = tenant(plane)
        channel = plane.tls_channel("store")
        refused = None
        for _ in range(20):
            try:
                _list_jobs(channel, bearer(token))
            except grpc.RpcError as exc:
                refused = exc
                break
        assert refused is not None and refused.code() == Code.RESOURCE_EXHAUSTED, refused
        assert 0 < int(dict(refused.trailing_metadata())["retry-after-ms"]) <= 500
        with Client(store=settings.address("store"), token=token, transport=client_transport(settings)) as client:
            for _ in range(3):
                client.store.ListJobs(store_pb2.ListJobsRequest())
        channel.close()
    finally:
        plane.stop()

