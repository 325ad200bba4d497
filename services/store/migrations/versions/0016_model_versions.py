"""Models are versioned by name: a different spec under a name already stored is its next version

Revision ID: 0016_model_versions
Revises: 0015_harmony_swap

models gains version (Model.version, 1 for every row stored before this revision), and the unique name per
tenant becomes a unique (name, version) per tenant: resubmitting a model under a name whose earlier spec failed
stores the new spec as version 2 instead of refusing it. A spec is still stored once per tenant (its signature
stays unique). Downgrade refuses while two versions share a name (it could only keep one of them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016_model_versions"
down_revision: str | None = "0015_harmony_swap"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("version", sa.Integer(), nullable=False, server_default="1"))
        batch.drop_constraint("uq_models_tenant_name", type_="unique")
        batch.create_unique_constraint("uq_models_tenant_name_version", ["tenant_id", "name", "version"])


def downgrade() -> None:
    shared = op.get_bind().execute(sa.text("SELECT count(*) FROM models WHERE version > 1")).scalar()
    if shared:
        raise RuntimeError(f"{shared} model rows are second or later versions of a name: rename them before "
                           "downgrading below 0016 (one name, one model there)")
    with op.batch_alter_table("models") as batch:
        batch.drop_constraint("uq_models_tenant_name_version", type_="unique")
        batch.create_unique_constraint("uq_models_tenant_name", ["tenant_id", "name"])
        batch.drop_column("version")
