import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ballast.v1 import fleet_pb2 as _fleet_pb2
from ballast.v1 import model_pb2 as _model_pb2
from ballast.v1 import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_SUBMITTED: _ClassVar[JobState]
    JOB_STATE_PROFILING: _ClassVar[JobState]
    JOB_STATE_PLANNING: _ClassVar[JobState]
    JOB_STATE_SCHEDULED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_REPARTITIONING: _ClassVar[JobState]
    JOB_STATE_MORPHING: _ClassVar[JobState]
    JOB_STATE_CANCELLING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]

class TokenDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_DTYPE_UNSPECIFIED: _ClassVar[TokenDtype]
    TOKEN_DTYPE_UINT16: _ClassVar[TokenDtype]
    TOKEN_DTYPE_UINT32: _ClassVar[TokenDtype]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_SUBMITTED: JobState
JOB_STATE_PROFILING: JobState
JOB_STATE_PLANNING: JobState
JOB_STATE_SCHEDULED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_REPARTITIONING: JobState
JOB_STATE_MORPHING: JobState
JOB_STATE_CANCELLING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_QUEUED: JobState
TOKEN_DTYPE_UNSPECIFIED: TokenDtype
TOKEN_DTYPE_UINT16: TokenDtype
TOKEN_DTYPE_UINT32: TokenDtype

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "learning_rate", "weight_decay")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    name: str
    learning_rate: float
    weight_decay: float
    def __init__(self, name: _Optional[str] = ..., learning_rate: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class TokenFile(_message.Message):
    __slots__ = ("path", "dtype", "validation_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    dtype: TokenDtype
    validation_path: str
    def __init__(self, path: _Optional[str] = ..., dtype: _Optional[_Union[TokenDtype, str]] = ..., validation_path: _Optional[str] = ...) -> None: ...

class HFDataset(_message.Message):
    __slots__ = ("path", "column", "text_column", "tokenizer_dir", "split", "validation_split")
    PATH_FIELD_NUMBER: _ClassVar[int]
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    TEXT_COLUMN_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIR_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_SPLIT_FIELD_NUMBER: _ClassVar[int]
    path: str
    column: str
    text_column: str
    tokenizer_dir: str
    split: str
    validation_split: str
    def __init__(self, path: _Optional[str] = ..., column: _Optional[str] = ..., text_column: _Optional[str] = ..., tokenizer_dir: _Optional[str] = ..., split: _Optional[str] = ..., validation_split: _Optional[str] = ...) -> None: ...

class DataFactory(_message.Message):
    __slots__ = ("factory", "kwargs")
    FACTORY_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    factory: str
    kwargs: _struct_pb2.Struct
    def __init__(self, factory: _Optional[str] = ..., kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class DataSpec(_message.Message):
    __slots__ = ("tokens", "hf_dataset", "factory")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HF_DATASET_FIELD_NUMBER: _ClassVar[int]
    FACTORY_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenFile
    hf_dataset: HFDataset
    factory: DataFactory
    def __init__(self, tokens: _Optional[_Union[TokenFile, _Mapping]] = ..., hf_dataset: _Optional[_Union[HFDataset, _Mapping]] = ..., factory: _Optional[_Union[DataFactory, _Mapping]] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "model", "fleet", "global_batch_size", "iterations", "optimizer", "memory_budget_bytes", "engine", "schedule", "seed", "checkpoint_every", "online_repartition", "layer_toggles", "pipeline_stages", "priority_class", "min_devices", "max_devices", "micro_batches", "elastic", "data", "eval_every", "eval_batches", "keep_checkpoints", "init_from", "resume_from", "raw_metrics")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    ONLINE_REPARTITION_FIELD_NUMBER: _ClassVar[int]
    LAYER_TOGGLES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    MIN_DEVICES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_BATCHES_FIELD_NUMBER: _ClassVar[int]
    KEEP_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    RAW_METRICS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: _model_pb2.ModelSpec
    fleet: _fleet_pb2.Fleet
    global_batch_size: int
    iterations: int
    optimizer: OptimizerSpec
    memory_budget_bytes: int
    engine: _plan_pb2.PlanEngine
    schedule: _plan_pb2.Schedule
    seed: int
    checkpoint_every: int
    online_repartition: bool
    layer_toggles: _containers.RepeatedCompositeFieldContainer[LayerToggle]
    pipeline_stages: int
    priority_class: str
    min_devices: int
    max_devices: int
    micro_batches: int
    elastic: bool
    data: DataSpec
    eval_every: int
    eval_batches: int
    keep_checkpoints: int
    init_from: str
    resume_from: str
    raw_metrics: bool
    def __init__(self, name: _Optional[str] = ..., model: _Optional[_Union[_model_pb2.ModelSpec, _Mapping]] = ..., fleet: _Optional[_Union[_fleet_pb2.Fleet, _Mapping]] = ..., global_batch_size: _Optional[int] = ..., iterations: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., memory_budget_bytes: _Optional[int] = ..., engine: _Optional[_Union[_plan_pb2.PlanEngine, str]] = ..., schedule: _Optional[_Union[_plan_pb2.Schedule, str]] = ..., seed: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., online_repartition: _Optional[bool] = ..., layer_toggles: _Optional[_Iterable[_Union[LayerToggle, _Mapping]]] = ..., pipeline_stages: _Optional[int] = ..., priority_class: _Optional[str] = ..., min_devices: _Optional[int] = ..., max_devices: _Optional[int] = ..., micro_batches: _Optional[int] = ..., elastic: _Optional[bool] = ..., data: _Optional[_Union[DataSpec, _Mapping]] = ..., eval_every: _Optional[int] = ..., eval_batches: _Optional[int] = ..., keep_checkpoints: _Optional[int] = ..., init_from: _Optional[str] = ..., resume_from: _Optional[str] = ..., raw_metrics: _Optional[bool] = ...) -> None: ...

class LayerToggle(_message.Message):
    __slots__ = ("layer_index", "iteration", "active")
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    layer_index: int
    iteration: int
    active: bool
    def __init__(self, layer_index: _Optional[int] = ..., iteration: _Optional[int] = ..., active: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "tenant_id", "spec", "model_id", "state", "plan_id", "plan_version", "message", "created_at", "updated_at", "iteration", "started_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant_id: str
    spec: JobSpec
    model_id: str
    state: JobState
    plan_id: str
    plan_version: int
    message: str
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    iteration: int
    started_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., model_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., plan_id: _Optional[str] = ..., plan_version: _Optional[int] = ..., message: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., iteration: _Optional[int] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job_id", "seq", "type", "state", "message", "attributes", "created_at")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    seq: int
    type: str
    state: JobState
    message: str
    attributes: _containers.ScalarMap[str, str]
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., seq: _Optional[int] = ..., type: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., message: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class IterationMetric(_message.Message):
    __slots__ = ("job_id", "iteration", "stage_index", "replica_index", "plan_version", "iteration_time_s", "forward_s", "backward_s", "comm_s", "idle_s", "peak_memory_bytes", "loss", "has_loss", "throughput_samples_per_s", "predicted_iteration_time_s", "recorded_at", "recompute_s", "p2p_s", "allreduce_s", "optimizer_s", "overhead_s", "predicted_peak_memory_bytes", "predicted_stage_compute_s", "swap_in_bytes", "swap_out_bytes", "swap_s", "predicted_swap_in_bytes", "predicted_swap_out_bytes", "data_s", "first_iteration", "iterations", "iteration_time_p50_s", "iteration_time_p95_s", "iteration_time_max_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_S_FIELD_NUMBER: _ClassVar[int]
    COMM_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ITERATION_TIME_S_FIELD_NUMBER: _ClassVar[int]
    RECORDED_AT_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    P2P_S_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_S_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_S_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STAGE_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SWAP_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SWAP_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_ITERATION_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TIME_P50_S_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TIME_P95_S_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TIME_MAX_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    iteration: int
    stage_index: int
    replica_index: int
    plan_version: int
    iteration_time_s: float
    forward_s: float
    backward_s: float
    comm_s: float
    idle_s: float
    peak_memory_bytes: int
    loss: float
    has_loss: bool
    throughput_samples_per_s: float
    predicted_iteration_time_s: float
    recorded_at: _timestamp_pb2.Timestamp
    recompute_s: float
    p2p_s: float
    allreduce_s: float
    optimizer_s: float
    overhead_s: float
    predicted_peak_memory_bytes: int
    predicted_stage_compute_s: float
    swap_in_bytes: int
    swap_out_bytes: int
    swap_s: float
    predicted_swap_in_bytes: int
    predicted_swap_out_bytes: int
    data_s: float
    first_iteration: int
    iterations: int
    iteration_time_p50_s: float
    iteration_time_p95_s: float
    iteration_time_max_s: float
    def __init__(self, job_id: _Optional[str] = ..., iteration: _Optional[int] = ..., stage_index: _Optional[int] = ..., replica_index: _Optional[int] = ..., plan_version: _Optional[int] = ..., iteration_time_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., backward_s: _Optional[float] = ..., comm_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., peak_memory_bytes: _Optional[int] = ..., loss: _Optional[float] = ..., has_loss: _Optional[bool] = ..., throughput_samples_per_s: _Optional[float] = ..., predicted_iteration_time_s: _Optional[float] = ..., recorded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., recompute_s: _Optional[float] = ..., p2p_s: _Optional[float] = ..., allreduce_s: _Optional[float] = ..., optimizer_s: _Optional[float] = ..., overhead_s: _Optional[float] = ..., predicted_peak_memory_bytes: _Optional[int] = ..., predicted_stage_compute_s: _Optional[float] = ..., swap_in_bytes: _Optional[int] = ..., swap_out_bytes: _Optional[int] = ..., swap_s: _Optional[float] = ..., predicted_swap_in_bytes: _Optional[int] = ..., predicted_swap_out_bytes: _Optional[int] = ..., data_s: _Optional[float] = ..., first_iteration: _Optional[int] = ..., iterations: _Optional[int] = ..., iteration_time_p50_s: _Optional[float] = ..., iteration_time_p95_s: _Optional[float] = ..., iteration_time_max_s: _Optional[float] = ...) -> None: ...

class Evaluation(_message.Message):
    __slots__ = ("id", "job_id", "iteration", "plan_version", "loss", "perplexity", "eval_s", "samples", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    EVAL_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    iteration: int
    plan_version: int
    loss: float
    perplexity: float
    eval_s: float
    samples: int
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., iteration: _Optional[int] = ..., plan_version: _Optional[int] = ..., loss: _Optional[float] = ..., perplexity: _Optional[float] = ..., eval_s: _Optional[float] = ..., samples: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LayerMigration(_message.Message):
    __slots__ = ("id", "job_id", "layer_index", "from_stage", "to_stage", "bytes", "duration_s", "iteration", "plan_version", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    layer_index: int
    from_stage: int
    to_stage: int
    bytes: int
    duration_s: float
    iteration: int
    plan_version: int
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., layer_index: _Optional[int] = ..., from_stage: _Optional[int] = ..., to_stage: _Optional[int] = ..., bytes: _Optional[int] = ..., duration_s: _Optional[float] = ..., iteration: _Optional[int] = ..., plan_version: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LayerCheckpoint(_message.Message):
    __slots__ = ("layer_index", "uri", "bytes", "sha256")
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    layer_index: int
    uri: str
    bytes: int
    sha256: str
    def __init__(self, layer_index: _Optional[int] = ..., uri: _Optional[str] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("id", "job_id", "iteration", "plan_version", "layers", "complete", "created_at", "deleted_at", "exported_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    DELETED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    iteration: int
    plan_version: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerCheckpoint]
    complete: bool
    created_at: _timestamp_pb2.Timestamp
    deleted_at: _timestamp_pb2.Timestamp
    exported_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., iteration: _Optional[int] = ..., plan_version: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerCheckpoint, _Mapping]]] = ..., complete: _Optional[bool] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., deleted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., exported_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Morph(_message.Message):
    __slots__ = ("id", "job_id", "cause", "detail", "from_stages", "from_replicas", "from_plan_version", "to_stages", "to_replicas", "to_plan_version", "failed_iteration", "checkpoint_iteration", "lost_iterations", "detected_at", "resumed_at", "first_iteration_at", "recovery_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGES_FIELD_NUMBER: _ClassVar[int]
    FROM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FROM_PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_STAGES_FIELD_NUMBER: _ClassVar[int]
    TO_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TO_PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    FAILED_ITERATION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ITERATION_FIELD_NUMBER: _ClassVar[int]
    LOST_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AT_FIELD_NUMBER: _ClassVar[int]
    FIRST_ITERATION_AT_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    cause: str
    detail: str
    from_stages: int
    from_replicas: int
    from_plan_version: int
    to_stages: int
    to_replicas: int
    to_plan_version: int
    failed_iteration: int
    checkpoint_iteration: int
    lost_iterations: int
    detected_at: _timestamp_pb2.Timestamp
    resumed_at: _timestamp_pb2.Timestamp
    first_iteration_at: _timestamp_pb2.Timestamp
    recovery_s: float
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., cause: _Optional[str] = ..., detail: _Optional[str] = ..., from_stages: _Optional[int] = ..., from_replicas: _Optional[int] = ..., from_plan_version: _Optional[int] = ..., to_stages: _Optional[int] = ..., to_replicas: _Optional[int] = ..., to_plan_version: _Optional[int] = ..., failed_iteration: _Optional[int] = ..., checkpoint_iteration: _Optional[int] = ..., lost_iterations: _Optional[int] = ..., detected_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., resumed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., first_iteration_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., recovery_s: _Optional[float] = ...) -> None: ...
