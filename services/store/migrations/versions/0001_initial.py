"""Initial schema: tenants, models, profiles, hosts, plans, jobs, metrics, checkpoints, queue.

Revision ID: 0001_initial
Revises:
Create Date: 2026-05-10

Hand-cleaned from autogenerate. Self-contained (no import of the ORM models) so the revision
keeps describing this exact schema as models.py evolves.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(40)
ENUM = sa.String(40)
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

# Creation order respects foreign keys; downgrade drops in reverse.
TABLES = [
    "tenants", "hosts", "devices", "workers", "models", "queued_requests", "jobs", "profiles",
    "profile_layers", "profile_layer_samples", "plans", "plan_layers", "plan_candidates", "job_events",
    "iteration_metrics", "layer_migrations", "checkpoints", "checkpoint_layers",
]  # fmt: skip


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _json(name: str) -> sa.Column:
    return sa.Column(name, JSON, nullable=False)


def _col(
    name: str, type_: sa.types.TypeEngine | type[sa.types.TypeEngine], nullable: bool = False
) -> sa.Column:
    return sa.Column(name, type_, nullable=nullable)


def _fk(
    cols: list[str], target: str, refs: list[str], ondelete: str | None = None
) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(cols, [f"{target}.{r}" for r in refs], ondelete=ondelete)


def _index(table: str, *cols: str, name: str | None = None) -> None:
    op.create_index(name or f"ix_{table}_{'_'.join(cols)}", table, list(cols))


def upgrade() -> None:
    op.create_table(
        "tenants",
        _col("id", ID),
        _col("name", sa.String(63)),
        _col("admin", sa.Boolean),
        _col("token_hash", sa.String(64)),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        sa.UniqueConstraint("token_hash"),
    )

    op.create_table(
        "hosts",
        _col("id", ID),
        _col("name", sa.String(253)),
        _col("address", sa.String(300)),
        _col("agent_port", sa.Integer),
        _col("agent_version", sa.String(100)),
        _col("state", ENUM),
        _json("supported_parallelism"),
        _json("labels"),
        _ts("last_heartbeat_at", nullable=True),
        _ts("registered_at"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    _index("hosts", "state")

    op.create_table(
        "devices",
        _col("host_id", ID),
        _col("device_index", sa.Integer),
        _col("kind", sa.String(100)),
        _col("memory_bytes", sa.BigInteger),
        _col("peak_flops", sa.Double),
        _col("uuid", sa.String(100)),
        _json("spec"),
        _fk(["host_id"], "hosts", ["id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("host_id", "device_index"),
    )
    _index("devices", "kind")

    op.create_table(
        "workers",
        _col("name", sa.String(200)),
        _col("pid", sa.Integer),
        _json("queues"),
        _ts("seen_at"),
        _col("current_request_id", ID, nullable=True),
        sa.PrimaryKeyConstraint("name"),
    )
    _index("workers", "seen_at")

    op.create_table(
        "models",
        _col("id", ID),
        _col("tenant_id", ID),
        _col("name", sa.String(200)),
        _col("family", ENUM),
        _col("signature", sa.String(64)),
        _col("parameter_count", sa.BigInteger),
        _json("spec"),
        _ts("created_at"),
        _fk(["tenant_id"], "tenants", ["id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_models_tenant_name"),
        sa.UniqueConstraint("tenant_id", "signature", name="uq_models_tenant_signature"),
    )
    _index("models", "created_at")
    _index("models", "signature")
    _index("models", "tenant_id")

    op.create_table(
        "queued_requests",
        _col("id", ID),
        _col("tenant_id", ID),
        _col("kind", sa.String(100)),
        _col("payload_json", sa.Text),
        _col("dedupe_key", sa.String(64)),
        _col("state", ENUM),
        _col("lease_owner", sa.String(200), nullable=True),
        _col("lease_token", sa.String(64), nullable=True),
        _ts("lease_expires_at", nullable=True),
        _col("attempts", sa.Integer),
        _col("max_attempts", sa.Integer),
        _col("requeues", sa.Integer),
        _col("result_json", sa.Text, nullable=True),
        _col("error", sa.Text, nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        _fk(["tenant_id"], "tenants", ["id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("dedupe_key"),
    )
    _index("queued_requests", "created_at")
    _index("queued_requests", "tenant_id")
    _index("queued_requests", "state", "lease_expires_at", name="ix_queued_requests_state_lease")

    op.create_table(
        "jobs",
        _col("id", ID),
        _col("tenant_id", ID),
        _col("model_id", ID),
        _col("name", sa.String(200)),
        _col("state", ENUM),
        _col("plan_id", ID, nullable=True),
        _col("plan_version", sa.Integer),
        _col("message", sa.Text),
        _col("iteration", sa.Integer),
        _col("last_event_seq", sa.BigInteger),
        _json("spec"),
        _ts("created_at"),
        _ts("updated_at"),
        _fk(["model_id"], "models", ["id"]),
        _fk(["tenant_id"], "tenants", ["id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    _index("jobs", "created_at")
    _index("jobs", "model_id")
    _index("jobs", "state")
    _index("jobs", "tenant_id", "created_at", name="ix_jobs_tenant_created")

    op.create_table(
        "profiles",
        _col("id", ID),
        _col("tenant_id", ID),
        _col("model_id", ID),
        _col("model_signature", sa.String(64)),
        _col("device_kind", sa.String(100)),
        _col("dtype", ENUM),
        _col("software", sa.String(200)),
        _col("intra_op_threads", sa.Integer),
        _col("projected", sa.Boolean),
        _col("source_profile_id", ID, nullable=True),
        _col("non_model_memory_bytes", sa.BigInteger),
        _json("device"),
        _json("comm"),
        _ts("created_at"),
        _fk(["model_id"], "models", ["id"]),
        _fk(["source_profile_id"], "profiles", ["id"]),
        _fk(["tenant_id"], "tenants", ["id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    for col in ("created_at", "device_kind", "model_id", "model_signature", "tenant_id"):
        _index("profiles", col)

    op.create_table(
        "profile_layers",
        _col("profile_id", ID),
        _col("layer_index", sa.Integer),
        _col("name", sa.String(200)),
        _col("kind", sa.String(100)),
        _col("parameter_count", sa.BigInteger),
        _col("parameter_bytes", sa.BigInteger),
        _col("gradient_bytes", sa.BigInteger),
        _col("optimizer_state_bytes", sa.BigInteger),
        _json("extra_inputs"),
        _json("tied_with"),
        _fk(["profile_id"], "profiles", ["id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("profile_id", "layer_index"),
    )

    op.create_table(
        "profile_layer_samples",
        _col("profile_id", ID),
        _col("layer_index", sa.Integer),
        _col("micro_batch_size", sa.Integer),
        _col("measured", sa.Boolean),
        _col("forward_s", sa.Double),
        _col("backward_s", sa.Double),
        _col("recompute_s", sa.Double),
        _col("boundary_activation_bytes", sa.BigInteger),
        _col("stashed_activation_bytes", sa.BigInteger),
        _col("output_bytes", sa.BigInteger),
        _col("peak_memory_bytes", sa.BigInteger),
        _fk(
            ["profile_id", "layer_index"], "profile_layers", ["profile_id", "layer_index"], ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("profile_id", "layer_index", "micro_batch_size"),
    )

    op.create_table(
        "plans",
        _col("id", ID),
        _col("tenant_id", ID),
        _col("model_id", ID),
        _col("profile_id", ID, nullable=True),
        _col("job_id", ID, nullable=True),
        _col("engine", ENUM),
        _col("version", sa.Integer),
        _col("parent_plan_id", ID, nullable=True),
        _col("global_batch_size", sa.Integer),
        _col("micro_batch_size", sa.Integer),
        _col("num_micro_batches", sa.Integer),
        _col("schedule", ENUM),
        _col("pipeline_degree", sa.Integer),
        _col("iteration_time_s", sa.Double),
        _col("throughput_samples_per_s", sa.Double),
        _col("peak_memory_bytes", sa.BigInteger),
        _col("out_of_memory", sa.Boolean),
        _col("memory_budget_bytes", sa.BigInteger),
        _json("fleet"),
        _json("stages"),
        _json("prediction"),
        _col("explanation", sa.Text),
        _ts("created_at"),
        _fk(["job_id"], "jobs", ["id"]),
        _fk(["model_id"], "models", ["id"]),
        _fk(["parent_plan_id"], "plans", ["id"]),
        _fk(["profile_id"], "profiles", ["id"]),
        _fk(["tenant_id"], "tenants", ["id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    for col in ("created_at", "job_id", "model_id", "tenant_id"):
        _index("plans", col)

    op.create_table(
        "plan_layers",
        _col("plan_id", ID),
        _col("layer_index", sa.Integer),
        _col("stage_index", sa.Integer),
        _col("dp", sa.Integer),
        _col("sdp", sa.Integer),
        _col("tp", sa.Integer),
        _json("order"),
        _col("checkpoint", sa.Boolean),
        _col("swap_activations", sa.Boolean),
        _fk(["plan_id"], "plans", ["id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("plan_id", "layer_index"),
    )

    op.create_table(
        "plan_candidates",
        _col("plan_id", ID),
        _col("position", sa.Integer),
        _col("name", sa.String(200)),
        _col("engine", ENUM),
        _col("global_batch_size", sa.Integer),
        _col("iteration_time_s", sa.Double),
        _col("throughput_samples_per_s", sa.Double),
        _col("peak_memory_bytes", sa.BigInteger),
        _col("out_of_memory", sa.Boolean),
        _col("reason", sa.Text),
        _col("candidate_plan_id", ID, nullable=True),
        _fk(["plan_id"], "plans", ["id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("plan_id", "position"),
    )

    op.create_table(
        "job_events",
        _col("job_id", ID),
        _col("seq", sa.BigInteger),
        _col("type", sa.String(100)),
        _col("state", ENUM),
        _col("message", sa.Text),
        _json("attributes"),
        _ts("created_at"),
        _fk(["job_id"], "jobs", ["id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "seq"),
    )
    _index("job_events", "created_at")

    op.create_table(
        "iteration_metrics",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        _col("job_id", ID),
        _col("iteration", sa.Integer),
        _col("stage_index", sa.Integer),
        _col("replica_index", sa.Integer),
        _col("plan_version", sa.Integer),
        _col("iteration_time_s", sa.Double),
        _col("forward_s", sa.Double),
        _col("backward_s", sa.Double),
        _col("comm_s", sa.Double),
        _col("idle_s", sa.Double),
        _col("peak_memory_bytes", sa.BigInteger),
        _col("loss", sa.Double, nullable=True),
        _col("throughput_samples_per_s", sa.Double),
        _col("predicted_iteration_time_s", sa.Double),
        _ts("recorded_at"),
        _fk(["job_id"], "jobs", ["id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint(
            "job_id",
            "plan_version",
            "iteration",
            "stage_index",
            "replica_index",
            name="uq_iteration_metrics_row",
        ),
    )
    _index("iteration_metrics", "job_id", "iteration", name="ix_iteration_metrics_job_iteration")
    _index("iteration_metrics", "recorded_at")

    op.create_table(
        "layer_migrations",
        _col("id", ID),
        _col("job_id", ID),
        _col("layer_index", sa.Integer),
        _col("from_stage", sa.Integer),
        _col("to_stage", sa.Integer),
        _col("bytes", sa.BigInteger),
        _col("duration_s", sa.Double),
        _col("iteration", sa.Integer),
        _col("plan_version", sa.Integer),
        _ts("created_at"),
        _fk(["job_id"], "jobs", ["id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    _index("layer_migrations", "job_id")

    op.create_table(
        "checkpoints",
        _col("id", ID),
        _col("job_id", ID),
        _col("iteration", sa.Integer),
        _col("plan_version", sa.Integer),
        _col("complete", sa.Boolean),
        _ts("created_at"),
        _fk(["job_id"], "jobs", ["id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    _index("checkpoints", "job_id")

    op.create_table(
        "checkpoint_layers",
        _col("checkpoint_id", ID),
        _col("layer_index", sa.Integer),
        _col("uri", sa.Text),
        _col("bytes", sa.BigInteger),
        _col("sha256", sa.String(64)),
        _fk(["checkpoint_id"], "checkpoints", ["id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("checkpoint_id", "layer_index"),
    )


def downgrade() -> None:
    # Dropping a table drops its indexes with it, on both backends.
    for table in reversed(TABLES):
        op.drop_table(table)
