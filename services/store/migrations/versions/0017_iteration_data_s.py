"""Iterations say how long drawing their samples took

Revision ID: 0017_iteration_data_s
Revises: 0016_model_versions

iteration_metrics gains data_s (IterationMetric.data_s): reading and batching the iteration's samples, a part of
the breakdown of its own (forward + backward + p2p + allreduce + optimizer + data + overhead = the iteration),
so a slow dataset shows as itself and not as overhead. Rows stored before read NULL. Downgrade drops it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017_iteration_data_s"
down_revision: str | None = "0016_model_versions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("iteration_metrics") as batch:
        batch.add_column(sa.Column("data_s", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("iteration_metrics") as batch:
        batch.drop_column("data_s")
