"""Byte accounting: model data per parameter, tensor sizes, and activations saved for backward.

Model data (PatrickStar §2) for Adam, per parameter, at training precision `dtype`:

    fp32:       param 4 + grad 4 + optimizer 8 (momentum fp32, variance fp32)             = 16 B
    fp16/bf16:  param 2 + grad 2 + optimizer 12 (fp32 master copy, momentum, variance)    = 16 B

The mixed-precision row is ZeRO's 2 + 2 + 12 = 16 bytes/parameter; PatrickStar §2 itemises the
same tensors (param fp16, grad fp16, param/momentum/variance fp32: "4M + 12M").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ballast.v1 import common_pb2

_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_PROTO = {
    common_pb2.DTYPE_UNSPECIFIED: torch.float32,
    common_pb2.DTYPE_FP32: torch.float32,
    common_pb2.DTYPE_FP16: torch.float16,
    common_pb2.DTYPE_BF16: torch.bfloat16,
}
_TO_PROTO = {
    torch.float32: common_pb2.DTYPE_FP32,
    torch.float16: common_pb2.DTYPE_FP16,
    torch.bfloat16: common_pb2.DTYPE_BF16,
}


def as_dtype(dtype: torch.dtype | str | int | None) -> torch.dtype:
    """Training precision from a torch dtype, a name ("bf16") or a `DType` proto value; None = fp32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        found = dtype if dtype in _TO_PROTO else None
    elif isinstance(dtype, str):
        found = _NAMES.get(dtype.lower().removeprefix("dtype_"))
    else:
        found = _PROTO.get(int(dtype))
    if found is None:
        raise ValueError(f"unsupported training precision {dtype!r}: use fp32, fp16 or bf16")
    return found


def proto_dtype(dtype: torch.dtype) -> int:
    return _TO_PROTO[dtype]


@dataclass(frozen=True)
class BytesPerParam:
    param: int
    grad: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


def adam_bytes_per_param(dtype: torch.dtype) -> BytesPerParam:
    """Adam's model data per parameter (see module docstring): 16 B for fp32 and for mixed precision."""
    width = torch.empty((), dtype=dtype).element_size()
    master = 4 if dtype != torch.float32 else 0
    return BytesPerParam(param=width, grad=width, optimizer=8 + master)


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Logical bytes (numel * element size) of distinct tensor objects."""
    seen: dict[int, Tensor] = {}
    for t in tensors:
        if isinstance(t, Tensor):
            seen.setdefault(id(t), t)
    return sum(t.numel() * t.element_size() for t in seen.values())


def storage_key(t: Tensor) -> int:
    """Identity of the memory a tensor lives in: views and the tensor they view share it."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, some subclasses)
        return 0


def parameters_of(module: nn.Module) -> list[nn.Parameter]:
    """Distinct parameters of a module (a Parameter registered twice counts once)."""
    return list({id(p): p for p in module.parameters()}.values())


class SavedTensorBytes:
    """Sums the storages autograd saves for backward (`saved_tensors_hooks`), each storage once.

    Storages listed in `exclude` (the parameters and the layer's own inputs, accounted for as model
    data and as the boundary activation) are not counted. Pack returns the tensor itself: nothing is
    copied, so the measured pass behaves like an unhooked one.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self.excluded = {storage_key(t) for t in exclude} - {0}
        self.sizes: dict[int, int] = {}

    def _pack(self, t: Tensor) -> Tensor:
        key = storage_key(t)
        if key and key not in self.excluded and key not in self.sizes:
            self.sizes[key] = t.untyped_storage().nbytes()
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.sizes.values())
