"""profile details: per-layer notes and reuse, memory trace, sweep bounds; cache-lookup index

Revision ID: 0004_profile_details
Revises: 0003_plan_version_unique

profile_layers gains note (why a layer has fewer samples than asked), measured_as (the layer whose
rows were reused), batch_input_bytes and max_micro_batch_size; profiles gains memory_trace (JSON list
of points), measured_micro_batch_sizes (JSON list), memory_cap_bytes and profiling_time_s. Every new
column but the nullable note has a server default, so rows stored before this revision stay valid and
read as proto3's empty values. ix_profiles_cache_lookup serves the profiler's cache lookup (tenant,
model signature, device kind, dtype). SQLite alters tables by rebuilding them (batch mode), which
env.py runs with foreign keys off; downgrade drops everything this revision added.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004_profile_details"
down_revision: str | None = "0003_plan_version_unique"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Self-contained like 0001: no import of the ORM models, whose columns may change later.
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
CACHE_INDEX = "ix_profiles_cache_lookup"
CACHE_KEY = ["tenant_id", "model_signature", "device_kind", "dtype"]


def _layer_columns() -> list[sa.Column]:
    return [
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("measured_as", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("batch_input_bytes", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("max_micro_batch_size", sa.Integer(), nullable=False, server_default="0"),
    ]


def _profile_columns() -> list[sa.Column]:
    return [
        sa.Column("memory_trace", JSON, nullable=False, server_default="[]"),
        sa.Column("measured_micro_batch_sizes", JSON, nullable=False, server_default="[]"),
        sa.Column("memory_cap_bytes", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("profiling_time_s", sa.Double(), nullable=False, server_default="0"),
    ]


def upgrade() -> None:
    with op.batch_alter_table("profile_layers") as batch:
        for column in _layer_columns():
            batch.add_column(column)
    with op.batch_alter_table("profiles") as batch:
        for column in _profile_columns():
            batch.add_column(column)
        batch.create_index(CACHE_INDEX, CACHE_KEY)


def downgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.drop_index(CACHE_INDEX)
        for column in reversed(_profile_columns()):
            batch.drop_column(column.name)
    with op.batch_alter_table("profile_layers") as batch:
        for column in reversed(_layer_columns()):
            batch.drop_column(column.name)
