"""queue.run_request against a fake store: what a handler gets, and which failures end a request.

A deterministic failure (bad input, nothing fits) is recorded as the request's error at once; a transient
one (the store unavailable) is left for the sweeper to retry until the last attempt, which records it.
"""

from __future__ import annotations

from typing import Any

import pytest

from ballast.v1 import queue_pb2, store_pb2
from services.planner.queue import durable as queue
from services.runtime.errors import FailedPrecondition, Unavailable


class FakeStore:
    """The four queue RPCs run_request uses; records completions."""

    def __init__(self, attempts: int = 1, max_attempts: int = 3):
        self.request = queue_pb2.QueuedRequest(id="req-1", tenant_id="tnt-a", kind="test.kind", payload_json='{"x": 1}',
                                               state=queue_pb2.REQUEST_STATE_RUNNING, attempts=attempts,
                                               max_attempts=max_attempts, lease_token="tok")
        self.completions: list[store_pb2.CompleteRequestRequest] = []

    def claim_request(self, request: store_pb2.ClaimRequestRequest) -> store_pb2.ClaimRequestResponse:
        return store_pb2.ClaimRequestResponse(claimed=True, request=self.request)

    def renew_lease(self, request: store_pb2.RenewLeaseRequest) -> queue_pb2.QueuedRequest:
        return self.request

    def complete_request(self, request: store_pb2.CompleteRequestRequest) -> queue_pb2.QueuedRequest:
        self.completions.append(request)
        return self.request


def run(monkeypatch, handler, store: FakeStore | None = None) -> tuple[FakeStore, Any]:
    store = store or FakeStore()
    monkeypatch.setitem(queue.HANDLERS, "test.kind", handler)
    return store, queue.run_request(store, "req-1", "w", lease_s=30)


def test_a_handler_gets_its_request_and_the_store(monkeypatch) -> None:
    seen = {}

    def handler(payload: dict, task: queue.Task) -> dict:
        seen.update(payload=payload, request_id=task.request.id, tenant=task.request.tenant_id, store=task.store,
                    lost=task.lease_lost.is_set())
        return {"ok": True}

    store, _ = run(monkeypatch, handler)
    assert seen == {"payload": {"x": 1}, "request_id": "req-1", "tenant": "tnt-a", "store": store, "lost": False}
    assert [c.result_json for c in store.completions] == ['{"ok": true}']


def test_a_deterministic_failure_is_recorded_once(monkeypatch) -> None:
    def handler(payload: dict, task: queue.Task) -> dict:
        raise FailedPrecondition("nothing fits", field="memory_budget_bytes", fix="raise the budget")

    store, _ = run(monkeypatch, handler)
    assert [c.error for c in store.completions] == [
        "FailedPrecondition: memory_budget_bytes: nothing fits (raise the budget)"]


@pytest.mark.parametrize("attempts, recorded", [(1, False), (3, True)])
def test_a_transient_failure_is_retried_until_the_last_attempt(monkeypatch, attempts: int, recorded: bool) -> None:
    def handler(payload: dict, task: queue.Task) -> dict:
        raise Unavailable("store restarting")

    store, result = run(monkeypatch, handler, FakeStore(attempts=attempts, max_attempts=3))
    assert bool(store.completions) == recorded and (result is None) != recorded
    if recorded:
        assert "store restarting" in store.completions[0].error


def test_a_handler_that_lost_its_lease_completes_nothing(monkeypatch) -> None:
    def handler(payload: dict, task: queue.Task) -> dict:
        raise queue.LeaseLost()

    store, result = run(monkeypatch, handler)
    assert result is None and not store.completions
