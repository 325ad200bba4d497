"""Celery app for planner work. JSON only (pickle refused), acks late, one task at a time.

The broker carries only request ids; state lives in the store (see queue/durable.py). The embedded default
broker is kombu's SQLAlchemy transport over a SQLite file in the data directory (no server);
production uses Redis (RabbitMQ also works).
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import threading

import sqlalchemy as sa
from celery import Celery

from ballast.client import open_channel
from ballast.config import Settings, load_settings
from ballast.transport import client_transport
from ballast.v1 import queue_pb2, services_pb2_grpc, store_pb2
from services.planner.jobs import calibrate_job, prepare
from services.planner.plans import operations
from services.planner.queue import broker, durable
from services.planner.queue.publisher import Publisher
from services.runtime.metrics_http import serve_metrics
from services.runtime.store_client import remote_stores

log = logging.getLogger("ballast.worker")

TASK = "ballast.planner.run_request"
HOLD_ENV = "BALLAST_TEST_TASK_HOLD_S"  # test hooks: hold a task open before / after its handler ran
HOLD_AFTER_ENV = "BALLAST_TEST_TASK_HOLD_AFTER_S"
PROFILE_TIMEOUT_S = 3600.0  # a job's profile is measured inside the call

# The planner's queued work: registered here, by the app that runs it, so the queue imports no handler.
durable.register(operations.KIND, operations.run_plan)
durable.register(prepare.KIND, prepare.prepare_job)
durable.register(calibrate_job.KIND, calibrate_job.calibrate_after)
broker.install()  # the embedded broker's leaner publish (queue/broker.py)


def make_app(settings: Settings) -> Celery:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    sqlite_broker_wal(settings.broker_url)
    prepare.CALIBRATION.min_iterations = settings.calibration_min_iterations
    app = Celery("ballast", broker=settings.broker_url, set_as_current=False)
    # kombu's SQLAlchemy transport hands its options to create_engine and never redelivers anyway.
    sqla = settings.broker_url.startswith("sqla+")
    transport = {} if sqla else {"visibility_timeout": int(settings.visibility_timeout_s)}
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        worker_pool="solo",
        task_default_queue=settings.queue,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        enable_utc=True,
    )
    app.task(name=TASK, bind=False)(_run_request)
    return app


_WORKER: dict[str, object] = {}


def configure_worker(settings: Settings) -> None:
    """The settings tasks in this process use (`ballast worker --data-dir D` must mean D, not the env)."""
    _, platform = remote_stores(settings)
    profiler = services_pb2_grpc.ProfilerServiceStub(
        open_channel(settings.address("profiler"), settings.resolved_token(), timeout=PROFILE_TIMEOUT_S,
                     transport=client_transport(settings)))
    _WORKER.update(settings=settings, store=platform, profiler=profiler,
                   name=f"{socket.gethostname()}:{os.getpid()}")


def _run_request(request_id: str) -> None:
    if not _WORKER:
        configure_worker(load_settings())
    settings, store, worker = _WORKER["settings"], _WORKER["store"], _WORKER["name"]
    durable.run_request(store, request_id, worker, settings.lease_seconds, float(os.environ.get(HOLD_ENV, "0")),
                      float(os.environ.get(HOLD_AFTER_ENV, "0")), profiler=_WORKER["profiler"])


def sqlite_broker_wal(broker_url: str) -> None:
    """Put the embedded broker's SQLite file in WAL mode (it stays so): the worker's polls then never hold
    off a publish's commit, as they do in SQLite's default rollback journal."""
    if not broker_url.startswith("sqla+sqlite:"):
        return
    path = sa.engine.make_url(broker_url.removeprefix("sqla+")).database
    if not path or path == ":memory:":
        return
    try:
        conn = sqlite3.connect(path, timeout=5.0)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
        finally:
            conn.close()
    except sqlite3.OperationalError as exc:  # another process holds it now: the next start switches it
        log.warning("could not put the broker in WAL mode: %s", exc)


def sender(app: Celery, queue_name: str) -> Publisher:
    """A started `send(request_id)` that puts request ids on the planner queue from a thread of its own
    (queue/publisher.py: the caller does not wait for the broker; a failed publish is retried). One thread also
    means this process's publishes go one at a time, which the embedded SQLite broker needs: concurrent writers
    would each wait in SQLite's busy handler, which sleeps in growing steps (up to 100 ms) however soon the lock
    frees."""

    def publish(request_id: str) -> None:
        app.send_task(TASK, args=[request_id], queue=queue_name)

    publisher = Publisher(publish)
    publisher.start()
    return publisher


class WorkerHeartbeat(threading.Thread):
    """Writes the worker's liveness to the store, so `ballast status` needs no broker broadcast."""

    def __init__(self, settings: Settings, name: str):
        super().__init__(name="worker-heartbeat", daemon=True)
        _, self._store = remote_stores(settings)
        self._interval = settings.worker_heartbeat_s
        self._name = name
        self._queue = settings.queue
        self._stop = threading.Event()

    def beat(self) -> None:
        beat = queue_pb2.WorkerHeartbeat(name=self._name, pid=os.getpid(), queues=[self._queue])
        beat.seen_at.GetCurrentTime()
        self._store.record_worker_heartbeat(store_pb2.RecordWorkerHeartbeatRequest(heartbeat=beat))

    def run(self) -> None:
        while True:
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - the store may be restarting
                log.warning("heartbeat failed: %s", exc)
            if self._stop.wait(self._interval):
                return

    def stop(self) -> None:
        self._stop.set()


def run_worker(settings: Settings) -> int:
    """Run a real Celery worker in this process (solo pool: one request at a time)."""
    app = make_app(settings)
    configure_worker(settings)
    name = f"planner@{socket.gethostname()}-{os.getpid()}"
    heartbeat = WorkerHeartbeat(settings, name)
    heartbeat.start()
    stop_metrics = serve_metrics(settings, settings.worker_metrics_port, "worker")
    try:
        app.worker_main(["worker", "--pool", "solo", "--concurrency", "1", "-Q", settings.queue, "-n", name,
                         "--loglevel", settings.log_level, "--without-gossip", "--without-mingle"])
    finally:
        heartbeat.stop()
        stop_metrics()
    return 0
