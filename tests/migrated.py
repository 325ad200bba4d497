"""Migrated databases for store tests, made once per test process and handed out clean to each test.

Migrating a database (alembic, every revision) cost a store test most of its time: ~0.4 s of a ~0.5 s SQLite
test, and creating, migrating and force-dropping a PostgreSQL database ~1 s. Each test still gets a database of
its own that no other test touched: SQLite is a copy of a file migrated once; PostgreSQL is one database per test
process, emptied between tests (its sessions ended, every table truncated, identities restarted). A test that
changed the schema (a table created or dropped) gets a freshly migrated one instead of the changed one. Tests of
the migrations themselves keep using `fresh_database` (empty, no tables).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

KEEP = frozenset({"alembic_version"})


class MigratedDatabases:
    """`create`, `drop` and `require` make, drop and check for a PostgreSQL database (tests/conftest.py's)."""

    def __init__(self, root: Path, create: Callable[[], str], drop: Callable[[str], None],
                 require: Callable[[], None]) -> None:
        self._root, self._template, self._postgres, self._tables = root, None, "", frozenset()
        self._create, self._drop, self._require = create, drop, require

    @contextlib.contextmanager
    def clean(self, kind: str, tmp_path: Path) -> Iterator[str]:
        """The URL of a migrated database of `kind` ("sqlite" or "postgresql") with no rows."""
        if kind == "sqlite":
            target = tmp_path / "ballast.db"
            shutil.copyfile(self._sqlite_template(), target)
            yield f"sqlite:///{target}"
            return
        self._require()
        yield self._clean_postgres()

    def close(self) -> None:
        if self._postgres:
            self._drop(self._postgres)
            self._postgres = ""

    def _sqlite_template(self) -> Path:
        if self._template is None:
            from services.store import schema

            path = self._root / "migrated-template.db"
            schema.upgrade(f"sqlite:///{path}")
            engine = sa.create_engine(f"sqlite:///{path}", poolclass=NullPool)
            with engine.connect() as conn:  # one file: fold the write-ahead log in, so a copy is the whole database
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                conn.exec_driver_sql("PRAGMA journal_mode=DELETE")
            engine.dispose()
            self._template = path
        return self._template

    def _clean_postgres(self) -> str:
        if self._postgres:
            with contextlib.suppress(sa.exc.DBAPIError):  # one that cannot be emptied is replaced below
                if self._emptied(self._postgres):
                    return self._postgres
            self.close()
        from services.store import schema

        url = self._create()
        schema.upgrade(url)
        self._postgres, self._tables = url, self._table_names(url)
        return url

    def _emptied(self, url: str) -> bool:
        """End every other session on the database and truncate its tables; False if its schema changed."""
        engine = sa.create_engine(url, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                     "WHERE datname = current_database() AND pid <> pg_backend_pid()"))
                if frozenset(sa.inspect(conn).get_table_names()) != self._tables:
                    return False
                conn.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
                names = ", ".join(f'"{t}"' for t in sorted(self._tables - KEEP))
                conn.execute(sa.text(f"TRUNCATE TABLE {names} RESTART IDENTITY CASCADE"))
            return True
        finally:
            engine.dispose()

    @staticmethod
    def _table_names(url: str) -> frozenset[str]:
        engine = sa.create_engine(url, poolclass=NullPool)
        try:
            return frozenset(sa.inspect(engine).get_table_names())
        finally:
            engine.dispose()
