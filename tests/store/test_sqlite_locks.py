"""SQLite locking: reads run beside a foreign writer, writes queue behind it instead of failing.

SQLite only, and on the Repository in-process: PostgreSQL's MVCC never makes a reader wait for a
writer, and the gRPC hop would only blur the timing this test is about.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

import pytest

from ballast.v1 import job_pb2, queue_pb2, store_pb2
from services.store.db import checkpoint_in_background, create_engine
from tests.harness import wait_for
from tests.store_builders import plan_msg
from tests.store_fixtures import ADMIN_TOKEN, JS, Store, claim, enqueue, events, move, new_job


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run `fn` in a daemon thread; its result (or exception) lands in the returned list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as err:  # surfaced by the caller
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("store_backend", ["sqlite"], indirect=True)
def test_sqlite_reads_run_beside_a_writer_and_writes_queue_behind_it(store: Store):
    repo, a, admin = store.repo, store.a, store.admin
    job = new_job(store)
    rid = enqueue(store, '{"lock": 1}').request.id
    get = store_pb2.GetRequest
    reads: list[Callable[[], Any]] = [
        lambda: repo.principal_for_token(ADMIN_TOKEN),
        lambda: repo.get_job(a, get(id=job.id)),
        lambda: repo.list_jobs(a, store_pb2.ListJobsRequest()),
        lambda: repo.list_job_events(a, store_pb2.ListJobEventsRequest(job_id=job.id)),  # Watch polls this
        lambda: repo.get_model(a, get(id=job.model_id)),
        lambda: repo.list_models(a, store_pb2.ListModelsRequest()),
        lambda: repo.list_profiles(a, store_pb2.ListProfilesRequest()),
        lambda: repo.list_plans(a, store_pb2.ListPlansRequest()),
        lambda: repo.list_hosts(a, store_pb2.ListHostsRequest()),
        lambda: repo.list_iteration_metrics(a, store_pb2.ListIterationMetricsRequest(job_id=job.id)),
        lambda: repo.list_layer_migrations(a, store_pb2.ListLayerMigrationsRequest(job_id=job.id)),
        lambda: repo.list_checkpoints(a, store_pb2.ListCheckpointsRequest(job_id=job.id)),
        lambda: repo.get_queued_request(a, get(id=rid)),
        lambda: repo.list_requests(a, store_pb2.ListRequestsRequest()),
        lambda: repo.list_workers(a, store_pb2.ListWorkersRequest()),
        lambda: repo.get_tenant(a, get(id=a.tenant_id)),
        lambda: repo.list_tenants(admin, store_pb2.ListTenantsRequest()),
    ]
    writes: list[Callable[[], Any]] = [
        lambda: repo.append_job_event(
            a, store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type="LOCKED"))
        ),
        lambda: move(store, job.id, JS.JOB_STATE_PROFILING),
        lambda: repo.write_iteration_metrics(
            a,
            store_pb2.WriteIterationMetricsRequest(metrics=[job_pb2.IterationMetric(job_id=job.id, iteration=1)]),
        ),
        lambda: enqueue(store, '{"lock": 2}'),
        lambda: claim(store, rid, "w1"),
        lambda: repo.create_tenant(admin, store_pb2.CreateTenantRequest(name="team-c")),
        lambda: repo.create_plan(a, store_pb2.CreatePlanRequest(plan=plan_msg(job.model_id))),
        lambda: repo.record_worker_heartbeat(
            admin, store_pb2.RecordWorkerHeartbeatRequest(heartbeat=queue_pb2.WorkerHeartbeat(name="w1"))
        ),
    ]
    writer = sqlite3.connect(store.engine.url.database, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # a foreign writer holds the lock (e.g. a big metrics batch)
    try:
        for read in reads:
            thread, out = in_thread(read)
            thread.join(10)
            assert not thread.is_alive(), "a read waited for the writer"
            assert not isinstance(out[0], BaseException), out[0]
        queued = [in_thread(write) for write in writes]
        for thread, _ in queued:
            thread.join(0.2)
        assert all(thread.is_alive() for thread, _ in queued), "a write did not wait for the lock"
    finally:
        writer.execute("COMMIT")
        writer.close()
    for thread, out in queued:
        thread.join(30)
        assert not thread.is_alive() and not isinstance(out[0], BaseException), out
    assert {"LOCKED", "STATE_CHANGED"} <= {e.type for e in events(store, job.id)}


# --- bad input: INVALID_ARGUMENT on both backends ------------------------------------------------


def test_the_store_checkpoints_its_wal_beside_the_writers(tmp_path):
    """Commits no longer checkpoint (the one crossing 1000 pages would hold up every writer behind it):
    a thread does, and what was committed reaches the database file itself."""
    path = tmp_path / "wal.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    checkpointer = checkpoint_in_background(engine, interval_s=0.05)
    try:
        with engine.begin() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
            conn.exec_driver_sql("INSERT INTO t VALUES (1)")

        def in_the_database_file() -> bool:  # immutable: the file alone, the WAL not read
            try:
                with contextlib.closing(sqlite3.connect(f"file:{path}?immutable=1", uri=True)) as raw:
                    return raw.execute("SELECT count(*) FROM t").fetchone()[0] == 1
            except sqlite3.OperationalError:  # the table itself is still only in the WAL
                return False

        wait_for(in_the_database_file, timeout=30, what="the WAL checkpointed into the database file")
    finally:
        checkpointer.stop()
        engine.dispose()
