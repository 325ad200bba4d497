import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ballast.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelFamily(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_FAMILY_UNSPECIFIED: _ClassVar[ModelFamily]
    MODEL_FAMILY_GPT: _ClassVar[ModelFamily]
    MODEL_FAMILY_BERT: _ClassVar[ModelFamily]
    MODEL_FAMILY_T5: _ClassVar[ModelFamily]
    MODEL_FAMILY_VIT: _ClassVar[ModelFamily]
    MODEL_FAMILY_SWIN: _ClassVar[ModelFamily]
    MODEL_FAMILY_CUSTOM: _ClassVar[ModelFamily]
    MODEL_FAMILY_HF: _ClassVar[ModelFamily]

class HFTask(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HF_TASK_UNSPECIFIED: _ClassVar[HFTask]
    HF_TASK_CAUSAL_LM: _ClassVar[HFTask]
    HF_TASK_MASKED_LM: _ClassVar[HFTask]
    HF_TASK_IMAGE_CLASSIFICATION: _ClassVar[HFTask]
MODEL_FAMILY_UNSPECIFIED: ModelFamily
MODEL_FAMILY_GPT: ModelFamily
MODEL_FAMILY_BERT: ModelFamily
MODEL_FAMILY_T5: ModelFamily
MODEL_FAMILY_VIT: ModelFamily
MODEL_FAMILY_SWIN: ModelFamily
MODEL_FAMILY_CUSTOM: ModelFamily
MODEL_FAMILY_HF: ModelFamily
HF_TASK_UNSPECIFIED: HFTask
HF_TASK_CAUSAL_LM: HFTask
HF_TASK_MASKED_LM: HFTask
HF_TASK_IMAGE_CLASSIFICATION: HFTask

class TransformerConfig(_message.Message):
    __slots__ = ("num_layers", "num_decoder_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "seq_length", "decoder_seq_length", "max_positions", "tie_embeddings")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    FFN_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DECODER_SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TIE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_decoder_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    decoder_seq_length: int
    max_positions: int
    tie_embeddings: bool
    def __init__(self, num_layers: _Optional[int] = ..., num_decoder_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_heads: _Optional[int] = ..., ffn_hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., seq_length: _Optional[int] = ..., decoder_seq_length: _Optional[int] = ..., max_positions: _Optional[int] = ..., tie_embeddings: _Optional[bool] = ...) -> None: ...

class VisionConfig(_message.Message):
    __slots__ = ("image_size", "patch_size", "channels", "num_classes", "hidden_size", "num_layers", "num_heads", "depths", "window_size", "mlp_ratio", "head_dim")
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    MLP_RATIO_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    image_size: int
    patch_size: int
    channels: int
    num_classes: int
    hidden_size: int
    num_layers: int
    num_heads: int
    depths: _containers.RepeatedScalarFieldContainer[int]
    window_size: int
    mlp_ratio: float
    head_dim: int
    def __init__(self, image_size: _Optional[int] = ..., patch_size: _Optional[int] = ..., channels: _Optional[int] = ..., num_classes: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., depths: _Optional[_Iterable[int]] = ..., window_size: _Optional[int] = ..., mlp_ratio: _Optional[float] = ..., head_dim: _Optional[int] = ...) -> None: ...

class CustomModel(_message.Message):
    __slots__ = ("factory", "kwargs", "cut_points")
    FACTORY_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    CUT_POINTS_FIELD_NUMBER: _ClassVar[int]
    factory: str
    kwargs: _struct_pb2.Struct
    cut_points: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, factory: _Optional[str] = ..., kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., cut_points: _Optional[_Iterable[str]] = ...) -> None: ...

class HuggingFaceModel(_message.Message):
    __slots__ = ("config", "config_dir", "task", "weights_dir", "seq_length")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIR_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIR_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    config: _struct_pb2.Struct
    config_dir: str
    task: HFTask
    weights_dir: str
    seq_length: int
    def __init__(self, config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., config_dir: _Optional[str] = ..., task: _Optional[_Union[HFTask, str]] = ..., weights_dir: _Optional[str] = ..., seq_length: _Optional[int] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("name", "family", "transformer", "vision", "custom", "hf", "dropout", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    TRANSFORMER_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_FIELD_NUMBER: _ClassVar[int]
    HF_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    family: ModelFamily
    transformer: TransformerConfig
    vision: VisionConfig
    custom: CustomModel
    hf: HuggingFaceModel
    dropout: float
    dtype: _common_pb2.DType
    def __init__(self, name: _Optional[str] = ..., family: _Optional[_Union[ModelFamily, str]] = ..., transformer: _Optional[_Union[TransformerConfig, _Mapping]] = ..., vision: _Optional[_Union[VisionConfig, _Mapping]] = ..., custom: _Optional[_Union[CustomModel, _Mapping]] = ..., hf: _Optional[_Union[HuggingFaceModel, _Mapping]] = ..., dropout: _Optional[float] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "tenant_id", "spec", "signature", "parameter_count", "created_at", "version")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant_id: str
    spec: ModelSpec
    signature: str
    parameter_count: int
    created_at: _timestamp_pb2.Timestamp
    version: int
    def __init__(self, id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., signature: _Optional[str] = ..., parameter_count: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class ModelLayer(_message.Message):
    __slots__ = ("index", "name", "kind", "parameter_count", "tensor_parallel", "tied_with", "inputs", "batch_keys", "output_shape", "sequence_parallel")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    TIED_WITH_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    kind: str
    parameter_count: int
    tensor_parallel: int
    tied_with: _containers.RepeatedScalarFieldContainer[int]
    inputs: _containers.RepeatedScalarFieldContainer[int]
    batch_keys: _containers.RepeatedScalarFieldContainer[str]
    output_shape: _containers.RepeatedScalarFieldContainer[int]
    sequence_parallel: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., kind: _Optional[str] = ..., parameter_count: _Optional[int] = ..., tensor_parallel: _Optional[int] = ..., tied_with: _Optional[_Iterable[int]] = ..., inputs: _Optional[_Iterable[int]] = ..., batch_keys: _Optional[_Iterable[str]] = ..., output_shape: _Optional[_Iterable[int]] = ..., sequence_parallel: _Optional[int] = ...) -> None: ...

class ModelInspection(_message.Message):
    __slots__ = ("signature", "parameter_count", "layers", "code_version")
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CODE_VERSION_FIELD_NUMBER: _ClassVar[int]
    signature: str
    parameter_count: int
    layers: _containers.RepeatedCompositeFieldContainer[ModelLayer]
    code_version: str
    def __init__(self, signature: _Optional[str] = ..., parameter_count: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[ModelLayer, _Mapping]]] = ..., code_version: _Optional[str] = ...) -> None: ...
