"""Who a call runs as. Plain data, shared by the store's repository and the interceptors."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Principal:
    tenant_id: str
    tenant_name: str
    admin: bool = False


def new_token() -> str:
    """A bearer token: 256 random bits, URL-safe."""
    return "blt_" + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """Only the SHA-256 of a token is stored, so a leaked database leaks no credentials."""
    return hashlib.sha256(token.encode()).hexdigest()
