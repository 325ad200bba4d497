import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ballast.v1 import fleet_pb2 as _fleet_pb2
from ballast.v1 import job_pb2 as _job_pb2
from ballast.v1 import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageStats(_message.Message):
    __slots__ = ("job_id", "stage_index", "replica_index", "iteration", "plan_version", "forward_s", "backward_s", "comm_s", "idle_s", "memory_bytes", "peak_memory_bytes", "loss", "has_loss", "layers", "iteration_time_s", "recompute_s", "bytes_sent", "throughput_samples_per_s", "rank", "swapped_bytes", "active_layers", "p2p_s", "allreduce_s", "optimizer_s", "overhead_s", "swap_in_bytes", "swap_out_bytes", "swap_s", "ended_at", "data_s", "first_iteration", "iterations", "iteration_time_p50_s", "iteration_time_p95_s", "iteration_time_max_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_S_FIELD_NUMBER: _ClassVar[int]
    COMM_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TIME_S_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    P2P_S_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_S_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_S_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_S_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    DATA_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_ITERATION_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TIME_P50_S_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TIME_P95_S_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TIME_MAX_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_index: int
    replica_index: int
    iteration: int
    plan_version: int
    forward_s: float
    backward_s: float
    comm_s: float
    idle_s: float
    memory_bytes: int
    peak_memory_bytes: int
    loss: float
    has_loss: bool
    layers: _containers.RepeatedScalarFieldContainer[int]
    iteration_time_s: float
    recompute_s: float
    bytes_sent: int
    throughput_samples_per_s: float
    rank: int
    swapped_bytes: int
    active_layers: _containers.RepeatedScalarFieldContainer[int]
    p2p_s: float
    allreduce_s: float
    optimizer_s: float
    overhead_s: float
    swap_in_bytes: int
    swap_out_bytes: int
    swap_s: float
    ended_at: _timestamp_pb2.Timestamp
    data_s: float
    first_iteration: int
    iterations: int
    iteration_time_p50_s: float
    iteration_time_p95_s: float
    iteration_time_max_s: float
    def __init__(self, job_id: _Optional[str] = ..., stage_index: _Optional[int] = ..., replica_index: _Optional[int] = ..., iteration: _Optional[int] = ..., plan_version: _Optional[int] = ..., forward_s: _Optional[float] = ..., backward_s: _Optional[float] = ..., comm_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., loss: _Optional[float] = ..., has_loss: _Optional[bool] = ..., layers: _Optional[_Iterable[int]] = ..., iteration_time_s: _Optional[float] = ..., recompute_s: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., throughput_samples_per_s: _Optional[float] = ..., rank: _Optional[int] = ..., swapped_bytes: _Optional[int] = ..., active_layers: _Optional[_Iterable[int]] = ..., p2p_s: _Optional[float] = ..., allreduce_s: _Optional[float] = ..., optimizer_s: _Optional[float] = ..., overhead_s: _Optional[float] = ..., swap_in_bytes: _Optional[int] = ..., swap_out_bytes: _Optional[int] = ..., swap_s: _Optional[float] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., data_s: _Optional[float] = ..., first_iteration: _Optional[int] = ..., iterations: _Optional[int] = ..., iteration_time_p50_s: _Optional[float] = ..., iteration_time_p95_s: _Optional[float] = ..., iteration_time_max_s: _Optional[float] = ...) -> None: ...

class RegisterAgent(_message.Message):
    __slots__ = ("host", "applied_versions")
    class AppliedVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HOST_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    host: _fleet_pb2.Host
    applied_versions: _containers.ScalarMap[str, int]
    def __init__(self, host: _Optional[_Union[_fleet_pb2.Host, _Mapping]] = ..., applied_versions: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("host_id", "sent_at", "stages")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    sent_at: _timestamp_pb2.Timestamp
    stages: _containers.RepeatedCompositeFieldContainer[StageStats]
    def __init__(self, host_id: _Optional[str] = ..., sent_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., stages: _Optional[_Iterable[_Union[StageStats, _Mapping]]] = ...) -> None: ...

class InstructionAck(_message.Message):
    __slots__ = ("instruction_id", "version", "ok", "message")
    INSTRUCTION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    instruction_id: str
    version: int
    ok: bool
    message: str
    def __init__(self, instruction_id: _Optional[str] = ..., version: _Optional[int] = ..., ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerExit(_message.Message):
    __slots__ = ("job_id", "rank", "stage_index", "replica_index", "exit_code", "finished", "message", "iteration", "drained", "infrastructure", "traceback")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    INFRASTRUCTURE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    stage_index: int
    replica_index: int
    exit_code: int
    finished: bool
    message: str
    iteration: int
    drained: bool
    infrastructure: bool
    traceback: str
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., stage_index: _Optional[int] = ..., replica_index: _Optional[int] = ..., exit_code: _Optional[int] = ..., finished: _Optional[bool] = ..., message: _Optional[str] = ..., iteration: _Optional[int] = ..., drained: _Optional[bool] = ..., infrastructure: _Optional[bool] = ..., traceback: _Optional[str] = ...) -> None: ...

class CheckpointWritten(_message.Message):
    __slots__ = ("checkpoint", "rank", "checkpoint_s", "write_s", "background", "error")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_S_FIELD_NUMBER: _ClassVar[int]
    WRITE_S_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    checkpoint: _job_pb2.Checkpoint
    rank: int
    checkpoint_s: float
    write_s: float
    background: bool
    error: str
    def __init__(self, checkpoint: _Optional[_Union[_job_pb2.Checkpoint, _Mapping]] = ..., rank: _Optional[int] = ..., checkpoint_s: _Optional[float] = ..., write_s: _Optional[float] = ..., background: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class LayerMigrated(_message.Message):
    __slots__ = ("migration", "rank", "replica_index")
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    migration: _job_pb2.LayerMigration
    rank: int
    replica_index: int
    def __init__(self, migration: _Optional[_Union[_job_pb2.LayerMigration, _Mapping]] = ..., rank: _Optional[int] = ..., replica_index: _Optional[int] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "ack", "worker_exit", "checkpoint_written", "layer_migrated", "evaluated")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    WORKER_EXIT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LAYER_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_FIELD_NUMBER: _ClassVar[int]
    register: RegisterAgent
    heartbeat: Heartbeat
    ack: InstructionAck
    worker_exit: WorkerExit
    checkpoint_written: CheckpointWritten
    layer_migrated: LayerMigrated
    evaluated: _job_pb2.Evaluation
    def __init__(self, register: _Optional[_Union[RegisterAgent, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., ack: _Optional[_Union[InstructionAck, _Mapping]] = ..., worker_exit: _Optional[_Union[WorkerExit, _Mapping]] = ..., checkpoint_written: _Optional[_Union[CheckpointWritten, _Mapping]] = ..., layer_migrated: _Optional[_Union[LayerMigrated, _Mapping]] = ..., evaluated: _Optional[_Union[_job_pb2.Evaluation, _Mapping]] = ...) -> None: ...

class WorkerAssignment(_message.Message):
    __slots__ = ("device_index", "rank", "stage_index", "replica_index")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    rank: int
    stage_index: int
    replica_index: int
    def __init__(self, device_index: _Optional[int] = ..., rank: _Optional[int] = ..., stage_index: _Optional[int] = ..., replica_index: _Optional[int] = ...) -> None: ...

class AssignInstruction(_message.Message):
    __slots__ = ("plan", "workers", "process_group_timeout_s", "start_iteration", "checkpoint_id", "spec", "checkpoint_uri", "checkpoint_dir", "init_from", "placement", "metrics_window")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_GROUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    START_ITERATION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    METRICS_WINDOW_FIELD_NUMBER: _ClassVar[int]
    plan: _plan_pb2.Plan
    workers: _containers.RepeatedCompositeFieldContainer[WorkerAssignment]
    process_group_timeout_s: int
    start_iteration: int
    checkpoint_id: str
    spec: _job_pb2.JobSpec
    checkpoint_uri: str
    checkpoint_dir: str
    init_from: str
    placement: _fleet_pb2.JobPlacement
    metrics_window: int
    def __init__(self, plan: _Optional[_Union[_plan_pb2.Plan, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerAssignment, _Mapping]]] = ..., process_group_timeout_s: _Optional[int] = ..., start_iteration: _Optional[int] = ..., checkpoint_id: _Optional[str] = ..., spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., checkpoint_uri: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ..., init_from: _Optional[str] = ..., placement: _Optional[_Union[_fleet_pb2.JobPlacement, _Mapping]] = ..., metrics_window: _Optional[int] = ...) -> None: ...

class LayerMove(_message.Message):
    __slots__ = ("layer_index", "from_stage", "to_stage")
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    layer_index: int
    from_stage: int
    to_stage: int
    def __init__(self, layer_index: _Optional[int] = ..., from_stage: _Optional[int] = ..., to_stage: _Optional[int] = ...) -> None: ...

class RepartitionInstruction(_message.Message):
    __slots__ = ("plan", "moves", "effective_iteration")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_ITERATION_FIELD_NUMBER: _ClassVar[int]
    plan: _plan_pb2.Plan
    moves: _containers.RepeatedCompositeFieldContainer[LayerMove]
    effective_iteration: int
    def __init__(self, plan: _Optional[_Union[_plan_pb2.Plan, _Mapping]] = ..., moves: _Optional[_Iterable[_Union[LayerMove, _Mapping]]] = ..., effective_iteration: _Optional[int] = ...) -> None: ...

class CheckpointInstruction(_message.Message):
    __slots__ = ("iteration", "uri")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    uri: str
    def __init__(self, iteration: _Optional[int] = ..., uri: _Optional[str] = ...) -> None: ...

class StopInstruction(_message.Message):
    __slots__ = ("reason", "checkpoint")
    REASON_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    checkpoint: bool
    def __init__(self, reason: _Optional[str] = ..., checkpoint: _Optional[bool] = ...) -> None: ...

class HoldInstruction(_message.Message):
    __slots__ = ("held", "reason")
    HELD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    held: bool
    reason: str
    def __init__(self, held: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("host_id", "heartbeat_interval_s")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    heartbeat_interval_s: float
    def __init__(self, host_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class PlannerMessage(_message.Message):
    __slots__ = ("instruction_id", "version", "job_id", "registered", "assign", "repartition", "checkpoint", "stop", "hold")
    INSTRUCTION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    REPARTITION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    instruction_id: str
    version: int
    job_id: str
    registered: Registered
    assign: AssignInstruction
    repartition: RepartitionInstruction
    checkpoint: CheckpointInstruction
    stop: StopInstruction
    hold: HoldInstruction
    def __init__(self, instruction_id: _Optional[str] = ..., version: _Optional[int] = ..., job_id: _Optional[str] = ..., registered: _Optional[_Union[Registered, _Mapping]] = ..., assign: _Optional[_Union[AssignInstruction, _Mapping]] = ..., repartition: _Optional[_Union[RepartitionInstruction, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointInstruction, _Mapping]] = ..., stop: _Optional[_Union[StopInstruction, _Mapping]] = ..., hold: _Optional[_Union[HoldInstruction, _Mapping]] = ...) -> None: ...
