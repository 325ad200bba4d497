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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ballast import trace
from ballast.v1 import queue_pb2, store_pb2
from services.runtime import logs
from services.runtime.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from services.runtime.metrics import TASK_SECONDS
from services.runtime.store_api import Store

log = logging.getLogger("ballast.queue")

Send = Callable[[str], None]
# Failures worth another attempt (the store restarting); anything else a handler raises is deterministic for
# its payload (bad input, nothing fits) and ends the request as FAILED at once, with the error as its reason.
TRANSIENT = (Unavailable, DeadlineExceeded)


@dataclass(frozen=True)
class Task:
    """What a handler gets besides its payload.

    `request` is the claimed row: its id is the idempotency key for anything the handler stores (a re-run
    after a lost lease must find its own earlier write), its tenant_id who asked, as the store recorded it.
    `store` acts for the platform, so the handler itself must confine the work to that tenant's rows.
    `lease_lost` is set when another worker took the request: long work checks it and stops (LeaseLost),
    because this worker's result would be refused. `profiler` reaches ProfilerService as the platform
    (None where a worker was started without one).
    """

    request: queue_pb2.QueuedRequest
    store: Store
    lease_lost: threading.Event
    profiler: Any = None


class LeaseLost(Exception):
    """Raised by a handler that saw its lease go: another worker owns the request; nothing is completed."""


Handler = Callable[[dict[str, Any], Task], dict[str, Any]]


def _echo(payload: dict[str, Any], task: Task) -> dict[str, Any]:
    """Diagnostic: proves the path client -> store -> broker -> worker -> store end to end."""
    return {"text": str(payload.get("text", "")), "worker_pid": os.getpid()}


# The handlers this process runs, by request kind. The queue knows none but its own diagnostic: the
# Celery app (services/planner/celery_app.py) registers the planner's, so this module imports none of them.
HANDLERS: dict[str, Handler] = {"diagnostic.echo": _echo}


def register(kind: str, handler: Handler) -> None:
    """Make `kind` a request this process accepts and runs (idempotent for the same handler)."""
    known = HANDLERS.get(kind)
    if known is not None and known is not handler:
        raise ValueError(f"request kind {kind!r} already has a handler ({known.__qualname__})")
    HANDLERS[kind] = handler


def submit(store: Store, kind: str, payload: dict[str, Any], send: Send,
           max_attempts: int = 3) -> queue_pb2.QueuedRequest:
    """Store the request (deduplicated by content) and, if it is new, put its id on the broker."""
    if kind not in HANDLERS:
        raise InvalidArgument(f"unknown request kind {kind!r}", field="kind", fix=f"use one of {sorted(HANDLERS)}")
    reply = store.enqueue_request(store_pb2.EnqueueRequestRequest(
        kind=kind, payload_json=json.dumps(payload, sort_keys=True), max_attempts=max_attempts))
    if reply.created:
        send(reply.request.id)
    return reply.request


def sweep_once(store: Store, send: Send, requeue_unclaimed_s: float = 0.0,
               limit: int = 100) -> int:
    """Re-enqueue requests whose lease expired (their worker died or hung) and, after
    `requeue_unclaimed_s`, requests nobody claimed (a lost broker message). Returns how many."""
    reply = store.reap_expired_leases(store_pb2.ReapExpiredLeasesRequest(
        limit=limit, queued_stale_s=requeue_unclaimed_s))
    for request in reply.requests:
        log.warning("re-enqueueing", extra={"request_id": request.id, "attempts": request.attempts})
        send(request.id)
    return len(reply.requests)


class Sweeper(threading.Thread):
    """Runs sweep_once every `interval_s` until stopped; failures are logged and retried."""

    def __init__(self, store: Store, send: Send, interval_s: float,
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


def run_request(store: Store, request_id: str, worker: str, lease_s: float,
                hold_s: float = 0.0, hold_after_s: float = 0.0, profiler: Any = None) -> queue_pb2.QueuedRequest | None:
    """Claim, run and complete one request. Returns the completed request, or None if not ours to run
    (or left for another attempt after a transient failure: the lease expires and the sweeper re-sends it)."""
    claim = store.claim_request(store_pb2.ClaimRequestRequest(id=request_id, worker=worker,
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
                store.renew_lease(store_pb2.RenewLeaseRequest(id=request_id, lease_token=token,
                                                                   lease_seconds=lease_s))
            except FailedPrecondition:
                lost.set()
                return
            except Exception:  # noqa: BLE001 - keep trying until the lease runs out
                log.exception("lease renewal failed")

    renewer = threading.Thread(target=renew, name=f"lease-{request_id}", daemon=True)
    renewer.start()
    completion: store_pb2.CompleteRequestRequest | None = None
    started, outcome = time.monotonic(), "failed"
    traced = trace.set_current(request_id)  # the request's id is the trace of its work, in every service's log
    scoped = logs.bind()
    try:
        if hold_s:
            lost.wait(hold_s)  # test hook: keeps the task open so a kill lands mid-task
        request = claim.request
        try:
            payload = json.loads(request.payload_json)
            logs.set_scope(job_id=str(payload.get("job_id", "")) if isinstance(payload, dict) else "")
            result = HANDLERS[request.kind](payload, Task(request, store, lost, profiler))
            completion = store_pb2.CompleteRequestRequest(id=request_id, lease_token=token,
                                                          result_json=json.dumps(result, sort_keys=True))
            outcome = "succeeded"
            if hold_after_s:
                lost.wait(hold_after_s)  # test hook: the work is done (and stored) but not yet completed
        except LeaseLost:
            outcome = "lease_lost"
            log.warning("lease lost mid-task; stopped", extra={"request_id": request_id})
        except TRANSIENT as exc:
            outcome = "transient"
            if request.attempts < request.max_attempts:
                log.warning("transient failure; the sweeper retries after the lease expires",
                            extra={"request_id": request_id, "attempt": request.attempts, "why": str(exc)})
            else:  # out of attempts: record the real reason rather than "gave up" at the next claim
                completion = store_pb2.CompleteRequestRequest(id=request_id, lease_token=token,
                                                              error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - deterministic for this payload: recorded, never retried
            log.exception("request failed", extra={"request_id": request_id})
            completion = store_pb2.CompleteRequestRequest(id=request_id, lease_token=token,
                                                          error=f"{type(exc).__name__}: {exc}")
    finally:
        done.set()
        renewer.join()
        trace.reset(traced)  # the caller's thread goes back to its own trace and ids
        logs.unbind(scoped)
        TASK_SECONDS.labels(claim.request.kind, outcome).observe(time.monotonic() - started)
    if completion is None:
        return None
    try:
        return store.complete_request(completion)
    except FailedPrecondition as exc:
        log.warning("lease lost before completion; result discarded", extra={"request_id": request_id,
                                                                             "why": str(exc)})
        return None
