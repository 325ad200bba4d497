"""Who is visiting: the bearer token from `Authorization: Bearer` or the login cookie, checked by the store.

The token is the same one the gRPC API takes; the dashboard keeps no sessions of its own. The cookie is
HttpOnly (no script reads it), SameSite=Strict (no other site's page sends it) and Secure over HTTPS.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs

COOKIE = "ballast_token"
COOKIE_MAX_AGE_S = 12 * 3600
MAX_TOKEN_CHARS = 512
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


def bearer(authorization: str) -> str:
    """The token of an `Authorization: Bearer …` header ("" for none or another scheme)."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def token_of(headers: dict[str, str] | object, cookies: dict[str, str]) -> tuple[str, bool]:
    """(token, from_header): the header wins over the cookie."""
    header = bearer(headers.get("authorization", ""))  # type: ignore[union-attr]
    if header:
        return header, True
    return cookies.get(COOKIE, ""), False


def login_token(body: bytes) -> str:
    """The token field of the login form (application/x-www-form-urlencoded); ValueError when unusable."""
    try:
        fields = parse_qs(body.decode("ascii"), max_num_fields=4)
    except (UnicodeDecodeError, ValueError):
        raise ValueError("the login form must be URL-encoded ASCII") from None
    token = (fields.get("token") or [""])[0].strip()
    if not token:
        raise ValueError("paste a bearer token (`ballast tenant create NAME` prints one)")
    if len(token) > MAX_TOKEN_CHARS or not token.isprintable() or " " in token:
        raise ValueError("that is not a bearer token")
    return token


def safe_next(path: str) -> str:
    """Where to go after logging in: a path on this site only (no open redirect)."""
    if not path.startswith("/") or path.startswith("//") or "\\" in path or path.startswith("/login"):
        return "/"
    return path


def valid_id(value: str) -> bool:
    """Ids of jobs, plans and profiles: short, plain characters (anything else is refused before a call)."""
    return bool(_ID.match(value))
