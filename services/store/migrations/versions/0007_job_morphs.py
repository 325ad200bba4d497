"""Job morphs: one row per job reshaped after a loss (or grown onto returning devices)

Revision ID: 0007_job_morphs
Revises: 0006_shared_fleet

Plain columns (layouts, iterations, timestamps, recovery seconds) rather than JSON, so recovery times and
lost work can be read with `ballast sql`. first_iteration_at and recovery_s stay NULL until the first
iteration after the resume is reported. Downgrade drops the table (the morph history is lost).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_job_morphs"
down_revision: str | None = "0006_shared_fleet"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COUNTS = ("from_stages", "from_replicas", "from_plan_version", "to_stages", "to_replicas", "to_plan_version",
          "failed_iteration", "checkpoint_iteration", "lost_iterations")


def UTCDateTime() -> sa.DateTime:  # noqa: N802 - reads like the column type it stands for
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "job_morphs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("cause", sa.String(40), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        *(sa.Column(name, sa.Integer(), nullable=False) for name in COUNTS),
        sa.Column("detected_at", UTCDateTime(), nullable=False),
        sa.Column("resumed_at", UTCDateTime(), nullable=False),
        sa.Column("first_iteration_at", UTCDateTime(), nullable=True),
        sa.Column("recovery_s", sa.Double(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("resumed_at >= detected_at", name="ck_job_morphs_order"),
    )
    op.create_index("ix_job_morphs_job_id", "job_morphs", ["job_id"])


def downgrade() -> None:
    op.drop_table("job_morphs")
