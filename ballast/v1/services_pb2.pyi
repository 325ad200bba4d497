from ballast.v1 import fleet_pb2 as _fleet_pb2
from ballast.v1 import job_pb2 as _job_pb2
from ballast.v1 import plan_pb2 as _plan_pb2
from ballast.v1 import profile_pb2 as _profile_pb2
from ballast.v1 import queue_pb2 as _queue_pb2
from ballast.v1 import store_pb2 as _store_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileRequest(_message.Message):
    __slots__ = ("model_id", "device_kind", "max_micro_batch_size", "memory_cap_bytes", "refresh")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    device_kind: str
    max_micro_batch_size: int
    memory_cap_bytes: int
    refresh: bool
    def __init__(self, model_id: _Optional[str] = ..., device_kind: _Optional[str] = ..., max_micro_batch_size: _Optional[int] = ..., memory_cap_bytes: _Optional[int] = ..., refresh: _Optional[bool] = ...) -> None: ...

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
