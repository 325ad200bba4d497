"""Who a call runs as. Plain data, shared by the store's repository and the interceptors."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# TenantRole names (common.proto), as the store keeps them
MEMBER, VIEWER, ADMIN = "TENANT_ROLE_MEMBER", "TENANT_ROLE_VIEWER", "TENANT_ROLE_ADMIN"


@dataclass(frozen=True)
class Principal:
    tenant_id: str
    tenant_name: str
    admin: bool = False
    viewer: bool = False  # reads what the admin reads through the API and changes nothing (dashboards)

    @property
    def reads_all(self) -> bool:
        """Sees every tenant's rows: the admin, and viewers."""
        return self.admin or self.viewer

    @property
    def role(self) -> str:
        return ADMIN if self.admin else VIEWER if self.viewer else MEMBER

    @classmethod
    def of(cls, tenant_id: str, tenant_name: str, role: str) -> Principal:
        return cls(tenant_id, tenant_name, admin=role == ADMIN, viewer=role == VIEWER)


def new_token() -> str:
    """A bearer token: 256 random bits, URL-safe."""
    return "blt_" + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """Only the SHA-256 of a token is stored, so a leaked database leaks no credentials."""
    return hashlib.sha256(token.encode()).hexdigest()


class PrincipalCache:
    """Resolved tokens, trusted for `ttl_s` seconds without asking again (a database read on the store, a
    round trip to it elsewhere, on every call otherwise); keyed by the token's hash, thread-safe.

    `forget` drops a tenant's entries (a rotated token) or all; a resolution that began before a forget is
    not cached (`stamp` then `put`), so a reader racing a rotation cannot bring the old token back."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_entries, self.clock = ttl_s, max_entries, clock
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._generation = 0
        self._lock = threading.Lock()

    def get(self, token: str) -> Principal | None:
        with self._lock:
            hit = self._entries.get(hash_token(token))
        return hit[1] if hit is not None and hit[0] > self.clock() else None

    def stamp(self) -> int:
        with self._lock:
            return self._generation

    def put(self, token: str, principal: Principal, stamp: int) -> None:
        now = self.clock()
        with self._lock:
            if stamp != self._generation:
                return
            if len(self._entries) >= self.max_entries:
                self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
            self._entries[hash_token(token)] = (now + self.ttl_s, principal)

    def forget(self, tenant_id: str | None = None) -> None:
        with self._lock:
            self._generation += 1
            self._entries = {k: v for k, v in self._entries.items()
                             if tenant_id is not None and v[1].tenant_id != tenant_id}
