"""The durable queue: content dedupe, leases that expire and are reaped, exactly-once completion, workers."""

from __future__ import annotations

import json
import threading
from datetime import UTC, timedelta

import pytest

from ballast.v1 import queue_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from tests.store_fixtures import Store, claim, complete, enqueue


def test_enqueue_deduplicates_by_content(store: Store):
    first = enqueue(store, '{"a": 1, "b": [1, 2]}')
    assert first.created and first.request.id.startswith("req-") and first.request.max_attempts == 3
    assert first.request.state == queue_pb2.REQUEST_STATE_QUEUED and len(first.request.dedupe_key) == 64
    same = enqueue(store, '{"b":[1,2],"a":1}')
    assert not same.created and same.request.id == first.request.id
    assert enqueue(store, '{"a": 2}').created
    assert enqueue(store, '{"a": 1, "b": [1, 2]}', who=store.b).created  # other tenant, other request
    with pytest.raises(InvalidArgument) as err:
        enqueue(store, "{not json")
    assert err.value.field == "payload_json"
    a = store.as_(store.a)
    echo = a.enqueue_request(store_pb2.EnqueueRequestRequest(kind="diagnostic.echo", payload_json="1"))

    def ids(who: Principal, **kw):
        return [r.id for r in store.as_(who).list_requests(store_pb2.ListRequestsRequest(**kw)).requests]

    assert len(ids(store.a)) == 3 and len(ids(store.admin)) == 4
    assert ids(store.a, kind="diagnostic.echo") == [echo.request.id]
    claim(store, echo.request.id, "w1")
    assert ids(store.a, state=queue_pb2.REQUEST_STATE_RUNNING) == [echo.request.id]
    for call, req in [
        (a.claim_request, store_pb2.ClaimRequestRequest(id=echo.request.id, worker="w", lease_seconds=1)),
        (a.reap_expired_leases, store_pb2.ReapExpiredLeasesRequest()),
        (a.renew_lease, store_pb2.RenewLeaseRequest(id=echo.request.id, lease_token="x", lease_seconds=1)),
        (a.complete_request, store_pb2.CompleteRequestRequest(id=echo.request.id, lease_token="x")),
    ]:
        with pytest.raises(PermissionDenied):
            call(req)


def test_concurrent_identical_enqueues_store_one_request(store: Store):
    results: list[store_pb2.EnqueueRequestResponse] = []
    barrier = threading.Barrier(4)

    def go() -> None:
        barrier.wait()
        results.append(enqueue(store, '{"race": true}'))

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and sum(r.created for r in results) == 1
    assert len({r.request.id for r in results}) == 1 and store.count("queued_requests") == 1


def test_lease_claim_renew_expire_reap_reclaim_complete_once(store: Store):
    admin = store.as_(store.admin)
    rid = enqueue(store, '{"job": 1}').request.id
    first = claim(store, rid, "w1", lease=30)
    assert first.claimed and first.request.lease_owner == "w1" and first.request.attempts == 1
    token1 = first.request.lease_token
    assert not claim(store, rid, "w2").claimed  # live lease
    store.clock.advance(20)
    renewed = admin.renew_lease(store_pb2.RenewLeaseRequest(id=rid, lease_token=token1, lease_seconds=30))
    assert renewed.lease_expires_at.ToDatetime(UTC) == store.clock.t + timedelta(seconds=30)
    with pytest.raises(FailedPrecondition) as err:
        admin.renew_lease(store_pb2.RenewLeaseRequest(id=rid, lease_token="stale", lease_seconds=5))
    assert err.value.field == "lease_token" and "lease lost" in str(err.value)

    store.clock.advance(25)
    assert not admin.reap_expired_leases(store_pb2.ReapExpiredLeasesRequest()).requests
    store.clock.advance(10)  # now expired
    with pytest.raises(FailedPrecondition):
        admin.renew_lease(store_pb2.RenewLeaseRequest(id=rid, lease_token=token1, lease_seconds=5))
    reaped = admin.reap_expired_leases(store_pb2.ReapExpiredLeasesRequest()).requests
    assert [r.id for r in reaped] == [rid]
    assert (
        reaped[0].state == queue_pb2.REQUEST_STATE_QUEUED and reaped[0].requeues == 1 and not reaped[0].lease_token
    )
    assert not admin.reap_expired_leases(store_pb2.ReapExpiredLeasesRequest()).requests

    second = claim(store, rid, "w2")
    assert second.claimed and second.request.attempts == 2 and second.request.lease_token != token1
    with pytest.raises(FailedPrecondition) as err:
        complete(store, rid, token1)  # w1 lost its lease
    assert err.value.field == "lease_token"
    done = complete(store, rid, second.request.lease_token)
    assert done.state == queue_pb2.REQUEST_STATE_SUCCEEDED and json.loads(done.result_json) == {"ok": True}
    with pytest.raises(FailedPrecondition):
        complete(store, rid, second.request.lease_token)  # exactly once
    after = claim(store, rid, "w3")
    assert not after.claimed and after.request.state == queue_pb2.REQUEST_STATE_SUCCEEDED

    failing = enqueue(store, '{"job": 2}').request.id
    lease = claim(store, failing, "w1").request.lease_token
    failed = admin.complete_request(store_pb2.CompleteRequestRequest(id=failing, lease_token=lease, error="boom"))
    assert failed.state == queue_pb2.REQUEST_STATE_FAILED and failed.error == "boom"


def test_expired_lease_reclaimed_directly_and_max_attempts(store: Store):
    rid = enqueue(store, '{"x": 1}', max_attempts=2).request.id
    w1 = claim(store, rid, "w1", lease=5)
    store.clock.advance(6)
    w2 = claim(store, rid, "w2", lease=5)  # expired lease: claimable without a reap
    assert w2.claimed and w2.request.attempts == 2
    with pytest.raises(FailedPrecondition):
        complete(store, rid, w1.request.lease_token)
    store.clock.advance(6)
    out = claim(store, rid, "w3")
    assert not out.claimed and out.request.state == queue_pb2.REQUEST_STATE_FAILED and out.request.attempts == 2
    assert "attempts" in out.request.error
    with pytest.raises(NotFound):
        claim(store, "req-missing", "w1")
    with pytest.raises(InvalidArgument) as err:
        claim(store, rid, "w1", lease=0)
    assert err.value.field == "lease_seconds"


def test_unclaimed_request_is_reaped_only_after_the_stale_window(store: Store):
    rid = enqueue(store, '{"text": "lost"}').request.id
    reap = store.as_(store.admin).reap_expired_leases
    assert not reap(store_pb2.ReapExpiredLeasesRequest(queued_stale_s=60)).requests
    store.clock.advance(61)
    assert not reap(store_pb2.ReapExpiredLeasesRequest()).requests  # 0 disables
    again = reap(store_pb2.ReapExpiredLeasesRequest(queued_stale_s=60)).requests
    assert [r.id for r in again] == [rid] and again[0].requeues == 1
    assert again[0].state == queue_pb2.REQUEST_STATE_QUEUED
    # Re-sent just now: not due again until another window passes.
    assert not reap(store_pb2.ReapExpiredLeasesRequest(queued_stale_s=60)).requests
    with pytest.raises(InvalidArgument, match="queued_stale_s"):
        reap(store_pb2.ReapExpiredLeasesRequest(queued_stale_s=-1))


def test_worker_heartbeats(store: Store):
    admin = store.as_(store.admin)

    def beat(name: str, **kw) -> queue_pb2.WorkerHeartbeat:
        hb = queue_pb2.WorkerHeartbeat(name=name, pid=42, queues=["planner"], **kw)
        return admin.record_worker_heartbeat(store_pb2.RecordWorkerHeartbeatRequest(heartbeat=hb))

    beat("w-old")
    store.clock.advance(120)
    beat("w1", current_request_id="req-1")
    updated = beat("w1")
    assert updated.current_request_id == "" and list(updated.queues) == ["planner"]

    def names(**kw):
        return [w.name for w in store.as_(store.a).list_workers(store_pb2.ListWorkersRequest(**kw)).workers]

    assert names() == ["w1"] and names(seen_within_s=300) == ["w-old", "w1"]
    with pytest.raises(PermissionDenied):
        store.as_(store.a).record_worker_heartbeat(
            store_pb2.RecordWorkerHeartbeatRequest(heartbeat=queue_pb2.WorkerHeartbeat(name="x"))
        )
    assert store.count("workers") == 2


# --- a FAILED request releases its dedupe key --------------------------------------------------------


def test_failed_request_releases_its_dedupe_key(store: Store):
    payload = '{"retry": 1}'
    first = enqueue(store, payload).request
    assert not enqueue(store, payload).created  # QUEUED dedupes
    token = claim(store, first.id, "w1").request.lease_token
    assert enqueue(store, payload).request.id == first.id  # RUNNING dedupes
    failed = store.as_(store.admin).complete_request(
        store_pb2.CompleteRequestRequest(id=first.id, lease_token=token, error="boom")
    )
    assert failed.state == queue_pb2.REQUEST_STATE_FAILED and failed.dedupe_key == "" and failed.error == "boom"
    again = enqueue(store, payload)
    assert again.created and again.request.id != first.id and again.request.state == queue_pb2.REQUEST_STATE_QUEUED
    assert again.request.dedupe_key == first.dedupe_key
    assert enqueue(store, payload).request.id == again.request.id  # the fresh one dedupes in turn
    done = complete(store, again.request.id, claim(store, again.request.id, "w2").request.lease_token)
    assert done.state == queue_pb2.REQUEST_STATE_SUCCEEDED
    after = enqueue(store, payload)
    assert not after.created and after.request.id == again.request.id  # SUCCEEDED still dedupes
    old = store.as_(store.a).get_queued_request(store_pb2.GetRequest(id=first.id))
    assert old.state == queue_pb2.REQUEST_STATE_FAILED and old.error == "boom"  # history kept


def test_request_failed_by_max_attempts_releases_its_dedupe_key(store: Store):
    payload = '{"retry": 2}'
    first = enqueue(store, payload, max_attempts=1).request
    assert claim(store, first.id, "w1", lease=5).claimed
    store.clock.advance(6)
    out = claim(store, first.id, "w2")
    assert not out.claimed and out.request.state == queue_pb2.REQUEST_STATE_FAILED and not out.request.dedupe_key
    again = enqueue(store, payload, max_attempts=1)
    assert again.created and again.request.id != first.id and again.request.attempts == 0
    assert store.count("queued_requests") == 2
