"""Calibrations fit Harmony's and chunk offload's timings too

Revision ID: 0021_offload_calibration
Revises: 0020_profile_fidelity

calibrations gains harmony_scale and chunks_scale: measured over predicted iteration time of the host class's
Harmony and chunk offload runs, by which a plan of that kind is priced (issue 45). Rows stored before read 0 (none
fitted: the estimator's time as it is). Downgrade drops them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021_offload_calibration"
down_revision: str | None = "0020_profile_fidelity"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("harmony_scale", "chunks_scale")


def upgrade() -> None:
    with op.batch_alter_table("calibrations") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.Double(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("calibrations") as batch:
        for name in COLUMNS:
            batch.drop_column(name)
