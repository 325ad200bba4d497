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

class PlanEngine(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_ENGINE_UNSPECIFIED: _ClassVar[PlanEngine]
    PLAN_ENGINE_GALVATRON: _ClassVar[PlanEngine]
    PLAN_ENGINE_VARUNA: _ClassVar[PlanEngine]
    PLAN_ENGINE_HARMONY: _ClassVar[PlanEngine]
    PLAN_ENGINE_PATRICKSTAR: _ClassVar[PlanEngine]
    PLAN_ENGINE_VPIPE: _ClassVar[PlanEngine]
    PLAN_ENGINE_MANUAL: _ClassVar[PlanEngine]
    PLAN_ENGINE_BASELINE: _ClassVar[PlanEngine]

class Schedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_UNSPECIFIED: _ClassVar[Schedule]
    SCHEDULE_GPIPE: _ClassVar[Schedule]
    SCHEDULE_1F1B: _ClassVar[Schedule]
    SCHEDULE_VARUNA: _ClassVar[Schedule]
    SCHEDULE_HARMONY_WRAP: _ClassVar[Schedule]
PLAN_ENGINE_UNSPECIFIED: PlanEngine
PLAN_ENGINE_GALVATRON: PlanEngine
PLAN_ENGINE_VARUNA: PlanEngine
PLAN_ENGINE_HARMONY: PlanEngine
PLAN_ENGINE_PATRICKSTAR: PlanEngine
PLAN_ENGINE_VPIPE: PlanEngine
PLAN_ENGINE_MANUAL: PlanEngine
PLAN_ENGINE_BASELINE: PlanEngine
SCHEDULE_UNSPECIFIED: Schedule
SCHEDULE_GPIPE: Schedule
SCHEDULE_1F1B: Schedule
SCHEDULE_VARUNA: Schedule
SCHEDULE_HARMONY_WRAP: Schedule

class LayerStrategy(_message.Message):
    __slots__ = ("layer_index", "stage_index", "dp", "sdp", "tp", "order", "checkpoint", "swap_activations", "dp_sharding", "sequence_parallel")
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    SDP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SWAP_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    DP_SHARDING_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    layer_index: int
    stage_index: int
    dp: int
    sdp: int
    tp: int
    order: _containers.RepeatedScalarFieldContainer[_common_pb2.ParallelDim]
    checkpoint: bool
    swap_activations: bool
    dp_sharding: _common_pb2.DpSharding
    sequence_parallel: bool
    def __init__(self, layer_index: _Optional[int] = ..., stage_index: _Optional[int] = ..., dp: _Optional[int] = ..., sdp: _Optional[int] = ..., tp: _Optional[int] = ..., order: _Optional[_Iterable[_Union[_common_pb2.ParallelDim, str]]] = ..., checkpoint: _Optional[bool] = ..., swap_activations: _Optional[bool] = ..., dp_sharding: _Optional[_Union[_common_pb2.DpSharding, str]] = ..., sequence_parallel: _Optional[bool] = ...) -> None: ...

class Stage(_message.Message):
    __slots__ = ("index", "layer_begin", "layer_end", "devices", "predicted_time_s", "predicted_peak_memory_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    layer_begin: int
    layer_end: int
    devices: int
    predicted_time_s: float
    predicted_peak_memory_bytes: int
    def __init__(self, index: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., devices: _Optional[int] = ..., predicted_time_s: _Optional[float] = ..., predicted_peak_memory_bytes: _Optional[int] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("iteration_time_s", "throughput_samples_per_s", "peak_memory_bytes", "bubble_fraction", "out_of_memory", "iteration_time_high_s")
    ITERATION_TIME_S_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_MEMORY_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TIME_HIGH_S_FIELD_NUMBER: _ClassVar[int]
    iteration_time_s: float
    throughput_samples_per_s: float
    peak_memory_bytes: int
    bubble_fraction: float
    out_of_memory: bool
    iteration_time_high_s: float
    def __init__(self, iteration_time_s: _Optional[float] = ..., throughput_samples_per_s: _Optional[float] = ..., peak_memory_bytes: _Optional[int] = ..., bubble_fraction: _Optional[float] = ..., out_of_memory: _Optional[bool] = ..., iteration_time_high_s: _Optional[float] = ...) -> None: ...

class PlanAlternative(_message.Message):
    __slots__ = ("name", "engine", "prediction", "global_batch_size", "reason", "plan_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    engine: PlanEngine
    prediction: Prediction
    global_batch_size: int
    reason: str
    plan_id: str
    def __init__(self, name: _Optional[str] = ..., engine: _Optional[_Union[PlanEngine, str]] = ..., prediction: _Optional[_Union[Prediction, _Mapping]] = ..., global_batch_size: _Optional[int] = ..., reason: _Optional[str] = ..., plan_id: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("id", "tenant_id", "model_id", "profile_id", "job_id", "fleet", "engine", "version", "parent_plan_id", "global_batch_size", "micro_batch_size", "num_micro_batches", "schedule", "stages", "layers", "prediction", "alternatives", "explanation", "memory_budget_bytes", "created_at", "offload", "harmony")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    HARMONY_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant_id: str
    model_id: str
    profile_id: str
    job_id: str
    fleet: _fleet_pb2.Fleet
    engine: PlanEngine
    version: int
    parent_plan_id: str
    global_batch_size: int
    micro_batch_size: int
    num_micro_batches: int
    schedule: Schedule
    stages: _containers.RepeatedCompositeFieldContainer[Stage]
    layers: _containers.RepeatedCompositeFieldContainer[LayerStrategy]
    prediction: Prediction
    alternatives: _containers.RepeatedCompositeFieldContainer[PlanAlternative]
    explanation: str
    memory_budget_bytes: int
    created_at: _timestamp_pb2.Timestamp
    offload: ChunkOffload
    harmony: HarmonySwap
    def __init__(self, id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., model_id: _Optional[str] = ..., profile_id: _Optional[str] = ..., job_id: _Optional[str] = ..., fleet: _Optional[_Union[_fleet_pb2.Fleet, _Mapping]] = ..., engine: _Optional[_Union[PlanEngine, str]] = ..., version: _Optional[int] = ..., parent_plan_id: _Optional[str] = ..., global_batch_size: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., schedule: _Optional[_Union[Schedule, str]] = ..., stages: _Optional[_Iterable[_Union[Stage, _Mapping]]] = ..., layers: _Optional[_Iterable[_Union[LayerStrategy, _Mapping]]] = ..., prediction: _Optional[_Union[Prediction, _Mapping]] = ..., alternatives: _Optional[_Iterable[_Union[PlanAlternative, _Mapping]]] = ..., explanation: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., offload: _Optional[_Union[ChunkOffload, _Mapping]] = ..., harmony: _Optional[_Union[HarmonySwap, _Mapping]] = ...) -> None: ...

class LayerSpan(_message.Message):
    __slots__ = ("begin", "end")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    begin: int
    end: int
    def __init__(self, begin: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class HarmonySwap(_message.Message):
    __slots__ = ("forward_micro_batch", "forward_packs", "backward_micro_batch", "backward_packs", "devices", "prefetch", "device_budget_bytes", "predicted_to_device_bytes", "predicted_to_host_bytes", "predicted_peer_bytes", "predicted_iteration_s", "predicted_device_peak_bytes", "configurations_explored", "predicted_to_device_by_device", "predicted_to_host_by_device")
    FORWARD_MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PACKS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_PACKS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TO_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TO_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PEER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_DEVICE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONFIGURATIONS_EXPLORED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TO_DEVICE_BY_DEVICE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TO_HOST_BY_DEVICE_FIELD_NUMBER: _ClassVar[int]
    forward_micro_batch: int
    forward_packs: _containers.RepeatedCompositeFieldContainer[LayerSpan]
    backward_micro_batch: int
    backward_packs: _containers.RepeatedCompositeFieldContainer[LayerSpan]
    devices: int
    prefetch: bool
    device_budget_bytes: int
    predicted_to_device_bytes: int
    predicted_to_host_bytes: int
    predicted_peer_bytes: int
    predicted_iteration_s: float
    predicted_device_peak_bytes: int
    configurations_explored: int
    predicted_to_device_by_device: _containers.RepeatedScalarFieldContainer[int]
    predicted_to_host_by_device: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, forward_micro_batch: _Optional[int] = ..., forward_packs: _Optional[_Iterable[_Union[LayerSpan, _Mapping]]] = ..., backward_micro_batch: _Optional[int] = ..., backward_packs: _Optional[_Iterable[_Union[LayerSpan, _Mapping]]] = ..., devices: _Optional[int] = ..., prefetch: _Optional[bool] = ..., device_budget_bytes: _Optional[int] = ..., predicted_to_device_bytes: _Optional[int] = ..., predicted_to_host_bytes: _Optional[int] = ..., predicted_peer_bytes: _Optional[int] = ..., predicted_iteration_s: _Optional[float] = ..., predicted_device_peak_bytes: _Optional[int] = ..., configurations_explored: _Optional[int] = ..., predicted_to_device_by_device: _Optional[_Iterable[int]] = ..., predicted_to_host_by_device: _Optional[_Iterable[int]] = ...) -> None: ...

class ChunkOffload(_message.Message):
    __slots__ = ("chunk_bytes", "device_budget_bytes", "predicted_to_device_bytes", "predicted_to_host_bytes", "predicted_gathered_bytes", "predicted_reduced_bytes", "predicted_swap_s", "chunks", "predicted_device_peak_bytes", "plain_peak_memory_bytes", "predicted_host_bytes", "predicted_iteration_s")
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TO_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TO_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GATHERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_REDUCED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SWAP_S_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_DEVICE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAIN_PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    chunk_bytes: int
    device_budget_bytes: int
    predicted_to_device_bytes: int
    predicted_to_host_bytes: int
    predicted_gathered_bytes: int
    predicted_reduced_bytes: int
    predicted_swap_s: float
    chunks: int
    predicted_device_peak_bytes: int
    plain_peak_memory_bytes: int
    predicted_host_bytes: int
    predicted_iteration_s: float
    def __init__(self, chunk_bytes: _Optional[int] = ..., device_budget_bytes: _Optional[int] = ..., predicted_to_device_bytes: _Optional[int] = ..., predicted_to_host_bytes: _Optional[int] = ..., predicted_gathered_bytes: _Optional[int] = ..., predicted_reduced_bytes: _Optional[int] = ..., predicted_swap_s: _Optional[float] = ..., chunks: _Optional[int] = ..., predicted_device_peak_bytes: _Optional[int] = ..., plain_peak_memory_bytes: _Optional[int] = ..., predicted_host_bytes: _Optional[int] = ..., predicted_iteration_s: _Optional[float] = ...) -> None: ...

class Calibration(_message.Message):
    __slots__ = ("id", "host_class", "device_kind", "cores", "colocated", "version", "forward_scale", "forward_fixed_s", "backward_scale", "backward_fixed_s", "allreduce_scale", "update_scale", "iteration_fixed_s", "memory_scale", "memory_fixed_bytes", "iterations", "residual", "residual_before", "job_ids", "fitted_at", "notes", "run_spread", "harmony_scale", "chunks_scale")
    ID_FIELD_NUMBER: _ClassVar[int]
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SCALE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_SCALE_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SCALE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SCALE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIXED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_BEFORE_FIELD_NUMBER: _ClassVar[int]
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    FITTED_AT_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    RUN_SPREAD_FIELD_NUMBER: _ClassVar[int]
    HARMONY_SCALE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SCALE_FIELD_NUMBER: _ClassVar[int]
    id: str
    host_class: str
    device_kind: str
    cores: int
    colocated: int
    version: int
    forward_scale: float
    forward_fixed_s: float
    backward_scale: float
    backward_fixed_s: float
    allreduce_scale: float
    update_scale: float
    iteration_fixed_s: float
    memory_scale: float
    memory_fixed_bytes: int
    iterations: int
    residual: float
    residual_before: float
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    fitted_at: _timestamp_pb2.Timestamp
    notes: str
    run_spread: float
    harmony_scale: float
    chunks_scale: float
    def __init__(self, id: _Optional[str] = ..., host_class: _Optional[str] = ..., device_kind: _Optional[str] = ..., cores: _Optional[int] = ..., colocated: _Optional[int] = ..., version: _Optional[int] = ..., forward_scale: _Optional[float] = ..., forward_fixed_s: _Optional[float] = ..., backward_scale: _Optional[float] = ..., backward_fixed_s: _Optional[float] = ..., allreduce_scale: _Optional[float] = ..., update_scale: _Optional[float] = ..., iteration_fixed_s: _Optional[float] = ..., memory_scale: _Optional[float] = ..., memory_fixed_bytes: _Optional[int] = ..., iterations: _Optional[int] = ..., residual: _Optional[float] = ..., residual_before: _Optional[float] = ..., job_ids: _Optional[_Iterable[str]] = ..., fitted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., notes: _Optional[str] = ..., run_spread: _Optional[float] = ..., harmony_scale: _Optional[float] = ..., chunks_scale: _Optional[float] = ...) -> None: ...
