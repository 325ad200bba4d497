"""Evaluations: a job's validation loss after an iteration, in a table of its own

Revision ID: 0019_evaluations
Revises: 0018_checkpoint_lifecycle

evaluations holds one row per (job, iteration) evaluated (JobSpec.eval_every): the mean validation loss, the
perplexity of a language model (0 for other models), the seconds it took (apart from every iteration's time, so
the calibration never sees it) and the samples read. Rows go with their job. Downgrade drops the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019_evaluations"
down_revision: str | None = "0018_checkpoint_lifecycle"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "evaluations",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=False),
        sa.Column("plan_version", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Double(), nullable=False),
        sa.Column("perplexity", sa.Double(), nullable=False),
        sa.Column("eval_s", sa.Double(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("job_id", "iteration", name="uq_evaluations_job_iteration"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
    )
    op.create_index("ix_evaluations_job_id", "evaluations", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_evaluations_job_id", table_name="evaluations")
    op.drop_table("evaluations")
