"""Profiles keep what says how far to trust them

Revision ID: 0020_profile_fidelity
Revises: 0019_evaluations

profiles gains composition_factor (the whole model's time over the sum of its layers alone, which the profiler
measured but the store dropped, so a plan priced from a stored profile lost it), host_noise (how much a fixed
workload's time moved between before and after the measurement), noisy (still above the threshold after
measuring again) and measure_passes (1, or 2 when the first pass was re-taken); profile_layer_samples gains
forward_spread and backward_spread (each time's robust coefficient of variation over its repeats); calibrations
gains run_spread (how noisy the runs it was fitted on were). Rows stored before read 0 / false. Downgrade drops
them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020_profile_fidelity"
down_revision: str | None = "0019_evaluations"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PROFILE_COLUMNS = (("composition_factor", sa.Double(), "0"), ("host_noise", sa.Double(), "0"),
                   ("noisy", sa.Boolean(), sa.false()), ("measure_passes", sa.Integer(), "0"))
SAMPLE_COLUMNS = (("forward_spread", sa.Double(), "0"), ("backward_spread", sa.Double(), "0"))


def upgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        for name, kind, default in PROFILE_COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=False, server_default=default))
    with op.batch_alter_table("profile_layer_samples") as batch:
        for name, kind, default in SAMPLE_COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=False, server_default=default))
    with op.batch_alter_table("calibrations") as batch:
        batch.add_column(sa.Column("run_spread", sa.Double(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("calibrations") as batch:
        batch.drop_column("run_spread")
    with op.batch_alter_table("profile_layer_samples") as batch:
        for name, _, _ in SAMPLE_COLUMNS:
            batch.drop_column(name)
    with op.batch_alter_table("profiles") as batch:
        for name, _, _ in PROFILE_COLUMNS:
            batch.drop_column(name)
