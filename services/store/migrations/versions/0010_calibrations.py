"""Calibrations: the planner's cost-model corrections, one row per fitted version of a host class

Revision ID: 0010_calibrations
Revises: 0009_iteration_breakdown

Plain columns for the host class's parts, the model's scales and fixed costs, and the residuals before and
after, so `ballast sql` can follow a class's fit across versions; the runs a version was fitted from are one
JSON list. uq_calibrations_host_class_version makes the store's version numbering safe under concurrent
writers. Downgrade drops the table (the calibrations are lost; the planner falls back to the raw model).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010_calibrations"
down_revision: str | None = "0009_iteration_breakdown"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
COUNTS = ("cores", "colocated", "version")
MODEL = ("forward_scale", "forward_fixed_s", "backward_scale", "backward_fixed_s", "allreduce_scale",
         "update_scale", "iteration_fixed_s", "memory_scale")


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("host_class", sa.String(200), nullable=False),
        sa.Column("device_kind", sa.String(100), nullable=False),
        *(sa.Column(name, sa.Integer(), nullable=False) for name in COUNTS),
        *(sa.Column(name, sa.Double(), nullable=False) for name in MODEL),
        sa.Column("memory_fixed_bytes", sa.BigInteger(), nullable=False),
        sa.Column("iterations", sa.Integer(), nullable=False),
        sa.Column("residual", sa.Double(), nullable=False),
        sa.Column("residual_before", sa.Double(), nullable=False),
        sa.Column("job_ids", JSON, nullable=False),
        sa.Column("notes", sa.Text(), nullable=False),
        sa.Column("fitted_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("host_class", "version", name="uq_calibrations_host_class_version"),
    )
    op.create_index("ix_calibrations_fitted_at", "calibrations", ["fitted_at"])


def downgrade() -> None:
    op.drop_table("calibrations")
