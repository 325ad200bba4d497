"""Jobs: creation with their model, the state machine with compare-and-set, and a gapless event log."""

from __future__ import annotations

import json
import threading
from datetime import UTC

import pytest
import sqlalchemy as sa
from google.protobuf.timestamp_pb2 import Timestamp

from ballast.v1 import job_pb2, store_pb2
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.store_builders import gpt, job_spec, page
from tests.store_fixtures import JS, Store, events, move, new_job


def test_create_job_round_trip_and_listing(store: Store):
    a = store.as_(store.a)
    job = new_job(store, name="first")
    assert job.id.startswith("job-") and job.state == JS.JOB_STATE_SUBMITTED and job.spec == job_spec("first")
    assert a.get_job(store_pb2.GetRequest(id=job.id)) == job
    model = a.get_model(store_pb2.GetRequest(id=job.model_id))
    assert model.spec == gpt()
    # The same model content is matched, not stored twice; a nameless model gets a derived name.
    second = new_job(store, name="second")
    unnamed = new_job(store, name="third", model=gpt(name="", layers=3))
    assert second.model_id == job.model_id and unnamed.model_id != job.model_id
    assert a.get_model(store_pb2.GetRequest(id=unnamed.model_id)).spec.name.startswith("gpt-")
    assert [e.type for e in events(store, job.id)] == ["SUBMITTED"]

    move(store, second.id, JS.JOB_STATE_PROFILING)
    listed = a.list_jobs(store_pb2.ListJobsRequest()).jobs
    assert [j.spec.name for j in listed] == ["third", "second", "first"]  # newest first
    assert [j.id for j in a.list_jobs(store_pb2.ListJobsRequest(state=JS.JOB_STATE_PROFILING)).jobs] == [second.id]
    by_model = a.list_jobs(store_pb2.ListJobsRequest(model_id=job.model_id, page=page(1)))
    assert [j.id for j in by_model.jobs] == [second.id]
    rest = a.list_jobs(store_pb2.ListJobsRequest(model_id=job.model_id, page=page(1, by_model.next_page_token)))
    assert [j.id for j in rest.jobs] == [job.id] and rest.next_page_token == ""

    bad = job_spec()
    bad.iterations = 0
    with pytest.raises(InvalidArgument) as err:
        a.create_job(store_pb2.CreateJobRequest(spec=bad))
    assert err.value.field == "spec.iterations"
    with store.engine.connect() as conn:
        state = conn.execute(sa.text(f"SELECT state FROM jobs WHERE id = '{job.id}'")).scalar()
    assert state == "JOB_STATE_SUBMITTED"


def test_a_job_under_a_model_name_already_used_stores_its_spec_as_the_next_version(store: Store):
    """Resubmitting under a model name whose earlier spec failed (or changed) is never a dead end: the new spec
    is that name's version 2, the job runs it, and resubmitting it again reuses that row."""
    a = store.as_(store.a)
    first = a.create_model(store_pb2.CreateModelRequest(spec=gpt("gpt-tiny", layers=2)))
    job = new_job(store, model=gpt("gpt-tiny", layers=4))
    second = a.get_model(store_pb2.GetRequest(id=job.model_id))
    assert (first.version, second.version, second.id != first.id) == (1, 2, True)
    assert second.spec.transformer.num_layers == 4 and second.spec.name == "gpt-tiny"
    assert new_job(store, name="again", model=gpt("gpt-tiny", layers=4)).model_id == second.id
    assert new_job(store, name="old", model=gpt("gpt-tiny", layers=2)).model_id == first.id
    assert store.count("models") == 2 and store.count("jobs") == 3


def test_a_queued_job_is_stored_with_its_request_or_not_at_all(store: Store):
    """CreateQueuedJob (JobService.Submit): the job, its event and the request that prepares it in one
    transaction; a refusal, of the spec or of the request, stores none of them."""
    a = store.as_(store.a)
    made = a.create_queued_job(store_pb2.CreateQueuedJobRequest(spec=job_spec("queued"), kind="jobs.prepare"))
    assert made.job.state == JS.JOB_STATE_SUBMITTED and made.job.spec == job_spec("queued")
    assert (made.request.kind, json.loads(made.request.payload_json)) == ("jobs.prepare", {"job_id": made.job.id})
    assert (made.request.tenant_id, made.request.max_attempts) == (made.job.tenant_id, 3)
    assert a.get_queued_request(store_pb2.GetRequest(id=made.request.id)) == made.request
    assert [e.type for e in events(store, made.job.id)] == ["SUBMITTED"]
    bad = job_spec()
    bad.iterations = 0
    for request, field in ((store_pb2.CreateQueuedJobRequest(spec=bad, kind="jobs.prepare"), "spec.iterations"),
                           (store_pb2.CreateQueuedJobRequest(spec=job_spec()), "kind")):
        with pytest.raises(InvalidArgument) as err:
            a.create_queued_job(request)
        assert err.value.field == field
    assert (store.count("jobs"), store.count("job_events"), store.count("queued_requests")) == (1, 1, 1)


def test_a_known_model_is_not_read_again_and_stays_its_tenants(store: Store):
    """Once a submit has found a tenant's stored model, later submits of it take its id from the store's memory
    (a stored model never changes) without reading the models table; the memory is per tenant, so the same
    content submitted by another tenant is still stored as that tenant's own model."""
    statements: list[str] = []

    def seen(conn, cursor, statement, *args) -> None:
        statements.append(statement)

    first = new_job(store, name="first")  # stores the model
    second = new_job(store, name="second")  # finds it, and keeps its id
    sa.event.listen(store.engine, "before_cursor_execute", seen)
    try:
        third = new_job(store, name="third")
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", seen)
    assert first.model_id == second.model_id == third.model_id
    assert statements and not [s for s in statements if "FROM models" in s]
    theirs = new_job(store, who=store.b, name="theirs")
    again = new_job(store, who=store.b, name="theirs-again")
    assert theirs.model_id != first.model_id and again.model_id == theirs.model_id
    assert store.count("models") == 2
    with pytest.raises(NotFound):
        store.as_(store.b).get_model(store_pb2.GetRequest(id=first.model_id))


def test_job_state_machine_events_and_compare_and_set(store: Store):
    a = store.as_(store.a)
    job = new_job(store)
    with pytest.raises(FailedPrecondition) as err:
        move(store, job.id, JS.JOB_STATE_RUNNING)
    assert err.value.field == "state"
    with pytest.raises(FailedPrecondition) as err:
        move(store, job.id, JS.JOB_STATE_PROFILING, expected_state=JS.JOB_STATE_PLANNING)
    assert err.value.field == "expected_state"
    assert a.get_job(store_pb2.GetRequest(id=job.id)).state == JS.JOB_STATE_SUBMITTED

    before = a.get_job(store_pb2.GetRequest(id=job.id))
    moved = move(store, job.id, JS.JOB_STATE_PROFILING, expected_state=JS.JOB_STATE_SUBMITTED, message="go")
    assert moved.message == "go" and moved.updated_at.ToDatetime() > before.updated_at.ToDatetime()
    for state in (JS.JOB_STATE_PLANNING, JS.JOB_STATE_SCHEDULED, JS.JOB_STATE_RUNNING):
        move(store, job.id, state)
    ev = a.append_job_event(
        store_pb2.AppendJobEventRequest(
            event=job_pb2.JobEvent(job_id=job.id, type="MIGRATION", message="layer 3", attributes={"layer": "3"})
        )
    )
    assert ev.seq == 6 and ev.state == JS.JOB_STATE_RUNNING and ev.attributes == {"layer": "3"}
    move(store, job.id, JS.JOB_STATE_REPARTITIONING, attributes={"why": "skew"})
    move(store, job.id, JS.JOB_STATE_RUNNING)
    done = move(store, job.id, JS.JOB_STATE_SUCCEEDED)
    assert done.state == JS.JOB_STATE_SUCCEEDED

    for target in (JS.JOB_STATE_RUNNING, JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLING):
        with pytest.raises(FailedPrecondition):
            move(store, job.id, target)
    with pytest.raises(InvalidArgument):
        move(store, job.id, JS.JOB_STATE_UNSPECIFIED)

    log = events(store, job.id)
    assert [e.seq for e in log] == list(range(1, 10))
    assert [e.type for e in log][:2] == ["SUBMITTED", "STATE_CHANGED"]
    assert log[-1].state == JS.JOB_STATE_SUCCEEDED and log[6].attributes == {"why": "skew"}
    assert [e.seq for e in events(store, job.id, after_seq=7)] == [8, 9]
    first = a.list_job_events(store_pb2.ListJobEventsRequest(job_id=job.id, page=page(4)))
    second = a.list_job_events(store_pb2.ListJobEventsRequest(job_id=job.id, page=page(4, first.next_page_token)))
    assert [e.seq for e in first.events] == [1, 2, 3, 4] and [e.seq for e in second.events] == [5, 6, 7, 8]
    assert events(store, job.id) == log  # append-only: history unchanged by reads

    cancelled = new_job(store, name="c")
    assert move(store, cancelled.id, JS.JOB_STATE_CANCELLED).state == JS.JOB_STATE_CANCELLED


def test_concurrent_events_are_gapless(store: Store):
    a = store.as_(store.a)
    job = new_job(store)
    errors: list[BaseException] = []

    def append(n: int) -> None:
        try:
            for i in range(5):
                a.append_job_event(
                    store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type=f"T{n}.{i}"))
                )
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=append, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [e.seq for e in events(store, job.id, page=page(100))] == list(range(1, 22))


def test_jobs_changed_since_a_time_are_those_created_or_moved_since_and_not_those_that_progressed(store: Store):
    """What the admission pass's queue reader asks each half second (ListJobs changed_since), with the store's
    read time to ask from next."""
    a = store.as_(store.a)
    old = new_job(store, name="old")
    store.clock.advance(10)
    since = Timestamp()
    since.FromDatetime(store.clock())
    fresh = new_job(store, name="fresh")
    store.as_(store.admin).write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(
        metrics=[job_pb2.IterationMetric(job_id=old.id, iteration=3, iteration_time_s=1.0)]))

    def changed() -> list[str]:
        reply = a.list_jobs(store_pb2.ListJobsRequest(changed_since=since))
        assert reply.read_at.ToDatetime(UTC) <= store.clock()
        return [j.spec.name for j in reply.jobs]

    assert changed() == ["fresh"]  # progress is no change
    store.clock.advance(1)
    move(store, old.id, JS.JOB_STATE_PROFILING)
    assert changed() == ["fresh", "old"]
    assert [j.spec.name for j in a.list_jobs(store_pb2.ListJobsRequest(
        changed_since=since, state=JS.JOB_STATE_PROFILING)).jobs] == ["old"]
    since.FromDatetime(store.clock())
    assert changed() == [] and fresh.id
    store.clock.advance(1)
    move(store, fresh.id, JS.JOB_STATE_CANCELLED)
    assert changed() == ["fresh"]
    assert store.as_(store.b).list_jobs(store_pb2.ListJobsRequest(changed_since=since)).jobs == []  # scoped


def test_paging_through_jobs_skips_none_when_some_leave_the_list_between_pages(store: Store):
    """Keyset pages: the planner reads thousands of queued jobs whole while some are admitted."""
    a = store.as_(store.a)
    jobs = [new_job(store, name=f"j{i}") for i in range(5)]
    request = store_pb2.ListJobsRequest(state=JS.JOB_STATE_SUBMITTED, page=page(2))
    first = a.list_jobs(request)
    assert [j.spec.name for j in first.jobs] == ["j4", "j3"]
    move(store, jobs[4].id, JS.JOB_STATE_PROFILING)  # an earlier page's job leaves the list
    move(store, jobs[1].id, JS.JOB_STATE_PROFILING)  # and a later page's
    request.page.page_token = first.next_page_token
    rest = a.list_jobs(request)
    assert [j.spec.name for j in rest.jobs] == ["j2", "j0"] and rest.next_page_token == ""
    with pytest.raises(InvalidArgument) as info:
        a.list_jobs(store_pb2.ListJobsRequest(page=page(1, "bm90IGEgdG9rZW4=")))
    assert info.value.field == "page.page_token"
