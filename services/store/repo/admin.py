"""The admin's window on the store itself: read-only SQL over the database and the schema status."""

from __future__ import annotations

from google.protobuf import struct_pb2, timestamp_pb2

from ballast.v1 import store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import PermissionDenied
from services.store import schema, sql
from services.store.repo.base import RepositoryBase


def exact(value: object) -> object:
    """ListValue numbers are doubles: integers beyond 2**53 travel as strings so no digit is lost."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        return str(value)
    return value


class AdminStore(RepositoryBase):
    """Query runs on `sql_engine` (on PostgreSQL a read-only login), so the database enforces read-only."""

    def query(self, p: Principal, req: store_pb2.QueryRequest) -> store_pb2.QueryResponse:
        if not p.admin:
            raise PermissionDenied("SQL queries are for the platform admin", fix="use an admin token")
        result = sql.run_readonly_query(self.sql_engine, req.sql, row_limit=req.row_limit, timeout_s=req.timeout_s)
        rows = []
        for row in result.rows:
            value = struct_pb2.ListValue()
            value.extend([exact(v) for v in row])
            rows.append(value)
        return store_pb2.QueryResponse(columns=result.columns, rows=rows, truncated=result.truncated)

    def get_schema_status(self, p: Principal, req: store_pb2.SchemaStatusRequest) -> store_pb2.SchemaStatus:
        """Any caller may ask; `now` is the store's clock."""
        now = timestamp_pb2.Timestamp()
        now.FromDatetime(self.now())
        return store_pb2.SchemaStatus(
            current_revision=schema.current_revision(self.engine) or "",
            head_revision=schema.head_revision(),
            dialect=self.engine.dialect.name,
            now=now,
        )
