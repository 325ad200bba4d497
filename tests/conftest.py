"""Shared fixtures: fresh databases on SQLite and PostgreSQL, Redis URLs.

PostgreSQL and Redis are real servers. Outside CI a developer without them gets a skip that
says how to start them; under CI (CI=true) their absence is a failure, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

PG_ADMIN_URL = os.environ.get(
    "BALLAST_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("BALLAST_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url.replace("+psycopg", ""))
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), 1.0):
            return True
    except OSError:
        return False


def require_service(name: str, url: str, port: int, how: str) -> None:
    """Fail under CI, skip with instructions elsewhere, when a real service is down."""
    if _reachable(url, port):
        return
    message = f"{name} not reachable at {url}; start it with: {how}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def require_postgres() -> None:
    require_service(
        "PostgreSQL", PG_ADMIN_URL, 5432, "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
    )


def require_redis() -> None:
    require_service("Redis", REDIS_URL, 6379, "redis-server --daemonize yes --port 6379")


def create_postgres_database() -> str:
    """Create an empty PostgreSQL database and return its URL."""
    import sqlalchemy as sa

    name = f"ballast_t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


def drop_postgres_database(url: str) -> None:
    import sqlalchemy as sa

    name = url.rsplit("/", 1)[1]
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@contextlib.contextmanager
def fresh_database(kind: str, tmp_path) -> Iterator[str]:
    """The URL of a new, empty database (no tables) of `kind` ("sqlite" or "postgresql"), dropped after."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'ballast.db'}"
        return
    require_postgres()
    url = create_postgres_database()
    try:
        yield url
    finally:
        drop_postgres_database(url)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_database_url(request, tmp_path) -> Iterator[str]:
    """A fresh, empty database on each backend (no tables)."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres), "remote"])
def store_backend(request) -> str:
    """Which store a `store` test runs against: the Repository in-process on SQLite or PostgreSQL, or a
    real store server over SQLite on a loopback port. Parametrize it (indirectly) to narrow a test."""
    return request.param


@pytest.fixture
def store(store_backend, tmp_path):
    """A migrated store with an admin and tenants team-a, team-b, on `store_backend` (tests/store_fixtures.py)."""
    from tests.store_fixtures import open_store  # imported here: only store tests pay for it

    with fresh_database("postgresql" if store_backend == "postgresql" else "sqlite", tmp_path) as url:
        with open_store(url, store_backend, tmp_path) as st:
            yield st


@pytest.fixture
def redis_url() -> str:
    require_redis()
    return REDIS_URL


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, as profiling and executor workers use: deterministic sums, no oversubscription."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
