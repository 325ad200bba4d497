"""Degraded hosts (Varuna §4.6): a fail-stutter host keeps its heartbeat while computing slower than its peers.

Such a host looks healthy to every liveness check, so only measurements can catch it, and only a person (or a
probe) can vouch for it again. Hence the mark lives beside the host's state rather than in it: heartbeats and
re-registration, which rewrite the state every few seconds, never touch it; only ClearHostDegraded does.
Every mark keeps its evidence in host_degradations, cleared rows included, so a host that keeps coming back
slow shows in `ballast sql`; the current mark is also on the host row, so reading a host needs no join.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from ballast.v1 import fleet_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.store import models as m
from services.store.repo.base import RepositoryBase, fit, new_id, quote
from services.store.repo.hosts import HOST_LOAD, host_pb

EVIDENCE_FIX = 'send a JSON object, e.g. {"rank": 1, "ratio": 2.0}, or nothing'


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_evidence(text: str) -> dict[str, Any]:
    """evidence_json as the object stored; NaN/Infinity and NUL characters are refused, since PostgreSQL's
    JSONB cannot hold them and SQLite would store what PostgreSQL refuses."""
    if not text:
        return {}
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise InvalidArgument(f"not valid JSON: {exc}", field="evidence_json", fix=EVIDENCE_FIX) from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"a JSON {type(value).__name__}, not an object", field="evidence_json",
                              fix=EVIDENCE_FIX)
    if _has_nul(value):
        raise InvalidArgument("contains a NUL character", field="evidence_json", fix="remove the \\u0000")
    return value


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return isinstance(value, list) and any(_has_nul(v) for v in value)


class DegradedStore(RepositoryBase):
    """MarkHostDegraded and ClearHostDegraded, both for the platform admin (the planner or an operator)."""

    def _host(self, s: Session, host_id: str) -> m.Host:
        return self._one(s, m.Host, host_id, None, what="host", lock=True, options=HOST_LOAD)

    def mark_host_degraded(self, p: Principal, req: store_pb2.MarkHostDegradedRequest) -> fleet_pb2.Host:
        """A second mark of a degraded host adds its evidence and takes its reason, keeping degraded_at: the
        host has been slow since the first."""
        self._require_admin(p, "marking a host degraded")
        if not req.reason.strip():
            raise InvalidArgument("reason is not set", field="reason",
                                  fix='say why, e.g. "rank 1 computed 2.0x its peers\' time over 10 iterations"')
        reason = fit(m.HostDegradation.reason, req.reason, "reason")
        evidence = parse_evidence(req.evidence_json)
        with self._tx(write=True) as s:
            host = self._host(s, req.id)
            job_id = self._job(s, p, req.job_id).id if req.job_id else None
            now = self.now()
            s.add(m.HostDegradation(id=new_id("hdg"), host_id=host.id, job_id=job_id, reason=reason,
                                    evidence=evidence, marked_at=now))
            host.degraded_reason = reason
            host.changed_at = now
            if host.degraded_at is None:
                host.degraded_at = now
            s.flush()
            return host_pb(host)

    def clear_host_degraded(self, p: Principal, req: store_pb2.ClearHostDegradedRequest) -> fleet_pb2.Host:
        """Every open mark of the host is closed with who cleared it and why."""
        self._require_admin(p, "clearing a host's degraded mark")
        reason = fit(m.HostDegradation.cleared_reason, req.reason, "reason")
        with self._tx(write=True) as s:
            host = self._host(s, req.id)
            if host.degraded_at is None:
                raise FailedPrecondition(f"host {quote(host.name)} has no degraded mark to clear", field="id",
                                         fix="it is not marked degraded; `ballast fleet` shows which hosts are")
            now = self.now()
            s.execute(sa.update(m.HostDegradation)
                      .where(m.HostDegradation.host_id == host.id, m.HostDegradation.cleared_at.is_(None))
                      .values(cleared_at=now, cleared_reason=reason, cleared_by=p.tenant_id))
            host.degraded_reason, host.degraded_at, host.changed_at = None, None, now
            s.flush()
            return host_pb(host)
