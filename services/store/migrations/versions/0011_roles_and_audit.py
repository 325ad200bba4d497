"""Roles and the audit log: tenants get a role (member, viewer, admin); every state-changing call is a row

Revision ID: 0011_roles_and_audit
Revises: 0010_calibrations

`tenants.role` holds the TenantRole name; existing admin tenants become TENANT_ROLE_ADMIN and every other one
TENANT_ROLE_MEMBER, so no token gains or loses a right. `audit_log` has plain columns (who, what, when, the
result) for `ballast sql`; `uid` is unique so a batch a service sends twice is stored once. Downgrade drops
both (the audit records are lost; viewers become members).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_roles_and_audit"
down_revision: str | None = "0010_calibrations"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TEXT = {"tenant_id": 40, "tenant_name": 63, "role": 40, "service": 100, "method": 100, "target": 200,
        "code": 40, "message": 500, "peer": 200, "server": 40}


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("role", sa.String(40), nullable=False, server_default="TENANT_ROLE_MEMBER"))
    op.execute("UPDATE tenants SET role = 'TENANT_ROLE_ADMIN' WHERE admin")
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("uid", sa.String(40), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        *(sa.Column(name, sa.String(size), nullable=False) for name, size in TEXT.items()),
        sa.Column("duration_ms", sa.Double(), nullable=False),
        sa.UniqueConstraint("uid", name="uq_audit_log_uid"),
    )
    for column in ("at", "tenant_id", "method"):
        op.create_index(f"ix_audit_log_{column}", "audit_log", [column])


def downgrade() -> None:
    op.drop_table("audit_log")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("role")
