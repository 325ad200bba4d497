"""unique plan versions per job; FAILED requests release their dedupe key

Revision ID: 0003_plan_version_unique
Revises: 0002_readonly_role

A job's plan versions were unique only by convention, so two CreatePlan naming the same version both
succeeded; uq_plans_job_version enforces it (what-if plans have job_id NULL and stay unconstrained,
as NULLs never compare equal). Rows that already clash keep the oldest plan at its version and move
the others to the job's next free versions, adopting jobs following along. queued_requests.dedupe_key
becomes nullable: a FAILED request sets it NULL so identical work can be enqueued again. SQLite alters
tables by rebuilding them (batch mode), which env.py runs with foreign keys off.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_plan_version_unique"
down_revision: str | None = "0002_readonly_role"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FAILED = "REQUEST_STATE_FAILED"
PLANS = sa.table("plans", sa.column("id"), sa.column("job_id"), sa.column("version"), sa.column("created_at"))
JOBS = sa.table("jobs", sa.column("plan_id"), sa.column("plan_version"))
REQUESTS = sa.table("queued_requests", sa.column("id"), sa.column("state"), sa.column("dedupe_key"))


def _renumber_clashing_plan_versions() -> None:
    """Give every plan but the oldest of a clashing (job_id, version) the job's next free version."""
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(PLANS.c.id, PLANS.c.job_id, PLANS.c.version)
        .where(PLANS.c.job_id.is_not(None))
        .order_by(PLANS.c.job_id, PLANS.c.created_at, PLANS.c.id)
    ).all()
    top: dict[str, int] = {}
    for _, job_id, version in rows:
        top[job_id] = max(top.get(job_id, 0), version)
    seen: set[tuple[str, int]] = set()
    for plan_id, job_id, version in rows:
        if (job_id, version) not in seen:
            seen.add((job_id, version))
            continue
        top[job_id] += 1
        bind.execute(sa.update(PLANS).where(PLANS.c.id == plan_id).values(version=top[job_id]))
        bind.execute(sa.update(JOBS).where(JOBS.c.plan_id == plan_id).values(plan_version=top[job_id]))


def upgrade() -> None:
    _renumber_clashing_plan_versions()
    with op.batch_alter_table("plans") as batch:
        batch.create_unique_constraint("uq_plans_job_version", ["job_id", "version"])
    with op.batch_alter_table("queued_requests") as batch:
        batch.alter_column("dedupe_key", existing_type=sa.String(64), nullable=True)
    op.execute(sa.update(REQUESTS).where(REQUESTS.c.state == FAILED).values(dedupe_key=None))


def downgrade() -> None:
    # A released key becomes the request's id: unique, and never a sha256 hex digest.
    op.execute(sa.update(REQUESTS).where(REQUESTS.c.dedupe_key.is_(None)).values(dedupe_key=REQUESTS.c.id))
    with op.batch_alter_table("queued_requests") as batch:
        batch.alter_column("dedupe_key", existing_type=sa.String(64), nullable=False)
    with op.batch_alter_table("plans") as batch:
        batch.drop_constraint("uq_plans_job_version", type_="unique")
