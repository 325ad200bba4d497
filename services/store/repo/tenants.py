"""Tenants and bearer-token authentication: who a call runs as."""

from __future__ import annotations

import re

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from ballast.v1 import common_pb2, store_pb2
from ballast.v1.common_pb2 import TenantRole
from services.runtime.auth import ADMIN, MEMBER, Principal, hash_token, new_token
from services.runtime.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from services.store import models as m
from services.store.convert import shared_fields
from services.store.repo.base import RepositoryBase, new_id, quote

TENANT_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
UNAUTHENTICATED_FIX = "pass a bearer token from `ballast tenant create` or the embedded admin token"


def tenant_pb(row: m.Tenant) -> common_pb2.Tenant:
    return common_pb2.Tenant(**shared_fields(row, common_pb2.Tenant))


def principal_pb(p: Principal) -> common_pb2.Principal:
    return common_pb2.Principal(tenant_id=p.tenant_id, tenant_name=p.tenant_name, admin=p.admin,
                                role=TenantRole.Value(p.role))


def requested_role(req: store_pb2.CreateTenantRequest) -> str:
    """The role a CreateTenant asks for: `role`, or admin by the legacy flag; member when neither."""
    if req.role not in TenantRole.values():
        raise InvalidArgument(f"unknown role {req.role}", field="role",
                              fix="send TENANT_ROLE_MEMBER, TENANT_ROLE_VIEWER or TENANT_ROLE_ADMIN")
    role = TenantRole.Name(req.role) if req.role else (ADMIN if req.admin else MEMBER)
    if req.admin and role != ADMIN:
        raise InvalidArgument(f"admin is set but role is {role}", field="role",
                              fix="send role TENANT_ROLE_ADMIN, or leave admin unset")
    return role


class TenantStore(RepositoryBase):
    """Tenant RPCs; only a token's hash is stored, so the store cannot leak tokens."""

    def create_tenant(self, p: Principal, req: store_pb2.CreateTenantRequest) -> store_pb2.CreateTenantResponse:
        self._require_admin(p, "creating tenants")
        if not TENANT_NAME_RE.match(req.name):
            raise InvalidArgument(
                f"invalid tenant name {quote(req.name)}",
                field="name",
                fix="use 1-63 lowercase letters, digits and dashes; start and end with a letter or digit",
            )
        role = requested_role(req)
        token = new_token()
        try:
            with self._tx(write=True) as s:
                if s.scalars(sa.select(m.Tenant.id).where(m.Tenant.name == req.name)).first():
                    raise AlreadyExists(f"tenant {req.name!r} already exists", field="name", fix="pick another name")
                row = m.Tenant(
                    id=new_id("tnt"),
                    name=req.name,
                    admin=role == ADMIN,
                    role=role,
                    token_hash=hash_token(token),
                    created_at=self.now(),
                )
                s.add(row)
        except sa_exc.IntegrityError:
            raise AlreadyExists(f"tenant {req.name!r} already exists", field="name", fix="pick another name") from None
        return store_pb2.CreateTenantResponse(tenant=tenant_pb(row), token=token)

    def get_tenant(self, p: Principal, req: store_pb2.GetRequest) -> common_pb2.Tenant:
        if not p.reads_all and req.id != p.tenant_id:
            raise NotFound(f"tenant {quote(req.id)} not found", field="id")
        with self._tx(write=False) as s:
            return tenant_pb(self._one(s, m.Tenant, req.id, None, what="tenant"))

    def list_tenants(self, p: Principal, req: store_pb2.ListTenantsRequest) -> store_pb2.ListTenantsResponse:
        self._require_reader(p, "listing tenants")
        with self._tx(write=False) as s:
            rows, token = self._page(s, sa.select(m.Tenant).order_by(m.Tenant.created_at, m.Tenant.id), req.page)
            return store_pb2.ListTenantsResponse(tenants=[tenant_pb(r) for r in rows], next_page_token=token)

    def authenticate(self, p: Principal, req: store_pb2.AuthenticateRequest) -> common_pb2.Principal:
        """The Authenticate RPC: other services' auth hooks resolve their callers' tokens here.

        A tenant may only ask about its own token: another tenant's answers exactly like an unknown one,
        so the RPC is no oracle for who holds which token. The admin (the services) may ask about any."""
        found = self.principal_for_token(req.token)
        if not p.admin and found.tenant_id != p.tenant_id:
            raise Unauthenticated("unknown bearer token", fix=UNAUTHENTICATED_FIX)
        return principal_pb(found)

    def rotate_tenant_token(self, p: Principal,
                            req: store_pb2.RotateTenantTokenRequest) -> store_pb2.CreateTenantResponse:
        """A new token for the tenant; the old one's hash is overwritten, so it stops authenticating here now
        (the other services' caches keep it at most their TTL). Another tenant's id is NOT_FOUND, as for GetTenant."""
        if not req.tenant_id:
            raise InvalidArgument("required", field="tenant_id", fix="name the tenant whose token to rotate")
        if not p.admin and req.tenant_id != p.tenant_id:
            raise NotFound(f"tenant {quote(req.tenant_id)} not found", field="tenant_id")
        token = new_token()
        with self._tx(write=True) as s:
            row = self._one(s, m.Tenant, req.tenant_id, None, what="tenant")
            if row.admin:
                raise FailedPrecondition("the platform admin's token is BALLAST_TOKEN, which every service uses",
                                         field="tenant_id", fix="change BALLAST_TOKEN and restart the services")
            row.token_hash = hash_token(token)
            reply = store_pb2.CreateTenantResponse(tenant=tenant_pb(row), token=token)
        self.principals.forget(req.tenant_id)  # committed: the old token stops here now
        return reply

    def principal_for_token(self, token: str) -> Principal:
        """Resolve a bearer token; only its hash is compared, the token itself is never stored. Every call
        to the store begins here, so a resolved token is cached for a few seconds (rotation forgets it)."""
        if not token:
            raise Unauthenticated("no bearer token", fix=UNAUTHENTICATED_FIX)
        hit = self.principals.get(token)
        if hit is not None:
            return hit
        stamp = self.principals.stamp()
        with self._tx(write=False) as s:
            row = s.scalars(sa.select(m.Tenant).where(m.Tenant.token_hash == hash_token(token))).first()
        if row is None:
            raise Unauthenticated("unknown bearer token", fix=UNAUTHENTICATED_FIX)
        principal = Principal.of(row.id, row.name, ADMIN if row.admin else row.role)
        self.principals.put(token, principal, stamp)
        return principal

    def ensure_admin(self, token: str, name: str = "admin") -> Principal:
        """Create (or re-key) the platform-admin tenant so `token` authenticates as admin; idempotent."""
        if not token:
            raise InvalidArgument("empty admin token", field="token", fix="set BALLAST_TOKEN")
        for attempt in range(2):  # a concurrent first start creates the same tenant: retry and find it
            try:
                with self._tx(write=True) as s:
                    row = self._admin_row(s, hash_token(token), name)
                self.principals.forget()  # a re-keyed admin: its old token stops here now
                return Principal(tenant_id=row.id, tenant_name=row.name, admin=True)
            except sa_exc.IntegrityError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _admin_row(self, s: Session, digest: str, name: str) -> m.Tenant:
        row = s.scalars(sa.select(m.Tenant).where(m.Tenant.token_hash == digest)).first()
        if row is not None:
            if not row.admin:
                raise FailedPrecondition(
                    "the admin token belongs to a non-admin tenant", field="token", fix="use a fresh token"
                )
            return row
        row = s.scalars(sa.select(m.Tenant).where(m.Tenant.name == name).with_for_update()).first()
        if row is None:
            row = m.Tenant(id=new_id("tnt"), name=name, admin=True, role=ADMIN, token_hash=digest,
                           created_at=self.now())
            s.add(row)
        elif not row.admin:
            raise FailedPrecondition(
                f"tenant {name!r} exists and is not an admin", field="name", fix="pick another name"
            )
        else:
            row.token_hash = digest
        return row
