import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ballast.v1 import common_pb2 as _common_pb2
from ballast.v1 import fleet_pb2 as _fleet_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LinkScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LINK_SCOPE_UNSPECIFIED: _ClassVar[LinkScope]
    LINK_SCOPE_INTRA_NODE: _ClassVar[LinkScope]
    LINK_SCOPE_INTER_NODE: _ClassVar[LinkScope]
    LINK_SCOPE_HOST_DEVICE: _ClassVar[LinkScope]
LINK_SCOPE_UNSPECIFIED: LinkScope
LINK_SCOPE_INTRA_NODE: LinkScope
LINK_SCOPE_INTER_NODE: LinkScope
LINK_SCOPE_HOST_DEVICE: LinkScope

class LayerSample(_message.Message):
    __slots__ = ("micro_batch_size", "measured", "forward_s", "backward_s", "recompute_s", "boundary_activation_bytes", "stashed_activation_bytes", "output_bytes", "peak_memory_bytes", "forward_spread", "backward_spread", "off_line")
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_S_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    STASHED_ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SPREAD_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_SPREAD_FIELD_NUMBER: _ClassVar[int]
    OFF_LINE_FIELD_NUMBER: _ClassVar[int]
    micro_batch_size: int
    measured: bool
    forward_s: float
    backward_s: float
    recompute_s: float
    boundary_activation_bytes: int
    stashed_activation_bytes: int
    output_bytes: int
    peak_memory_bytes: int
    forward_spread: float
    backward_spread: float
    off_line: float
    def __init__(self, micro_batch_size: _Optional[int] = ..., measured: _Optional[bool] = ..., forward_s: _Optional[float] = ..., backward_s: _Optional[float] = ..., recompute_s: _Optional[float] = ..., boundary_activation_bytes: _Optional[int] = ..., stashed_activation_bytes: _Optional[int] = ..., output_bytes: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., forward_spread: _Optional[float] = ..., backward_spread: _Optional[float] = ..., off_line: _Optional[float] = ...) -> None: ...

class LayerProfile(_message.Message):
    __slots__ = ("index", "name", "kind", "parameter_count", "parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "extra_inputs", "tied_with", "samples", "note", "measured_as", "batch_input_bytes", "max_micro_batch_size", "optimizer_step_s", "tensor_parallel", "parameter_numels", "parameter_tensors", "sequence_parallel")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INPUTS_FIELD_NUMBER: _ClassVar[int]
    TIED_WITH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AS_FIELD_NUMBER: _ClassVar[int]
    BATCH_INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_S_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_NUMELS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_TENSORS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    kind: str
    parameter_count: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    extra_inputs: _containers.RepeatedScalarFieldContainer[int]
    tied_with: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[LayerSample]
    note: str
    measured_as: int
    batch_input_bytes: int
    max_micro_batch_size: int
    optimizer_step_s: float
    tensor_parallel: int
    parameter_numels: _containers.RepeatedScalarFieldContainer[int]
    parameter_tensors: _containers.RepeatedScalarFieldContainer[int]
    sequence_parallel: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., kind: _Optional[str] = ..., parameter_count: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., gradient_bytes: _Optional[int] = ..., optimizer_state_bytes: _Optional[int] = ..., extra_inputs: _Optional[_Iterable[int]] = ..., tied_with: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[LayerSample, _Mapping]]] = ..., note: _Optional[str] = ..., measured_as: _Optional[int] = ..., batch_input_bytes: _Optional[int] = ..., max_micro_batch_size: _Optional[int] = ..., optimizer_step_s: _Optional[float] = ..., tensor_parallel: _Optional[int] = ..., parameter_numels: _Optional[_Iterable[int]] = ..., parameter_tensors: _Optional[_Iterable[int]] = ..., sequence_parallel: _Optional[int] = ...) -> None: ...

class MemoryTracePoint(_message.Message):
    __slots__ = ("op_index", "op", "layer", "phase", "non_model_bytes")
    OP_INDEX_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NON_MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    op_index: int
    op: str
    layer: str
    phase: str
    non_model_bytes: int
    def __init__(self, op_index: _Optional[int] = ..., op: _Optional[str] = ..., layer: _Optional[str] = ..., phase: _Optional[str] = ..., non_model_bytes: _Optional[int] = ...) -> None: ...

class LinkFit(_message.Message):
    __slots__ = ("collective", "group_size", "latency_s", "bandwidth_bytes_per_s", "bus_bandwidth_bytes_per_s", "r2")
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUS_BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    R2_FIELD_NUMBER: _ClassVar[int]
    collective: str
    group_size: int
    latency_s: float
    bandwidth_bytes_per_s: float
    bus_bandwidth_bytes_per_s: float
    r2: float
    def __init__(self, collective: _Optional[str] = ..., group_size: _Optional[int] = ..., latency_s: _Optional[float] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., bus_bandwidth_bytes_per_s: _Optional[float] = ..., r2: _Optional[float] = ...) -> None: ...

class LinkSample(_message.Message):
    __slots__ = ("scope", "bytes", "seconds")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    scope: LinkScope
    bytes: int
    seconds: float
    def __init__(self, scope: _Optional[_Union[LinkScope, str]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CollectiveSample(_message.Message):
    __slots__ = ("collective", "group_size", "scope", "bytes", "seconds")
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    collective: str
    group_size: int
    scope: LinkScope
    bytes: int
    seconds: float
    def __init__(self, collective: _Optional[str] = ..., group_size: _Optional[int] = ..., scope: _Optional[_Union[LinkScope, str]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CommCalibration(_message.Message):
    __slots__ = ("links", "collectives", "overlap_slowdown", "fits", "unsupported", "colocated_slowdown")
    LINKS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    FITS_FIELD_NUMBER: _ClassVar[int]
    UNSUPPORTED_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkSample]
    collectives: _containers.RepeatedCompositeFieldContainer[CollectiveSample]
    overlap_slowdown: float
    fits: _containers.RepeatedCompositeFieldContainer[LinkFit]
    unsupported: _containers.RepeatedScalarFieldContainer[str]
    colocated_slowdown: float
    def __init__(self, links: _Optional[_Iterable[_Union[LinkSample, _Mapping]]] = ..., collectives: _Optional[_Iterable[_Union[CollectiveSample, _Mapping]]] = ..., overlap_slowdown: _Optional[float] = ..., fits: _Optional[_Iterable[_Union[LinkFit, _Mapping]]] = ..., unsupported: _Optional[_Iterable[str]] = ..., colocated_slowdown: _Optional[float] = ...) -> None: ...

class Profile(_message.Message):
    __slots__ = ("id", "tenant_id", "model_id", "model_signature", "device", "dtype", "software", "intra_op_threads", "layers", "comm", "non_model_memory_bytes", "projected", "source_profile_id", "created_at", "memory_trace", "measured_micro_batch_sizes", "memory_cap_bytes", "profiling_time_s", "composition_factor", "host_noise", "noisy", "measure_passes")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_FIELD_NUMBER: _ClassVar[int]
    INTRA_OP_THREADS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    NON_MODEL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TRACE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_MICRO_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROFILING_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COMPOSITION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    HOST_NOISE_FIELD_NUMBER: _ClassVar[int]
    NOISY_FIELD_NUMBER: _ClassVar[int]
    MEASURE_PASSES_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant_id: str
    model_id: str
    model_signature: str
    device: _fleet_pb2.DeviceSpec
    dtype: _common_pb2.DType
    software: str
    intra_op_threads: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerProfile]
    comm: CommCalibration
    non_model_memory_bytes: int
    projected: bool
    source_profile_id: str
    created_at: _timestamp_pb2.Timestamp
    memory_trace: _containers.RepeatedCompositeFieldContainer[MemoryTracePoint]
    measured_micro_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    memory_cap_bytes: int
    profiling_time_s: float
    composition_factor: float
    host_noise: float
    noisy: bool
    measure_passes: int
    def __init__(self, id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., model_id: _Optional[str] = ..., model_signature: _Optional[str] = ..., device: _Optional[_Union[_fleet_pb2.DeviceSpec, _Mapping]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., software: _Optional[str] = ..., intra_op_threads: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerProfile, _Mapping]]] = ..., comm: _Optional[_Union[CommCalibration, _Mapping]] = ..., non_model_memory_bytes: _Optional[int] = ..., projected: _Optional[bool] = ..., source_profile_id: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., memory_trace: _Optional[_Iterable[_Union[MemoryTracePoint, _Mapping]]] = ..., measured_micro_batch_sizes: _Optional[_Iterable[int]] = ..., memory_cap_bytes: _Optional[int] = ..., profiling_time_s: _Optional[float] = ..., composition_factor: _Optional[float] = ..., host_noise: _Optional[float] = ..., noisy: _Optional[bool] = ..., measure_passes: _Optional[int] = ...) -> None: ...
