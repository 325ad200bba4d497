"""How one layer runs (Galvatron-BMW §III: DP, SDP, TP, CKPT per layer) and how its model states are sized.

`LayerStrategy.order` nests the non-pipeline dimensions outermost first; the innermost one gets
consecutive device ranks and so the fastest (intra-node) links while its group fits in a node
(Galvatron-BMW §III-B: the permutation of hybrid strategies matters under hierarchical bandwidth).
Dimensions of degree 1 carry no meaning and are dropped from `order`; an empty order means
(dp, sdp, tp): TP innermost, as Megatron places it.

Model states per parameter (Varuna §2, ZeRO): fp32 Adam keeps 4 B weights + 4 B gradients + 8 B
moments = 16 B (Galvatron-BMW's setting); mixed-precision Adam keeps 2 B fp16/bf16 weights + 2 B
gradients + 12 B fp32 master copy and moments = 16 B; MEASURED takes the profile's own bytes.
Gradient bytes also size DP/SDP traffic and parameter bytes the SDP all-gathers.

DP flavours (`dp_sharding`, ZeRO stages 1 and 2 over the layer's dp replicas; SDP is stage 3): plain DP
replicates every model state; ZeRO-1 shards the optimizer states over the dp replicas (each updates its
share, then the updated parameters are all-gathered); ZeRO-2 also shards the gradients (reduce-scatter
instead of all-reduce). A flavour changes neither the sample layout nor the devices, so it is not part of
`layout`; over a group of one (dp == 1) every flavour is plain, and it is normalised to PLAIN there.

Sequence parallelism (`sequence_parallel`, Megatron-style, only with tp > 1): the layer's input and output, its
norms and residuals are split along the sequence over the tp ranks, so its boundary activation is 1/tp per device,
and each TP all-reduce becomes an all-gather plus a reduce-scatter (the same ring volume). Its tensors between
layers are split differently from plain TP's (samples x sequence), so it is part of `layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ballast.v1 import plan_pb2
    from services.planner.cost.profile_view import LayerView


class Dim(StrEnum):
    """A non-pipeline parallel dimension (values match plan.proto's lower-cased ParallelDim names)."""

    DP = "dp"
    SDP = "sdp"
    TP = "tp"


class DpSharding(StrEnum):
    """How a layer's dp replicas keep gradients and optimizer states (values match space.FLAVOURS)."""

    PLAIN = "plain"  # replicated; gradients all-reduced
    ZERO1 = "zero1"  # optimizer states sharded; gradients all-reduced; parameters all-gathered after the step
    ZERO2 = "zero2"  # optimizer states and gradients sharded; gradients reduce-scattered; parameters all-gathered


DEFAULT_ORDER = (Dim.DP, Dim.SDP, Dim.TP)
SEQUENCE = "sp"  # the executor capability sequence parallelism needs (space.CAPABILITIES)
_PROTO_DIM = {1: Dim.DP, 2: Dim.SDP, 3: Dim.TP}  # common_pb2.ParallelDim; PP and UNSPECIFIED are not layer dims
_DIM_PROTO = {v: k for k, v in _PROTO_DIM.items()}
_PROTO_SHARDING = {0: DpSharding.PLAIN, 1: DpSharding.ZERO1, 2: DpSharding.ZERO2}  # common_pb2.DpSharding
_SHARDING_PROTO = {v: k for k, v in _PROTO_SHARDING.items()}


@dataclass(frozen=True, slots=True)
class LayerStrategy:
    """dp x sdp x tp devices for one layer, their nesting, and the memory-for-time switches."""

    dp: int = 1
    sdp: int = 1
    tp: int = 1
    order: tuple[Dim, ...] = ()  # outermost first; normalised to the dims of degree > 1
    checkpoint: bool = False  # activation checkpointing: keep the boundary, recompute in backward
    swap: bool = False  # swap the kept activations to host between forward and backward
    dp_sharding: DpSharding = DpSharding.PLAIN  # ZeRO-1/2 over the dp replicas; PLAIN whenever dp == 1
    sequence_parallel: bool = False  # split the sequence over the tp ranks too; False whenever tp == 1

    def __post_init__(self) -> None:
        for name in ("dp", "sdp", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        sharding = DpSharding(self.dp_sharding)  # a ValueError names a bad flavour even where dp == 1
        object.__setattr__(self, "dp_sharding", sharding if self.dp > 1 else DpSharding.PLAIN)
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel) and self.tp > 1)
        dims = tuple(Dim(d) for d in self.order)
        if len(set(dims)) != len(dims):
            raise ValueError(f"order repeats a dimension: {[d.value for d in dims]}")
        active = {d for d in Dim if self.degree(d) > 1}
        given = tuple(d for d in (dims or DEFAULT_ORDER) if d in active)
        if dims and set(given) != active:
            missing = sorted(d.value for d in active - set(given))
            raise ValueError(f"order {[d.value for d in dims]} lacks dimension(s) of degree > 1: {missing}")
        object.__setattr__(self, "order", given)

    def degree(self, dim: Dim) -> int:
        return self.dp if dim is Dim.DP else self.sdp if dim is Dim.SDP else self.tp

    @property
    def devices(self) -> int:
        return self.dp * self.sdp * self.tp

    @property
    def batch_split(self) -> int:
        """Ways the micro-batch is split across devices (DP and SDP split samples; TP replicates them)."""
        return self.dp * self.sdp

    @property
    def layout(self) -> tuple[int, int, int, tuple[Dim, ...], bool]:
        """What a neighbouring layer must match for a zero transformation cost (Galvatron-BMW Eq. 4)."""
        return (self.dp, self.sdp, self.tp, self.order, self.sequence_parallel)

    @classmethod
    def of_layout(cls, layout: tuple[int, int, int, tuple[Dim, ...], bool]) -> LayerStrategy:
        dp, sdp, tp, order, sequence = layout
        return cls(dp, sdp, tp, order, sequence_parallel=sequence)

    @property
    def sharded(self) -> bool:
        """ZeRO-1 or ZeRO-2: each dp replica keeps and updates 1/dp of the optimizer states."""
        return self.dp_sharding is not DpSharding.PLAIN

    @property
    def requires(self) -> tuple[str, ...]:
        """Executor capabilities this strategy needs (space.CAPABILITIES names): its dims of degree > 1 and
        its DP flavour; pipeline stages always run."""
        dims = tuple(d.value for d in Dim if self.degree(d) > 1)
        dims = (*dims, self.dp_sharding.value) if self.sharded else dims
        return (*dims, SEQUENCE) if self.sequence_parallel else dims

    def describe(self) -> str:
        dims = "x".join(f"{d.value}{self.degree(d)}" for d in self.order) or "single"
        flags = "".join((" +sp" if self.sequence_parallel else "",
                         f" +{self.dp_sharding.value}" if self.sharded else "", " +ckpt" if self.checkpoint else "",
                         " +swap" if self.swap else ""))
        return dims + flags

    @classmethod
    def from_proto(cls, msg: plan_pb2.LayerStrategy) -> LayerStrategy:
        return cls(
            dp=msg.dp or 1,
            sdp=msg.sdp or 1,
            tp=msg.tp or 1,
            order=tuple(_PROTO_DIM[d] for d in msg.order if d in _PROTO_DIM),
            checkpoint=msg.checkpoint,
            swap=msg.swap_activations,
            dp_sharding=_sharding_from_proto(msg.dp_sharding),
            sequence_parallel=msg.sequence_parallel,
        )

    def to_proto(self, layer_index: int, stage_index: int) -> plan_pb2.LayerStrategy:
        from ballast.v1 import plan_pb2

        return plan_pb2.LayerStrategy(
            layer_index=layer_index, stage_index=stage_index, dp=self.dp, sdp=self.sdp, tp=self.tp,
            order=[_DIM_PROTO[d] for d in self.order], checkpoint=self.checkpoint, swap_activations=self.swap,
            dp_sharding=_SHARDING_PROTO[self.dp_sharding],  # type: ignore[arg-type]
            sequence_parallel=self.sequence_parallel,
        )


def _sharding_from_proto(value: int) -> DpSharding:
    if value not in _PROTO_SHARDING:
        raise ValueError(f"unknown dp_sharding {value} in a plan's LayerStrategy (known: 0 plain, 1 ZeRO-1, 2 ZeRO-2)")
    return _PROTO_SHARDING[value]


class ModelStateFormat(StrEnum):
    """Where bytes of weights, gradients and optimizer state come from."""

    FP32_ADAM = "fp32_adam"  # 4 + 4 + 8 = 16 B/param
    MIXED_ADAM = "mixed_adam"  # 2 + 2 + 12 = 16 B/param (fp16/bf16 weights and grads, fp32 master + moments)
    MEASURED = "measured"  # the profile's parameter/gradient/optimizer_state_bytes


Precision = ModelStateFormat  # the name the planners' options use

BYTES_PER_PARAM: dict[ModelStateFormat, tuple[int, int, int]] = {
    ModelStateFormat.FP32_ADAM: (4, 4, 8),
    ModelStateFormat.MIXED_ADAM: (2, 2, 12),
}


def model_state_bytes(layer: LayerView, fmt: ModelStateFormat) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes of the whole, unsharded layer."""
    if fmt is ModelStateFormat.MEASURED:
        return float(layer.parameter_bytes), float(layer.gradient_bytes), float(layer.optimizer_state_bytes)
    p, g, o = BYTES_PER_PARAM[fmt]
    n = layer.parameter_count
    return float(p * n), float(g * n), float(o * n)
