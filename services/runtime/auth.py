"""Who a call runs as. Plain data, shared by the store's repository and the interceptors."""

from __future__ import annotations

import hashlib
import secrets
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
