"""Shared fleet: device_leases, fleet_policies, jobs.priority_class

Revision ID: 0006_shared_fleet
Revises: 0005_plan_request_id

A lease binds one device to one job from started_at until ended_at. The partial unique index over
(host_id, device_index) WHERE ended_at IS NULL lets the database itself refuse a second live lease on a
device, on SQLite and PostgreSQL alike, whatever a scheduler believes. Fleet policies are versioned rows
(the highest is in force). jobs.priority_class keeps the class a job was admitted under queryable.
Downgrade drops the tables and the column (lease history and policies are lost).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006_shared_fleet"
down_revision: str | None = "0005_plan_request_id"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIVE = sa.text("ended_at IS NULL")
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def UTCDateTime() -> sa.DateTime:  # noqa: N802 - reads like the column type it stands for
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "device_leases",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("host_id", sa.String(40), sa.ForeignKey("hosts.id"), nullable=False),
        sa.Column("device_index", sa.Integer(), nullable=False),
        sa.Column("device_kind", sa.String(100), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
        sa.Column("end_reason", sa.String(40), nullable=True),
        sa.CheckConstraint("ended_at IS NULL OR ended_at >= started_at", name="ck_device_leases_order"),
    )
    op.create_index("ix_device_leases_job_id", "device_leases", ["job_id"])
    op.create_index("ix_device_leases_started_at", "device_leases", ["started_at"])
    op.create_index("ix_device_leases_tenant_live", "device_leases", ["tenant_id", "ended_at"])
    op.create_index("uq_device_leases_live", "device_leases", ["host_id", "device_index"], unique=True,
                    sqlite_where=LIVE, postgresql_where=LIVE)
    op.create_table(
        "fleet_policies",
        sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("policy", JSON, nullable=False),
        sa.Column("created_by", sa.String(63), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("priority_class", sa.String(63), nullable=False, server_default=sa.text("''")))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("priority_class")
    op.drop_table("fleet_policies")
    op.drop_index("uq_device_leases_live", table_name="device_leases")
    op.drop_table("device_leases")
