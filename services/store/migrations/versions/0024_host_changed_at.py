"""Hosts say when they last changed

Revision ID: 0024_host_changed_at
Revises: 0023_profile_off_line

hosts gains changed_at: when the host's row last changed other than by a heartbeat (registration, a state, a
degraded mark set or cleared), indexed, so the planner's admission pass reads only the hosts that changed since
its last pass (ListHosts changed_since) instead of the whole fleet every half second. Rows stored before read
their registered_at. Downgrade drops it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024_host_changed_at"
down_revision: str | None = "0023_profile_off_line"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("changed_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE hosts SET changed_at = registered_at")
    with op.batch_alter_table("hosts") as batch:
        batch.alter_column("changed_at", existing_type=sa.DateTime(timezone=True), nullable=False)
        batch.create_index("ix_hosts_changed_at", ["changed_at"])


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_index("ix_hosts_changed_at")
        batch.drop_column("changed_at")
