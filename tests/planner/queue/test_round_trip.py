"""Planner queue end to end: real Celery worker processes on the embedded broker and on Redis.

Durability is the store's lease, not the broker: a worker killed with SIGKILL mid-task loses its
lease, the planner's sweeper re-enqueues the request, another worker completes it, exactly once.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
import uuid
from pathlib import Path

import pytest
from kombu.exceptions import ContentDisallowed
from kombu.serialization import dumps, loads

from ballast.v1 import queue_pb2, services_pb2, store_pb2
from services.planner.celery_app import TASK, make_app
from tests.conftest import REDIS_URL, require_redis
from tests.harness import kill_group, make_settings, spawn_cli, start_plane, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(params=["embedded", pytest.param("redis", marks=pytest.mark.redis)])
def broker_url(request, tmp_path: Path) -> str:
    if request.param == "embedded":
        return f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    require_redis()
    return REDIS_URL


@pytest.fixture
def plane_factory(tmp_path: Path, broker_url: str):
    planes = []

    def make(requeue_unclaimed_s: float = 0.0):
        """Store + planner in-process; requeue of unclaimed requests off unless a test is about it."""
        settings = make_settings(tmp_path / "data", broker_url=broker_url, queue=f"planner-{uuid.uuid4().hex[:8]}",
                                 lease_seconds=2.0, sweep_interval_s=0.5, visibility_timeout_s=6.0,
                                 requeue_unclaimed_s=requeue_unclaimed_s, worker_heartbeat_s=0.5)
        planes.append(start_plane(settings, services=("store", "planner")))
        return planes[-1]

    yield make
    for plane in planes:
        plane.stop()


@pytest.fixture
def plane(plane_factory):
    return plane_factory()


def _request(plane, request_id: str) -> queue_pb2.QueuedRequest:
    with plane.client() as client:
        return client.planner.GetQueuedRequest(store_pb2.GetRequest(id=request_id))


def test_celery_config_is_json_only_and_late_ack(tmp_path: Path) -> None:
    app = make_app(make_settings(tmp_path))
    conf = app.conf
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"
    assert conf.result_accept_content == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1 and conf.worker_concurrency == 1
    redis_app = make_app(make_settings(tmp_path, broker_url=REDIS_URL))
    assert 60 <= redis_app.conf.broker_transport_options["visibility_timeout"] <= 3600  # minutes, not hours
    _, content_type, encoding, body = (None, *dumps({"x": 1}, serializer="pickle"))
    with pytest.raises(ContentDisallowed):
        loads(body, content_type, encoding, accept=conf.accept_content)


def test_the_embedded_broker_runs_in_wal_mode(tmp_path: Path) -> None:
    """Its worker's polls must not hold off the planner's publishes (rollback journal: they do)."""
    settings = make_settings(tmp_path)
    make_app(settings)
    path = settings.data_dir / "broker.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_echo_round_trip_through_a_real_worker(plane, tmp_path: Path) -> None:
    worker = spawn_cli(plane.settings, "worker", log=tmp_path / "worker.log")
    try:
        with plane.client() as client:
            queued = client.planner.Echo(services_pb2.EchoRequest(text="hello"))
            done = wait_for(lambda: (r := _request(plane, queued.id)).state == queue_pb2.REQUEST_STATE_SUCCEEDED and r,
                            what="echo to complete")
            assert json.loads(done.result_json)["text"] == "hello"
            assert json.loads(done.result_json)["worker_pid"] == worker.pid
            assert done.attempts == 1
            # The same content again is the same request, not a second task.
            again = client.planner.Echo(services_pb2.EchoRequest(text="hello"))
            assert again.id == queued.id
            workers = client.store.ListWorkers(store_pb2.ListWorkersRequest(seen_within_s=30)).workers
            assert any(w.pid == worker.pid and plane.settings.queue in w.queues for w in workers)
    finally:
        kill_group(worker)


def test_request_of_a_killed_worker_completes_exactly_once(plane, tmp_path: Path) -> None:
    doomed = spawn_cli(plane.settings, "worker", extra_env={"BALLAST_TEST_TASK_HOLD_S": "120"},
                       log=tmp_path / "doomed.log")
    rescuer = None
    try:
        with plane.client() as client:
            queued = client.planner.Echo(services_pb2.EchoRequest(text="survive"))
            running = wait_for(lambda: (r := _request(plane, queued.id)).state == queue_pb2.REQUEST_STATE_RUNNING and r,
                               what="the doomed worker to claim the request")
            assert running.lease_owner.endswith(f":{doomed.pid}")
            kill_group(doomed)  # SIGKILL mid-task: no ack, no completion, no lease renewal
            rescuer = spawn_cli(plane.settings, "worker", log=tmp_path / "rescuer.log")
            done = wait_for(lambda: (r := _request(plane, queued.id)).state == queue_pb2.REQUEST_STATE_SUCCEEDED and r,
                            what="the rescuer to complete the request")
            assert json.loads(done.result_json) == {"text": "survive", "worker_pid": rescuer.pid}
            assert done.attempts == 2 and done.requeues >= 1
            # Let the broker redeliver whatever it still holds (Redis: after its 6 s visibility timeout);
            # the store refuses a second run, so the request stays completed once, by the rescuer.
            time.sleep(8)
            final = _request(plane, queued.id)
            assert final.state == queue_pb2.REQUEST_STATE_SUCCEEDED
            assert final.attempts == 2 and final.result_json == done.result_json
    finally:
        kill_group(doomed)
        if rescuer:
            kill_group(rescuer)


def test_pickled_message_is_refused_by_the_worker(plane, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    worker = spawn_cli(plane.settings, "worker", log=log)
    try:
        with plane.client() as client:
            stored = client.store.EnqueueRequest(store_pb2.EnqueueRequestRequest(
                kind="diagnostic.echo", payload_json=json.dumps({"text": "pickled"}))).request
            app = make_app(plane.settings)
            app.send_task(TASK, args=[stored.id], queue=plane.settings.queue, serializer="pickle")
            wait_for(lambda: "untrusted content" in log.read_text(errors="replace") or
                     "ContentDisallowed" in log.read_text(errors="replace"), what="the worker to refuse pickle")
            assert _request(plane, stored.id).attempts == 0  # never ran
            app.send_task(TASK, args=[stored.id], queue=plane.settings.queue)  # the same id, as JSON
            done = wait_for(lambda: (r := _request(plane, stored.id)).state == queue_pb2.REQUEST_STATE_SUCCEEDED and r,
                            what="the JSON message to complete")
            assert done.attempts == 1
    finally:
        kill_group(worker)


def test_request_whose_broker_message_was_lost_is_sent_again(plane_factory, tmp_path: Path) -> None:
    plane = plane_factory(requeue_unclaimed_s=3.0)
    log = tmp_path / "worker.log"
    worker = spawn_cli(plane.settings, "worker", log=log)

    def worker_log() -> str:
        return "worker log:\n" + log.read_text(errors="replace")[-3000:] if log.exists() else "no worker log"

    try:
        with plane.client() as client:
            # The worker up first: on a loaded machine its start alone took most of the wait below (CI, 2026-11-29)
            wait_for(lambda: any(w.pid == worker.pid for w in client.store.ListWorkers(
                store_pb2.ListWorkersRequest(seen_within_s=30)).workers), timeout=180, what="the worker to start",
                story=worker_log)
            # Stored but never put on the broker: what a planner crash (or an emptied broker) leaves behind.
            stored = client.store.EnqueueRequest(store_pb2.EnqueueRequestRequest(
                kind="diagnostic.echo", payload_json=json.dumps({"text": "lost"}))).request
            done = wait_for(lambda: (r := _request(plane, stored.id)).state == queue_pb2.REQUEST_STATE_SUCCEEDED and r,
                            what="the sweeper to re-send the unclaimed request", story=worker_log)
            assert done.attempts == 1 and done.requeues >= 1
            assert json.loads(done.result_json)["text"] == "lost"
    finally:
        kill_group(worker)
