"""ORM tables of the metadata store.

Enums are stored as their proto names ("JOB_STATE_RUNNING") so SQL users can read them; nested
protos are stored as JSON (MessageToDict with proto field names). Timestamps are UTC-aware on
both backends: SQLite drops tzinfo, so `UTCDateTime` normalizes on write and re-attaches on read.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class UTCDateTime(sa.types.TypeDecorator):
    """Timezone-aware UTC in, timezone-aware UTC out, on every backend."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use timezone-aware UTC")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
# SQLite only autoincrements INTEGER PRIMARY KEY.
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Id = sa.String(40)
EnumName = sa.String(40)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSONType, list[Any]: JSONType}


def _fk(target: str, ondelete: str | None = None) -> sa.ForeignKey:
    return sa.ForeignKey(target, ondelete=ondelete)


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(63), unique=True)
    admin: Mapped[bool] = mapped_column(default=False)
    # TenantRole by name; `admin` stays (true exactly for TENANT_ROLE_ADMIN) for the SQL that reads it
    role: Mapped[str] = mapped_column(EnumName, default="TENANT_ROLE_MEMBER", server_default="TENANT_ROLE_MEMBER")
    token_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    created_at: Mapped[datetime]


class Model(Base):
    __tablename__ = "models"
    __table_args__ = (
        sa.UniqueConstraint("tenant_id", "name", "version", name="uq_models_tenant_name_version"),
        sa.UniqueConstraint("tenant_id", "signature", name="uq_models_tenant_signature"),
    )
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Id, _fk("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(sa.String(200))
    version: Mapped[int] = mapped_column(default=1, server_default="1")  # a different spec under one name: next
    family: Mapped[str] = mapped_column(EnumName)
    signature: Mapped[str] = mapped_column(sa.String(64), index=True)
    parameter_count: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(index=True)


class Profile(Base):
    __tablename__ = "profiles"
    # The profiler's cache lookup: same tenant, model signature, device kind and dtype (then software).
    __table_args__ = (
        sa.Index("ix_profiles_cache_lookup", "tenant_id", "model_signature", "device_kind", "dtype"),
    )
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Id, _fk("tenants.id"), index=True)
    model_id: Mapped[str] = mapped_column(Id, _fk("models.id"), index=True)
    model_signature: Mapped[str] = mapped_column(sa.String(64), index=True)
    device_kind: Mapped[str] = mapped_column(sa.String(100), index=True)
    dtype: Mapped[str] = mapped_column(EnumName)
    software: Mapped[str] = mapped_column(sa.String(200), default="")
    intra_op_threads: Mapped[int] = mapped_column(default=0)
    projected: Mapped[bool] = mapped_column(default=False)
    source_profile_id: Mapped[str | None] = mapped_column(Id, _fk("profiles.id"))
    non_model_memory_bytes: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    device: Mapped[dict[str, Any]]
    comm: Mapped[dict[str, Any]]
    # Columns added by 0004; the server defaults let rows stored before it read as empty/0.
    memory_trace: Mapped[list[Any]] = mapped_column(default=list, server_default="[]")
    measured_micro_batch_sizes: Mapped[list[Any]] = mapped_column(default=list, server_default="[]")
    memory_cap_bytes: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    profiling_time_s: Mapped[float] = mapped_column(default=0.0, server_default="0")
    # Columns added by 0020: how far to trust the profile (issue 45).
    composition_factor: Mapped[float] = mapped_column(default=0.0, server_default="0")
    host_noise: Mapped[float] = mapped_column(default=0.0, server_default="0")
    noisy: Mapped[bool] = mapped_column(default=False, server_default=sa.false())
    measure_passes: Mapped[int] = mapped_column(default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(index=True)

    layers: Mapped[list[ProfileLayer]] = relationship(
        order_by="ProfileLayer.layer_index", cascade="all, delete-orphan"
    )


class ProfileLayer(Base):
    __tablename__ = "profile_layers"
    profile_id: Mapped[str] = mapped_column(Id, _fk("profiles.id", "CASCADE"), primary_key=True)
    layer_index: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(200))
    kind: Mapped[str] = mapped_column(sa.String(100))
    parameter_count: Mapped[int] = mapped_column(sa.BigInteger)
    parameter_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    gradient_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    optimizer_state_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    extra_inputs: Mapped[list[Any]]
    tied_with: Mapped[list[Any]]
    # Columns added by 0004; NULL note and the server defaults read as proto3's "" and 0.
    note: Mapped[str | None] = mapped_column(sa.Text)
    measured_as: Mapped[int] = mapped_column(default=0, server_default="0")
    batch_input_bytes: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    max_micro_batch_size: Mapped[int] = mapped_column(default=0, server_default="0")
    # Added by 0013: TP degrees dividing it are runnable, 0 none (rows stored before read 0).
    tensor_parallel: Mapped[int] = mapped_column(default=0, server_default="0")
    # Added by 0027: TP degrees at which the sequence splits too, 0 none (rows stored before read 0).
    sequence_parallel: Mapped[int] = mapped_column(default=0, server_default="0")
    # Added by 0014: the parameter tensors the layer owns (elements) and uses (model-wide indices).
    parameter_numels: Mapped[list[Any]] = mapped_column(default=list, server_default="[]")
    parameter_tensors: Mapped[list[Any]] = mapped_column(default=list, server_default="[]")

    samples: Mapped[list[ProfileLayerSample]] = relationship(
        order_by="ProfileLayerSample.micro_batch_size", cascade="all, delete-orphan"
    )


class ProfileLayerSample(Base):
    __tablename__ = "profile_layer_samples"
    __table_args__ = (
        sa.ForeignKeyConstraint(
            ["profile_id", "layer_index"],
            ["profile_layers.profile_id", "profile_layers.layer_index"],
            ondelete="CASCADE",
        ),
    )
    profile_id: Mapped[str] = mapped_column(Id, primary_key=True)
    layer_index: Mapped[int] = mapped_column(primary_key=True)
    micro_batch_size: Mapped[int] = mapped_column(primary_key=True)
    measured: Mapped[bool]
    forward_s: Mapped[float]
    backward_s: Mapped[float]
    recompute_s: Mapped[float]
    boundary_activation_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    stashed_activation_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    output_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    peak_memory_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    forward_spread: Mapped[float] = mapped_column(default=0.0, server_default="0")  # 0020
    backward_spread: Mapped[float] = mapped_column(default=0.0, server_default="0")
    off_line: Mapped[float] = mapped_column(default=0.0, server_default="0")  # 0023


class Host(Base):
    __tablename__ = "hosts"
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(253), unique=True)
    address: Mapped[str] = mapped_column(sa.String(300), default="")
    agent_port: Mapped[int] = mapped_column(default=0)
    agent_version: Mapped[str] = mapped_column(sa.String(100), default="")
    state: Mapped[str] = mapped_column(EnumName, index=True)
    supported_parallelism: Mapped[list[Any]]
    labels: Mapped[dict[str, Any]]
    last_heartbeat_at: Mapped[datetime | None]
    registered_at: Mapped[datetime]
    # Last change other than a heartbeat (added by 0024): what ListHosts changed_since filters on.
    changed_at: Mapped[datetime] = mapped_column(index=True)
    # The current degraded mark (added by 0008), so a host reads whole without a join; NULL when healthy.
    degraded_reason: Mapped[str | None] = mapped_column(sa.Text)
    degraded_at: Mapped[datetime | None]

    devices: Mapped[list[Device]] = relationship(order_by="Device.device_index", cascade="all, delete-orphan")


class Device(Base):
    __tablename__ = "devices"
    host_id: Mapped[str] = mapped_column(Id, _fk("hosts.id", "CASCADE"), primary_key=True)
    device_index: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(sa.String(100), index=True)
    memory_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    peak_flops: Mapped[float]
    uuid: Mapped[str] = mapped_column(sa.String(100), default="")
    spec: Mapped[dict[str, Any]]


class Plan(Base):
    __tablename__ = "plans"
    # A job's versions are unique; what-if plans (job_id NULL) are exempt, as NULLs never compare equal.
    # request_id is CreatePlan's idempotency key (a queued search's request id), unique within a tenant;
    # plans stored without one (NULL) are unconstrained.
    __table_args__ = (
        sa.UniqueConstraint("job_id", "version", name="uq_plans_job_version"),
        sa.UniqueConstraint("tenant_id", "request_id", name="uq_plans_tenant_request"),
    )
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Id, _fk("tenants.id"), index=True)
    model_id: Mapped[str] = mapped_column(Id, _fk("models.id"), index=True)
    profile_id: Mapped[str | None] = mapped_column(Id, _fk("profiles.id"))
    job_id: Mapped[str | None] = mapped_column(Id, _fk("jobs.id"), index=True)
    engine: Mapped[str] = mapped_column(EnumName)
    version: Mapped[int]
    parent_plan_id: Mapped[str | None] = mapped_column(Id, _fk("plans.id"))
    global_batch_size: Mapped[int]
    micro_batch_size: Mapped[int]
    num_micro_batches: Mapped[int]
    schedule: Mapped[str] = mapped_column(EnumName)
    pipeline_degree: Mapped[int]
    iteration_time_s: Mapped[float]
    throughput_samples_per_s: Mapped[float]
    peak_memory_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    out_of_memory: Mapped[bool]
    memory_budget_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    fleet: Mapped[dict[str, Any]]
    stages: Mapped[list[Any]]
    prediction: Mapped[dict[str, Any]]
    explanation: Mapped[str] = mapped_column(sa.Text, default="")
    created_at: Mapped[datetime] = mapped_column(index=True)
    request_id: Mapped[str | None] = mapped_column(Id)  # added by 0005
    offload: Mapped[dict[str, Any] | None]  # added by 0014: Plan.offload (chunk offload), NULL without
    harmony: Mapped[dict[str, Any] | None]  # added by 0015: Plan.harmony (Harmony's swap schedule), NULL without

    layers: Mapped[list[PlanLayer]] = relationship(
        order_by="PlanLayer.layer_index", cascade="all, delete-orphan"
    )
    candidates: Mapped[list[PlanCandidate]] = relationship(
        order_by="PlanCandidate.position", cascade="all, delete-orphan"
    )


class PlanLayer(Base):
    __tablename__ = "plan_layers"
    plan_id: Mapped[str] = mapped_column(Id, _fk("plans.id", "CASCADE"), primary_key=True)
    layer_index: Mapped[int] = mapped_column(primary_key=True)
    stage_index: Mapped[int]
    dp: Mapped[int]
    sdp: Mapped[int]
    tp: Mapped[int]
    order: Mapped[list[Any]]
    checkpoint: Mapped[bool]
    swap_activations: Mapped[bool]
    dp_sharding: Mapped[str] = mapped_column(EnumName, default="DP_SHARDING_UNSPECIFIED",
                                             server_default="DP_SHARDING_UNSPECIFIED")
    # Added by 0027 (LayerStrategy.sequence_parallel); rows stored before read false.
    sequence_parallel: Mapped[bool] = mapped_column(default=False, server_default=sa.false())


class PlanCandidate(Base):
    __tablename__ = "plan_candidates"
    plan_id: Mapped[str] = mapped_column(Id, _fk("plans.id", "CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(200))
    engine: Mapped[str] = mapped_column(EnumName)
    global_batch_size: Mapped[int]
    iteration_time_s: Mapped[float]
    throughput_samples_per_s: Mapped[float]
    peak_memory_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    out_of_memory: Mapped[bool]
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    candidate_plan_id: Mapped[str | None] = mapped_column(Id)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (sa.Index("ix_jobs_tenant_created", "tenant_id", "created_at"),)
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Id, _fk("tenants.id"))
    model_id: Mapped[str] = mapped_column(Id, _fk("models.id"), index=True)
    name: Mapped[str] = mapped_column(sa.String(200), default="")
    state: Mapped[str] = mapped_column(EnumName, index=True)
    # No FK: plans.job_id already points here and a cycle would complicate inserts and drops.
    plan_id: Mapped[str | None] = mapped_column(Id)
    plan_version: Mapped[int] = mapped_column(default=0)
    message: Mapped[str] = mapped_column(sa.Text, default="")
    iteration: Mapped[int] = mapped_column(default=0)
    last_event_seq: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    # Loaded only when read: the store answers from its cache of parsed specs (repo/jobs.py SpecCache), so a
    # page of jobs need not decode every spec's JSON.
    spec: Mapped[dict[str, Any]] = mapped_column(deferred=True)
    created_at: Mapped[datetime] = mapped_column(index=True)
    # A new job or a state change, not progress (indexed by 0025): what ListJobs changed_since filters on.
    updated_at: Mapped[datetime] = mapped_column(index=True)
    # When it first went RUNNING (0025); NULL until then: a job that never ran has no interruptions to read.
    started_at: Mapped[datetime | None]
    # The fleet policy's class the job runs under (resolved at submit), so wait times group by it in SQL.
    priority_class: Mapped[str] = mapped_column(sa.String(63), default="", server_default=sa.text("''"))


class JobEvent(Base):
    __tablename__ = "job_events"
    job_id: Mapped[str] = mapped_column(Id, _fk("jobs.id", "CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    type: Mapped[str] = mapped_column(sa.String(100))
    state: Mapped[str] = mapped_column(EnumName)
    message: Mapped[str] = mapped_column(sa.Text, default="")
    attributes: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(index=True)


def _param(ctx, name: str):
    """A column's default taken from another value of the same INSERT (a row written as one iteration)."""
    return ctx.get_current_parameters()[name]


class IterationMetric(Base):
    __tablename__ = "iteration_metrics"
    __table_args__ = (
        sa.UniqueConstraint(
            "job_id",
            "plan_version",
            "iteration",
            "stage_index",
            "replica_index",
            name="uq_iteration_metrics_row",
        ),
        sa.Index("ix_iteration_metrics_job_iteration", "job_id", "iteration"),
    )
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(Id, _fk("jobs.id", "CASCADE"))
    iteration: Mapped[int]
    stage_index: Mapped[int]
    replica_index: Mapped[int]
    plan_version: Mapped[int]
    iteration_time_s: Mapped[float]
    forward_s: Mapped[float]
    backward_s: Mapped[float]
    comm_s: Mapped[float]
    idle_s: Mapped[float]
    peak_memory_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    loss: Mapped[float | None]
    throughput_samples_per_s: Mapped[float]
    predicted_iteration_time_s: Mapped[float]
    recorded_at: Mapped[datetime] = mapped_column(index=True)
    # The breakdown and per-stage predictions (0009); NULL on rows recorded before it.
    recompute_s: Mapped[float | None]
    p2p_s: Mapped[float | None]
    allreduce_s: Mapped[float | None]
    optimizer_s: Mapped[float | None]
    overhead_s: Mapped[float | None]
    predicted_peak_memory_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    predicted_stage_compute_s: Mapped[float | None]
    # Added by 0014 (chunk offload; NULL for earlier rows, 0 without offload).
    swap_in_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    swap_out_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    swap_s: Mapped[float | None]
    predicted_swap_in_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    predicted_swap_out_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    data_s: Mapped[float | None]  # 0017: drawing the samples, seconds; NULL for earlier rows
    # 0026: the row's window of the worker's iterations (first .. iteration, `iterations` of them) and its
    # iteration times' median, p95 and max; rows stored before are windows of one iteration
    first_iteration: Mapped[int] = mapped_column(default=lambda ctx: _param(ctx, "iteration"))
    iterations: Mapped[int] = mapped_column(default=1)
    iteration_time_p50_s: Mapped[float] = mapped_column(default=lambda ctx: _param(ctx, "iteration_time_s"))
    iteration_time_p95_s: Mapped[float] = mapped_column(default=lambda ctx: _param(ctx, "iteration_time_s"))
    iteration_time_max_s: Mapped[float] = mapped_column(default=lambda ctx: _param(ctx, "iteration_time_s"))


class LayerMigration(Base):
    __tablename__ = "layer_migrations"
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    job_id: Mapped[str] = mapped_column(Id, _fk("jobs.id", "CASCADE"), index=True)
    layer_index: Mapped[int]
    from_stage: Mapped[int]
    to_stage: Mapped[int]
    bytes: Mapped[int] = mapped_column(sa.BigInteger)
    duration_s: Mapped[float]
    iteration: Mapped[int]
    plan_version: Mapped[int]
    created_at: Mapped[datetime]


class Evaluation(Base):
    """0019: a job's validation loss after an iteration; one row per (job, iteration)."""

    __tablename__ = "evaluations"
    __table_args__ = (sa.UniqueConstraint("job_id", "iteration", name="uq_evaluations_job_iteration"),)
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    job_id: Mapped[str] = mapped_column(Id, _fk("jobs.id", "CASCADE"), index=True)
    iteration: Mapped[int]
    plan_version: Mapped[int]
    loss: Mapped[float]
    perplexity: Mapped[float]
    eval_s: Mapped[float]
    samples: Mapped[int] = mapped_column(sa.BigInteger)
    created_at: Mapped[datetime]


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    job_id: Mapped[str] = mapped_column(Id, _fk("jobs.id", "CASCADE"), index=True)
    iteration: Mapped[int]
    plan_version: Mapped[int]
    complete: Mapped[bool]
    created_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]  # 0018: the files deleted by the job's retention
    exported_at: Mapped[datetime | None]  # 0018: first exported; kept beside the newest ones from then on

    layers: Mapped[list[CheckpointLayer]] = relationship(
        order_by="CheckpointLayer.layer_index", cascade="all, delete-orphan"
    )


class CheckpointLayer(Base):
    __tablename__ = "checkpoint_layers"
    checkpoint_id: Mapped[str] = mapped_column(Id, _fk("checkpoints.id", "CASCADE"), primary_key=True)
    layer_index: Mapped[int] = mapped_column(primary_key=True)
    uri: Mapped[str] = mapped_column(sa.Text)
    bytes: Mapped[int] = mapped_column(sa.BigInteger)
    sha256: Mapped[str] = mapped_column(sa.String(64), default="")


class QueuedRequest(Base):
    __tablename__ = "queued_requests"
    __table_args__ = (sa.Index("ix_queued_requests_state_lease", "state", "lease_expires_at"),)
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Id, _fk("tenants.id"), index=True)
    kind: Mapped[str] = mapped_column(sa.String(100))
    payload_json: Mapped[str] = mapped_column(sa.Text)
    # NULL once FAILED, so the same work can be enqueued again; unique among the rest.
    dedupe_key: Mapped[str | None] = mapped_column(sa.String(64), unique=True)
    state: Mapped[str] = mapped_column(EnumName)
    lease_owner: Mapped[str | None] = mapped_column(sa.String(200))
    lease_token: Mapped[str | None] = mapped_column(sa.String(64))
    lease_expires_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(default=0)
    max_attempts: Mapped[int] = mapped_column(default=3)
    requeues: Mapped[int] = mapped_column(default=0)
    result_json: Mapped[str | None] = mapped_column(sa.Text)
    error: Mapped[str | None] = mapped_column(sa.Text)
    created_at: Mapped[datetime] = mapped_column(index=True)
    updated_at: Mapped[datetime]


class Worker(Base):
    __tablename__ = "workers"
    name: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    pid: Mapped[int] = mapped_column(default=0)
    queues: Mapped[list[Any]]
    seen_at: Mapped[datetime] = mapped_column(index=True)
    current_request_id: Mapped[str | None] = mapped_column(Id)


LIVE = sa.text("ended_at IS NULL")


class DeviceLease(Base):
    """One device bound to one job for a time. At most one live lease per device: a partial unique index the
    database enforces in the inserting transaction (SQLite and PostgreSQL alike), not a planner check."""

    __tablename__ = "device_leases"
    __table_args__ = (
        sa.Index("uq_device_leases_live", "host_id", "device_index", unique=True,
                 sqlite_where=LIVE, postgresql_where=LIVE),
        sa.Index("ix_device_leases_tenant_live", "tenant_id", "ended_at"),
        sa.CheckConstraint("ended_at IS NULL OR ended_at >= started_at", name="ck_device_leases_order"),
    )
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    job_id: Mapped[str] = mapped_column(Id, _fk("jobs.id", "CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(Id, _fk("tenants.id"))
    host_id: Mapped[str] = mapped_column(Id, _fk("hosts.id"))
    device_index: Mapped[int]
    device_kind: Mapped[str] = mapped_column(sa.String(100), default="")
    started_at: Mapped[datetime] = mapped_column(index=True)
    ended_at: Mapped[datetime | None] = mapped_column(index=True)  # with started_at: ListLeases changed_since
    end_reason: Mapped[str | None] = mapped_column(EnumName)
    # the job's rank on this device, from the placement the lease was made for (both NULL without one)
    placement_id: Mapped[str | None] = mapped_column(Id, _fk("job_placements.id", "CASCADE"), index=True)
    rank: Mapped[int | None]


class JobPlacement(Base):
    """Where a job's ranks ran: written with the leases it was started on, one row per start (a morph or a
    resize starts it again, elsewhere). The layout's numbers are plain columns for `ballast sql`; every rank's
    host and device are on the lease rows (device_leases.placement_id, rank) and in `body`, the whole message."""

    __tablename__ = "job_placements"
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    job_id: Mapped[str] = mapped_column(Id, _fk("jobs.id", "CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(Id, _fk("tenants.id"))
    plan_id: Mapped[str] = mapped_column(Id)
    plan_version: Mapped[int]
    stages: Mapped[int]
    replicas: Mapped[int]
    world_size: Mapped[int]
    micro_batch_size: Mapped[int]
    num_micro_batches: Mapped[int]
    global_batch_size: Mapped[int]
    rendezvous: Mapped[str] = mapped_column(sa.String(300))
    backend: Mapped[str] = mapped_column(sa.String(20))
    body: Mapped[dict[str, Any]]  # the JobPlacement as JSON (convert.to_json)
    created_at: Mapped[datetime] = mapped_column(index=True)


class FleetPolicyVersion(Base):
    """Every fleet policy ever stored; the highest version is in force."""

    __tablename__ = "fleet_policies"
    version: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    policy: Mapped[dict[str, Any]]
    created_by: Mapped[str] = mapped_column(sa.String(63), default="")
    created_at: Mapped[datetime]


class JobMorph(Base):
    """A job reshaped after a loss (or grown): its layouts, the iterations it trained again and how long
    it took to recover. Plain columns, so `ballast sql` can chart recovery times without decoding JSON."""

    __tablename__ = "job_morphs"
    __table_args__ = (sa.CheckConstraint("resumed_at >= detected_at", name="ck_job_morphs_order"),)
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    job_id: Mapped[str] = mapped_column(Id, _fk("jobs.id", "CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(Id, _fk("tenants.id"))
    cause: Mapped[str] = mapped_column(sa.String(40))
    detail: Mapped[str] = mapped_column(sa.Text, default="")
    from_stages: Mapped[int]
    from_replicas: Mapped[int]
    from_plan_version: Mapped[int]
    to_stages: Mapped[int]
    to_replicas: Mapped[int]
    to_plan_version: Mapped[int]
    failed_iteration: Mapped[int]
    checkpoint_iteration: Mapped[int]
    lost_iterations: Mapped[int]
    detected_at: Mapped[datetime]
    resumed_at: Mapped[datetime]
    first_iteration_at: Mapped[datetime | None]
    recovery_s: Mapped[float | None]
    created_at: Mapped[datetime]


class HostDegradation(Base):
    """One degraded mark of a host with the measurements behind it (Varuna §4.6 fail-stutter stragglers).

    Kept after the mark is cleared (cleared_at, cleared_reason, cleared_by), so `ballast sql` can tell a host
    that keeps coming back slow from one that was slow once."""

    __tablename__ = "host_degradations"
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    host_id: Mapped[str] = mapped_column(Id, _fk("hosts.id", "CASCADE"), index=True)
    job_id: Mapped[str | None] = mapped_column(Id, _fk("jobs.id", "SET NULL"))
    reason: Mapped[str] = mapped_column(sa.Text)
    evidence: Mapped[dict[str, Any]]
    marked_at: Mapped[datetime]
    cleared_at: Mapped[datetime | None]
    cleared_reason: Mapped[str | None] = mapped_column(sa.Text)
    cleared_by: Mapped[str | None] = mapped_column(Id, _fk("tenants.id"))


class Calibration(Base):
    """One fitted version of the planner's cost-model correction for a host class, with its provenance.

    Plain columns, so `ballast sql` can compare residuals before and after across versions; (host_class,
    version) is unique, which is what makes concurrent recorders of one class get distinct versions."""

    __tablename__ = "calibrations"
    __table_args__ = (sa.UniqueConstraint("host_class", "version", name="uq_calibrations_host_class_version"),)
    id: Mapped[str] = mapped_column(Id, primary_key=True)
    host_class: Mapped[str] = mapped_column(sa.String(200))
    device_kind: Mapped[str] = mapped_column(sa.String(100))
    cores: Mapped[int]
    colocated: Mapped[int]
    version: Mapped[int]
    forward_scale: Mapped[float]
    forward_fixed_s: Mapped[float]
    backward_scale: Mapped[float]
    backward_fixed_s: Mapped[float]
    allreduce_scale: Mapped[float]
    update_scale: Mapped[float]
    iteration_fixed_s: Mapped[float]
    memory_scale: Mapped[float]
    memory_fixed_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    iterations: Mapped[int]
    residual: Mapped[float]
    residual_before: Mapped[float]
    job_ids: Mapped[list[Any]]
    notes: Mapped[str] = mapped_column(sa.Text, default="")
    run_spread: Mapped[float] = mapped_column(default=0.0, server_default="0")  # 0020
    harmony_scale: Mapped[float] = mapped_column(default=0.0, server_default="0")  # 0021
    chunks_scale: Mapped[float] = mapped_column(default=0.0, server_default="0")  # 0021
    fitted_at: Mapped[datetime] = mapped_column(index=True)


class AuditRecord(Base):
    """One state-changing call (who, what, when, result), as the server that answered it recorded it.

    No foreign keys: a record outlives what it names, and a refused caller has no tenant. `uid` is set by the
    recording server, so a batch sent again after a lost reply is stored once."""

    __tablename__ = "audit_log"
    __table_args__ = (sa.UniqueConstraint("uid", name="uq_audit_log_uid"),)
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    uid: Mapped[str] = mapped_column(sa.String(40))
    at: Mapped[datetime] = mapped_column(index=True)
    tenant_id: Mapped[str] = mapped_column(Id, index=True)
    tenant_name: Mapped[str] = mapped_column(sa.String(63))
    role: Mapped[str] = mapped_column(EnumName)
    service: Mapped[str] = mapped_column(sa.String(100))
    method: Mapped[str] = mapped_column(sa.String(100), index=True)
    target: Mapped[str] = mapped_column(sa.String(200))
    code: Mapped[str] = mapped_column(sa.String(40))
    message: Mapped[str] = mapped_column(sa.String(500))
    duration_ms: Mapped[float]
    peer: Mapped[str] = mapped_column(sa.String(200))
    server: Mapped[str] = mapped_column(sa.String(40))
