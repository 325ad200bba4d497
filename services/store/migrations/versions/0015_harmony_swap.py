"""Harmony swap schedules: plans that run a model larger than device memory as a wrap-around pipeline

Revision ID: 0015_harmony_swap
Revises: 0014_chunk_offload

plans gains harmony (JSON of Plan.harmony: the configuration search's forward/backward micro-batch sizes and
layer packs, devices, prefetch, device budget and the predicted traffic per iteration; NULL for a plan that is
not a Harmony schedule). A Harmony worker's measured swap lands in the iteration_metrics columns 0014 added.
Downgrade drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015_harmony_swap"
down_revision: str | None = "0014_chunk_offload"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Self-contained like 0001: no import of the ORM models, whose columns may change later.
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("harmony", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("harmony")
