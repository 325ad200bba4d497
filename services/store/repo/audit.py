"""The audit log: every state-changing call as a row (who, what, when, the result).

The servers record their calls (services/runtime/audit.py); the store keeps them. A batch sent again after a
lost reply is stored once (each record's uid is unique). A member reads its own tenant's records, the admin and
viewers everyone's; a refused caller's records (no tenant) are the admin's and viewers' to read.
"""

from __future__ import annotations

import sqlalchemy as sa

from ballast.v1 import store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import InvalidArgument
from services.store import models as m
from services.store.convert import shared_fields, to_datetime
from services.store.repo.base import RepositoryBase

MAX_RECORDS = 1000


def audit_pb(row: m.AuditRecord) -> store_pb2.AuditRecord:
    return store_pb2.AuditRecord(**shared_fields(row, store_pb2.AuditRecord))


class AuditStore(RepositoryBase):
    def record_audit(self, p: Principal, req: store_pb2.RecordAuditRequest) -> store_pb2.RecordAuditResponse:
        self._require_admin(p, "recording audit records")
        if len(req.records) > MAX_RECORDS:
            raise InvalidArgument(f"{len(req.records)} records", field="records",
                                  fix=f"send at most {MAX_RECORDS} records per call")
        rows = []
        for i, record in enumerate(req.records):
            where = f"records[{i}]"
            if not record.uid:
                raise InvalidArgument("required", field=f"{where}.uid", fix="set a unique id per record")
            if not record.service or not record.method:
                raise InvalidArgument("required", field=f"{where}.method", fix="name the service and method called")
            row = shared_fields(record, m.AuditRecord, skip=("id",), field=where)
            row["message"] = record.message[:500]
            row["at"] = to_datetime(record.at, f"{where}.at") if record.HasField("at") else self.now()
            rows.append(row)
        if not rows:
            return store_pb2.RecordAuditResponse()
        with self._tx(write=True) as s:
            # Rows as executemany parameters, not .values(rows): a multi-row VALUES is a new statement to compile
            # for every batch size, and compiling it was 5% of a loaded store's CPU.
            stored = s.execute(self._insert(m.AuditRecord.__table__)
                               .on_conflict_do_nothing(index_elements=["uid"]).returning(m.AuditRecord.id), rows)
            return store_pb2.RecordAuditResponse(recorded=len(stored.all()))

    def list_audit(self, p: Principal, req: store_pb2.ListAuditRequest) -> store_pb2.ListAuditResponse:
        stmt = sa.select(m.AuditRecord).order_by(m.AuditRecord.id.desc())
        if not p.reads_all:
            stmt = stmt.where(m.AuditRecord.tenant_id == p.tenant_id)
        if req.tenant_id:
            stmt = stmt.where(m.AuditRecord.tenant_id == req.tenant_id)
        if req.method:
            stmt = stmt.where(m.AuditRecord.method == req.method)
        if req.HasField("since"):
            stmt = stmt.where(m.AuditRecord.at >= to_datetime(req.since, "since"))
        records, token = self._page_of(stmt, req.page, audit_pb)
        return store_pb2.ListAuditResponse(records=records, next_page_token=token)
