"""Profile layers say whether the executors can run them tensor-parallel

Revision ID: 0013_profile_layer_tp
Revises: 0012_plan_layer_dp_sharding

profile_layers gains tensor_parallel (LayerProfile.tensor_parallel): the tensor-parallel degrees the executors
can split the layer into are those dividing it (0: none). Rows stored before this revision read 0, so plans made
from older profiles keep their layers unsplit until the model is profiled again. Downgrade drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_profile_layer_tp"
down_revision: str | None = "0012_plan_layer_dp_sharding"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("profile_layers") as batch:
        batch.add_column(sa.Column("tensor_parallel", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("profile_layers") as batch:
        batch.drop_column("tensor_parallel")
