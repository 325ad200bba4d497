"""Iteration breakdown: where each iteration's time went, and the plan's per-stage predictions beside it

Revision ID: 0009_iteration_breakdown
Revises: 0008_degraded_hosts

iteration_metrics gains recompute_s, p2p_s, allreduce_s, optimizer_s and overhead_s (forward_s + backward_s +
p2p_s + allreduce_s + optimizer_s + overhead_s = iteration_time_s; recompute_s is inside backward_s), and the
plan's predictions for the row's stage: predicted_peak_memory_bytes (beside peak_memory_bytes) and
predicted_stage_compute_s (beside forward_s + backward_s). Nullable: rows recorded before this revision read
NULL (not measured), not 0. Downgrade drops the columns (the breakdown is lost, the rows stay).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_iteration_breakdown"
down_revision: str | None = "0008_degraded_hosts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS: tuple[tuple[str, type[sa.types.TypeEngine]], ...] = (
    ("recompute_s", sa.Double), ("p2p_s", sa.Double), ("allreduce_s", sa.Double), ("optimizer_s", sa.Double),
    ("overhead_s", sa.Double), ("predicted_peak_memory_bytes", sa.BigInteger),
    ("predicted_stage_compute_s", sa.Double),
)


def upgrade() -> None:
    with op.batch_alter_table("iteration_metrics") as batch:
        for name, type_ in COLUMNS:
            batch.add_column(sa.Column(name, type_(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("iteration_metrics") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
