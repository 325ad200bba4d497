"""The embedded broker's leaner publish (services/planner/queue/broker.py) against kombu's own consumer.

The worker reads with kombu's unchanged `_get`; these tests read the same way, so a message this transport
writes that kombu could not deliver (a column it expects, the order it polls in) fails here. The real worker
round trip is tests/planner/queue/test_round_trip.py.
"""

from __future__ import annotations

import base64
import json
import sqlite3
from pathlib import Path

import pytest
from kombu.transport.sqlalchemy import Channel as KombuChannel

from services.planner.celery_app import TASK, make_app
from services.planner.queue import broker
from tests.harness import make_settings


def _ids(channel, queue: str) -> list[str]:
    """Every request id on `queue`, taken the way the worker takes them (kombu's `_get`)."""
    ids = []
    while True:
        try:
            message = KombuChannel._get(channel, queue)
        except Exception as exc:  # noqa: BLE001 - kombu's Empty ends the queue
            assert type(exc).__name__ == "Empty", exc
            return ids
        assert message["headers"]["task"] == TASK
        args, _, _ = json.loads(base64.b64decode(message["body"]))
        ids.append(args[0])


def test_a_publish_is_one_row_kombus_consumer_delivers_in_order(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    app = make_app(settings)
    sent = [f"req-{i:04d}" for i in range(25)]
    for request_id in sent:
        app.send_task(TASK, args=[request_id], queue=settings.queue)
    with app.connection_for_read() as conn:
        assert isinstance(conn.transport, broker.Transport)
        channel = conn.channel()
        assert channel._size(settings.queue) == len(sent)
        assert _ids(channel, settings.queue) == sent
        assert channel._size(settings.queue) == 0


def test_queues_keep_their_own_messages_and_a_purge_leaves_publishing_working(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    app = make_app(settings)
    for queue, ids in (("q-one", ["a1", "a2"]), ("q-two", ["b1"])):
        for request_id in ids:
            app.send_task(TASK, args=[request_id], queue=queue)
    with app.connection_for_read() as conn:
        channel = conn.channel()
        assert _ids(channel, "q-two") == ["b1"]
        assert channel._purge("q-one") == 2
    app.send_task(TASK, args=["a3"], queue="q-one")
    with app.connection_for_read() as conn:
        assert _ids(conn.channel(), "q-one") == ["a3"]


def test_a_publish_that_cannot_be_stored_raises_and_stores_nothing(tmp_path: Path) -> None:
    """The publisher thread retries what raises (queue/publisher.py), so a failed insert must raise."""
    settings = make_settings(tmp_path)
    app = make_app(settings)
    app.send_task(TASK, args=["first"], queue=settings.queue)
    path = settings.data_dir / "broker.db"
    with sqlite3.connect(path) as db:  # a column the insert needs, gone: every publish must now fail
        db.execute("ALTER TABLE kombu_message RENAME COLUMN payload TO gone")
    with pytest.raises(Exception, match="payload"):
        app.send_task(TASK, args=["second"], queue=settings.queue, retry=False)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM kombu_message").fetchone()[0] == 1


def _declare(url: str, queue: str, at: float) -> int:
    """In a process of its own, as a planner or a worker starting: declare `queue` on the broker at `at`."""
    import time

    from kombu import Connection

    broker.install()
    time.sleep(max(0.0, at - time.time()))
    with Connection(url) as connection:
        connection.default_channel.queue_declare(queue)
        return connection.default_channel._get_or_create(queue).id


def test_processes_starting_together_on_a_fresh_broker_all_declare_its_queue(tmp_path: Path) -> None:
    """kombu guards its tables and queue row with a lock of its own process: the loser of a race between a
    planner and a worker on a fresh broker file failed ("already exists", a UNIQUE name) and the worker exited."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_declare, [f"sqla+sqlite:///{tmp_path}/warm.db"] * 4, ["q"] * 4, [0.0] * 4))  # imports done
        for round_ in range(8):
            path = tmp_path / f"broker-{round_}.db"
            at = time.time() + 0.3
            ids = list(pool.map(_declare, [f"sqla+sqlite:///{path}"] * 4, ["q"] * 4, [at] * 4))
            assert len(set(ids)) == 1  # every process found the one row, whoever made it
            with sqlite3.connect(path) as db:
                assert db.execute("SELECT count(*) FROM kombu_queue WHERE name = 'q'").fetchone() == (1,)
