"""Plan layers keep their data-parallel flavour (plain DP, ZeRO-1, ZeRO-2)

Revision ID: 0012_plan_layer_dp_sharding
Revises: 0011_roles_and_audit

plan_layers gains dp_sharding, the DpSharding name of LayerStrategy.dp_sharding. Rows stored before this
revision were all plain data parallel, so they read DP_SHARDING_UNSPECIFIED. Downgrade drops the column (a
plan's ZeRO layers then read back as plain DP).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_plan_layer_dp_sharding"
down_revision: str | None = "0011_roles_and_audit"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("plan_layers") as batch:
        batch.add_column(sa.Column("dp_sharding", sa.String(40), nullable=False,
                                   server_default="DP_SHARDING_UNSPECIFIED"))


def downgrade() -> None:
    with op.batch_alter_table("plan_layers") as batch:
        batch.drop_column("dp_sharding")
