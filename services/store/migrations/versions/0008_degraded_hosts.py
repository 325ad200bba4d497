"""Degraded hosts: host_degradations, hosts.degraded_reason and hosts.degraded_at

Revision ID: 0008_degraded_hosts
Revises: 0007_job_morphs

A fail-stutter host (Varuna §4.6) is marked degraded with the measurements behind the mark; the rows stay
after an operator clears it (cleared_at, cleared_reason, cleared_by), so `ballast sql` shows a host that
keeps coming back slow. The current mark is also kept on the host row itself, so reading a host needs no
join. Plain columns beside one JSON evidence object. Downgrade drops the table and the two columns (the
marks and their history are lost).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008_degraded_hosts"
down_revision: str | None = "0007_job_morphs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def UTCDateTime() -> sa.DateTime:  # noqa: N802 - reads like the column type it stands for
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("degraded_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("degraded_at", UTCDateTime(), nullable=True))
    op.create_table(
        "host_degradations",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("host_id", sa.String(40), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("evidence", JSON, nullable=False),
        sa.Column("marked_at", UTCDateTime(), nullable=False),
        sa.Column("cleared_at", UTCDateTime(), nullable=True),
        sa.Column("cleared_reason", sa.Text(), nullable=True),
        sa.Column("cleared_by", sa.String(40), sa.ForeignKey("tenants.id"), nullable=True),
    )
    op.create_index("ix_host_degradations_host_id", "host_degradations", ["host_id"])


def downgrade() -> None:
    op.drop_table("host_degradations")
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("degraded_at")
        batch.drop_column("degraded_reason")
