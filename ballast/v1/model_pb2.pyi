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
MODEL_FAMILY_UNSPECIFIED: ModelFamily
MODEL_FAMILY_GPT: ModelFamily
MODEL_FAMILY_BERT: ModelFamily
MODEL_FAMILY_T5: ModelFamily
MODEL_FAMILY_VIT: ModelFamily
MODEL_FAMILY_SWIN: ModelFamily
MODEL_FAMILY_CUSTOM: ModelFamily

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

class ModelSpec(_message.Message):
    __slots__ = ("name", "family", "transformer", "vision", "custom", "dropout", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    TRANSFORMER_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    family: ModelFamily
    transformer: TransformerConfig
    vision: VisionConfig
    custom: CustomModel
    dropout: float
    dtype: _common_pb2.DType
    def __init__(self, name: _Optional[str] = ..., family: _Optional[_Union[ModelFamily, str]] = ..., transformer: _Optional[_Union[TransformerConfig, _Mapping]] = ..., vision: _Optional[_Union[VisionConfig, _Mapping]] = ..., custom: _Optional[_Union[CustomModel, _Mapping]] = ..., dropout: _Optional[float] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "tenant_id", "spec", "signature", "parameter_count", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant_id: str
    spec: ModelSpec
    signature: str
    parameter_count: int
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., signature: _Optional[str] = ..., parameter_count: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
