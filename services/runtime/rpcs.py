"""Which RPCs change state, by one rule for the whole plane: a viewer may call only the others, every call of
one is a row in the audit log, and the store client repeats only the others after a blip.

Reads are named Get…, List… or Watch…, plus a few that compute without storing (Compare, WhatIf, Inspect),
resolve a token (Authenticate) or run read-only SQL (Query). tests/runtime/test_audit.py lists every RPC that
changes state, so a new one is classified on purpose."""

from __future__ import annotations

from services.runtime.auth import Principal

READ_PREFIXES = ("Get", "List", "Watch")
READ_METHODS = frozenset({"Authenticate", "Query", "Compare", "WhatIf", "Inspect"})
# High-volume writes the platform's own services make, each a row that is its own record (a metric, an event, a
# heartbeat, a queue lease tick): audited only when someone other than the platform admin makes them.
PLATFORM_TELEMETRY = frozenset({
    "WriteIterationMetrics", "AppendJobEvent", "RecordWorkerHeartbeat", "RenewLease", "ReapExpiredLeases",
    "ClaimRequest", "RecordAudit", "TouchHosts",
})
# ...and the writes that are telemetry only in one form: a host's liveness tick (UpdateHostState heartbeat)
TELEMETRY_FORMS = {"UpdateHostState": lambda request: bool(getattr(request, "heartbeat", False))}


def split(full_method: str) -> tuple[str, str]:
    """'/ballast.v1.JobService/Submit' -> ('ballast.v1.JobService', 'Submit')."""
    service, _, method = full_method.lstrip("/").partition("/")
    return service, method


def changes_state(method: str) -> bool:
    """True for an RPC (bare method name) that writes."""
    return not (method.startswith(READ_PREFIXES) or method in READ_METHODS)


def audited(method: str, caller: Principal | None, request: object = None) -> bool:
    """Whether a finished call of `method` by `caller` (None: refused before we knew who) is an audit row."""
    if not changes_state(method):
        return False
    telemetry = method in PLATFORM_TELEMETRY or TELEMETRY_FORMS.get(method, lambda r: False)(request)
    return not (telemetry and caller is not None and caller.admin)
