"""Engine construction: one place that knows how each backend must be configured.

SQLite (embedded mode) needs WAL, enforced foreign keys, a busy timeout and BEGIN IMMEDIATE for
writes so concurrent writers queue instead of failing, while reads begin deferred so WAL lets them
run beside a writer; PostgreSQL needs the psycopg 3 driver and pre-ping so a restarted server does
not surface as a broken pooled connection.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

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


def session_factory(engine: sa.Engine, *, read_only: bool = False) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit (protos are built after the transaction).

    `read_only` sessions must not write: on SQLite they hold no lock, so a write would fail with
    SQLITE_BUSY rather than wait. Unmarked connections stay write transactions, the safe default.
    """
    bind = engine.execution_options(**{READ_ONLY: True}) if read_only else engine
    return sessionmaker(bind=bind, expire_on_commit=False)
