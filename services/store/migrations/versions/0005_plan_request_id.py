"""plans.request_id: CreatePlan's idempotency key, unique per tenant

Revision ID: 0005_plan_request_id
Revises: 0004_profile_details

A planner worker stores its plan under the id of the queued request it runs. A search that is run
twice (a worker killed after storing but before completing, a redelivered broker message) then finds
the plan already stored instead of inserting a second one. The key is nullable (plans stored by hand
have none; NULLs never compare equal) and unique per tenant, so one tenant's key says nothing about
another's. SQLite alters tables by rebuilding them (batch mode), which env.py runs with foreign keys
off; downgrade drops the constraint and the column (the keys are lost, the plans kept).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_plan_request_id"
down_revision: str | None = "0004_profile_details"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CONSTRAINT = "uq_plans_tenant_request"


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("request_id", sa.String(40), nullable=True))
        batch.create_unique_constraint(CONSTRAINT, ["tenant_id", "request_id"])


def downgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.drop_constraint(CONSTRAINT, type_="unique")
        batch.drop_column("request_id")
