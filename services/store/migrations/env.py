"""Alembic environment: the URL (or an open connection) always comes from the caller.

`services.store.schema` sets `config.attributes["connection"]` or the `sqlalchemy.url` option;
there is deliberately no default database, so a migration can never hit the wrong one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context
from sqlalchemy.pool import NullPool

from services.store.db import normalize_url
from services.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass one via services.store.schema (BALLAST_DATABASE_URL)")
    return normalize_url(url)


def _configure(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_offline() -> None:
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    # A plain engine: on SQLite foreign keys stay off so batch table rebuilds cannot cascade deletes.
    engine = sa.create_engine(_url(), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
