import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FP32: _ClassVar[DType]
    DTYPE_FP16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]

class TenantRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENANT_ROLE_UNSPECIFIED: _ClassVar[TenantRole]
    TENANT_ROLE_MEMBER: _ClassVar[TenantRole]
    TENANT_ROLE_VIEWER: _ClassVar[TenantRole]
    TENANT_ROLE_ADMIN: _ClassVar[TenantRole]

class ParallelDim(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARALLEL_DIM_UNSPECIFIED: _ClassVar[ParallelDim]
    PARALLEL_DIM_DP: _ClassVar[ParallelDim]
    PARALLEL_DIM_SDP: _ClassVar[ParallelDim]
    PARALLEL_DIM_TP: _ClassVar[ParallelDim]
    PARALLEL_DIM_PP: _ClassVar[ParallelDim]
    PARALLEL_DIM_ZERO1: _ClassVar[ParallelDim]
    PARALLEL_DIM_ZERO2: _ClassVar[ParallelDim]
    PARALLEL_DIM_CHUNKS: _ClassVar[ParallelDim]
    PARALLEL_DIM_HARMONY: _ClassVar[ParallelDim]
    PARALLEL_DIM_SP: _ClassVar[ParallelDim]

class DpSharding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DP_SHARDING_UNSPECIFIED: _ClassVar[DpSharding]
    DP_SHARDING_ZERO1: _ClassVar[DpSharding]
    DP_SHARDING_ZERO2: _ClassVar[DpSharding]
DTYPE_UNSPECIFIED: DType
DTYPE_FP32: DType
DTYPE_FP16: DType
DTYPE_BF16: DType
TENANT_ROLE_UNSPECIFIED: TenantRole
TENANT_ROLE_MEMBER: TenantRole
TENANT_ROLE_VIEWER: TenantRole
TENANT_ROLE_ADMIN: TenantRole
PARALLEL_DIM_UNSPECIFIED: ParallelDim
PARALLEL_DIM_DP: ParallelDim
PARALLEL_DIM_SDP: ParallelDim
PARALLEL_DIM_TP: ParallelDim
PARALLEL_DIM_PP: ParallelDim
PARALLEL_DIM_ZERO1: ParallelDim
PARALLEL_DIM_ZERO2: ParallelDim
PARALLEL_DIM_CHUNKS: ParallelDim
PARALLEL_DIM_HARMONY: ParallelDim
PARALLEL_DIM_SP: ParallelDim
DP_SHARDING_UNSPECIFIED: DpSharding
DP_SHARDING_ZERO1: DpSharding
DP_SHARDING_ZERO2: DpSharding

class PageRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("id", "name", "admin", "created_at", "role")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    admin: bool
    created_at: _timestamp_pb2.Timestamp
    role: TenantRole
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., admin: _Optional[bool] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., role: _Optional[_Union[TenantRole, str]] = ...) -> None: ...

class Principal(_message.Message):
    __slots__ = ("tenant_id", "tenant_name", "admin", "role")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_NAME_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    tenant_name: str
    admin: bool
    role: TenantRole
    def __init__(self, tenant_id: _Optional[str] = ..., tenant_name: _Optional[str] = ..., admin: _Optional[bool] = ..., role: _Optional[_Union[TenantRole, str]] = ...) -> None: ...
