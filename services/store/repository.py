"""All reads and writes of the metadata store, one method per StoreService RPC.

Every write is one transaction, so nothing is ever half-written. Tenant isolation lives here:
a non-admin principal sees only its own tenant's rows, and another tenant's id answers NotFound
exactly like an unknown id, so ids leak nothing. The clock is injected so tests control time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import secrets
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import sqlalchemy as sa
from google.protobuf import json_format, timestamp_pb2
from google.protobuf.message import Message
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, selectinload

from ballast.v1 import (
    common_pb2,
    fleet_pb2,
    job_pb2,
    model_pb2,
    plan_pb2,
    profile_pb2,
    queue_pb2,
    store_pb2,
)
from services.runtime.auth import Principal, hash_token, new_token
from services.runtime.errors import (
    AlreadyExists,
    BallastError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SchemaOutOfDate,
    Unauthenticated,
    Unavailable,
)
from services.store import job_states
from services.store import models as m
from services.store.db import session_factory
from services.store.validation import model_signature, validate_job_spec, validate_model_spec

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_WORKER_WINDOW_S = 60.0
METRICS_CHUNK = 200  # rows per INSERT; keeps bound parameters far below SQLite's limit
TENANT_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
UNAUTHENTICATED_FIX = "pass a bearer token from `ballast tenant create` or the embedded admin token"
ADMIN_FIX = "use the platform admin token"

QUEUED = "REQUEST_STATE_QUEUED"
RUNNING = "REQUEST_STATE_RUNNING"
SUCCEEDED = "REQUEST_STATE_SUCCEEDED"
FAILED = "REQUEST_STATE_FAILED"

T = TypeVar("T")
M = TypeVar("M", bound=Message)


def utc_now() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


# --- conversions -------------------------------------------------------------------------------


def _ts(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value)
    return ts


def _to_json(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def _from_json(data: dict[str, Any] | None, cls: type[M]) -> M:
    return json_format.ParseDict(data or {}, cls(), ignore_unknown_fields=True)


def _enum_name(enum: Any, value: int, field: str) -> str:
    try:
        return enum.Name(value)
    except ValueError:
        raise InvalidArgument(f"unknown enum value {value}", field=field) from None


def _tenant_pb(row: m.Tenant) -> common_pb2.Tenant:
    return common_pb2.Tenant(id=row.id, name=row.name, admin=row.admin, created_at=_ts(row.created_at))


def _model_pb(row: m.Model) -> model_pb2.Model:
    return model_pb2.Model(
        id=row.id,
        tenant_id=row.tenant_id,
        spec=_from_json(row.spec, model_pb2.ModelSpec),
        signature=row.signature,
        parameter_count=row.parameter_count,
        created_at=_ts(row.created_at),
    )


def _profile_pb(row: m.Profile) -> profile_pb2.Profile:
    out = profile_pb2.Profile(
        id=row.id,
        tenant_id=row.tenant_id,
        model_id=row.model_id,
        model_signature=row.model_signature,
        device=_from_json(row.device, fleet_pb2.DeviceSpec),
        dtype=common_pb2.DType.Value(row.dtype),
        software=row.software,
        intra_op_threads=row.intra_op_threads,
        non_model_memory_bytes=row.non_model_memory_bytes,
        projected=row.projected,
        source_profile_id=row.source_profile_id or "",
        created_at=_ts(row.created_at),
    )
    if row.comm:
        out.comm.CopyFrom(_from_json(row.comm, profile_pb2.CommCalibration))
    for layer in row.layers:
        out.layers.add(
            index=layer.layer_index,
            name=layer.name,
            kind=layer.kind,
            parameter_count=layer.parameter_count,
            parameter_bytes=layer.parameter_bytes,
            gradient_bytes=layer.gradient_bytes,
            optimizer_state_bytes=layer.optimizer_state_bytes,
            extra_inputs=layer.extra_inputs,
            tied_with=layer.tied_with,
            samples=[
                profile_pb2.LayerSample(
                    micro_batch_size=s.micro_batch_size,
                    measured=s.measured,
                    forward_s=s.forward_s,
                    backward_s=s.backward_s,
                    recompute_s=s.recompute_s,
                    boundary_activation_bytes=s.boundary_activation_bytes,
                    stashed_activation_bytes=s.stashed_activation_bytes,
                    output_bytes=s.output_bytes,
                    peak_memory_bytes=s.peak_memory_bytes,
                )
                for s in layer.samples
            ],
        )
    return out


def _host_pb(row: m.Host) -> fleet_pb2.Host:
    return fleet_pb2.Host(
        id=row.id,
        name=row.name,
        address=row.address,
        devices=[
            fleet_pb2.Device(index=d.device_index, spec=_from_json(d.spec, fleet_pb2.DeviceSpec), uuid=d.uuid)
            for d in row.devices
        ],
        supported_parallelism=[common_pb2.ParallelDim.Value(n) for n in row.supported_parallelism],
        agent_version=row.agent_version,
        state=fleet_pb2.HostState.Value(row.state),
        last_heartbeat_at=_ts(row.last_heartbeat_at),
        registered_at=_ts(row.registered_at),
        labels=row.labels,
        agent_port=row.agent_port,
    )


def _plan_pb(row: m.Plan) -> plan_pb2.Plan:
    out = plan_pb2.Plan(
        id=row.id,
        tenant_id=row.tenant_id,
        model_id=row.model_id,
        profile_id=row.profile_id or "",
        job_id=row.job_id or "",
        engine=plan_pb2.PlanEngine.Value(row.engine),
        version=row.version,
        parent_plan_id=row.parent_plan_id or "",
        global_batch_size=row.global_batch_size,
        micro_batch_size=row.micro_batch_size,
        num_micro_batches=row.num_micro_batches,
        schedule=plan_pb2.Schedule.Value(row.schedule),
        stages=[_from_json(s, plan_pb2.Stage) for s in row.stages],
        prediction=_from_json(row.prediction, plan_pb2.Prediction),
        explanation=row.explanation,
        memory_budget_bytes=row.memory_budget_bytes,
        created_at=_ts(row.created_at),
    )
    if row.fleet:
        out.fleet.CopyFrom(_from_json(row.fleet, fleet_pb2.Fleet))
    for layer in row.layers:
        out.layers.add(
            layer_index=layer.layer_index,
            stage_index=layer.stage_index,
            dp=layer.dp,
            sdp=layer.sdp,
            tp=layer.tp,
            order=[common_pb2.ParallelDim.Value(n) for n in layer.order],
            checkpoint=layer.checkpoint,
            swap_activations=layer.swap_activations,
        )
    for cand in row.candidates:
        out.alternatives.add(
            name=cand.name,
            engine=plan_pb2.PlanEngine.Value(cand.engine),
            prediction=plan_pb2.Prediction(
                iteration_time_s=cand.iteration_time_s,
                throughput_samples_per_s=cand.throughput_samples_per_s,
                peak_memory_bytes=cand.peak_memory_bytes,
                out_of_memory=cand.out_of_memory,
            ),
            global_batch_size=cand.global_batch_size,
            reason=cand.reason,
            plan_id=cand.candidate_plan_id or "",
        )
    return out


def _job_pb(row: m.Job) -> job_pb2.Job:
    return job_pb2.Job(
        id=row.id,
        tenant_id=row.tenant_id,
        spec=_from_json(row.spec, job_pb2.JobSpec),
        model_id=row.model_id,
        state=job_pb2.JobState.Value(row.state),
        plan_id=row.plan_id or "",
        plan_version=row.plan_version,
        message=row.message,
        created_at=_ts(row.created_at),
        updated_at=_ts(row.updated_at),
        iteration=row.iteration,
    )


def _event_pb(row: m.JobEvent) -> job_pb2.JobEvent:
    return job_pb2.JobEvent(
        job_id=row.job_id,
        seq=row.seq,
        type=row.type,
        state=job_pb2.JobState.Value(row.state),
        message=row.message,
        attributes=row.attributes,
        created_at=_ts(row.created_at),
    )


def _metric_pb(row: m.IterationMetric) -> job_pb2.IterationMetric:
    return job_pb2.IterationMetric(
        job_id=row.job_id,
        iteration=row.iteration,
        stage_index=row.stage_index,
        replica_index=row.replica_index,
        plan_version=row.plan_version,
        iteration_time_s=row.iteration_time_s,
        forward_s=row.forward_s,
        backward_s=row.backward_s,
        comm_s=row.comm_s,
        idle_s=row.idle_s,
        peak_memory_bytes=row.peak_memory_bytes,
        loss=row.loss if row.loss is not None else 0.0,
        has_loss=row.loss is not None,
        throughput_samples_per_s=row.throughput_samples_per_s,
        predicted_iteration_time_s=row.predicted_iteration_time_s,
        recorded_at=_ts(row.recorded_at),
    )


def _migration_pb(row: m.LayerMigration) -> job_pb2.LayerMigration:
    return job_pb2.LayerMigration(
        id=row.id,
        job_id=row.job_id,
        layer_index=row.layer_index,
        from_stage=row.from_stage,
        to_stage=row.to_stage,
        bytes=row.bytes,
        duration_s=row.duration_s,
        iteration=row.iteration,
        plan_version=row.plan_version,
        created_at=_ts(row.created_at),
    )


def _checkpoint_pb(row: m.Checkpoint) -> job_pb2.Checkpoint:
    return job_pb2.Checkpoint(
        id=row.id,
        job_id=row.job_id,
        iteration=row.iteration,
        plan_version=row.plan_version,
        layers=[
            job_pb2.LayerCheckpoint(layer_index=c.layer_index, uri=c.uri, bytes=c.bytes, sha256=c.sha256)
            for c in row.layers
        ],
        complete=row.complete,
        created_at=_ts(row.created_at),
    )


def _request_pb(row: m.QueuedRequest) -> queue_pb2.QueuedRequest:
    return queue_pb2.QueuedRequest(
        id=row.id,
        tenant_id=row.tenant_id,
        kind=row.kind,
        payload_json=row.payload_json,
        dedupe_key=row.dedupe_key,
        state=queue_pb2.RequestState.Value(row.state),
        lease_owner=row.lease_owner or "",
        lease_token=row.lease_token or "",
        lease_expires_at=_ts(row.lease_expires_at),
        attempts=row.attempts,
        max_attempts=row.max_attempts,
        result_json=row.result_json or "",
        error=row.error or "",
        created_at=_ts(row.created_at),
        updated_at=_ts(row.updated_at),
        requeues=row.requeues,
    )


def _worker_pb(row: m.Worker) -> queue_pb2.WorkerHeartbeat:
    return queue_pb2.WorkerHeartbeat(
        name=row.name,
        pid=row.pid,
        queues=row.queues,
        seen_at=_ts(row.seen_at),
        current_request_id=row.current_request_id or "",
    )


# --- paging ------------------------------------------------------------------------------------


def _page_size(page: common_pb2.PageRequest) -> int:
    return min(page.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def _encode_token(position: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"o": position}).encode()).decode()


def _decode_token(token: str) -> int:
    if not token:
        return 0
    try:
        value = json.loads(base64.urlsafe_b64decode(token.encode()))["o"]
    except (ValueError, KeyError, TypeError, binascii.Error):
        value = None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(
            "malformed page token",
            field="page.page_token",
            fix="pass next_page_token from the previous response unchanged, or empty for the first page",
        )
    return value


def canonical_json(payload: str, field: str) -> str:
    """Parse `payload` and re-serialize it with sorted keys (the dedupe key's input)."""
    try:
        return json.dumps(json.loads(payload), sort_keys=True, separators=(",", ":"))
    except ValueError as err:
        raise InvalidArgument(f"not valid JSON: {err}", field=field, fix="send a JSON document") from None


def dedupe_key(tenant_id: str, kind: str, payload_json: str) -> str:
    canonical = canonical_json(payload_json, "payload_json")
    return hashlib.sha256(json.dumps([tenant_id, kind, canonical]).encode()).hexdigest()


class Repository:
    """The store's data access; methods take the caller's Principal and the RPC's request proto."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        now: Callable[[], datetime] = utc_now,
        allowed_factories: Iterable[str] = (),
    ):
        self.engine = engine
        self.now = now
        self.allowed_factories = tuple(allowed_factories)
        self._sessions = session_factory(engine)

    # --- plumbing ------------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        """One transaction; database connectivity failures become Unavailable."""
        try:
            with self._sessions() as session, session.begin():
                yield session
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError) as err:
            if "no such table" in str(err.orig if isinstance(err, sa_exc.DBAPIError) else err):
                raise self._schema_error() from err
            raise Unavailable(
                f"database unavailable: {err.orig if isinstance(err, sa_exc.DBAPIError) else err}",
                fix="check BALLAST_DATABASE_URL and that the database is running",
            ) from err
        except sa_exc.ProgrammingError as err:
            if "UndefinedTable" in type(err.orig).__name__:
                raise self._schema_error() from err
            raise

    def _schema_error(self) -> BallastError:
        from services.store import schema

        try:
            current = schema.current_revision(self.engine)
        except sa_exc.SQLAlchemyError:
            current = None
        return SchemaOutOfDate(current, schema.head_revision())

    @staticmethod
    def _require_admin(p: Principal, what: str) -> None:
        if not p.admin:
            raise PermissionDenied(f"{what} is for the platform admin", fix=ADMIN_FIX)

    @staticmethod
    def _scoped(stmt: sa.Select, tenant_col: Any, p: Principal) -> sa.Select:
        return stmt if p.admin else stmt.where(tenant_col == p.tenant_id)

    def _one(
        self,
        s: Session,
        cls: Any,
        id_: str,
        p: Principal | None,
        *,
        what: str,
        field: str = "id",
        lock: bool = False,
        options: tuple = (),
    ) -> Any:
        """Fetch by id within the principal's tenant (p=None: platform data, no scoping)."""
        stmt = sa.select(cls).where(cls.id == id_).options(*options)
        if p is not None:
            stmt = self._scoped(stmt, cls.tenant_id, p)
        if lock:
            stmt = stmt.with_for_update()
        row = s.scalars(stmt).first() if id_ else None
        if row is None:
            raise NotFound(f"{what} {id_!r} not found", field=field)
        return row

    def _job(
        self, s: Session, p: Principal, job_id: str, *, field: str = "job_id", lock: bool = False
    ) -> m.Job:
        return self._one(s, m.Job, job_id, p, what="job", field=field, lock=lock)

    @staticmethod
    def _page(s: Session, stmt: sa.Select, page: common_pb2.PageRequest) -> tuple[list[Any], str]:
        size, offset = _page_size(page), _decode_token(page.page_token)
        rows = list(s.scalars(stmt.offset(offset).limit(size + 1)).all())
        more = len(rows) > size
        return rows[:size], _encode_token(offset + size) if more else ""

    def _insert(self, table: Any) -> Any:
        return (postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert)(table)

    # --- tenants and authentication ------------------------------------------------------------

    def create_tenant(
        self, p: Principal, req: store_pb2.CreateTenantRequest
    ) -> store_pb2.CreateTenantResponse:
        self._require_admin(p, "creating tenants")
        if not TENANT_NAME_RE.match(req.name):
            raise InvalidArgument(
                f"invalid tenant name {req.name!r}",
                field="name",
                fix="use 1-63 lowercase letters, digits and dashes; start and end with a letter or digit",
            )
        token = new_token()
        try:
            with self._tx() as s:
                if s.scalars(sa.select(m.Tenant.id).where(m.Tenant.name == req.name)).first():
                    raise AlreadyExists(
                        f"tenant {req.name!r} already exists", field="name", fix="pick another name"
                    )
                row = m.Tenant(
                    id=new_id("tnt"),
                    name=req.name,
                    admin=req.admin,
                    token_hash=hash_token(token),
                    created_at=self.now(),
                )
                s.add(row)
        except sa_exc.IntegrityError:
            raise AlreadyExists(
                f"tenant {req.name!r} already exists", field="name", fix="pick another name"
            ) from None
        return store_pb2.CreateTenantResponse(tenant=_tenant_pb(row), token=token)

    def get_tenant(self, p: Principal, req: store_pb2.GetRequest) -> common_pb2.Tenant:
        if not p.admin and req.id != p.tenant_id:
            raise NotFound(f"tenant {req.id!r} not found", field="id")
        with self._tx() as s:
            return _tenant_pb(self._one(s, m.Tenant, req.id, None, what="tenant"))

    def list_tenants(self, p: Principal, req: store_pb2.ListTenantsRequest) -> store_pb2.ListTenantsResponse:
        self._require_admin(p, "listing tenants")
        with self._tx() as s:
            rows, token = self._page(
                s, sa.select(m.Tenant).order_by(m.Tenant.created_at, m.Tenant.id), req.page
            )
            return store_pb2.ListTenantsResponse(tenants=[_tenant_pb(r) for r in rows], next_page_token=token)

    def authenticate(self, token: str) -> Principal:
        """Resolve a bearer token; only its hash is compared, the token itself is never stored."""
        if not token:
            raise Unauthenticated("no bearer token", fix=UNAUTHENTICATED_FIX)
        with self._tx() as s:
            row = s.scalars(sa.select(m.Tenant).where(m.Tenant.token_hash == hash_token(token))).first()
        if row is None:
            raise Unauthenticated("unknown bearer token", fix=UNAUTHENTICATED_FIX)
        return Principal(tenant_id=row.id, tenant_name=row.name, admin=row.admin)

    def ensure_admin(self, token: str, name: str = "admin") -> Principal:
        """Create (or re-key) the platform-admin tenant so `token` authenticates as admin; idempotent."""
        if not token:
            raise InvalidArgument("empty admin token", field="token", fix="set BALLAST_TOKEN")
        for attempt in range(2):
            try:
                with self._tx() as s:
                    digest = hash_token(token)
                    row = s.scalars(sa.select(m.Tenant).where(m.Tenant.token_hash == digest)).first()
                    if row is None:
                        row = s.scalars(
                            sa.select(m.Tenant).where(m.Tenant.name == name).with_for_update()
                        ).first()
                        if row is None:
                            row = m.Tenant(
                                id=new_id("tnt"),
                                name=name,
                                admin=True,
                                token_hash=digest,
                                created_at=self.now(),
                            )
                            s.add(row)
                        elif not row.admin:
                            raise FailedPrecondition(
                                f"tenant {name!r} exists and is not an admin",
                                field="name",
                                fix="pick another name",
                            )
                        else:
                            row.token_hash = digest
                    elif not row.admin:
                        raise FailedPrecondition(
                            "the admin token belongs to a non-admin tenant",
                            field="token",
                            fix="use a fresh token",
                        )
                return Principal(tenant_id=row.id, tenant_name=row.name, admin=True)
            except sa_exc.IntegrityError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    # --- models --------------------------------------------------------------------------------

    def _resolve_model(self, s: Session, tenant_id: str, spec: model_pb2.ModelSpec, prefix: str) -> m.Model:
        """The tenant's stored model with this content, stored now if new; a name clash is AlreadyExists."""
        signature = model_signature(spec)
        existing = s.scalars(
            sa.select(m.Model).where(m.Model.tenant_id == tenant_id, m.Model.signature == signature)
        ).first()
        if existing is not None:
            return existing
        family = model_pb2.ModelFamily.Name(spec.family).removeprefix("MODEL_FAMILY_").lower()
        name = spec.name or f"{family}-{signature[:12]}"
        clash = s.scalars(
            sa.select(m.Model.id).where(m.Model.tenant_id == tenant_id, m.Model.name == name)
        ).first()
        if clash:
            raise AlreadyExists(
                f"a different model named {name!r} already exists ({clash})",
                field=f"{prefix}.name",
                fix="rename the model, or submit the stored spec unchanged",
            )
        stored = spec.__class__()
        stored.CopyFrom(spec)
        stored.name = name
        row = m.Model(
            id=new_id("mdl"),
            tenant_id=tenant_id,
            name=name,
            family=model_pb2.ModelFamily.Name(spec.family),
            signature=signature,
            parameter_count=0,
            spec=_to_json(stored),
            created_at=self.now(),
        )
        s.add(row)
        s.flush()
        return row

    def create_model(self, p: Principal, req: store_pb2.CreateModelRequest) -> model_pb2.Model:
        validate_model_spec(req.spec, self.allowed_factories)
        if not req.spec.name:
            raise InvalidArgument(
                "a stored model needs a name", field="spec.name", fix='e.g. name: "gpt-tiny"'
            )
        try:
            with self._tx() as s:
                signature = model_signature(req.spec)
                same = s.scalars(
                    sa.select(m.Model).where(m.Model.tenant_id == p.tenant_id, m.Model.signature == signature)
                ).first()
                if same is not None and same.name != req.spec.name:
                    raise AlreadyExists(
                        f"an identical spec is already stored as model {same.name!r} ({same.id})",
                        field="spec",
                        fix=f"use model {same.id}",
                    )
                return _model_pb(same or self._resolve_model(s, p.tenant_id, req.spec, "spec"))
        except sa_exc.IntegrityError:
            raise AlreadyExists(f"model {req.spec.name!r} already exists", field="spec.name") from None

    def get_model(self, p: Principal, req: store_pb2.GetRequest) -> model_pb2.Model:
        with self._tx() as s:
            return _model_pb(self._one(s, m.Model, req.id, p, what="model"))

    def list_models(self, p: Principal, req: store_pb2.ListModelsRequest) -> store_pb2.ListModelsResponse:
        stmt = self._scoped(sa.select(m.Model), m.Model.tenant_id, p).order_by(m.Model.created_at, m.Model.id)
        if req.family:
            stmt = stmt.where(m.Model.family == _enum_name(model_pb2.ModelFamily, req.family, "family"))
        if req.name:
            stmt = stmt.where(m.Model.name == req.name)
        with self._tx() as s:
            rows, token = self._page(s, stmt, req.page)
            return store_pb2.ListModelsResponse(models=[_model_pb(r) for r in rows], next_page_token=token)

    # --- profiles ------------------------------------------------------------------------------

    _PROFILE_LOAD = (selectinload(m.Profile.layers).selectinload(m.ProfileLayer.samples),)

    def create_profile(self, p: Principal, req: store_pb2.CreateProfileRequest) -> profile_pb2.Profile:
        pr = req.profile
        if not pr.device.kind:
            raise InvalidArgument("device kind is not set", field="profile.device.kind", fix='e.g. "cpu"')
        with self._tx() as s:
            model = self._one(s, m.Model, pr.model_id, p, what="model", field="profile.model_id", lock=True)
            if pr.source_profile_id:
                self._one(
                    s, m.Profile, pr.source_profile_id, p, what="profile", field="profile.source_profile_id"
                )
            row = m.Profile(
                id=new_id("prf"),
                tenant_id=model.tenant_id,
                model_id=model.id,
                model_signature=pr.model_signature or model.signature,
                device_kind=pr.device.kind,
                dtype=_enum_name(common_pb2.DType, pr.dtype, "profile.dtype"),
                software=pr.software,
                intra_op_threads=pr.intra_op_threads,
                projected=pr.projected,
                source_profile_id=pr.source_profile_id or None,
                non_model_memory_bytes=pr.non_model_memory_bytes,
                device=_to_json(pr.device),
                comm=_to_json(pr.comm),
                created_at=self.now(),
            )
            for i, layer in enumerate(pr.layers):
                field = f"profile.layers[{i}]"
                if layer.index != i:
                    raise InvalidArgument(
                        f"layer index {layer.index} at position {i}",
                        field=f"{field}.index",
                        fix="list layers 0..n-1",
                    )
                sizes = [smp.micro_batch_size for smp in layer.samples]
                if any(b <= 0 for b in sizes) or sizes != sorted(set(sizes)):
                    raise InvalidArgument(
                        "micro-batch sizes must be positive, unique and ascending",
                        field=f"{field}.samples",
                        fix="one sample per micro-batch size, ascending",
                    )
                row.layers.append(
                    m.ProfileLayer(
                        layer_index=layer.index,
                        name=layer.name,
                        kind=layer.kind,
                        parameter_count=layer.parameter_count,
                        parameter_bytes=layer.parameter_bytes,
                        gradient_bytes=layer.gradient_bytes,
                        optimizer_state_bytes=layer.optimizer_state_bytes,
                        extra_inputs=list(layer.extra_inputs),
                        tied_with=list(layer.tied_with),
                        samples=[
                            m.ProfileLayerSample(
                                micro_batch_size=smp.micro_batch_size,
                                measured=smp.measured,
                                forward_s=smp.forward_s,
                                backward_s=smp.backward_s,
                                recompute_s=smp.recompute_s,
                                boundary_activation_bytes=smp.boundary_activation_bytes,
                                stashed_activation_bytes=smp.stashed_activation_bytes,
                                output_bytes=smp.output_bytes,
                                peak_memory_bytes=smp.peak_memory_bytes,
                            )
                            for smp in layer.samples
                        ],
                    )
                )
            s.add(row)
            total = sum(layer.parameter_count for layer in pr.layers)
            if total and not model.parameter_count:
                model.parameter_count = total  # "0 until profiled"
            s.flush()
            return _profile_pb(row)

    def get_profile(self, p: Principal, req: store_pb2.GetRequest) -> profile_pb2.Profile:
        with self._tx() as s:
            return _profile_pb(self._one(s, m.Profile, req.id, p, what="profile", options=self._PROFILE_LOAD))

    def list_profiles(
        self, p: Principal, req: store_pb2.ListProfilesRequest
    ) -> store_pb2.ListProfilesResponse:
        stmt = self._scoped(sa.select(m.Profile), m.Profile.tenant_id, p).options(*self._PROFILE_LOAD)
        stmt = stmt.order_by(m.Profile.created_at, m.Profile.id)
        if req.model_id:
            stmt = stmt.where(m.Profile.model_id == req.model_id)
        if req.device_kind:
            stmt = stmt.where(m.Profile.device_kind == req.device_kind)
        if req.model_signature:
            stmt = stmt.where(m.Profile.model_signature == req.model_signature)
        with self._tx() as s:
            rows, token = self._page(s, stmt, req.page)
            return store_pb2.ListProfilesResponse(
                profiles=[_profile_pb(r) for r in rows], next_page_token=token
            )

    # --- hosts (platform data: anyone reads, admin writes) ------------------------------------

    def register_host(self, p: Principal, req: store_pb2.RegisterHostRequest) -> fleet_pb2.Host:
        self._require_admin(p, "registering hosts")
        h = req.host
        if not h.name:
            raise InvalidArgument("host name is not set", field="host.name", fix="set the agent's host name")
        indexes = [d.index for d in h.devices]
        if len(set(indexes)) != len(indexes):
            raise InvalidArgument(
                "duplicate device index", field="host.devices", fix="one entry per device index"
            )
        for i, d in enumerate(h.devices):
            if not d.spec.kind:
                raise InvalidArgument(
                    "device kind is not set", field=f"host.devices[{i}].spec.kind", fix='e.g. "cpu"'
                )
        state = _enum_name(fleet_pb2.HostState, h.state or fleet_pb2.HOST_STATE_ONLINE, "host.state")
        parallelism = [
            _enum_name(common_pb2.ParallelDim, d, "host.supported_parallelism")
            for d in h.supported_parallelism
        ]
        for attempt in range(2):  # a concurrent first registration of the same name: retry as an update
            try:
                with self._tx() as s:
                    now = self.now()
                    row = s.scalars(
                        sa.select(m.Host)
                        .where(m.Host.name == h.name)
                        .options(selectinload(m.Host.devices))
                        .with_for_update()
                    ).first()
                    if row is None:
                        row = m.Host(id=new_id("hst"), name=h.name, registered_at=now)
                        s.add(row)
                    else:
                        row.devices.clear()
                        s.flush()
                    row.address, row.agent_port, row.agent_version = h.address, h.agent_port, h.agent_version
                    row.state, row.supported_parallelism, row.labels = state, parallelism, dict(h.labels)
                    row.last_heartbeat_at = now
                    row.devices.extend(
                        m.Device(
                            device_index=d.index,
                            kind=d.spec.kind,
                            memory_bytes=d.spec.memory_bytes,
                            peak_flops=d.spec.peak_flops,
                            uuid=d.uuid,
                            spec=_to_json(d.spec),
                        )
                        for d in h.devices
                    )
                    s.flush()
                    return _host_pb(row)
            except sa_exc.IntegrityError:
                if attempt:
                    raise AlreadyExists(
                        f"host {h.name!r} is being registered concurrently", field="host.name"
                    ) from None
        raise AssertionError("unreachable")

    def update_host_state(self, p: Principal, req: store_pb2.UpdateHostStateRequest) -> fleet_pb2.Host:
        self._require_admin(p, "changing host state")
        if not req.state:
            raise InvalidArgument("state is not set", field="state", fix="e.g. HOST_STATE_ONLINE")
        state = _enum_name(fleet_pb2.HostState, req.state, "state")
        with self._tx() as s:
            row = self._one(
                s, m.Host, req.id, None, what="host", lock=True, options=(selectinload(m.Host.devices),)
            )
            row.state = state
            if req.heartbeat:
                row.last_heartbeat_at = self.now()
            s.flush()
            return _host_pb(row)

    def get_host(self, p: Principal, req: store_pb2.GetRequest) -> fleet_pb2.Host:
        with self._tx() as s:
            return _host_pb(
                self._one(s, m.Host, req.id, None, what="host", options=(selectinload(m.Host.devices),))
            )

    def list_hosts(self, p: Principal, req: store_pb2.ListHostsRequest) -> store_pb2.ListHostsResponse:
        stmt = sa.select(m.Host).options(selectinload(m.Host.devices)).order_by(m.Host.name)
        if req.state:
            stmt = stmt.where(m.Host.state == _enum_name(fleet_pb2.HostState, req.state, "state"))
        if req.device_kind:
            stmt = stmt.where(
                m.Host.id.in_(sa.select(m.Device.host_id).where(m.Device.kind == req.device_kind))
            )
        with self._tx() as s:
            rows, token = self._page(s, stmt, req.page)
            return store_pb2.ListHostsResponse(hosts=[_host_pb(r) for r in rows], next_page_token=token)

    # --- plans ---------------------------------------------------------------------------------

    _PLAN_LOAD = (selectinload(m.Plan.layers), selectinload(m.Plan.candidates))

    def create_plan(self, p: Principal, req: store_pb2.CreatePlanRequest) -> plan_pb2.Plan:
        pl = req.plan
        with self._tx() as s:
            model = self._one(s, m.Model, pl.model_id, p, what="model", field="plan.model_id")
            if pl.profile_id:
                self._one(s, m.Profile, pl.profile_id, p, what="profile", field="plan.profile_id")
            if pl.parent_plan_id:
                self._one(s, m.Plan, pl.parent_plan_id, p, what="plan", field="plan.parent_plan_id")
            version = pl.version
            if pl.job_id:
                job = self._job(s, p, pl.job_id, field="plan.job_id", lock=True)
                if job.model_id != model.id:
                    raise FailedPrecondition(
                        f"job {job.id} trains model {job.model_id}, not {model.id}", field="plan.model_id"
                    )
                if not version:
                    latest = s.scalar(sa.select(sa.func.max(m.Plan.version)).where(m.Plan.job_id == job.id))
                    version = (latest or 0) + 1
            pred = pl.prediction
            row = m.Plan(
                id=new_id("pln"),
                tenant_id=model.tenant_id,
                model_id=model.id,
                profile_id=pl.profile_id or None,
                job_id=pl.job_id or None,
                engine=_enum_name(plan_pb2.PlanEngine, pl.engine, "plan.engine"),
                version=version or 1,
                parent_plan_id=pl.parent_plan_id or None,
                global_batch_size=pl.global_batch_size,
                micro_batch_size=pl.micro_batch_size,
                num_micro_batches=pl.num_micro_batches,
                schedule=_enum_name(plan_pb2.Schedule, pl.schedule, "plan.schedule"),
                pipeline_degree=len(pl.stages) or (max((x.stage_index for x in pl.layers), default=0) + 1),
                iteration_time_s=pred.iteration_time_s,
                throughput_samples_per_s=pred.throughput_samples_per_s,
                peak_memory_bytes=pred.peak_memory_bytes,
                out_of_memory=pred.out_of_memory,
                memory_budget_bytes=pl.memory_budget_bytes,
                fleet=_to_json(pl.fleet),
                stages=[_to_json(st) for st in pl.stages],
                prediction=_to_json(pred),
                explanation=pl.explanation,
                created_at=self.now(),
            )
            s.add(row)
            s.flush()  # the plan row exists now; a bad layer below must roll it back with everything else
            seen: set[int] = set()
            for i, layer in enumerate(pl.layers):
                self._check_plan_layer(layer, i, seen, len(pl.stages))
                row.layers.append(
                    m.PlanLayer(
                        layer_index=layer.layer_index,
                        stage_index=layer.stage_index,
                        dp=layer.dp,
                        sdp=layer.sdp,
                        tp=layer.tp,
                        order=[
                            _enum_name(common_pb2.ParallelDim, d, f"plan.layers[{i}].order")
                            for d in layer.order
                        ],
                        checkpoint=layer.checkpoint,
                        swap_activations=layer.swap_activations,
                    )
                )
                s.flush()
            for pos, alt in enumerate(pl.alternatives):
                row.candidates.append(
                    m.PlanCandidate(
                        position=pos,
                        name=alt.name,
                        engine=_enum_name(
                            plan_pb2.PlanEngine, alt.engine, f"plan.alternatives[{pos}].engine"
                        ),
                        global_batch_size=alt.global_batch_size,
                        iteration_time_s=alt.prediction.iteration_time_s,
                        throughput_samples_per_s=alt.prediction.throughput_samples_per_s,
                        peak_memory_bytes=alt.prediction.peak_memory_bytes,
                        out_of_memory=alt.prediction.out_of_memory,
                        reason=alt.reason,
                        candidate_plan_id=alt.plan_id or None,
                    )
                )
            s.flush()
            return _plan_pb(row)

    @staticmethod
    def _check_plan_layer(layer: plan_pb2.LayerStrategy, i: int, seen: set[int], num_stages: int) -> None:
        field = f"plan.layers[{i}]"
        if layer.layer_index in seen:
            raise InvalidArgument(
                f"layer {layer.layer_index} appears twice",
                field=f"{field}.layer_index",
                fix="one strategy per layer",
            )
        seen.add(layer.layer_index)
        if num_stages and layer.stage_index >= num_stages:
            raise InvalidArgument(
                f"stage {layer.stage_index} does not exist (plan has {num_stages})",
                field=f"{field}.stage_index",
                fix="use a stage index listed in plan.stages",
            )
        for dim in ("dp", "sdp", "tp"):
            if getattr(layer, dim) < 1:
                raise InvalidArgument(
                    "parallel degree must be at least 1",
                    field=f"{field}.{dim}",
                    fix="use 1 for a dimension the layer is not split along",
                )

    def get_plan(self, p: Principal, req: store_pb2.GetRequest) -> plan_pb2.Plan:
        with self._tx() as s:
            return _plan_pb(self._one(s, m.Plan, req.id, p, what="plan", options=self._PLAN_LOAD))

    def list_plans(self, p: Principal, req: store_pb2.ListPlansRequest) -> store_pb2.ListPlansResponse:
        stmt = self._scoped(sa.select(m.Plan), m.Plan.tenant_id, p).options(*self._PLAN_LOAD)
        stmt = stmt.order_by(m.Plan.created_at, m.Plan.id)
        if req.model_id:
            stmt = stmt.where(m.Plan.model_id == req.model_id)
        if req.job_id:
            stmt = stmt.where(m.Plan.job_id == req.job_id)
        if req.engine:
            stmt = stmt.where(m.Plan.engine == _enum_name(plan_pb2.PlanEngine, req.engine, "engine"))
        with self._tx() as s:
            rows, token = self._page(s, stmt, req.page)
            return store_pb2.ListPlansResponse(plans=[_plan_pb(r) for r in rows], next_page_token=token)

    # --- jobs and events -----------------------------------------------------------------------

    def _append_event(
        self, s: Session, job: m.Job, type_: str, message: str, attributes: dict[str, str]
    ) -> m.JobEvent:
        """Next gapless seq; the caller holds the job row's lock."""
        job.last_event_seq += 1
        event = m.JobEvent(
            job_id=job.id,
            seq=job.last_event_seq,
            type=type_,
            state=job.state,
            message=message,
            attributes=dict(attributes),
            created_at=self.now(),
        )
        s.add(event)
        return event

    def create_job(self, p: Principal, req: store_pb2.CreateJobRequest) -> job_pb2.Job:
        validate_job_spec(req.spec, self.allowed_factories)
        try:
            with self._tx() as s:
                model = self._resolve_model(s, p.tenant_id, req.spec.model, "spec.model")
                now = self.now()
                job = m.Job(
                    id=new_id("job"),
                    tenant_id=p.tenant_id,
                    model_id=model.id,
                    name=req.spec.name,
                    state=job_states.SUBMITTED,
                    plan_id=None,
                    plan_version=0,
                    message="",
                    iteration=0,
                    last_event_seq=0,
                    spec=_to_json(req.spec),
                    created_at=now,
                    updated_at=now,
                )
                s.add(job)
                s.flush()
                self._append_event(s, job, "SUBMITTED", "job submitted", {"model_id": model.id})
                s.flush()
                return _job_pb(job)
        except sa_exc.IntegrityError:
            raise AlreadyExists(
                "a model with this name was stored concurrently",
                field="spec.model.name",
                fix="retry the submission",
            ) from None

    def get_job(self, p: Principal, req: store_pb2.GetRequest) -> job_pb2.Job:
        with self._tx() as s:
            return _job_pb(self._job(s, p, req.id, field="id"))

    def list_jobs(self, p: Principal, req: store_pb2.ListJobsRequest) -> store_pb2.ListJobsResponse:
        stmt = self._scoped(sa.select(m.Job), m.Job.tenant_id, p).order_by(
            m.Job.created_at.desc(), m.Job.id.desc()
        )
        if req.state:
            stmt = stmt.where(m.Job.state == _enum_name(job_pb2.JobState, req.state, "state"))
        if req.model_id:
            stmt = stmt.where(m.Job.model_id == req.model_id)
        with self._tx() as s:
            rows, token = self._page(s, stmt, req.page)
            return store_pb2.ListJobsResponse(jobs=[_job_pb(r) for r in rows], next_page_token=token)

    def transition_job(self, p: Principal, req: store_pb2.TransitionJobRequest) -> job_pb2.Job:
        target = _enum_name(job_pb2.JobState, req.state, "state")
        with self._tx() as s:
            job = self._job(s, p, req.id, field="id", lock=True)
            if req.expected_state:
                expected = _enum_name(job_pb2.JobState, req.expected_state, "expected_state")
                if job.state != expected:
                    raise FailedPrecondition(
                        f"job is {job.state}, not {expected}",
                        field="expected_state",
                        fix="re-read the job and decide again",
                    )
            job_states.check_transition(job.state, target)
            if req.plan_id:
                plan = self._one(s, m.Plan, req.plan_id, p, what="plan", field="plan_id")
                if plan.job_id not in (None, job.id) or plan.model_id != job.model_id:
                    raise FailedPrecondition(
                        f"plan {plan.id} does not belong to job {job.id}",
                        field="plan_id",
                        fix="adopt a plan created for this job's model",
                    )
                job.plan_id, job.plan_version = plan.id, plan.version
            job.state = target
            job.message = req.message
            job.updated_at = self.now()
            attributes = dict(req.attributes)
            if req.plan_id:
                attributes.setdefault("plan_id", req.plan_id)
            self._append_event(s, job, req.event_type or "STATE_CHANGED", req.message, attributes)
            s.flush()
            return _job_pb(job)

    def append_job_event(self, p: Principal, req: store_pb2.AppendJobEventRequest) -> job_pb2.JobEvent:
        ev = req.event
        if not ev.type:
            raise InvalidArgument("event type is not set", field="event.type", fix='e.g. "MIGRATION"')
        with self._tx() as s:
            job = self._job(s, p, ev.job_id, field="event.job_id", lock=True)
            event = self._append_event(s, job, ev.type, ev.message, dict(ev.attributes))
            s.flush()
            return _event_pb(event)

    def list_job_events(
        self, p: Principal, req: store_pb2.ListJobEventsRequest
    ) -> store_pb2.ListJobEventsResponse:
        size = _page_size(req.page)
        after = req.after_seq if req.after_seq else _decode_token(req.page.page_token)
        with self._tx() as s:
            self._job(s, p, req.job_id)
            rows = s.scalars(
                sa.select(m.JobEvent)
                .where(m.JobEvent.job_id == req.job_id, m.JobEvent.seq > after)
                .order_by(m.JobEvent.seq)
                .limit(size + 1)
            ).all()
            more = len(rows) > size
            rows = rows[:size]
            token = _encode_token(rows[-1].seq) if more else ""
            return store_pb2.ListJobEventsResponse(events=[_event_pb(r) for r in rows], next_page_token=token)

    # --- iteration metrics ---------------------------------------------------------------------

    def write_iteration_metrics(
        self, p: Principal, req: store_pb2.WriteIterationMetricsRequest
    ) -> store_pb2.WriteIterationMetricsResponse:
        """Bulk insert; rows already stored (same job, plan version, iteration, stage, replica) skip."""
        if not req.metrics:
            return store_pb2.WriteIterationMetricsResponse(written=0)
        now = self.now()
        rows = []
        for row in req.metrics:
            rows.append(
                {
                    "job_id": row.job_id,
                    "iteration": row.iteration,
                    "stage_index": row.stage_index,
                    "replica_index": row.replica_index,
                    "plan_version": row.plan_version,
                    "iteration_time_s": row.iteration_time_s,
                    "forward_s": row.forward_s,
                    "backward_s": row.backward_s,
                    "comm_s": row.comm_s,
                    "idle_s": row.idle_s,
                    "peak_memory_bytes": row.peak_memory_bytes,
                    "loss": row.loss if row.has_loss else None,
                    "throughput_samples_per_s": row.throughput_samples_per_s,
                    "predicted_iteration_time_s": row.predicted_iteration_time_s,
                    "recorded_at": row.recorded_at.ToDatetime(UTC) if row.HasField("recorded_at") else now,
                }
            )
        written = 0
        with self._tx() as s:
            ids = {r["job_id"] for r in rows}
            owned = set(
                s.scalars(self._scoped(sa.select(m.Job.id).where(m.Job.id.in_(ids)), m.Job.tenant_id, p))
            )
            for i, r in enumerate(rows):
                if r["job_id"] not in owned:
                    raise NotFound(f"job {r['job_id']!r} not found", field=f"metrics[{i}].job_id")
            for start in range(0, len(rows), METRICS_CHUNK):
                stmt = self._insert(m.IterationMetric).values(rows[start : start + METRICS_CHUNK])
                # RETURNING yields only rows actually inserted (rowcount is unreliable for multi-row inserts).
                written += len(s.execute(stmt.on_conflict_do_nothing().returning(m.IterationMetric.id)).all())
            for job_id in owned:  # Job.iteration: last iteration reported
                top = max(r["iteration"] for r in rows if r["job_id"] == job_id)
                s.execute(
                    sa.update(m.Job).where(m.Job.id == job_id, m.Job.iteration < top).values(iteration=top)
                )
        return store_pb2.WriteIterationMetricsResponse(written=written)

    def list_iteration_metrics(
        self, p: Principal, req: store_pb2.ListIterationMetricsRequest
    ) -> store_pb2.ListIterationMetricsResponse:
        t = m.IterationMetric
        stmt = sa.select(t).where(t.job_id == req.job_id, t.iteration >= req.from_iteration)
        if req.to_iteration:
            stmt = stmt.where(t.iteration < req.to_iteration)
        if req.HasField("stage_index"):
            stmt = stmt.where(t.stage_index == req.stage_index)
        stmt = stmt.order_by(t.iteration, t.stage_index, t.replica_index, t.plan_version, t.id)
        with self._tx() as s:
            self._job(s, p, req.job_id)
            rows, token = self._page(s, stmt, req.page)
            return store_pb2.ListIterationMetricsResponse(
                metrics=[_metric_pb(r) for r in rows], next_page_token=token
            )

    # --- migrations and checkpoints ------------------------------------------------------------

    def record_layer_migration(
        self, p: Principal, req: store_pb2.RecordLayerMigrationRequest
    ) -> job_pb2.LayerMigration:
        mg = req.migration
        with self._tx() as s:
            self._job(s, p, mg.job_id, field="migration.job_id")
            row = m.LayerMigration(
                id=new_id("mig"),
                job_id=mg.job_id,
                layer_index=mg.layer_index,
                from_stage=mg.from_stage,
                to_stage=mg.to_stage,
                bytes=mg.bytes,
                duration_s=mg.duration_s,
                iteration=mg.iteration,
                plan_version=mg.plan_version,
                created_at=self.now(),
            )
            s.add(row)
            s.flush()
            return _migration_pb(row)

    def list_layer_migrations(
        self, p: Principal, req: store_pb2.ListLayerMigrationsRequest
    ) -> store_pb2.ListLayerMigrationsResponse:
        t = m.LayerMigration
        stmt = sa.select(t).where(t.job_id == req.job_id).order_by(t.created_at, t.id)
        with self._tx() as s:
            self._job(s, p, req.job_id)
            rows, token = self._page(s, stmt, req.page)
            return store_pb2.ListLayerMigrationsResponse(
                migrations=[_migration_pb(r) for r in rows], next_page_token=token
            )

    def create_checkpoint(self, p: Principal, req: store_pb2.CreateCheckpointRequest) -> job_pb2.Checkpoint:
        ck = req.checkpoint
        indexes = [layer.layer_index for layer in ck.layers]
        if len(set(indexes)) != len(indexes):
            raise InvalidArgument(
                "duplicate layer index", field="checkpoint.layers", fix="one file per layer"
            )
        with self._tx() as s:
            self._job(s, p, ck.job_id, field="checkpoint.job_id")
            row = m.Checkpoint(
                id=new_id("ckp"),
                job_id=ck.job_id,
                iteration=ck.iteration,
                plan_version=ck.plan_version,
                complete=ck.complete,
                created_at=self.now(),
                layers=[
                    m.CheckpointLayer(layer_index=c.layer_index, uri=c.uri, bytes=c.bytes, sha256=c.sha256)
                    for c in ck.layers
                ],
            )
            s.add(row)
            s.flush()
            return _checkpoint_pb(row)

    def _checkpoints(self, p: Principal) -> sa.Select:
        stmt = sa.select(m.Checkpoint).options(selectinload(m.Checkpoint.layers))
        if not p.admin:
            stmt = stmt.join(m.Job, m.Job.id == m.Checkpoint.job_id).where(m.Job.tenant_id == p.tenant_id)
        return stmt

    def get_checkpoint(self, p: Principal, req: store_pb2.GetRequest) -> job_pb2.Checkpoint:
        with self._tx() as s:
            row = s.scalars(self._checkpoints(p).where(m.Checkpoint.id == req.id)).first()
            if row is None:
                raise NotFound(f"checkpoint {req.id!r} not found", field="id")
            return _checkpoint_pb(row)

    def list_checkpoints(
        self, p: Principal, req: store_pb2.ListCheckpointsRequest
    ) -> store_pb2.ListCheckpointsResponse:
        t = m.Checkpoint
        stmt = self._checkpoints(p).where(t.job_id == req.job_id)
        if req.complete_only:
            stmt = stmt.where(t.complete.is_(True))
        stmt = stmt.order_by(t.iteration.desc(), t.created_at.desc(), t.id)
        with self._tx() as s:
            self._job(s, p, req.job_id)
            rows, token = self._page(s, stmt, req.page)
            return store_pb2.ListCheckpointsResponse(
                checkpoints=[_checkpoint_pb(r) for r in rows], next_page_token=token
            )

    # --- queued requests -----------------------------------------------------------------------

    def enqueue_request(
        self, p: Principal, req: store_pb2.EnqueueRequestRequest
    ) -> store_pb2.EnqueueRequestResponse:
        """Store a request once per (tenant, kind, payload); a duplicate returns the stored row."""
        if not req.kind:
            raise InvalidArgument("kind is not set", field="kind", fix='e.g. "planner.search"')
        key = dedupe_key(p.tenant_id, req.kind, req.payload_json)
        try:
            with self._tx() as s:
                existing = s.scalars(
                    sa.select(m.QueuedRequest).where(m.QueuedRequest.dedupe_key == key)
                ).first()
                if existing is not None:
                    return store_pb2.EnqueueRequestResponse(request=_request_pb(existing), created=False)
                now = self.now()
                row = m.QueuedRequest(
                    id=new_id("req"),
                    tenant_id=p.tenant_id,
                    kind=req.kind,
                    payload_json=req.payload_json,
                    dedupe_key=key,
                    state=QUEUED,
                    attempts=0,
                    max_attempts=req.max_attempts or DEFAULT_MAX_ATTEMPTS,
                    requeues=0,
                    created_at=now,
                    updated_at=now,
                )
                s.add(row)
                s.flush()
                return store_pb2.EnqueueRequestResponse(request=_request_pb(row), created=True)
        except sa_exc.IntegrityError:  # lost a race with an identical enqueue: theirs is the request
            with self._tx() as s:
                existing = s.scalars(
                    sa.select(m.QueuedRequest).where(m.QueuedRequest.dedupe_key == key)
                ).one()
                return store_pb2.EnqueueRequestResponse(request=_request_pb(existing), created=False)

    def get_queued_request(self, p: Principal, req: store_pb2.GetRequest) -> queue_pb2.QueuedRequest:
        with self._tx() as s:
            return _request_pb(self._one(s, m.QueuedRequest, req.id, p, what="request"))

    def list_requests(
        self, p: Principal, req: store_pb2.ListRequestsRequest
    ) -> store_pb2.ListRequestsResponse:
        t = m.QueuedRequest
        stmt = self._scoped(sa.select(t), t.tenant_id, p).order_by(t.created_at, t.id)
        if req.state:
            stmt = stmt.where(t.state == _enum_name(queue_pb2.RequestState, req.state, "state"))
        if req.kind:
            stmt = stmt.where(t.kind == req.kind)
        with self._tx() as s:
            rows, token = self._page(s, stmt, req.page)
            return store_pb2.ListRequestsResponse(
                requests=[_request_pb(r) for r in rows], next_page_token=token
            )

    @staticmethod
    def _lease_seconds(value: float) -> timedelta:
        if not value > 0:
            raise InvalidArgument("lease must be positive", field="lease_seconds", fix="e.g. 60")
        return timedelta(seconds=value)

    def claim_request(
        self, p: Principal, req: store_pb2.ClaimRequestRequest
    ) -> store_pb2.ClaimRequestResponse:
        """Lease a QUEUED request (or a RUNNING one whose lease expired) to `worker`."""
        self._require_admin(p, "claiming requests")
        if not req.worker:
            raise InvalidArgument("worker is not set", field="worker", fix="pass the worker's name")
        lease = self._lease_seconds(req.lease_seconds)
        with self._tx() as s:
            row = self._one(s, m.QueuedRequest, req.id, None, what="request", lock=True)
            now = self.now()
            live = row.state == RUNNING and row.lease_expires_at is not None and row.lease_expires_at > now
            if row.state in (SUCCEEDED, FAILED) or live:
                return store_pb2.ClaimRequestResponse(claimed=False, request=_request_pb(row))
            row.updated_at = now
            if row.attempts >= row.max_attempts:
                row.state, row.error = FAILED, f"gave up after {row.attempts} attempts (max_attempts)"
                row.lease_owner = row.lease_token = row.lease_expires_at = None
                s.flush()
                return store_pb2.ClaimRequestResponse(claimed=False, request=_request_pb(row))
            row.state, row.attempts = RUNNING, row.attempts + 1
            row.lease_owner, row.lease_token = req.worker, secrets.token_hex(16)
            row.lease_expires_at = now + lease
            s.flush()
            return store_pb2.ClaimRequestResponse(claimed=True, request=_request_pb(row))

    def _leased(self, s: Session, id_: str, token: str) -> m.QueuedRequest:
        row = self._one(s, m.QueuedRequest, id_, None, what="request", lock=True)
        if row.state in (SUCCEEDED, FAILED):
            raise FailedPrecondition(
                f"request already finished ({row.state})", field="id", fix="nothing to do; it completed once"
            )
        if row.state != RUNNING or not token or row.lease_token != token:
            raise FailedPrecondition(
                "lease lost",
                field="lease_token",
                fix="stop working on it; another worker holds or will take it",
            )
        return row

    def renew_lease(self, p: Principal, req: store_pb2.RenewLeaseRequest) -> queue_pb2.QueuedRequest:
        self._require_admin(p, "renewing leases")
        lease = self._lease_seconds(req.lease_seconds)
        with self._tx() as s:
            row = self._leased(s, req.id, req.lease_token)
            now = self.now()
            if row.lease_expires_at is None or row.lease_expires_at <= now:
                raise FailedPrecondition(
                    "lease lost (expired)", field="lease_token", fix="renew more often than the lease length"
                )
            row.lease_expires_at, row.updated_at = now + lease, now
            s.flush()
            return _request_pb(row)

    def complete_request(
        self, p: Principal, req: store_pb2.CompleteRequestRequest
    ) -> queue_pb2.QueuedRequest:
        """Finish exactly once; a holder of a stale token (re-claimed or reaped) is refused."""
        self._require_admin(p, "completing requests")
        if req.result_json and req.error:
            raise InvalidArgument("set result_json or error, not both", field="error")
        if req.result_json:
            canonical_json(req.result_json, "result_json")
        with self._tx() as s:
            row = self._leased(s, req.id, req.lease_token)
            row.state = FAILED if req.error else SUCCEEDED
            row.result_json, row.error = req.result_json or None, req.error or None
            row.lease_token = row.lease_expires_at = None
            row.updated_at = self.now()
            s.flush()
            return _request_pb(row)

    def reap_expired_leases(
        self, p: Principal, req: store_pb2.ReapExpiredLeasesRequest
    ) -> store_pb2.ReapExpiredLeasesResponse:
        """Return RUNNING requests whose lease expired to QUEUED so the sweeper can re-enqueue them."""
        self._require_admin(p, "reaping leases")
        t = m.QueuedRequest
        with self._tx() as s:
            now = self.now()
            rows = s.scalars(
                sa.select(t)
                .where(t.state == RUNNING, t.lease_expires_at <= now)
                .order_by(t.lease_expires_at, t.id)
                .limit(req.limit or DEFAULT_PAGE_SIZE)
                .with_for_update(skip_locked=True)
            ).all()
            for row in rows:
                row.state, row.requeues, row.updated_at = QUEUED, row.requeues + 1, now
                row.lease_owner = row.lease_token = row.lease_expires_at = None
            s.flush()
            return store_pb2.ReapExpiredLeasesResponse(requests=[_request_pb(r) for r in rows])

    # --- workers -------------------------------------------------------------------------------

    def record_worker_heartbeat(
        self, p: Principal, req: store_pb2.RecordWorkerHeartbeatRequest
    ) -> queue_pb2.WorkerHeartbeat:
        """Upsert by name; seen_at is the store's clock, so worker clock skew cannot fake liveness."""
        self._require_admin(p, "recording worker heartbeats")
        hb = req.heartbeat
        if not hb.name:
            raise InvalidArgument(
                "worker name is not set", field="heartbeat.name", fix="pass the celery hostname"
            )
        values = {
            "pid": hb.pid,
            "queues": list(hb.queues),
            "seen_at": self.now(),
            "current_request_id": hb.current_request_id or None,
        }
        with self._tx() as s:
            stmt = self._insert(m.Worker).values(name=hb.name, **values)
            s.execute(
                stmt.on_conflict_do_update(
                    index_elements=["name"], set_={k: stmt.excluded[k] for k in values}
                )
            )
            row = s.scalars(sa.select(m.Worker).where(m.Worker.name == hb.name)).one()
            return _worker_pb(row)

    def list_workers(self, p: Principal, req: store_pb2.ListWorkersRequest) -> store_pb2.ListWorkersResponse:
        window = timedelta(seconds=req.seen_within_s or DEFAULT_WORKER_WINDOW_S)
        with self._tx() as s:
            rows = s.scalars(
                sa.select(m.Worker).where(m.Worker.seen_at >= self.now() - window).order_by(m.Worker.name)
            ).all()
            return store_pb2.ListWorkersResponse(workers=[_worker_pb(r) for r in rows])
