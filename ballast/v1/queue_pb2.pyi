import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATE_UNSPECIFIED: _ClassVar[RequestState]
    REQUEST_STATE_QUEUED: _ClassVar[RequestState]
    REQUEST_STATE_RUNNING: _ClassVar[RequestState]
    REQUEST_STATE_SUCCEEDED: _ClassVar[RequestState]
    REQUEST_STATE_FAILED: _ClassVar[RequestState]
REQUEST_STATE_UNSPECIFIED: RequestState
REQUEST_STATE_QUEUED: RequestState
REQUEST_STATE_RUNNING: RequestState
REQUEST_STATE_SUCCEEDED: RequestState
REQUEST_STATE_FAILED: RequestState

class QueuedRequest(_message.Message):
    __slots__ = ("id", "tenant_id", "kind", "payload_json", "dedupe_key", "state", "lease_owner", "lease_token", "lease_expires_at", "attempts", "max_attempts", "result_json", "error", "created_at", "updated_at", "requeues")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    DEDUPE_KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    REQUEUES_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant_id: str
    kind: str
    payload_json: str
    dedupe_key: str
    state: RequestState
    lease_owner: str
    lease_token: str
    lease_expires_at: _timestamp_pb2.Timestamp
    attempts: int
    max_attempts: int
    result_json: str
    error: str
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    requeues: int
    def __init__(self, id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., kind: _Optional[str] = ..., payload_json: _Optional[str] = ..., dedupe_key: _Optional[str] = ..., state: _Optional[_Union[RequestState, str]] = ..., lease_owner: _Optional[str] = ..., lease_token: _Optional[str] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempts: _Optional[int] = ..., max_attempts: _Optional[int] = ..., result_json: _Optional[str] = ..., error: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., requeues: _Optional[int] = ...) -> None: ...

class WorkerHeartbeat(_message.Message):
    __slots__ = ("name", "pid", "queues", "seen_at", "current_request_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    SEEN_AT_FIELD_NUMBER: _ClassVar[int]
    CURRENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    pid: int
    queues: _containers.RepeatedScalarFieldContainer[str]
    seen_at: _timestamp_pb2.Timestamp
    current_request_id: str
    def __init__(self, name: _Optional[str] = ..., pid: _Optional[int] = ..., queues: _Optional[_Iterable[str]] = ..., seen_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., current_request_id: _Optional[str] = ...) -> None: ...
