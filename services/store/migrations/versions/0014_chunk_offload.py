"""Chunk offload: plans that keep model data in chunks, measured swap traffic, profiles' parameter tensors

Revision ID: 0014_chunk_offload
Revises: 0013_profile_layer_tp

plans gains offload (JSON of Plan.offload: chunk size, device budget, the simulator's swap prediction; NULL for
a plan held wholly in device memory). iteration_metrics gains swap_in_bytes, swap_out_bytes and swap_s (what a
chunk-offload worker moved, measured) beside predicted_swap_in_bytes / predicted_swap_out_bytes (the plan's);
rows stored before read NULL. profile_layers gains parameter_numels and parameter_tensors (JSON lists: the
parameter tensors a layer owns, in elements, and the model-wide indices of those it uses), which the planner's
chunk simulator lays out; profiles stored before read [] and cannot be offloaded until profiled again.
Downgrade drops the columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014_chunk_offload"
down_revision: str | None = "0013_profile_layer_tp"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Self-contained like 0001: no import of the ORM models, whose columns may change later.
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
METRICS = (("swap_in_bytes", sa.BigInteger()), ("swap_out_bytes", sa.BigInteger()), ("swap_s", sa.Double()),
           ("predicted_swap_in_bytes", sa.BigInteger()), ("predicted_swap_out_bytes", sa.BigInteger()))


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("offload", JSON, nullable=True))
    with op.batch_alter_table("iteration_metrics") as batch:
        for name, kind in METRICS:
            batch.add_column(sa.Column(name, kind, nullable=True))
    with op.batch_alter_table("profile_layers") as batch:
        batch.add_column(sa.Column("parameter_numels", JSON, nullable=False, server_default="[]"))
        batch.add_column(sa.Column("parameter_tensors", JSON, nullable=False, server_default="[]"))


def downgrade() -> None:
    with op.batch_alter_table("profile_layers") as batch:
        batch.drop_column("parameter_tensors")
        batch.drop_column("parameter_numels")
    with op.batch_alter_table("iteration_metrics") as batch:
        for name, _ in reversed(METRICS):
            batch.drop_column(name)
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("offload")
