"""A metrics row may summarise a window of a worker's iterations

Revision ID: 0026_metric_windows
Revises: 0025_queue_reads

Agents summarise each worker's iterations over windows (issue 43, item 3) so the rows per second do not grow with
a fleet's iteration rate. iteration_metrics gains first_iteration (the window's first; `iteration` stays its last),
iterations (how many it covers) and the window's median, 95th-percentile and longest iteration time. Rows stored
before are windows of one iteration: first_iteration = iteration, iterations = 1, and the three times are its own.
Downgrade drops the five columns (a window then reads as its last iteration).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0026_metric_windows"
down_revision: str | None = "0025_queue_reads"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("first_iteration", "iterations", "iteration_time_p50_s", "iteration_time_p95_s", "iteration_time_max_s")


def upgrade() -> None:
    with op.batch_alter_table("iteration_metrics") as batch:
        batch.add_column(sa.Column("first_iteration", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("iterations", sa.Integer(), nullable=True))
        for name in COLUMNS[2:]:
            batch.add_column(sa.Column(name, sa.Double(), nullable=True))
    op.execute("UPDATE iteration_metrics SET first_iteration = iteration, iterations = 1, "
               "iteration_time_p50_s = iteration_time_s, iteration_time_p95_s = iteration_time_s, "
               "iteration_time_max_s = iteration_time_s")
    with op.batch_alter_table("iteration_metrics") as batch:
        batch.alter_column("first_iteration", existing_type=sa.Integer(), nullable=False)
        batch.alter_column("iterations", existing_type=sa.Integer(), nullable=False)
        for name in COLUMNS[2:]:
            batch.alter_column(name, existing_type=sa.Double(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("iteration_metrics") as batch:
        for name in COLUMNS:
            batch.drop_column(name)
