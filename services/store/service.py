"""The store service: the only process that opens the database. A thin servicer over Repository."""

from __future__ import annotations

import logging
import sys

import sqlalchemy as sa
from google.protobuf import struct_pb2, timestamp_pb2

from ballast.config import Settings
from ballast.v1 import common_pb2, store_pb2, store_pb2_grpc
from services.runtime.context import current_principal
from services.runtime.errors import FailedPrecondition, PermissionDenied, SchemaOutOfDate
from services.runtime.server import Server, ServerSpec
from services.runtime.servicer import delegate
from services.store import schema, sql
from services.store.db import create_engine
from services.store.repository import Repository

log = logging.getLogger("ballast.store")
SERVICE = store_pb2.DESCRIPTOR.services_by_name["StoreService"]


def _query(engine: sa.Engine):
    def handler(request: store_pb2.QueryRequest, ctx) -> store_pb2.QueryResponse:
        if not current_principal().admin:
            raise PermissionDenied("SQL queries are for the platform admin", fix="use an admin token")
        result = sql.run_readonly_query(engine, request.sql, row_limit=request.row_limit, timeout_s=request.timeout_s)
        rows = []
        for row in result.rows:
            value = struct_pb2.ListValue()
            value.extend([_exact(v) for v in row])
            rows.append(value)
        return store_pb2.QueryResponse(columns=result.columns, rows=rows, truncated=result.truncated)

    return handler


def _exact(value: object) -> object:
    """ListValue numbers are doubles: integers beyond 2**53 travel as strings so no digit is lost."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        return str(value)
    return value


def _schema_status(engine: sa.Engine):
    def handler(request, ctx) -> store_pb2.SchemaStatus:
        now = timestamp_pb2.Timestamp()
        now.GetCurrentTime()
        return store_pb2.SchemaStatus(
            current_revision=schema.current_revision(engine) or "",
            head_revision=schema.head_revision(),
            dialect=engine.dialect.name,
            now=now,
        )

    return handler


def _authenticate(repo: Repository):
    def handler(request: store_pb2.AuthenticateRequest, ctx) -> common_pb2.Principal:
        p = repo.authenticate(request.token)
        return common_pb2.Principal(tenant_id=p.tenant_id, tenant_name=p.tenant_name, admin=p.admin)

    return handler


def query_engine(settings: Settings, engine: sa.Engine) -> sa.Engine:
    """The engine `ballast sql` uses: on PostgreSQL a separate login as the read-only role."""
    if engine.dialect.name != "postgresql":
        return engine  # SQLite opens its own read-only connection per query
    return create_engine(settings.sql_database_url or sql.readonly_url(settings.database_url))


def build_server(settings: Settings, engine: sa.Engine, address: str | None = None) -> Server:
    """A store server on `address` (default: the configured one); checks the schema first."""
    schema.check_schema(engine)
    readonly = query_engine(settings, engine)
    repo = Repository(engine, allowed_factories=settings.allowed_model_factories)
    token = settings.resolved_token()
    if token:
        repo.ensure_admin(token)
    servicer = delegate(
        SERVICE,
        repo,
        overrides={
            "Query": _query(readonly),
            "GetSchemaStatus": _schema_status(engine),
            "Authenticate": _authenticate(repo),
        },
    )()
    return Server(
        ServerSpec(
            name="store",
            address=address or f"{settings.host}:{settings.store_port}",
            register=lambda s: store_pb2_grpc.add_StoreServiceServicer_to_server(servicer, s),
            services=[SERVICE.full_name],
            authenticate=repo.authenticate,
            on_stop=[engine.dispose, readonly.dispose],
        )
    )


def main(settings: Settings) -> int:
    schema.ensure_sqlite_directory(settings.database_url)
    engine = create_engine(settings.database_url)
    try:
        server = build_server(settings, engine)
    except (SchemaOutOfDate, FailedPrecondition) as exc:
        log.error("refusing to start: %s", exc)
        print(f"ballast store: {exc}", file=sys.stderr)
        return 2
    server.start()
    server.wait()
    return 0
