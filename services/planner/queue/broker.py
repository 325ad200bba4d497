"""The embedded broker's transport: kombu's SQLAlchemy transport with a leaner publish.

Why: the planner publishes one message per submitted job, and kombu's own `_put` costs an ORM round per
message (look the queue row up again, add a Message object, flush it through the unit of work, commit). Under
the load benchmark that was 60% of the planner's Python time and 3.8 ms of CPU per publish on this VM. Here a
publish is one Core INSERT into kombu's own message table (same columns and values, so kombu's `_get` in the
worker reads it as it reads its own), with the queue's row id looked up once per queue name: kombu never
deletes a queue row, and a purge deletes messages only. Everything else (the worker's polls, the tables'
creation) is kombu's.
"""

from __future__ import annotations

import threading

import kombu.transport
import sqlalchemy as sa
from kombu.transport import sqlalchemy as kombu_sqla
from kombu.utils.json import dumps

RACES = 3  # tries at kombu's table creation: the tables exist after another process's first
ALIAS = "sqla"  # the broker URL's prefix (`sqla+sqlite:///…`) names this transport in every Ballast process


class Channel(kombu_sqla.Channel):
    _queue_ids: dict[tuple[str, str], int] = {}  # (database URL, queue name) -> kombu_queue.id
    _ids_lock = threading.Lock()

    # kombu guards its table creation and queue row with a lock of its process only. The planner and a worker
    # starting together on a fresh broker file both create: one CREATE TABLE fails "already exists", and one
    # queue INSERT fails the name's UNIQUE constraint, which a Celery worker takes as unrecoverable and exits
    # (CI saw a dashboard test's worker die so, leaving its job SUBMITTED). The loser reads what the winner made.
    def _open(self):  # noqa: ANN202 - kombu's signature
        for attempt in range(RACES):
            try:
                return super()._open()
            except sa.exc.OperationalError as exc:
                if "already exists" not in str(exc) or attempt == RACES - 1:
                    raise
        raise AssertionError("unreachable")

    def _get_or_create(self, queue: str):  # noqa: ANN202 - kombu's signature
        try:
            return super()._get_or_create(queue)
        except sa.exc.IntegrityError:
            self.session.rollback()
            return self.session.query(self.queue_cls).filter(self.queue_cls.name == queue).one()

    def _queue_id(self, queue: str) -> int:
        key = (str(self.connection.client.hostname), queue)
        known = self._queue_ids.get(key)
        if known is None:
            known = self._get_or_create(queue).id  # kombu's own lookup, which also creates the row
            with self._ids_lock:
                self._queue_ids[key] = known
        return known

    def _put(self, queue: str, payload: dict, **kwargs) -> None:
        engine, _ = self._open()
        table = self.message_cls.__table__
        with engine.begin() as conn:  # a failure rolls back and raises, as kombu's `_put` does
            conn.execute(sa.insert(table), {"visible": True, "payload": dumps(payload), "version": 1,
                                            "queue_id": self._queue_id(queue)})


class Transport(kombu_sqla.Transport):
    Channel = Channel


def install() -> None:
    """Make `sqla+…` broker URLs use this transport in this process (idempotent; before any connection, or
    kombu's resolved class stays cached)."""
    kombu.transport.TRANSPORT_ALIASES[ALIAS] = f"{__name__}:Transport"
    getattr(kombu.transport, "_transport_cache", {}).pop(ALIAS, None)
