"""Checkpoints have a lifecycle: deleted by the job's retention, kept once exported

Revision ID: 0018_checkpoint_lifecycle
Revises: 0017_iteration_data_s

checkpoints gains deleted_at (when the planner deleted the checkpoint's files, keeping the job's newest
JobSpec.keep_checkpoints; the row stays, as history) and exported_at (when its weights were first exported: an
exported checkpoint is kept beside the newest ones). Rows stored before read NULL for both. Downgrade drops them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018_checkpoint_lifecycle"
down_revision: str | None = "0017_iteration_data_s"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("exported_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("exported_at")
        batch.drop_column("deleted_at")
