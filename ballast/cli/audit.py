"""`ballast audit`: the audit log, newest first -- who changed what, when, and how it ended.

A member sees its own tenant's calls, the platform admin and viewers everyone's (the store decides). The
operator guide's "Roles and the audit log" (docs/operator-guide.md) has the SQL for anything this does not filter.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ballast.client import Client
from ballast.config import Settings
from ballast.v1 import common_pb2, store_pb2

console = Console()
err = Console(stderr=True)
ROLES = {"member": common_pb2.TENANT_ROLE_MEMBER, "viewer": common_pb2.TENANT_ROLE_VIEWER,
         "admin": common_pb2.TENANT_ROLE_ADMIN}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenant", default="", metavar="ID", help="only this tenant's calls (its id)")
    p.add_argument("--method", default="", metavar="NAME", help="only this method, e.g. Submit or CreateTenant")
    p.add_argument("--since", type=float, default=0, metavar="MINUTES", help="only the last MINUTES minutes")
    p.add_argument("--limit", type=int, default=50, help="at most this many records (default 50, at most 1000)")
    p.add_argument("--json", action="store_true", help="one JSON object per record")


def request(args: argparse.Namespace) -> store_pb2.ListAuditRequest:
    req = store_pb2.ListAuditRequest(tenant_id=args.tenant, method=args.method,
                                     page=common_pb2.PageRequest(page_size=max(1, min(args.limit, 1000))))
    if args.since > 0:
        req.since.FromSeconds(int(time.time() - args.since * 60))
    return req


def when(record: store_pb2.AuditRecord, today: str) -> str:
    """The time; the date too when it is not today (UTC)."""
    at = datetime.fromtimestamp(record.at.ToSeconds(), UTC)
    return at.strftime("%H:%M:%S" if at.strftime("%Y-%m-%d") == today else "%m-%d %H:%M")


def table(records: list[store_pb2.AuditRecord]) -> Table:
    """One line a record (the error text is in --json): the server column says which service answered."""
    out = Table()
    for name in ("UTC", "who", "role", "call", "target", "result", "ms", "server"):
        out.add_column(name, no_wrap=True, overflow="ellipsis", min_width=21 if name == "target" else None)
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    for r in records:
        role = common_pb2.TenantRole.Name(r.role).removeprefix("TENANT_ROLE_").lower() if r.role else "-"
        out.add_row(when(r, today), escape(r.tenant_name or "(refused)"), role, r.method, escape(r.target or "-"),
                    r.code, f"{r.duration_ms:.0f}", r.server)
    return out


def run(settings: Settings, args: argparse.Namespace) -> int:
    with Client.of(settings, ("store",)) as client:
        try:
            records = list(client.store.ListAudit(request(args)).records)
        except grpc.RpcError as exc:
            err.print(f"[red]error[/red] {exc.code().name}: {escape(exc.details() or '')}")
            return 1
    if args.json:
        for r in records:
            print(json.dumps(MessageToDict(r, preserving_proto_field_name=True)))
        return 0
    if not records:
        err.print("no audit records match")
        return 0
    console.print(table(records))
    return 0
