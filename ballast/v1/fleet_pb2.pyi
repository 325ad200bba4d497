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
    __slots__ = ("id", "name", "address", "devices", "supported_parallelism", "agent_version", "state", "last_heartbeat_at", "registered_at", "labels", "agent_port")
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
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., supported_parallelism: _Optional[_Iterable[_Union[_common_pb2.ParallelDim, str]]] = ..., agent_version: _Optional[str] = ..., state: _Optional[_Union[HostState, str]] = ..., last_heartbeat_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., registered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., agent_port: _Optional[int] = ...) -> None: ...
