import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ballast.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LinkKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LINK_KIND_UNSPECIFIED: _ClassVar[LinkKind]
    LINK_KIND_NVLINK: _ClassVar[LinkKind]
    LINK_KIND_PCIE: _ClassVar[LinkKind]
    LINK_KIND_INFINIBAND: _ClassVar[LinkKind]
    LINK_KIND_ETHERNET: _ClassVar[LinkKind]
    LINK_KIND_SHARED_MEMORY: _ClassVar[LinkKind]

class HostState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOST_STATE_UNSPECIFIED: _ClassVar[HostState]
    HOST_STATE_ONLINE: _ClassVar[HostState]
    HOST_STATE_LOST: _ClassVar[HostState]
    HOST_STATE_DRAINING: _ClassVar[HostState]
    HOST_STATE_OFFLINE: _ClassVar[HostState]

class LeaseEndReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_END_REASON_UNSPECIFIED: _ClassVar[LeaseEndReason]
    LEASE_END_REASON_FINISHED: _ClassVar[LeaseEndReason]
    LEASE_END_REASON_PREEMPTED: _ClassVar[LeaseEndReason]
    LEASE_END_REASON_HOST_LOST: _ClassVar[LeaseEndReason]
    LEASE_END_REASON_CANCELLED: _ClassVar[LeaseEndReason]
    LEASE_END_REASON_FAILED: _ClassVar[LeaseEndReason]
    LEASE_END_REASON_RELEASED: _ClassVar[LeaseEndReason]
    LEASE_END_REASON_MORPHED: _ClassVar[LeaseEndReason]
LINK_KIND_UNSPECIFIED: LinkKind
LINK_KIND_NVLINK: LinkKind
LINK_KIND_PCIE: LinkKind
LINK_KIND_INFINIBAND: LinkKind
LINK_KIND_ETHERNET: LinkKind
LINK_KIND_SHARED_MEMORY: LinkKind
HOST_STATE_UNSPECIFIED: HostState
HOST_STATE_ONLINE: HostState
HOST_STATE_LOST: HostState
HOST_STATE_DRAINING: HostState
HOST_STATE_OFFLINE: HostState
LEASE_END_REASON_UNSPECIFIED: LeaseEndReason
LEASE_END_REASON_FINISHED: LeaseEndReason
LEASE_END_REASON_PREEMPTED: LeaseEndReason
LEASE_END_REASON_HOST_LOST: LeaseEndReason
LEASE_END_REASON_CANCELLED: LeaseEndReason
LEASE_END_REASON_FAILED: LeaseEndReason
LEASE_END_REASON_RELEASED: LeaseEndReason
LEASE_END_REASON_MORPHED: LeaseEndReason

class Link(_message.Message):
    __slots__ = ("kind", "bandwidth_bytes_per_s", "latency_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    kind: LinkKind
    bandwidth_bytes_per_s: float
    latency_s: float
    def __init__(self, kind: _Optional[_Union[LinkKind, str]] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., latency_s: _Optional[float] = ...) -> None: ...

class DeviceSpec(_message.Message):
    __slots__ = ("kind", "memory_bytes", "peak_flops", "memory_bandwidth_bytes_per_s", "host_link")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    HOST_LINK_FIELD_NUMBER: _ClassVar[int]
    kind: str
    memory_bytes: int
    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    host_link: Link
    def __init__(self, kind: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., peak_flops: _Optional[float] = ..., memory_bandwidth_bytes_per_s: _Optional[float] = ..., host_link: _Optional[_Union[Link, _Mapping]] = ...) -> None: ...

class Fleet(_message.Message):
    __slots__ = ("name", "device", "devices_per_node", "nodes", "intra_node", "inter_node", "host_memory_bytes_per_node")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    INTRA_NODE_FIELD_NUMBER: _ClassVar[int]
    INTER_NODE_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    device: DeviceSpec
    devices_per_node: int
    nodes: int
    intra_node: Link
    inter_node: Link
    host_memory_bytes_per_node: int
    def __init__(self, name: _Optional[str] = ..., device: _Optional[_Union[DeviceSpec, _Mapping]] = ..., devices_per_node: _Optional[int] = ..., nodes: _Optional[int] = ..., intra_node: _Optional[_Union[Link, _Mapping]] = ..., inter_node: _Optional[_Union[Link, _Mapping]] = ..., host_memory_bytes_per_node: _Optional[int] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("index", "spec", "uuid")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    index: int
    spec: DeviceSpec
    uuid: str
    def __init__(self, index: _Optional[int] = ..., spec: _Optional[_Union[DeviceSpec, _Mapping]] = ..., uuid: _Optional[str] = ...) -> None: ...

class Host(_message.Message):
    __slots__ = ("id", "name", "address", "devices", "supported_parallelism", "agent_version", "state", "last_heartbeat_at", "registered_at", "labels", "agent_port", "degraded_reason", "degraded_at", "changed_at")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    AGENT_PORT_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_AT_FIELD_NUMBER: _ClassVar[int]
    CHANGED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    address: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    supported_parallelism: _containers.RepeatedScalarFieldContainer[_common_pb2.ParallelDim]
    agent_version: str
    state: HostState
    last_heartbeat_at: _timestamp_pb2.Timestamp
    registered_at: _timestamp_pb2.Timestamp
    labels: _containers.ScalarMap[str, str]
    agent_port: int
    degraded_reason: str
    degraded_at: _timestamp_pb2.Timestamp
    changed_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., supported_parallelism: _Optional[_Iterable[_Union[_common_pb2.ParallelDim, str]]] = ..., agent_version: _Optional[str] = ..., state: _Optional[_Union[HostState, str]] = ..., last_heartbeat_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., registered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., agent_port: _Optional[int] = ..., degraded_reason: _Optional[str] = ..., degraded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., changed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class DeviceRef(_message.Message):
    __slots__ = ("host_id", "device_index")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    device_index: int
    def __init__(self, host_id: _Optional[str] = ..., device_index: _Optional[int] = ...) -> None: ...

class DeviceLease(_message.Message):
    __slots__ = ("id", "job_id", "tenant_id", "device", "started_at", "ended_at", "end_reason", "device_kind", "rank", "placement_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    tenant_id: str
    device: DeviceRef
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    end_reason: LeaseEndReason
    device_kind: str
    rank: int
    placement_id: str
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., device: _Optional[_Union[DeviceRef, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_reason: _Optional[_Union[LeaseEndReason, str]] = ..., device_kind: _Optional[str] = ..., rank: _Optional[int] = ..., placement_id: _Optional[str] = ...) -> None: ...

class RankPlacement(_message.Message):
    __slots__ = ("rank", "stage_index", "replica_index", "host_id", "device_index")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    rank: int
    stage_index: int
    replica_index: int
    host_id: str
    device_index: int
    def __init__(self, rank: _Optional[int] = ..., stage_index: _Optional[int] = ..., replica_index: _Optional[int] = ..., host_id: _Optional[str] = ..., device_index: _Optional[int] = ...) -> None: ...

class JobPlacement(_message.Message):
    __slots__ = ("id", "job_id", "plan_id", "plan_version", "stages", "replicas", "world_size", "ranks", "rendezvous", "backend", "micro_batch_size", "num_micro_batches", "global_batch_size", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    plan_id: str
    plan_version: int
    stages: int
    replicas: int
    world_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankPlacement]
    rendezvous: str
    backend: str
    micro_batch_size: int
    num_micro_batches: int
    global_batch_size: int
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., plan_id: _Optional[str] = ..., plan_version: _Optional[int] = ..., stages: _Optional[int] = ..., replicas: _Optional[int] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankPlacement, _Mapping]]] = ..., rendezvous: _Optional[str] = ..., backend: _Optional[str] = ..., micro_batch_size: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PriorityClass(_message.Message):
    __slots__ = ("name", "priority", "preempts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREEMPTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    priority: int
    preempts: bool
    def __init__(self, name: _Optional[str] = ..., priority: _Optional[int] = ..., preempts: _Optional[bool] = ...) -> None: ...

class TenantPolicy(_message.Message):
    __slots__ = ("tenant", "device_quota", "weight", "max_priority_class")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_QUOTA_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    device_quota: int
    weight: float
    max_priority_class: str
    def __init__(self, tenant: _Optional[str] = ..., device_quota: _Optional[int] = ..., weight: _Optional[float] = ..., max_priority_class: _Optional[str] = ...) -> None: ...

class FleetPolicy(_message.Message):
    __slots__ = ("version", "priority_classes", "default_priority_class", "tenants", "fair_share_half_life_s", "max_preemptions_per_hour", "created_at", "created_by")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASSES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    FAIR_SHARE_HALF_LIFE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_PREEMPTIONS_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    version: int
    priority_classes: _containers.RepeatedCompositeFieldContainer[PriorityClass]
    default_priority_class: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantPolicy]
    fair_share_half_life_s: float
    max_preemptions_per_hour: int
    created_at: _timestamp_pb2.Timestamp
    created_by: str
    def __init__(self, version: _Optional[int] = ..., priority_classes: _Optional[_Iterable[_Union[PriorityClass, _Mapping]]] = ..., default_priority_class: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantPolicy, _Mapping]]] = ..., fair_share_half_life_s: _Optional[float] = ..., max_preemptions_per_hour: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., created_by: _Optional[str] = ...) -> None: ...
