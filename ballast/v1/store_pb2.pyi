import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ballast.v1 import common_pb2 as _common_pb2
from ballast.v1 import fleet_pb2 as _fleet_pb2
from ballast.v1 import job_pb2 as _job_pb2
from ballast.v1 import model_pb2 as _model_pb2
from ballast.v1 import plan_pb2 as _plan_pb2
from ballast.v1 import profile_pb2 as _profile_pb2
from ballast.v1 import queue_pb2 as _queue_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CreateTenantRequest(_message.Message):
    __slots__ = ("name", "admin", "role")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    admin: bool
    role: _common_pb2.TenantRole
    def __init__(self, name: _Optional[str] = ..., admin: _Optional[bool] = ..., role: _Optional[_Union[_common_pb2.TenantRole, str]] = ...) -> None: ...

class CreateTenantResponse(_message.Message):
    __slots__ = ("tenant", "token")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: _common_pb2.Tenant
    token: str
    def __init__(self, tenant: _Optional[_Union[_common_pb2.Tenant, _Mapping]] = ..., token: _Optional[str] = ...) -> None: ...

class RotateTenantTokenRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ("page",)
    PAGE_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants", "next_page_token")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tenant]
    next_page_token: str
    def __init__(self, tenants: _Optional[_Iterable[_Union[_common_pb2.Tenant, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class AuthenticateRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class CreateModelRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _model_pb2.ModelSpec
    def __init__(self, spec: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ("page", "family", "name", "signature")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    family: _model_pb2.ModelFamily
    name: str
    signature: str
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ..., family: _Optional[_Union[_model_pb2.ModelFamily, str]] = ..., name: _Optional[str] = ..., signature: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "next_page_token")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_model_pb2.Model]
    next_page_token: str
    def __init__(self, models: _Optional[_Iterable[_Union[_model_pb2.Model, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CreateProfileRequest(_message.Message):
    __slots__ = ("profile",)
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    profile: _profile_pb2.Profile
    def __init__(self, profile: _Optional[_Union[_profile_pb2.Profile, _Mapping]] = ...) -> None: ...

class ListProfilesRequest(_message.Message):
    __slots__ = ("page", "model_id", "device_kind", "model_signature", "dtype", "software", "projected")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    model_id: str
    device_kind: str
    model_signature: str
    dtype: _common_pb2.DType
    software: str
    projected: bool
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ..., model_id: _Optional[str] = ..., device_kind: _Optional[str] = ..., model_signature: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., software: _Optional[str] = ..., projected: _Optional[bool] = ...) -> None: ...

class ListProfilesResponse(_message.Message):
    __slots__ = ("profiles", "next_page_token")
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    profiles: _containers.RepeatedCompositeFieldContainer[_profile_pb2.Profile]
    next_page_token: str
    def __init__(self, profiles: _Optional[_Iterable[_Union[_profile_pb2.Profile, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RegisterHostRequest(_message.Message):
    __slots__ = ("host",)
    HOST_FIELD_NUMBER: _ClassVar[int]
    host: _fleet_pb2.Host
    def __init__(self, host: _Optional[_Union[_fleet_pb2.Host, _Mapping]] = ...) -> None: ...

class UpdateHostStateRequest(_message.Message):
    __slots__ = ("id", "state", "heartbeat")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: _fleet_pb2.HostState
    heartbeat: bool
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[_fleet_pb2.HostState, str]] = ..., heartbeat: _Optional[bool] = ...) -> None: ...

class TouchHostsRequest(_message.Message):
    __slots__ = ("host_ids",)
    HOST_IDS_FIELD_NUMBER: _ClassVar[int]
    host_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, host_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TouchHostsResponse(_message.Message):
    __slots__ = ("touched",)
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    touched: int
    def __init__(self, touched: _Optional[int] = ...) -> None: ...

class ListHostsRequest(_message.Message):
    __slots__ = ("page", "state", "device_kind", "changed_since")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    CHANGED_SINCE_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    state: _fleet_pb2.HostState
    device_kind: str
    changed_since: _timestamp_pb2.Timestamp
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ..., state: _Optional[_Union[_fleet_pb2.HostState, str]] = ..., device_kind: _Optional[str] = ..., changed_since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListHostsResponse(_message.Message):
    __slots__ = ("hosts", "next_page_token", "read_at")
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    READ_AT_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.Host]
    next_page_token: str
    read_at: _timestamp_pb2.Timestamp
    def __init__(self, hosts: _Optional[_Iterable[_Union[_fleet_pb2.Host, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., read_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class CreatePlanRequest(_message.Message):
    __slots__ = ("plan", "request_id")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    plan: _plan_pb2.Plan
    request_id: str
    def __init__(self, plan: _Optional[_Union[_plan_pb2.Plan, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class ListPlansRequest(_message.Message):
    __slots__ = ("page", "model_id", "job_id", "engine", "ids")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    model_id: str
    job_id: str
    engine: _plan_pb2.PlanEngine
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ..., model_id: _Optional[str] = ..., job_id: _Optional[str] = ..., engine: _Optional[_Union[_plan_pb2.PlanEngine, str]] = ..., ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListPlansResponse(_message.Message):
    __slots__ = ("plans", "next_page_token")
    PLANS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[_plan_pb2.Plan]
    next_page_token: str
    def __init__(self, plans: _Optional[_Iterable[_Union[_plan_pb2.Plan, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _job_pb2.JobSpec
    def __init__(self, spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ...) -> None: ...

class CreateQueuedJobRequest(_message.Message):
    __slots__ = ("spec", "kind", "max_attempts")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    spec: _job_pb2.JobSpec
    kind: str
    max_attempts: int
    def __init__(self, spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., kind: _Optional[str] = ..., max_attempts: _Optional[int] = ...) -> None: ...

class CreateQueuedJobResponse(_message.Message):
    __slots__ = ("job", "request")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.Job
    request: _queue_pb2.QueuedRequest
    def __init__(self, job: _Optional[_Union[_job_pb2.Job, _Mapping]] = ..., request: _Optional[_Union[_queue_pb2.QueuedRequest, _Mapping]] = ...) -> None: ...

class TransitionJobRequest(_message.Message):
    __slots__ = ("id", "state", "expected_state", "message", "event_type", "attributes", "plan_id")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: _job_pb2.JobState
    expected_state: _job_pb2.JobState
    message: str
    event_type: str
    attributes: _containers.ScalarMap[str, str]
    plan_id: str
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[_job_pb2.JobState, str]] = ..., expected_state: _Optional[_Union[_job_pb2.JobState, str]] = ..., message: _Optional[str] = ..., event_type: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ..., plan_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page", "state", "model_id", "changed_since")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CHANGED_SINCE_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    state: _job_pb2.JobState
    model_id: str
    changed_since: _timestamp_pb2.Timestamp
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ..., state: _Optional[_Union[_job_pb2.JobState, str]] = ..., model_id: _Optional[str] = ..., changed_since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token", "read_at")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    READ_AT_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_job_pb2.Job]
    next_page_token: str
    read_at: _timestamp_pb2.Timestamp
    def __init__(self, jobs: _Optional[_Iterable[_Union[_job_pb2.Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., read_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AppendJobEventRequest(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _job_pb2.JobEvent
    def __init__(self, event: _Optional[_Union[_job_pb2.JobEvent, _Mapping]] = ...) -> None: ...

class ListJobEventsRequest(_message.Message):
    __slots__ = ("job_id", "after_seq", "page")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    page: _common_pb2.PageRequest
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListJobEventsResponse(_message.Message):
    __slots__ = ("events", "next_page_token")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_job_pb2.JobEvent]
    next_page_token: str
    def __init__(self, events: _Optional[_Iterable[_Union[_job_pb2.JobEvent, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WriteIterationMetricsRequest(_message.Message):
    __slots__ = ("metrics",)
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.RepeatedCompositeFieldContainer[_job_pb2.IterationMetric]
    def __init__(self, metrics: _Optional[_Iterable[_Union[_job_pb2.IterationMetric, _Mapping]]] = ...) -> None: ...

class WriteIterationMetricsResponse(_message.Message):
    __slots__ = ("written",)
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    written: int
    def __init__(self, written: _Optional[int] = ...) -> None: ...

class ListIterationMetricsRequest(_message.Message):
    __slots__ = ("job_id", "from_iteration", "to_iteration", "stage_index", "page")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ITERATION_FIELD_NUMBER: _ClassVar[int]
    TO_ITERATION_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_iteration: int
    to_iteration: int
    stage_index: int
    page: _common_pb2.PageRequest
    def __init__(self, job_id: _Optional[str] = ..., from_iteration: _Optional[int] = ..., to_iteration: _Optional[int] = ..., stage_index: _Optional[int] = ..., page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListIterationMetricsResponse(_message.Message):
    __slots__ = ("metrics", "next_page_token")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.RepeatedCompositeFieldContainer[_job_pb2.IterationMetric]
    next_page_token: str
    def __init__(self, metrics: _Optional[_Iterable[_Union[_job_pb2.IterationMetric, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RecordLayerMigrationRequest(_message.Message):
    __slots__ = ("migration",)
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    migration: _job_pb2.LayerMigration
    def __init__(self, migration: _Optional[_Union[_job_pb2.LayerMigration, _Mapping]] = ...) -> None: ...

class RecordEvaluationRequest(_message.Message):
    __slots__ = ("evaluation",)
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    evaluation: _job_pb2.Evaluation
    def __init__(self, evaluation: _Optional[_Union[_job_pb2.Evaluation, _Mapping]] = ...) -> None: ...

class ListEvaluationsRequest(_message.Message):
    __slots__ = ("job_id", "page")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    page: _common_pb2.PageRequest
    def __init__(self, job_id: _Optional[str] = ..., page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListEvaluationsResponse(_message.Message):
    __slots__ = ("evaluations", "next_page_token")
    EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    evaluations: _containers.RepeatedCompositeFieldContainer[_job_pb2.Evaluation]
    next_page_token: str
    def __init__(self, evaluations: _Optional[_Iterable[_Union[_job_pb2.Evaluation, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListLayerMigrationsRequest(_message.Message):
    __slots__ = ("job_id", "page")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    page: _common_pb2.PageRequest
    def __init__(self, job_id: _Optional[str] = ..., page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListLayerMigrationsResponse(_message.Message):
    __slots__ = ("migrations", "next_page_token")
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    migrations: _containers.RepeatedCompositeFieldContainer[_job_pb2.LayerMigration]
    next_page_token: str
    def __init__(self, migrations: _Optional[_Iterable[_Union[_job_pb2.LayerMigration, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CreateCheckpointRequest(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: _job_pb2.Checkpoint
    def __init__(self, checkpoint: _Optional[_Union[_job_pb2.Checkpoint, _Mapping]] = ...) -> None: ...

class UpdateCheckpointsRequest(_message.Message):
    __slots__ = ("job_id", "deleted_ids", "exported_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DELETED_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    deleted_ids: _containers.RepeatedScalarFieldContainer[str]
    exported_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., deleted_ids: _Optional[_Iterable[str]] = ..., exported_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job_id", "complete_only", "page")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_ONLY_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    complete_only: bool
    page: _common_pb2.PageRequest
    def __init__(self, job_id: _Optional[str] = ..., complete_only: _Optional[bool] = ..., page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "next_page_token")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[_job_pb2.Checkpoint]
    next_page_token: str
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[_job_pb2.Checkpoint, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class EnqueueRequestRequest(_message.Message):
    __slots__ = ("kind", "payload_json", "max_attempts")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    payload_json: str
    max_attempts: int
    def __init__(self, kind: _Optional[str] = ..., payload_json: _Optional[str] = ..., max_attempts: _Optional[int] = ...) -> None: ...

class EnqueueRequestResponse(_message.Message):
    __slots__ = ("request", "created")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    request: _queue_pb2.QueuedRequest
    created: bool
    def __init__(self, request: _Optional[_Union[_queue_pb2.QueuedRequest, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class ClaimRequestRequest(_message.Message):
    __slots__ = ("id", "worker", "lease_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    worker: str
    lease_seconds: float
    def __init__(self, id: _Optional[str] = ..., worker: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ClaimRequestResponse(_message.Message):
    __slots__ = ("claimed", "request")
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    claimed: bool
    request: _queue_pb2.QueuedRequest
    def __init__(self, claimed: _Optional[bool] = ..., request: _Optional[_Union[_queue_pb2.QueuedRequest, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("id", "lease_token", "lease_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    lease_token: str
    lease_seconds: float
    def __init__(self, id: _Optional[str] = ..., lease_token: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class CompleteRequestRequest(_message.Message):
    __slots__ = ("id", "lease_token", "result_json", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    lease_token: str
    result_json: str
    error: str
    def __init__(self, id: _Optional[str] = ..., lease_token: _Optional[str] = ..., result_json: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("page", "state", "kind")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    state: _queue_pb2.RequestState
    kind: str
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ..., state: _Optional[_Union[_queue_pb2.RequestState, str]] = ..., kind: _Optional[str] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests", "next_page_token")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[_queue_pb2.QueuedRequest]
    next_page_token: str
    def __init__(self, requests: _Optional[_Iterable[_Union[_queue_pb2.QueuedRequest, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ReapExpiredLeasesRequest(_message.Message):
    __slots__ = ("limit", "queued_stale_s")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STALE_S_FIELD_NUMBER: _ClassVar[int]
    limit: int
    queued_stale_s: float
    def __init__(self, limit: _Optional[int] = ..., queued_stale_s: _Optional[float] = ...) -> None: ...

class ReapExpiredLeasesResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[_queue_pb2.QueuedRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[_queue_pb2.QueuedRequest, _Mapping]]] = ...) -> None: ...

class RecordWorkerHeartbeatRequest(_message.Message):
    __slots__ = ("heartbeat",)
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    heartbeat: _queue_pb2.WorkerHeartbeat
    def __init__(self, heartbeat: _Optional[_Union[_queue_pb2.WorkerHeartbeat, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("seen_within_s",)
    SEEN_WITHIN_S_FIELD_NUMBER: _ClassVar[int]
    seen_within_s: float
    def __init__(self, seen_within_s: _Optional[float] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_queue_pb2.WorkerHeartbeat]
    def __init__(self, workers: _Optional[_Iterable[_Union[_queue_pb2.WorkerHeartbeat, _Mapping]]] = ...) -> None: ...

class AcquireLeasesRequest(_message.Message):
    __slots__ = ("job_id", "devices", "placement")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    devices: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.DeviceRef]
    placement: _fleet_pb2.JobPlacement
    def __init__(self, job_id: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[_fleet_pb2.DeviceRef, _Mapping]]] = ..., placement: _Optional[_Union[_fleet_pb2.JobPlacement, _Mapping]] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class AcquireLeasesResponse(_message.Message):
    __slots__ = ("leases", "placement")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.DeviceLease]
    placement: _fleet_pb2.JobPlacement
    def __init__(self, leases: _Optional[_Iterable[_Union[_fleet_pb2.DeviceLease, _Mapping]]] = ..., placement: _Optional[_Union[_fleet_pb2.JobPlacement, _Mapping]] = ...) -> None: ...

class EndLeasesRequest(_message.Message):
    __slots__ = ("job_id", "reason", "host_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: _fleet_pb2.LeaseEndReason
    host_id: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[_Union[_fleet_pb2.LeaseEndReason, str]] = ..., host_id: _Optional[str] = ...) -> None: ...

class EndLeasesResponse(_message.Message):
    __slots__ = ("ended",)
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ended: int
    def __init__(self, ended: _Optional[int] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("live_only", "job_id", "host_id", "since", "page", "changed_since")
    LIVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    CHANGED_SINCE_FIELD_NUMBER: _ClassVar[int]
    live_only: bool
    job_id: str
    host_id: str
    since: _timestamp_pb2.Timestamp
    page: _common_pb2.PageRequest
    changed_since: _timestamp_pb2.Timestamp
    def __init__(self, live_only: _Optional[bool] = ..., job_id: _Optional[str] = ..., host_id: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ..., changed_since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases", "next_page_token", "read_at")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    READ_AT_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.DeviceLease]
    next_page_token: str
    read_at: _timestamp_pb2.Timestamp
    def __init__(self, leases: _Optional[_Iterable[_Union[_fleet_pb2.DeviceLease, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., read_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetFleetPolicyRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class SetFleetPolicyRequest(_message.Message):
    __slots__ = ("policy", "expected_version")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy: _fleet_pb2.FleetPolicy
    expected_version: int
    def __init__(self, policy: _Optional[_Union[_fleet_pb2.FleetPolicy, _Mapping]] = ..., expected_version: _Optional[int] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("sql", "row_limit", "timeout_s")
    SQL_FIELD_NUMBER: _ClassVar[int]
    ROW_LIMIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    sql: str
    row_limit: int
    timeout_s: float
    def __init__(self, sql: _Optional[str] = ..., row_limit: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("columns", "rows", "truncated")
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    columns: _containers.RepeatedScalarFieldContainer[str]
    rows: _containers.RepeatedCompositeFieldContainer[_struct_pb2.ListValue]
    truncated: bool
    def __init__(self, columns: _Optional[_Iterable[str]] = ..., rows: _Optional[_Iterable[_Union[_struct_pb2.ListValue, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class SchemaStatus(_message.Message):
    __slots__ = ("current_revision", "head_revision", "dialect", "now")
    CURRENT_REVISION_FIELD_NUMBER: _ClassVar[int]
    HEAD_REVISION_FIELD_NUMBER: _ClassVar[int]
    DIALECT_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    current_revision: str
    head_revision: str
    dialect: str
    now: _timestamp_pb2.Timestamp
    def __init__(self, current_revision: _Optional[str] = ..., head_revision: _Optional[str] = ..., dialect: _Optional[str] = ..., now: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SchemaStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MarkHostDegradedRequest(_message.Message):
    __slots__ = ("id", "reason", "evidence_json", "job_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_JSON_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    evidence_json: str
    job_id: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ..., evidence_json: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class ClearHostDegradedRequest(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RecordMorphRequest(_message.Message):
    __slots__ = ("morph",)
    MORPH_FIELD_NUMBER: _ClassVar[int]
    morph: _job_pb2.Morph
    def __init__(self, morph: _Optional[_Union[_job_pb2.Morph, _Mapping]] = ...) -> None: ...

class MorphResumedRequest(_message.Message):
    __slots__ = ("id", "first_iteration_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_ITERATION_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    first_iteration_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., first_iteration_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListMorphsRequest(_message.Message):
    __slots__ = ("job_id", "page")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    page: _common_pb2.PageRequest
    def __init__(self, job_id: _Optional[str] = ..., page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListMorphsResponse(_message.Message):
    __slots__ = ("morphs", "next_page_token")
    MORPHS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    morphs: _containers.RepeatedCompositeFieldContainer[_job_pb2.Morph]
    next_page_token: str
    def __init__(self, morphs: _Optional[_Iterable[_Union[_job_pb2.Morph, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RecordCalibrationRequest(_message.Message):
    __slots__ = ("calibration",)
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    calibration: _plan_pb2.Calibration
    def __init__(self, calibration: _Optional[_Union[_plan_pb2.Calibration, _Mapping]] = ...) -> None: ...

class GetCalibrationRequest(_message.Message):
    __slots__ = ("host_class", "min_iterations")
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    MIN_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    host_class: str
    min_iterations: int
    def __init__(self, host_class: _Optional[str] = ..., min_iterations: _Optional[int] = ...) -> None: ...

class ListCalibrationsRequest(_message.Message):
    __slots__ = ("host_class", "page")
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    host_class: str
    page: _common_pb2.PageRequest
    def __init__(self, host_class: _Optional[str] = ..., page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListCalibrationsResponse(_message.Message):
    __slots__ = ("calibrations", "next_page_token")
    CALIBRATIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    calibrations: _containers.RepeatedCompositeFieldContainer[_plan_pb2.Calibration]
    next_page_token: str
    def __init__(self, calibrations: _Optional[_Iterable[_Union[_plan_pb2.Calibration, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class AuditRecord(_message.Message):
    __slots__ = ("id", "at", "tenant_id", "tenant_name", "role", "service", "method", "target", "code", "message", "duration_ms", "peer", "server", "uid")
    ID_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    id: int
    at: _timestamp_pb2.Timestamp
    tenant_id: str
    tenant_name: str
    role: _common_pb2.TenantRole
    service: str
    method: str
    target: str
    code: str
    message: str
    duration_ms: float
    peer: str
    server: str
    uid: str
    def __init__(self, id: _Optional[int] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., tenant_id: _Optional[str] = ..., tenant_name: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.TenantRole, str]] = ..., service: _Optional[str] = ..., method: _Optional[str] = ..., target: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., duration_ms: _Optional[float] = ..., peer: _Optional[str] = ..., server: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class RecordAuditRequest(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AuditRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[AuditRecord, _Mapping]]] = ...) -> None: ...

class RecordAuditResponse(_message.Message):
    __slots__ = ("recorded",)
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    recorded: int
    def __init__(self, recorded: _Optional[int] = ...) -> None: ...

class ListAuditRequest(_message.Message):
    __slots__ = ("tenant_id", "method", "since", "page")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    method: str
    since: _timestamp_pb2.Timestamp
    page: _common_pb2.PageRequest
    def __init__(self, tenant_id: _Optional[str] = ..., method: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListAuditResponse(_message.Message):
    __slots__ = ("records", "next_page_token")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AuditRecord]
    next_page_token: str
    def __init__(self, records: _Optional[_Iterable[_Union[AuditRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
