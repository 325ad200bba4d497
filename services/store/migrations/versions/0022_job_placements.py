"""Job placements: the layout a job was started on, stored with its leases

Revision ID: 0022_job_placements
Revises: 0021_offload_calibration

job_placements holds one row per start of a job (pp, dp, world size, micro-batch size and count, global batch,
rendezvous, backend, and the whole JobPlacement as JSON); device_leases gains placement_id and rank, so which rank
ran on which device is a join (issue 42). Leases made before read NULL in both. Downgrade drops them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0022_job_placements"
down_revision: str | None = "0021_offload_calibration"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COUNTS = ("plan_version", "stages", "replicas", "world_size", "micro_batch_size", "num_micro_batches",
          "global_batch_size")


def upgrade() -> None:
    op.create_table(
        "job_placements",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("plan_id", sa.String(40), nullable=False),
        *(sa.Column(name, sa.Integer(), nullable=False) for name in COUNTS),
        sa.Column("rendezvous", sa.String(300), nullable=False),
        sa.Column("backend", sa.String(20), nullable=False),
        sa.Column("body", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_job_placements_job_id", "job_placements", ["job_id"])
    op.create_index("ix_job_placements_created_at", "job_placements", ["created_at"])
    with op.batch_alter_table("device_leases") as batch:
        batch.add_column(sa.Column("placement_id", sa.String(40), nullable=True))
        batch.add_column(sa.Column("rank", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_device_leases_placement_id", "job_placements", ["placement_id"], ["id"],
                                 ondelete="CASCADE")
        batch.create_index("ix_device_leases_placement_id", ["placement_id"])


def downgrade() -> None:
    with op.batch_alter_table("device_leases") as batch:
        batch.drop_index("ix_device_leases_placement_id")
        batch.drop_constraint("fk_device_leases_placement_id", type_="foreignkey")
        batch.drop_column("rank")
        batch.drop_column("placement_id")
    op.drop_table("job_placements")
