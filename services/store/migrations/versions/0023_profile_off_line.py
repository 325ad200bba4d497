"""Profile rows say when they lie off their layer's line

Revision ID: 0023_profile_off_line
Revises: 0022_job_placements

profile_layer_samples gains off_line: how far a measured row's forward + backward still lies off the line through
the layer's other measured sizes after the profiler re-measured it (0: on the line). Rows stored before read 0.
Downgrade drops it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023_profile_off_line"
down_revision: str | None = "0022_job_placements"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("profile_layer_samples") as batch:
        batch.add_column(sa.Column("off_line", sa.Double(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("profile_layer_samples") as batch:
        batch.drop_column("off_line")
