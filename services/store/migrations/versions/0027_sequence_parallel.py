"""Sequence parallelism: what a profiled layer allows and what a plan's layer uses

Revision ID: 0027_sequence_parallel
Revises: 0026_metric_windows

profile_layers gains sequence_parallel (LayerProfile.sequence_parallel: the TP degrees at which the executors can
also split the layer along the sequence divide it, 0 none) and plan_layers gains sequence_parallel
(LayerStrategy.sequence_parallel). Rows stored before read 0 and false: older profiles plan TP without sequence
parallelism until the model is profiled again, and older plans ran without it. Downgrade drops both columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0027_sequence_parallel"
down_revision: str | None = "0026_metric_windows"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("profile_layers") as batch:
        batch.add_column(sa.Column("sequence_parallel", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("plan_layers") as batch:
        batch.add_column(sa.Column("sequence_parallel", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("plan_layers") as batch:
        batch.drop_column("sequence_parallel")
    with op.batch_alter_table("profile_layers") as batch:
        batch.drop_column("sequence_parallel")
