"""Engine construction: one place that knows how each backend must be configured.

SQLite (embedded mode) needs WAL, enforced foreign keys, a busy timeout and BEGIN IMMEDIATE for
writes so concurrent writers queue instead of failing, while reads begin deferred so WAL lets them
run beside a writer; PostgreSQL needs the psycopg 3 driver and pre-ping so a restarted server does
not surface as a broken pooled connection.
"""

from __future__ import annotations

import logging
import threading

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("ballast.store")

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Execution option marking a connection's transactions read-only: on SQLite they BEGIN deferred.
READ_ONLY = "ballast_read_only"


def normalize_url(url: str) -> str:
    """Accept plain `postgresql://` URLs and pin the psycopg 3 driver."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    if url.startswith("postgres://"):
        return "postgresql+psycopg://" + url[len("postgres://") :]
    return url


def is_sqlite(url: str) -> bool:
    return normalize_url(url).startswith("sqlite")


def create_engine(url: str) -> sa.Engine:
    """An engine configured for the backend named by `url`."""
    url = normalize_url(url)
    if not is_sqlite(url):
        return sa.create_engine(url, pool_pre_ping=True)
    engine = sa.create_engine(url, connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        # Let SQLAlchemy emit BEGIN itself (pysqlite's implicit BEGIN is deferred and unreliable).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        # A write takes the lock up front: a deferred transaction that reads then writes fails with
        # SQLITE_BUSY instead of waiting when another writer committed in between. A read never
        # upgrades, so it begins deferred and reads its WAL snapshot without waiting for writers.
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")

    return engine


class WalCheckpointer(threading.Thread):
    """Checkpoints a SQLite WAL every `interval_s` on its own connection. Left to SQLite, the commit that takes
    the WAL past 1000 pages copies them into the database and syncs it before it returns, and every writer
    queued behind that commit waits as long (tens of ms under load); a checkpoint beside the writers holds
    none of them up."""

    def __init__(self, engine: sa.Engine, interval_s: float):
        super().__init__(name="wal-checkpointer", daemon=True)
        self.engine, self.interval_s = engine, interval_s
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                conn = self.engine.raw_connection()  # no SQLAlchemy transaction: it would BEGIN IMMEDIATE
                try:
                    conn.cursor().execute("PRAGMA wal_checkpoint(PASSIVE)")
                finally:
                    conn.close()
            except Exception as exc:  # noqa: BLE001 - a missed checkpoint is made up by the next one
                log.warning("WAL checkpoint failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()


def checkpoint_in_background(engine: sa.Engine, interval_s: float = 1.0) -> WalCheckpointer | None:
    """For a SQLite engine: its connections no longer checkpoint as they commit, a started WalCheckpointer
    does (stop it before disposing of the engine); None for any other database."""
    if engine.dialect.name != "sqlite":
        return None

    @event.listens_for(engine, "connect")
    def _no_autocheckpoint(dbapi_conn, _record) -> None:
        dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")

    engine.dispose()  # connections opened before now are replaced by ones that have it
    checkpointer = WalCheckpointer(engine, interval_s)
    checkpointer.start()
    return checkpointer


def session_factory(engine: sa.Engine, *, read_only: bool = False) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit (protos are built after the transaction).

    `read_only` sessions must not write: on SQLite they hold no lock, so a write would fail with
    SQLITE_BUSY rather than wait. Unmarked connections stay write transactions, the safe default.
    """
    bind = engine.execution_options(**{READ_ONLY: True}) if read_only else engine
    return sessionmaker(bind=bind, expire_on_commit=False)
