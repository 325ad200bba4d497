"""Durable queued work: every request is a store row with a lease; the broker only carries its id.

Brokers differ in what they redeliver (kombu's SQLAlchemy transport never returns a message whose
worker died), so durability rests here: a worker claims a lease and renews it while it works; the
sweeper puts requests whose lease expired back on the broker; a stale worker's completion is refused
by the store, so each request completes exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ballast.v1 import queue_pb2, store_pb2, store_pb2_grpc
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.runtime.remote import call

log = logging.getLogger("ballast.queue")

Send = Callable[[str], None]
# A handler gets the payload and an event set when its lease is lost: long work checks it and stops,
# because another worker now owns the request and this one's result will be refused.
Handler = Callable[[dict[str, Any], threading.Event], dict[str, Any]]


def _echo(payload: dict[str, Any], lease_lost: threading.Event) -> dict[str, Any]:
    """Diagnostic: proves the path client -> store -> broker -> worker -> store end to end."""
    return {"text": str(payload.get("text", "")), "worker_pid": os.getpid()}


HANDLERS: dict[str, Handler] = {"diagnostic.echo": _echo}


def submit(store: store_pb2_grpc.StoreServiceStub, kind: str, payload: dict[str, Any], send: Send,
           max_attempts: int = 3) -> queue_pb2.QueuedRequest:
    """Store the request (deduplicated by content) and, if it is new, put its id on the broker."""
    if kind not in HANDLERS:
        raise InvalidArgument(f"unknown request kind {kind!r}", field="kind", fix=f"use one of {sorted(HANDLERS)}")
    reply = call(
        store.EnqueueRequest,
        store_pb2.EnqueueRequestRequest(kind=kind, payload_json=json.dumps(payload, sort_keys=True),
                                        max_attempts=max_attempts),
    )
    if reply.created:
        send(reply.request.id)
    return reply.request


def sweep_once(store: store_pb2_grpc.StoreServiceStub, send: Send, requeue_unclaimed_s: float = 0.0,
               limit: int = 100) -> int:
    """Re-enqueue requests whose lease expired (their worker died or hung) and, after
    `requeue_unclaimed_s`, requests nobody claimed (a lost broker message). Returns how many."""
    reply = call(store.ReapExpiredLeases, store_pb2.ReapExpiredLeasesRequest(
        limit=limit, queued_stale_s=requeue_unclaimed_s))
    for request in reply.requests:
        log.warning("re-enqueueing", extra={"request_id": request.id, "attempts": request.attempts})
        send(request.id)
    return len(reply.requests)


class Sweeper(threading.Thread):
    """Runs sweep_once every `interval_s` until stopped; failures are logged and retried."""

    def __init__(self, store: store_pb2_grpc.StoreServiceStub, send: Send, interval_s: float,
                 requeue_unclaimed_s: float = 0.0):
        super().__init__(name="lease-sweeper", daemon=True)
        self._store, self._send, self._interval = store, send, interval_s
        self._requeue_unclaimed_s = requeue_unclaimed_s
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                sweep_once(self._store, self._send, self._requeue_unclaimed_s)
            except Exception:  # noqa: BLE001 - the sweeper must outlive a store restart
                log.exception("sweep failed")

    def stop(self) -> None:
        self._stop.set()


def run_request(store: store_pb2_grpc.StoreServiceStub, request_id: str, worker: str, lease_s: float,
                hold_s: float = 0.0) -> queue_pb2.QueuedRequest | None:
    """Claim, run and complete one request. Returns the completed request, or None if not ours to run."""
    claim = call(store.ClaimRequest, store_pb2.ClaimRequestRequest(id=request_id, worker=worker,
                                                                  lease_seconds=lease_s))
    if not claim.claimed:
        log.info("not claimed", extra={"request_id": request_id, "state": claim.request.state})
        return None
    token = claim.request.lease_token
    lost = threading.Event()
    done = threading.Event()

    def renew() -> None:
        while not done.wait(lease_s / 3):
            try:
                call(store.RenewLease, store_pb2.RenewLeaseRequest(id=request_id, lease_token=token,
                                                                   lease_seconds=lease_s))
            except FailedPrecondition:
                lost.set()
                return
            except Exception:  # noqa: BLE001 - keep trying until the lease runs out
                log.exception("lease renewal failed")

    renewer = threading.Thread(target=renew, name=f"lease-{request_id}", daemon=True)
    renewer.start()
    try:
        if hold_s:
            lost.wait(hold_s)  # test hook: keeps the task open so a kill lands mid-task
        request = claim.request
        try:
            result = HANDLERS[request.kind](json.loads(request.payload_json), lost)
            completion = store_pb2.CompleteRequestRequest(id=request_id, lease_token=token,
                                                          result_json=json.dumps(result, sort_keys=True))
        except Exception as exc:  # noqa: BLE001 - recorded as the request's error
            log.exception("request failed", extra={"request_id": request_id})
            completion = store_pb2.CompleteRequestRequest(id=request_id, lease_token=token,
                                                          error=f"{type(exc).__name__}: {exc}")
    finally:
        done.set()
        renewer.join()
    try:
        return call(store.CompleteRequest, completion)
    except FailedPrecondition as exc:
        log.warning("lease lost before completion; result discarded", extra={"request_id": request_id,
                                                                             "why": str(exc)})
        return None
