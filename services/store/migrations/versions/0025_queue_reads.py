"""Jobs and leases are read where they changed; jobs say when they first ran

Revision ID: 0025_queue_reads
Revises: 0024_host_changed_at

Indexes jobs.updated_at and device_leases.ended_at, so the planner's admission pass reads only the jobs and
leases that changed since its last pass (ListJobs and ListLeases changed_since) instead of the whole queue and
every live lease every half second. Jobs gain started_at, when the job first went RUNNING (NULL until then), so
a planner that starts with thousands of jobs queued reads the events (preemptions, a morph in progress) only of
those that ever ran; rows stored before take it from their first RUNNING event. Downgrade drops all three.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025_queue_reads"
down_revision: str | None = "0024_host_changed_at"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("started_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE jobs SET started_at = (SELECT min(e.created_at) FROM job_events e "
               "WHERE e.job_id = jobs.id AND e.state = 'JOB_STATE_RUNNING')")
    op.create_index("ix_jobs_updated_at", "jobs", ["updated_at"])
    op.create_index("ix_device_leases_ended_at", "device_leases", ["ended_at"])


def downgrade() -> None:
    op.drop_index("ix_device_leases_ended_at", "device_leases")
    op.drop_index("ix_jobs_updated_at", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("started_at")
