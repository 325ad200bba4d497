"""Jobs and their event log: the state machine every other service drives a job through."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from ballast.v1 import job_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.runtime.lru import BytesLRU
from services.specs import policy as fleet_policy
from services.specs.model import validate_job_spec
from services.store import job_states
from services.store import models as m
from services.store.convert import (
    bounded,
    bounded_attributes,
    enum_name,
    from_json,
    shared_fields,
    to_datetime,
    to_json,
)
from services.store.repo.base import (
    decode_key,
    decode_token,
    encode_key,
    encode_token,
    fit,
    int64,
    new_id,
    page_size,
    quote,
)
from services.store.repo.leases import LeaseStore
from services.store.repo.profiles import ModelStore
from services.store.repo.queue import QueueStore, request_pb


class SpecCache:
    """Parsed job specs by job id, as serialized protos (least recently used out first). A job's spec never
    changes once stored, and parsing its JSON (json_format, pure Python) was the store's costliest step under
    load: every ListJobs page and every scheduler pass parses every job it returns."""

    def __init__(self, size: int = 8192):
        self._items = BytesLRU(size)

    def spec(self, row: m.Job) -> job_pb2.JobSpec:
        known = self.get(row.id)
        return known if known is not None else self.parse(row.id, row.spec)

    def get(self, job_id: str) -> job_pb2.JobSpec | None:
        """The cached spec of job `job_id`, or None."""
        data = self._items.get(job_id)
        return None if data is None else job_pb2.JobSpec.FromString(data)

    def parse(self, job_id: str, stored: object) -> job_pb2.JobSpec:
        """Job `job_id`'s spec from its stored JSON, kept for next time."""
        parsed = from_json(stored, job_pb2.JobSpec)
        self.put(job_id, parsed)
        return parsed

    def clear(self) -> None:
        """Forget every spec (benchmarks/hot_paths.py: the cost of pages the cache has not seen)."""
        self._items.clear()

    def put(self, job_id: str, spec: job_pb2.JobSpec) -> None:
        """A job just stored: its spec is the one it was created from, no need to parse it back."""
        self._items.put(job_id, spec.SerializeToString())


SPECS = SpecCache()


def job_pb(row: m.Job) -> job_pb2.Job:
    return job_pb2.Job(**shared_fields(row, job_pb2.Job), spec=SPECS.spec(row))


# The hot reads (GetJob, ListJobs, ListJobEvents: most of what the read-only store serves) select columns with
# Core and convert the rows directly: the ORM's per-statement and per-row work cost more than the SQL. A job's
# spec is left out of the select: the cache has it, and those it lacks are read in one statement.
JOBS = m.Job.__table__
JOB_ROW = sa.select(*(c for c in JOBS.c if c.key != "spec"))
EVENTS = m.JobEvent.__table__


def job_pbs(s: Session, rows: Sequence[sa.Row]) -> list[job_pb2.Job]:
    """Rows of a JOB_ROW select, as protos."""
    specs = {r.id: SPECS.get(r.id) for r in rows}
    missing = [job_id for job_id, spec in specs.items() if spec is None]
    if missing:
        for job_id, stored in s.connection().execute(sa.select(JOBS.c.id, JOBS.c.spec).where(JOBS.c.id.in_(missing))):
            specs[job_id] = SPECS.parse(job_id, stored)
    return [job_pb2.Job(**shared_fields(r, job_pb2.Job, table=m.Job), spec=specs[r.id]) for r in rows]


def event_pb(row: m.JobEvent | sa.Row) -> job_pb2.JobEvent:
    return job_pb2.JobEvent(**shared_fields(row, job_pb2.JobEvent, table=m.JobEvent))


INSERT_JOB = sa.insert(JOBS)
INSERT_EVENT = sa.insert(EVENTS)


class _Known(NamedTuple):
    priority_class: str
    model_id: str | None  # None: the model is stored with the job
    spec_json: str


# A job leaving for one of these states gives its devices back in the same transaction, for this reason.
LEASE_ENDS = {
    job_states.SUCCEEDED: "LEASE_END_REASON_FINISHED",
    job_states.FAILED: "LEASE_END_REASON_FAILED",
    job_states.CANCELLED: "LEASE_END_REASON_CANCELLED",
    job_states.QUEUED: "LEASE_END_REASON_PREEMPTED",
}


class JobStore(ModelStore, LeaseStore, QueueStore):
    """Job RPCs. A ModelStore because a job's spec carries its model, stored on first use; a LeaseStore
    because a job's end ends its device leases in the same transaction; a QueueStore because a submitted job
    is stored with the request that prepares it."""

    def _append_event(self, s: Session, job: m.Job, type_: str, message: str, attributes: dict[str, str]) -> m.JobEvent:
        """Next gapless seq; the caller holds the job row's lock."""
        job.last_event_seq += 1
        event = m.JobEvent(
            job_id=job.id,
            seq=job.last_event_seq,
            type=type_,
            state=job.state,
            message=bounded(message),
            attributes=bounded_attributes(attributes, "attributes"),
            created_at=self.now(),
        )
        s.add(event)
        return event

    def create_job(self, p: Principal, req: store_pb2.CreateJobRequest) -> job_pb2.Job:
        self._check_spec(req.spec)
        known = self._before_add(p, req.spec)
        with self._model_race():
            with self._tx(write=True) as s:
                job = self._add_job(s, p, req.spec, known)
            SPECS.put(job.id, req.spec)
            return job_pb(job)

    def create_queued_job(self, p: Principal,
                          req: store_pb2.CreateQueuedJobRequest) -> store_pb2.CreateQueuedJobResponse:
        """CreateJob and the request that prepares the job, in one transaction: a job is never stored without
        it, and JobService.Submit takes one round trip to the store instead of two."""
        self._check_spec(req.spec)
        max_attempts = self._check_request(req.kind, req.max_attempts)
        known = self._before_add(p, req.spec)
        with self._model_race():
            with self._tx(write=True) as s:
                job = self._add_job(s, p, req.spec, known)
                row, _ = self._queue(s, p, req.kind, json.dumps({"job_id": job.id}, sort_keys=True), max_attempts,
                                     new=True)
            SPECS.put(job.id, req.spec)
            return store_pb2.CreateQueuedJobResponse(job=job_pb(job), request=request_pb(row))

    def _check_spec(self, spec: job_pb2.JobSpec) -> None:
        validate_job_spec(spec, self.user_inputs)
        fit(m.Job.name, spec.name, "spec.name")

    @staticmethod
    @contextmanager
    def _model_race() -> Iterator[None]:
        try:
            yield
        except sa_exc.IntegrityError:
            raise AlreadyExists(
                "a model with this name was stored concurrently",
                field="spec.model.name",
                fix="retry the submission",
            ) from None

    def _before_add(self, p: Principal, spec: job_pb2.JobSpec) -> _Known:
        """What a new job's write needs that can be read before the writer's turn (SQLite has one writer, and
        every millisecond inside it is one every other write waits): the priority class under the policy in
        force, the tenant's stored model of this content (a model is never deleted), the spec's JSON."""
        with self._tx(write=False) as s:
            priority = fleet_policy.class_for(self.current_policy(s), p.tenant_name, spec.priority_class)
            model_id = self._stored_model_id(s, p.tenant_id, spec.model)
        return _Known(priority.name, model_id, to_json(spec))

    def _add_job(self, s: Session, p: Principal, spec: job_pb2.JobSpec, known: _Known) -> m.Job:
        """A SUBMITTED job and its first event in transaction `s`, its model stored now if it was not yet.
        Two Core inserts: on the submit path the ORM's unit of work cost twice the SQL it ran. The job
        returned is not in the session (the callers only read it)."""
        model_id = known.model_id or self._resolve_model(s, p.tenant_id, spec.model, "spec.model").id
        now = self.now()
        job = dict(id=new_id("job"), tenant_id=p.tenant_id, model_id=model_id, name=spec.name,
                   state=job_states.SUBMITTED, plan_id=None, plan_version=0, message="", iteration=0, last_event_seq=1,
                   spec=known.spec_json, created_at=now, updated_at=now, priority_class=known.priority_class)
        conn = s.connection()
        conn.execute(INSERT_JOB, job)  # before its event: the event's foreign key names it
        conn.execute(INSERT_EVENT, dict(job_id=job["id"], seq=1, type="SUBMITTED", state=job_states.SUBMITTED,
                                        message="job submitted", created_at=now,
                                        attributes={"model_id": model_id, "priority_class": known.priority_class}))
        return m.Job(**job)

    def get_job(self, p: Principal, req: store_pb2.GetRequest) -> job_pb2.Job:
        with self._tx(write=False) as s:
            rows = s.connection().execute(self._scoped(JOB_ROW.where(JOBS.c.id == req.id), JOBS.c.tenant_id, p)).all() \
                if req.id else []
            if not rows:
                raise NotFound(f"job {quote(req.id)} not found", field="id")
            return job_pbs(s, rows)[0]

    def list_jobs(self, p: Principal, req: store_pb2.ListJobsRequest) -> store_pb2.ListJobsResponse:
        stmt = self._scoped(JOB_ROW, JOBS.c.tenant_id, p).order_by(JOBS.c.created_at.desc(), JOBS.c.id.desc())
        stmt = self._where_set(
            stmt,
            (JOBS.c.state, req.state and enum_name(job_pb2.JobState, req.state, "state")),
            (JOBS.c.model_id, req.model_id),
        )
        if req.HasField("changed_since"):  # by its index, not a walk of every job in creation order
            since = to_datetime(req.changed_since, "changed_since")
            stmt = stmt.where(JOBS.c.id.in_(sa.select(JOBS.c.id).where(JOBS.c.updated_at >= since)))
        # Keyset pages, not offsets: a job that leaves the listed state while a reader pages through (the
        # planner reads thousands of queued jobs whole) would otherwise make the next page skip one that stayed.
        after = decode_key(req.page.page_token)
        if after is not None:
            created, job_id = after
            stmt = stmt.where(sa.or_(JOBS.c.created_at < created,
                                     sa.and_(JOBS.c.created_at == created, JOBS.c.id < job_id)))
        size = page_size(req.page)
        read_at = self.now()
        with self._tx(write=False) as s:
            rows = s.connection().execute(stmt.limit(size + 1)).all()
            more, rows = len(rows) > size, rows[:size]
            reply = store_pb2.ListJobsResponse(jobs=job_pbs(s, rows), next_page_token=encode_key(
                rows[-1].created_at, rows[-1].id) if more else "")
        reply.read_at.FromDatetime(read_at)
        return reply

    def transition_job(self, p: Principal, req: store_pb2.TransitionJobRequest) -> job_pb2.Job:
        target = enum_name(job_pb2.JobState, req.state, "state")
        fit(m.JobEvent.type, req.event_type, "event_type")
        fit(m.Job.message, req.message, "message")
        with self._tx(write=True) as s:
            job = self._job(s, p, req.id, field="id", lock=True)
            if req.expected_state:
                expected = enum_name(job_pb2.JobState, req.expected_state, "expected_state")
                if job.state != expected:
                    raise FailedPrecondition(
                        f"job is {job.state}, not {expected}",
                        field="expected_state",
                        fix="re-read the job and decide again",
                    )
            job_states.check_transition(job.state, target)
            if req.plan_id:
                plan = self._one(s, m.Plan, req.plan_id, p, what="plan", field="plan_id")
                if plan.job_id not in (None, job.id) or plan.model_id != job.model_id:
                    raise FailedPrecondition(
                        f"plan {plan.id} does not belong to job {job.id}",
                        field="plan_id",
                        fix="adopt a plan created for this job's model",
                    )
            if target in LEASE_ENDS:
                self._end_live(s, job.id, LEASE_ENDS[target])
            attributes = bounded_attributes(req.attributes, "attributes")
            if req.plan_id:
                attributes.setdefault("plan_id", req.plan_id)
                changes = {"plan_id": plan.id, "plan_version": plan.version}
            else:
                changes = {}
            changes.update(state=target, message=bounded(req.message), updated_at=self.now(),
                           last_event_seq=job.last_event_seq + 1)
            if target == job_states.RUNNING and job.started_at is None:
                changes["started_at"] = changes["updated_at"]
            # Core statements, not the unit of work (which cost more than the SQL on this hot path); the row
            # object takes the same values as committed ones, so nothing is flushed a second time.
            conn = s.connection()
            conn.execute(sa.update(JOBS).where(JOBS.c.id == job.id).values(**changes))
            conn.execute(INSERT_EVENT, dict(job_id=job.id, seq=changes["last_event_seq"],
                                            type=req.event_type or "STATE_CHANGED", state=target,
                                            message=changes["message"],
                                            attributes=attributes, created_at=changes["updated_at"]))
            for key, value in changes.items():
                set_committed_value(job, key, value)
            return job_pb(job)

    def append_job_event(self, p: Principal, req: store_pb2.AppendJobEventRequest) -> job_pb2.JobEvent:
        ev = req.event
        if not ev.type:
            raise InvalidArgument("event type is not set", field="event.type", fix='e.g. "MIGRATION"')
        fit(m.JobEvent.type, ev.type, "event.type")
        fit(m.JobEvent.message, ev.message, "event.message")
        with self._tx(write=True) as s:
            job = self._job(s, p, ev.job_id, field="event.job_id", lock=True)
            event = self._append_event(s, job, ev.type, ev.message, dict(ev.attributes))
            s.flush()
            return event_pb(event)

    def list_job_events(self, p: Principal, req: store_pb2.ListJobEventsRequest) -> store_pb2.ListJobEventsResponse:
        """Paged by seq rather than offset, so a follower that passes after_seq never skips an event."""
        size = page_size(req.page)
        after = int64(req.after_seq, "after_seq") if req.after_seq else decode_token(req.page.page_token)
        with self._tx(write=False) as s:
            conn = s.connection()
            job = self._scoped(sa.select(JOBS.c.id).where(JOBS.c.id == req.job_id), JOBS.c.tenant_id, p)
            if not req.job_id or conn.execute(job).first() is None:
                raise NotFound(f"job {quote(req.job_id)} not found", field="job_id")
            rows = conn.execute(
                sa.select(EVENTS)
                .where(EVENTS.c.job_id == req.job_id, EVENTS.c.seq > after)
                .order_by(EVENTS.c.seq)
                .limit(size + 1)
            ).all()
        more = len(rows) > size
        rows = rows[:size]
        token = encode_token(rows[-1].seq) if more else ""
        return store_pb2.ListJobEventsResponse(
            events=[event_pb(r) for r in rows],
            next_page_token=token)
