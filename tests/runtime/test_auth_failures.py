"""Bad tokens are limited per peer address and their refusals audited, aggregated (issue 41, item 5): the
logic on a fake clock, then 40 bad-token calls against a real store server on loopback."""

from __future__ import annotations

import grpc
import pytest

from ballast.client import open_channel
from ballast.transport import client_transport
from ballast.v1 import store_pb2, store_pb2_grpc
from services.runtime.auth_failures import AUDIT_WINDOW_S, FAILURE_BURST, AuthFailures, TooManyFailures, peer_address
from tests.harness import make_settings, start_plane, wait_for

PEER = "ipv4:10.0.0.5:51234"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_peer_that_keeps_failing_waits_and_its_refusals_are_audited_once_a_minute() -> None:
    clock = Clock()
    failures = AuthFailures(rate=1.0, burst=3, clock=clock)
    audited = [failures.refused(PEER) for _ in range(3)]
    assert audited == [1, 0, 0]  # the first refusal of the window is written, the others counted
    with pytest.raises(TooManyFailures) as err:
        failures.check("ipv4:10.0.0.5:60000", "blt_guess")  # another port, the same address
    assert err.value.code == "RESOURCE_EXHAUSTED" and "10.0.0.5" in err.value.message
    failures.check("ipv4:10.0.0.6:1", "blt_guess")  # another address is not held back
    failures.succeeded("blt_good")
    failures.check(PEER, "blt_good")  # a token that authenticated lately passes a blocked address
    clock.t += 1.0
    failures.check(PEER, "blt_guess")  # one failure refilled
    clock.t += AUDIT_WINDOW_S
    assert failures.refused(PEER) == 3  # the two counted since the last row, and this one
    assert peer_address("ipv6:[::1]:5000") == "ipv6:[::1]" and peer_address("unix:/run/x") == "unix:/run/x"


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    # a bucket that refills once in 100 s: the flood's verdict cannot hang on how fast a loaded host makes its calls
    # (at the default 2 a second, one call slower than 0.5 s let an UNAUTHENTICATED through in CI)
    plane = start_plane(make_settings(tmp_path_factory.mktemp("auth-failures"), auth_failure_rate=0.01),
                        send=lambda request_id: None)
    yield plane
    plane.stop()


def test_a_flood_of_bad_tokens_is_held_back_audited_and_locks_no_one_out(plane) -> None:
    settings = plane.settings
    with plane.client() as client:  # the admin (as the services, with their own token) authenticated lately
        client.store.ListJobs(store_pb2.ListJobsRequest())
    codes = []
    bad = open_channel(settings.address("store"), "blt_not-a-token", transport=client_transport(settings),
                       retries=False)
    try:
        stub = store_pb2_grpc.StoreServiceStub(bad)
        for _ in range(FAILURE_BURST + 10):
            with pytest.raises(grpc.RpcError) as err:
                stub.ListJobs(store_pb2.ListJobsRequest(), timeout=10)
            codes.append(err.value.code())
    finally:
        bad.close()
    assert codes[:FAILURE_BURST] == [grpc.StatusCode.UNAUTHENTICATED] * FAILURE_BURST
    assert set(codes[FAILURE_BURST + 1:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    with plane.client() as client:  # ... so, from the same address, it is not locked out
        assert client.store.ListJobs(store_pb2.ListJobsRequest()) is not None

        def audited() -> list:
            return client.sql("SELECT message, peer FROM audit_log WHERE code = 'UNAUTHENTICATED' "
                              "AND method = 'ListJobs'").rows

        rows = wait_for(audited, timeout=30, what="the refusal's audit row")
        assert len(rows) == 1 and "1 refused authentication" in rows[0][0] and "127.0.0.1" in rows[0][1]
