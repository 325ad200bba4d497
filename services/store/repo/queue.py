"""The durable request queue (leases, retries, reaping) and the liveness of the workers that drain it."""

from __future__ import annotations

import hashlib
import json
import secrets
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from ballast.v1 import queue_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.specs.ranges import MAX_PAYLOAD_BYTES
from services.store import models as m
from services.store.convert import enum_name, shared_fields
from services.store.repo.base import DEFAULT_PAGE_SIZE, RepositoryBase, fit, new_id, seconds

DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_WORKER_WINDOW_S = 60.0
QUEUED = "REQUEST_STATE_QUEUED"
RUNNING = "REQUEST_STATE_RUNNING"
SUCCEEDED = "REQUEST_STATE_SUCCEEDED"
FAILED = "REQUEST_STATE_FAILED"
INSERT_REQUEST = sa.insert(m.QueuedRequest.__table__)


def canonical_json(payload: str, field: str) -> str:
    """Parse `payload` and re-serialize it with sorted keys (the dedupe key's input)."""
    try:
        return json.dumps(json.loads(payload), sort_keys=True, separators=(",", ":"))
    except ValueError as err:
        raise InvalidArgument(f"not valid JSON: {err}", field=field, fix="send a JSON document") from None


def dedupe_key(tenant_id: str, kind: str, payload_json: str) -> str:
    canonical = canonical_json(payload_json, "payload_json")
    return hashlib.sha256(json.dumps([tenant_id, kind, canonical]).encode()).hexdigest()


def request_pb(row: m.QueuedRequest) -> queue_pb2.QueuedRequest:
    return queue_pb2.QueuedRequest(**shared_fields(row, queue_pb2.QueuedRequest))


def worker_pb(row: m.Worker) -> queue_pb2.WorkerHeartbeat:
    return queue_pb2.WorkerHeartbeat(**shared_fields(row, queue_pb2.WorkerHeartbeat))


def lease_length(value: float) -> timedelta:
    if not value > 0:
        raise InvalidArgument("lease must be positive", field="lease_seconds", fix="e.g. 60")
    return timedelta(seconds=seconds(value, "lease_seconds", positive=True))


def fail(row: m.QueuedRequest, error: str) -> None:
    """Finish as FAILED and release the dedupe key, so enqueuing the same work again makes a fresh request."""
    row.state, row.error, row.dedupe_key = FAILED, error, None


class QueueStore(RepositoryBase):
    """Queue and worker RPCs; all but enqueue and listing are for the admin (the workers)."""

    def enqueue_request(self, p: Principal, req: store_pb2.EnqueueRequestRequest) -> store_pb2.EnqueueRequestResponse:
        """Store a request once per (tenant, kind, payload); a duplicate returns the stored row unless it
        FAILED (failing releases the key), so identical work can be retried by enqueuing it again."""
        max_attempts = self._check_request(req.kind, req.max_attempts)
        fit(m.QueuedRequest.payload_json, req.payload_json, "payload_json")
        try:
            with self._tx(write=True) as s:
                row, created = self._queue(s, p, req.kind, req.payload_json, max_attempts)
                return store_pb2.EnqueueRequestResponse(request=request_pb(row), created=created)
        except sa_exc.IntegrityError:  # lost a race with an identical enqueue: theirs is the request
            key = dedupe_key(p.tenant_id, req.kind, req.payload_json)
            with self._tx(write=False) as s:
                existing = s.scalars(sa.select(m.QueuedRequest).where(m.QueuedRequest.dedupe_key == key)).one()
                return store_pb2.EnqueueRequestResponse(request=request_pb(existing), created=False)

    @staticmethod
    def _check_request(kind: str, max_attempts: int) -> int:
        """A request's kind and attempts checked before any transaction; returns max_attempts (0: the default)."""
        if not kind:
            raise InvalidArgument("kind is not set", field="kind", fix='e.g. "planner.search"')
        fit(m.QueuedRequest.kind, kind, "kind")
        return fit(m.QueuedRequest.max_attempts, max_attempts or DEFAULT_MAX_ATTEMPTS, "max_attempts")

    def _queue(self, s: Session, p: Principal, kind: str, payload_json: str, max_attempts: int,
               new: bool = False) -> tuple[m.QueuedRequest, bool]:
        """The request in transaction `s`: (the stored one with the same content, False), or (a new one, True).
        `new`: the payload names a row made in this transaction, so no stored request can have it."""
        size = len(payload_json.encode())
        if size > MAX_PAYLOAD_BYTES:
            raise InvalidArgument(f"{size} bytes of payload", field="payload_json",
                                  fix=f"send at most {MAX_PAYLOAD_BYTES >> 10} KiB (docs/limits.md)")
        key = dedupe_key(p.tenant_id, kind, payload_json)
        existing = None if new else s.scalars(
            sa.select(m.QueuedRequest).where(m.QueuedRequest.dedupe_key == key)).first()
        if existing is not None:
            return existing, False
        now = self.now()
        values = dict(id=new_id("req"), tenant_id=p.tenant_id, kind=kind, payload_json=payload_json, dedupe_key=key,
                      state=QUEUED, lease_owner=None, lease_token=None, lease_expires_at=None, attempts=0,
                      max_attempts=max_attempts, requeues=0, result_json=None, error=None, created_at=now,
                      updated_at=now)
        s.connection().execute(INSERT_REQUEST, values)  # Core: the ORM's unit of work cost more than the SQL
        return m.QueuedRequest(**values), True  # not in the session: the caller only reads it

    def get_queued_request(self, p: Principal, req: store_pb2.GetRequest) -> queue_pb2.QueuedRequest:
        with self._tx(write=False) as s:
            return request_pb(self._one(s, m.QueuedRequest, req.id, p, what="request"))

    def list_requests(self, p: Principal, req: store_pb2.ListRequestsRequest) -> store_pb2.ListRequestsResponse:
        t = m.QueuedRequest
        stmt = self._scoped(sa.select(t), t.tenant_id, p).order_by(t.created_at, t.id)
        stmt = self._where_set(
            stmt,
            (t.state, req.state and enum_name(queue_pb2.RequestState, req.state, "state")),
            (t.kind, req.kind),
        )
        items, token = self._page_of(stmt, req.page, request_pb)
        return store_pb2.ListRequestsResponse(requests=items, next_page_token=token)

    def claim_request(self, p: Principal, req: store_pb2.ClaimRequestRequest) -> store_pb2.ClaimRequestResponse:
        """Lease a QUEUED request (or a RUNNING one whose lease expired) to `worker`."""
        self._require_admin(p, "claiming requests")
        if not req.worker:
            raise InvalidArgument("worker is not set", field="worker", fix="pass the worker's name")
        fit(m.QueuedRequest.lease_owner, req.worker, "worker")
        lease = lease_length(req.lease_seconds)
        with self._tx(write=True) as s:
            row = self._one(s, m.QueuedRequest, req.id, None, what="request", lock=True)
            now = self.now()
            live = row.state == RUNNING and row.lease_expires_at is not None and row.lease_expires_at > now
            if row.state in (SUCCEEDED, FAILED) or live:
                return store_pb2.ClaimRequestResponse(claimed=False, request=request_pb(row))
            row.updated_at = now
            if row.attempts >= row.max_attempts:
                fail(row, f"gave up after {row.attempts} attempts (max_attempts)")
                row.lease_owner = row.lease_token = row.lease_expires_at = None
                s.flush()
                return store_pb2.ClaimRequestResponse(claimed=False, request=request_pb(row))
            row.state, row.attempts = RUNNING, row.attempts + 1
            row.lease_owner, row.lease_token = req.worker, secrets.token_hex(16)
            row.lease_expires_at = now + lease
            s.flush()
            return store_pb2.ClaimRequestResponse(claimed=True, request=request_pb(row))

    def _leased(self, s: Session, id_: str, token: str) -> m.QueuedRequest:
        """The request, locked, if `token` still holds its lease; otherwise the worker must stop."""
        row = self._one(s, m.QueuedRequest, id_, None, what="request", lock=True)
        if row.state in (SUCCEEDED, FAILED):
            raise FailedPrecondition(
                f"request already finished ({row.state})", field="id", fix="nothing to do; it completed once"
            )
        if row.state != RUNNING or not token or row.lease_token != token:
            raise FailedPrecondition(
                "lease lost",
                field="lease_token",
                fix="stop working on it; another worker holds or will take it",
            )
        return row

    def renew_lease(self, p: Principal, req: store_pb2.RenewLeaseRequest) -> queue_pb2.QueuedRequest:
        self._require_admin(p, "renewing leases")
        lease = lease_length(req.lease_seconds)
        with self._tx(write=True) as s:
            row = self._leased(s, req.id, req.lease_token)
            now = self.now()
            if row.lease_expires_at is None or row.lease_expires_at <= now:
                raise FailedPrecondition(
                    "lease lost (expired)", field="lease_token", fix="renew more often than the lease length"
                )
            row.lease_expires_at, row.updated_at = now + lease, now
            s.flush()
            return request_pb(row)

    def complete_request(self, p: Principal, req: store_pb2.CompleteRequestRequest) -> queue_pb2.QueuedRequest:
        """Finish exactly once; a holder of a stale token (re-claimed or reaped) is refused."""
        self._require_admin(p, "completing requests")
        if req.result_json and req.error:
            raise InvalidArgument("set result_json or error, not both", field="error")
        if req.result_json:
            canonical_json(req.result_json, "result_json")
        fit(m.QueuedRequest.result_json, req.result_json, "result_json")
        fit(m.QueuedRequest.error, req.error, "error")
        with self._tx(write=True) as s:
            row = self._leased(s, req.id, req.lease_token)
            if req.error:
                fail(row, req.error)
            else:
                row.state, row.result_json, row.error = SUCCEEDED, req.result_json or None, None
            row.lease_token = row.lease_expires_at = None
            row.updated_at = self.now()
            s.flush()
            return request_pb(row)

    def reap_expired_leases(
        self, p: Principal, req: store_pb2.ReapExpiredLeasesRequest
    ) -> store_pb2.ReapExpiredLeasesResponse:
        """Return RUNNING requests whose lease expired to QUEUED so the sweeper can re-enqueue them, and
        (with queued_stale_s) QUEUED requests left unclaimed that long, whose broker message may be lost."""
        self._require_admin(p, "reaping leases")
        if req.queued_stale_s < 0:
            raise InvalidArgument("must be >= 0", field="queued_stale_s", fix="pass 0 to disable")
        seconds(req.queued_stale_s, "queued_stale_s")
        t = m.QueuedRequest
        with self._tx(write=True) as s:
            now = self.now()
            due = sa.and_(t.state == RUNNING, t.lease_expires_at <= now)
            if req.queued_stale_s:
                stale = sa.and_(t.state == QUEUED, t.updated_at <= now - timedelta(seconds=req.queued_stale_s))
                due = sa.or_(due, stale)
            rows = s.scalars(
                sa.select(t)
                .where(due)
                .order_by(t.updated_at, t.id)
                .limit(req.limit or DEFAULT_PAGE_SIZE)
                .with_for_update(skip_locked=True)
            ).all()
            for row in rows:
                row.state, row.requeues, row.updated_at = QUEUED, row.requeues + 1, now
                row.lease_owner = row.lease_token = row.lease_expires_at = None
            s.flush()
            return store_pb2.ReapExpiredLeasesResponse(requests=[request_pb(r) for r in rows])

    def record_worker_heartbeat(
        self, p: Principal, req: store_pb2.RecordWorkerHeartbeatRequest
    ) -> queue_pb2.WorkerHeartbeat:
        """Upsert by name; seen_at is the store's clock, so worker clock skew cannot fake liveness."""
        self._require_admin(p, "recording worker heartbeats")
        hb = req.heartbeat
        if not hb.name:
            raise InvalidArgument("worker name is not set", field="heartbeat.name", fix="pass the celery hostname")
        fit(m.Worker.name, hb.name, "heartbeat.name")
        values = {**shared_fields(hb, m.Worker, skip=("name",), field="heartbeat"), "seen_at": self.now()}
        with self._tx(write=True) as s:
            stmt = self._insert(m.Worker).values(name=hb.name, **values)
            s.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={k: stmt.excluded[k] for k in values}))
            row = s.scalars(sa.select(m.Worker).where(m.Worker.name == hb.name)).one()
            return worker_pb(row)

    def list_workers(self, p: Principal, req: store_pb2.ListWorkersRequest) -> store_pb2.ListWorkersResponse:
        window = timedelta(seconds=seconds(req.seen_within_s or DEFAULT_WORKER_WINDOW_S, "seen_within_s"))
        with self._tx(write=False) as s:
            rows = s.scalars(
                sa.select(m.Worker).where(m.Worker.seen_at >= self.now() - window).order_by(m.Worker.name)
            ).all()
            return store_pb2.ListWorkersResponse(workers=[worker_pb(r) for r in rows])
