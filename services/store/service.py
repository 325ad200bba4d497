"""The store service: the only process that opens the database. A plain dispatch to Repository,
which has one method per RPC (services/store/repository.py)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from ballast.config import Settings
from ballast.transport import server_credentials
from ballast.v1 import store_pb2, store_pb2_grpc
from services.runtime.audit import AuditLog
from services.runtime.auth import Principal, PrincipalCache
from services.runtime.errors import FailedPrecondition, SchemaOutOfDate
from services.runtime.metrics_http import register_collector
from services.runtime.ratelimit import RateLimiter
from services.runtime.rpcs import changes_state
from services.runtime.server import Server, ServerSpec
from services.runtime.servicer import delegate
from services.specs.user_inputs import UserInputs
from services.store import schema, sql
from services.store.db import checkpoint_in_background, create_engine
from services.store.gate import CallGate
from services.store.gauges import StoreGauges
from services.store.repository import Repository

log = logging.getLogger("ballast.store")
SERVICE = store_pb2.DESCRIPTOR.services_by_name["StoreService"]
PLATFORM = Principal("", "store", admin=True)  # the store's own writes (its audit records)
READER_TTL_S = 1.0  # how long a read-only store trusts a resolved token (the primary forgets one at once)


def query_engine(settings: Settings, engine: sa.Engine) -> sa.Engine:
    """The engine `ballast sql` uses: on PostgreSQL a separate login as the read-only role."""
    if engine.dialect.name != "postgresql":
        return engine  # SQLite opens its own read-only connection per query
    return create_engine(settings.sql_database_url or sql.readonly_url(settings.database_url))


def refuse_writes(primary: str) -> dict[str, Callable[..., Any]]:
    """Handlers for a read-only store's state-changing RPCs: each refuses, naming where the write goes."""

    def refuse(name: str) -> Callable[..., Any]:
        def handler(request: Any, ctx: Any) -> Any:
            raise FailedPrecondition(f"this store process serves only reads; {name} changes state",
                                     fix=f"send it to the store at {primary}")
        return handler

    return {m.name: refuse(m.name) for m in SERVICE.methods if changes_state(m.name)}


def build_server(
    settings: Settings, engine: sa.Engine, address: str | None = None, repo: Repository | None = None,
    read_only: bool = False,
) -> Server:
    """A store server on `address` (default: the configured one; "127.0.0.1:0" picks a free port, then
    read `.port`); checks the schema first. `repo`, if given, must be over `engine` (tests pass one
    with a fake clock). `read_only` serves the read-only RPCs alone, beside a store that serves all of them
    over the same database (docs/architecture.md, "Store reads"); it writes only the audit rows of writes it refused."""
    if repo is not None and repo.engine is not engine:
        raise ValueError("the repository must be over the engine the server checks and disposes")
    schema.check_schema(engine)
    if repo is None:
        repo = Repository(
            engine, user_inputs=UserInputs.of_settings(settings), sql_engine=query_engine(settings, engine)
        )
    token = settings.resolved_token()
    if token and not read_only:
        repo.ensure_admin(token)
    if read_only:  # a rotation or revocation reaches the primary's cache at once, this one's within READER_TTL_S
        repo.principals = PrincipalCache(READER_TTL_S)
    servicer = delegate(SERVICE, repo, overrides=refuse_writes(settings.address("store")) if read_only else None)()
    checkpointer = None if read_only else checkpoint_in_background(engine)
    on_stop = [*([checkpointer.stop] if checkpointer else []), engine.dispose, repo.sql_engine.dispose]
    metrics_port = 0 if read_only else settings.store_metrics_port  # one metrics port per plane's store
    if metrics_port:  # the gauges join this process's registry only while it serves them
        on_stop.insert(0, register_collector("store", StoreGauges(engine, settings.data_dir)))
    port = settings.store_read_port if read_only else settings.store_port
    return Server(
        ServerSpec(
            name="store-read" if read_only else "store",
            address=address or f"{settings.host}:{port}",
            register=lambda s: store_pb2_grpc.add_StoreServiceServicer_to_server(servicer, s),
            services=[SERVICE.full_name],
            authenticate=repo.principal_for_token,
            on_stop=on_stop,
            credentials=server_credentials(settings),
            audit=AuditLog(lambda records: repo.record_audit(
                PLATFORM, store_pb2.RecordAuditRequest(records=records)), "store"),
            metrics_port=metrics_port,
            settings=settings,
            rate_limit=RateLimiter.of(settings),
            call_gate=CallGate(settings.store_background_wait_ms / 1000),
        )
    )


def main(settings: Settings, read_only: bool = False) -> int:
    schema.ensure_sqlite_directory(settings.database_url)
    engine = create_engine(settings.database_url)
    try:
        server = build_server(settings, engine, read_only=read_only)
    except (SchemaOutOfDate, FailedPrecondition) as exc:
        log.error("refusing to start: %s", exc)
        print(f"ballast store: {exc}", file=sys.stderr)
        return 2
    server.start()
    server.wait()
    return 0
