import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ballast.v1 import common_pb2 as _common_pb2
from ballast.v1 import fleet_pb2 as _fleet_pb2
from ballast.v1 import model_pb2 as _model_pb2
from ballast.v1 import job_pb2 as _job_pb2
from ballast.v1 import plan_pb2 as _plan_pb2
from ballast.v1 import profile_pb2 as _profile_pb2
from ballast.v1 import queue_pb2 as _queue_pb2
from ballast.v1 import store_pb2 as _store_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WaitReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WAIT_REASON_UNSPECIFIED: _ClassVar[WaitReason]
    WAIT_REASON_DEVICES_BUSY: _ClassVar[WaitReason]
    WAIT_REASON_QUOTA: _ClassVar[WaitReason]
    WAIT_REASON_JOB_AHEAD: _ClassVar[WaitReason]
    WAIT_REASON_NO_EXECUTOR: _ClassVar[WaitReason]
    WAIT_REASON_PREEMPTED: _ClassVar[WaitReason]
    WAIT_REASON_REPLANNING: _ClassVar[WaitReason]
    WAIT_REASON_CALIBRATING: _ClassVar[WaitReason]
WAIT_REASON_UNSPECIFIED: WaitReason
WAIT_REASON_DEVICES_BUSY: WaitReason
WAIT_REASON_QUOTA: WaitReason
WAIT_REASON_JOB_AHEAD: WaitReason
WAIT_REASON_NO_EXECUTOR: WaitReason
WAIT_REASON_PREEMPTED: WaitReason
WAIT_REASON_REPLANNING: WaitReason
WAIT_REASON_CALIBRATING: WaitReason

class ProfileOptions(_message.Message):
    __slots__ = ("repeats", "warmup", "stride", "micro_batch_sizes", "intra_op_threads", "calibrate", "calibrate_group_sizes", "skip_memory_trace")
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    INTRA_OP_THREADS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATE_GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    SKIP_MEMORY_TRACE_FIELD_NUMBER: _ClassVar[int]
    repeats: int
    warmup: int
    stride: int
    micro_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    intra_op_threads: int
    calibrate: bool
    calibrate_group_sizes: _containers.RepeatedScalarFieldContainer[int]
    skip_memory_trace: bool
    def __init__(self, repeats: _Optional[int] = ..., warmup: _Optional[int] = ..., stride: _Optional[int] = ..., micro_batch_sizes: _Optional[_Iterable[int]] = ..., intra_op_threads: _Optional[int] = ..., calibrate: _Optional[bool] = ..., calibrate_group_sizes: _Optional[_Iterable[int]] = ..., skip_memory_trace: _Optional[bool] = ...) -> None: ...

class ProfileProgress(_message.Message):
    __slots__ = ("phase", "layer_index", "layers_total", "micro_batch_size", "fraction", "message", "profile", "cached")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    phase: str
    layer_index: int
    layers_total: int
    micro_batch_size: int
    fraction: float
    message: str
    profile: _profile_pb2.Profile
    cached: bool
    def __init__(self, phase: _Optional[str] = ..., layer_index: _Optional[int] = ..., layers_total: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., fraction: _Optional[float] = ..., message: _Optional[str] = ..., profile: _Optional[_Union[_profile_pb2.Profile, _Mapping]] = ..., cached: _Optional[bool] = ...) -> None: ...

class CalibrateRequest(_message.Message):
    __slots__ = ("group_sizes", "sizes_bytes", "backend")
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    SIZES_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    group_sizes: _containers.RepeatedScalarFieldContainer[int]
    sizes_bytes: _containers.RepeatedScalarFieldContainer[int]
    backend: str
    def __init__(self, group_sizes: _Optional[_Iterable[int]] = ..., sizes_bytes: _Optional[_Iterable[int]] = ..., backend: _Optional[str] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("model_id", "device_kind", "max_micro_batch_size", "memory_cap_bytes", "refresh", "model", "dtype", "options", "project_to", "analytical", "time_budget_s")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROJECT_TO_FIELD_NUMBER: _ClassVar[int]
    ANALYTICAL_FIELD_NUMBER: _ClassVar[int]
    TIME_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    device_kind: str
    max_micro_batch_size: int
    memory_cap_bytes: int
    refresh: bool
    model: _model_pb2.ModelSpec
    dtype: _common_pb2.DType
    options: ProfileOptions
    project_to: str
    analytical: bool
    time_budget_s: float
    def __init__(self, model_id: _Optional[str] = ..., device_kind: _Optional[str] = ..., max_micro_batch_size: _Optional[int] = ..., memory_cap_bytes: _Optional[int] = ..., refresh: _Optional[bool] = ..., model: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., options: _Optional[_Union[ProfileOptions, _Mapping]] = ..., project_to: _Optional[str] = ..., analytical: _Optional[bool] = ..., time_budget_s: _Optional[float] = ...) -> None: ...

class ProjectProfileRequest(_message.Message):
    __slots__ = ("profile_id", "device")
    PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    profile_id: str
    device: _fleet_pb2.DeviceSpec
    def __init__(self, profile_id: _Optional[str] = ..., device: _Optional[_Union[_fleet_pb2.DeviceSpec, _Mapping]] = ...) -> None: ...

class ListDeviceKindsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDeviceKindsResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.DeviceSpec]
    def __init__(self, devices: _Optional[_Iterable[_Union[_fleet_pb2.DeviceSpec, _Mapping]]] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("model", "data")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    model: _model_pb2.ModelSpec
    data: _job_pb2.DataSpec
    def __init__(self, model: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ..., data: _Optional[_Union[_job_pb2.DataSpec, _Mapping]] = ...) -> None: ...

class DataInspection(_message.Message):
    __slots__ = ("source", "train_samples", "validation_samples", "largest_token", "fields")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    source: str
    train_samples: int
    validation_samples: int
    largest_token: int
    fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, source: _Optional[str] = ..., train_samples: _Optional[int] = ..., validation_samples: _Optional[int] = ..., largest_token: _Optional[int] = ..., fields: _Optional[_Iterable[str]] = ...) -> None: ...

class Inspection(_message.Message):
    __slots__ = ("model", "data")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    model: _model_pb2.ModelInspection
    data: DataInspection
    def __init__(self, model: _Optional[_Union[_model_pb2.ModelInspection, _Mapping]] = ..., data: _Optional[_Union[DataInspection, _Mapping]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("profile_id", "fleet", "global_batch_size", "memory_budget_bytes", "engine", "schedule")
    PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    profile_id: str
    fleet: _fleet_pb2.Fleet
    global_batch_size: int
    memory_budget_bytes: int
    engine: _plan_pb2.PlanEngine
    schedule: _plan_pb2.Schedule
    def __init__(self, profile_id: _Optional[str] = ..., fleet: _Optional[_Union[_fleet_pb2.Fleet, _Mapping]] = ..., global_batch_size: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., engine: _Optional[_Union[_plan_pb2.PlanEngine, str]] = ..., schedule: _Optional[_Union[_plan_pb2.Schedule, str]] = ...) -> None: ...

class PlanOperation(_message.Message):
    __slots__ = ("request", "plan_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    request: _queue_pb2.QueuedRequest
    plan_id: str
    def __init__(self, request: _Optional[_Union[_queue_pb2.QueuedRequest, _Mapping]] = ..., plan_id: _Optional[str] = ...) -> None: ...

class ComparePlansRequest(_message.Message):
    __slots__ = ("plan_ids",)
    PLAN_IDS_FIELD_NUMBER: _ClassVar[int]
    plan_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, plan_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PlanComparison(_message.Message):
    __slots__ = ("plan_id", "engine", "profile_id", "fleet_name", "devices", "global_batch_size", "micro_batch_size", "num_micro_batches", "pipeline_stages", "schedule", "prediction", "relative_throughput")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    FLEET_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    engine: _plan_pb2.PlanEngine
    profile_id: str
    fleet_name: str
    devices: int
    global_batch_size: int
    micro_batch_size: int
    num_micro_batches: int
    pipeline_stages: int
    schedule: _plan_pb2.Schedule
    prediction: _plan_pb2.Prediction
    relative_throughput: float
    def __init__(self, plan_id: _Optional[str] = ..., engine: _Optional[_Union[_plan_pb2.PlanEngine, str]] = ..., profile_id: _Optional[str] = ..., fleet_name: _Optional[str] = ..., devices: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., pipeline_stages: _Optional[int] = ..., schedule: _Optional[_Union[_plan_pb2.Schedule, str]] = ..., prediction: _Optional[_Union[_plan_pb2.Prediction, _Mapping]] = ..., relative_throughput: _Optional[float] = ...) -> None: ...

class ComparePlansResponse(_message.Message):
    __slots__ = ("plans", "best_plan_id")
    PLANS_FIELD_NUMBER: _ClassVar[int]
    BEST_PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[PlanComparison]
    best_plan_id: str
    def __init__(self, plans: _Optional[_Iterable[_Union[PlanComparison, _Mapping]]] = ..., best_plan_id: _Optional[str] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _job_pb2.JobSpec
    def __init__(self, spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("job_id", "iteration", "format")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    iteration: int
    format: str
    def __init__(self, job_id: _Optional[str] = ..., iteration: _Optional[int] = ..., format: _Optional[str] = ...) -> None: ...

class ExportChunk(_message.Message):
    __slots__ = ("file", "offset", "data", "size", "sha256", "checkpoint_id", "iteration")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    data: bytes
    size: int
    sha256: str
    checkpoint_id: str
    iteration: int
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., iteration: _Optional[int] = ...) -> None: ...

class QueueEntry(_message.Message):
    __slots__ = ("job_id", "tenant_id", "tenant", "priority_class", "priority", "position", "devices", "device_kind", "reason", "detail", "predicted_start_s", "predicted_duration_s", "submitted_at", "preemptions")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_START_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tenant_id: str
    tenant: str
    priority_class: str
    priority: int
    position: int
    devices: int
    device_kind: str
    reason: WaitReason
    detail: str
    predicted_start_s: float
    predicted_duration_s: float
    submitted_at: _timestamp_pb2.Timestamp
    preemptions: int
    def __init__(self, job_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., tenant: _Optional[str] = ..., priority_class: _Optional[str] = ..., priority: _Optional[int] = ..., position: _Optional[int] = ..., devices: _Optional[int] = ..., device_kind: _Optional[str] = ..., reason: _Optional[_Union[WaitReason, str]] = ..., detail: _Optional[str] = ..., predicted_start_s: _Optional[float] = ..., predicted_duration_s: _Optional[float] = ..., submitted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., preemptions: _Optional[int] = ...) -> None: ...

class ListQueueRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListQueueResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ...) -> None: ...

class FleetDevice(_message.Message):
    __slots__ = ("device", "host_name", "device_kind", "online", "lease", "utilisation_last_hour")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_LAST_HOUR_FIELD_NUMBER: _ClassVar[int]
    device: _fleet_pb2.DeviceRef
    host_name: str
    device_kind: str
    online: bool
    lease: _fleet_pb2.DeviceLease
    utilisation_last_hour: float
    def __init__(self, device: _Optional[_Union[_fleet_pb2.DeviceRef, _Mapping]] = ..., host_name: _Optional[str] = ..., device_kind: _Optional[str] = ..., online: _Optional[bool] = ..., lease: _Optional[_Union[_fleet_pb2.DeviceLease, _Mapping]] = ..., utilisation_last_hour: _Optional[float] = ...) -> None: ...

class GetFleetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetFleetResponse(_message.Message):
    __slots__ = ("devices", "policy")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[FleetDevice]
    policy: _fleet_pb2.FleetPolicy
    def __init__(self, devices: _Optional[_Iterable[_Union[FleetDevice, _Mapping]]] = ..., policy: _Optional[_Union[_fleet_pb2.FleetPolicy, _Mapping]] = ...) -> None: ...
