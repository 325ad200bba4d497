"""Schema migrations as a library: what `ballast db upgrade` and the services' startup check call.

The migrations directory is located relative to this file so an installed package works.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.pool import NullPool

from services.runtime.errors import FailedPrecondition, SchemaOutOfDate
from services.store.db import normalize_url

_HERE = Path(__file__).resolve().parent


def alembic_config(url: str | None) -> Config:
    """An Alembic config for `url` (None: only for reading the revision graph)."""
    cfg = Config(str(_HERE / "alembic.ini"))
    cfg.set_main_option("script_location", str(_HERE / "migrations"))
    if url:
        url = normalize_url(url)
        cfg.attributes["url"] = url
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    ensure_sqlite_directory(url)
    current = current_revision(url)
    if current is not None and current not in known_revisions():
        raise FailedPrecondition(
            f"database schema is at revision {current}, newer than this build knows (head {head_revision()})",
            fix="upgrade Ballast itself; this build cannot migrate that database",
        )
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config(None)).get_current_head()
    assert head is not None, "no migrations found"
    return head


def current_revision(url_or_engine: str | sa.Engine) -> str | None:
    """The revision stamped in the database; None for an empty (never migrated) database."""
    if isinstance(url_or_engine, sa.Engine):
        engine, owned = url_or_engine, False
    else:
        engine, owned = sa.create_engine(normalize_url(url_or_engine), poolclass=NullPool), True
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        if owned:
            engine.dispose()


def known_revisions() -> set[str]:
    return {rev.revision for rev in ScriptDirectory.from_config(alembic_config(None)).walk_revisions()}


def check_schema(engine: sa.Engine) -> None:
    """Refuse to serve on a database that is not at this build's head revision."""
    current, head = current_revision(engine), head_revision()
    if current is not None and current not in known_revisions():
        raise FailedPrecondition(
            f"database schema is at revision {current}, newer than this build knows (head {head})",
            fix="run the Ballast version that migrated it, or downgrade the database with that version",
        )
    if current != head:
        raise SchemaOutOfDate(current, head)


def ensure_sqlite_directory(url: str) -> None:
    """SQLite creates the file but not its directory: make it, so a fresh data dir just works."""
    parsed = sa.make_url(normalize_url(url))
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def set_readonly_password(url: str, password: str) -> bool:
    """Give the read-only SQL login a password (PostgreSQL), so BALLAST_SQL_DATABASE_URL can use it
    under password authentication. Returns False on SQLite, which has no roles."""
    from psycopg import sql as pgsql

    from services.store.sql import READONLY_ROLE

    engine = sa.create_engine(normalize_url(url), poolclass=NullPool)
    try:
        if engine.dialect.name != "postgresql":
            return False
        with engine.begin() as conn:
            statement = pgsql.SQL("ALTER ROLE {} PASSWORD {}").format(
                pgsql.Identifier(READONLY_ROLE), pgsql.Literal(password))
            conn.exec_driver_sql(statement.as_string(conn.connection.driver_connection))
        return True
    finally:
        engine.dispose()
