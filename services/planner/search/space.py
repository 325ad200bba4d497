"""The per-layer hybrid-parallel strategy space (Galvatron-BMW §III-B, decision trees and Takeaways 1-3).

PP splits the devices first (Takeaway 1: pipeline stages go across the slow links) into equal groups
(Takeaway 2), so a PP degree is a divisor of the device count and every stage runs on
`num_devices // pp` devices. Inside a group, a layer's strategy is an ordered sequence of DISTINCT
dims among DP, SDP and TP (no dim twice in one decision tree), outermost first, so the innermost dim
gets the fastest links; each degree is at least 2 and the degrees multiply to the group size. A group
of one device has the single no-parallelism strategy. Takeaway 3 drops every DP+SDP mix (pure SDP
always communicates less), and each strategy comes with and without activation checkpointing.

Non-powers of two: Galvatron only tries degrees {2, 4, 8, ...}; Ballast uses the same rule for any
device count -- PP degree = any divisor of N, a group's degrees = any ordered factorization of the
group size into factors >= 2 (6 = 2x3 and 3x2; 12 = 2x6, 6x2, 3x4, 4x3, 2x2x3, 2x3x2, 3x2x2). On powers
of two this is exactly Galvatron's tree set: 8 devices give 68 strategies, 44 after Takeaway 3, 22 of
them without checkpointing.

DP flavours. With "zero1" / "zero2" among the dims (an executor capability, ParallelDim ZERO1 / ZERO2), every
strategy with dp > 1 also comes with its dp replicas running ZeRO-1 (optimizer states sharded) or ZeRO-2 (and
gradients; cost.layer prices both). A flavour changes neither the devices nor the sample layout, so it
re-lays nothing out against its plain twin. Takeaway 3 drops the ZeRO flavours of DP+SDP mixes with them:
Galvatron's argument carries over, as N1-way ZeRO-2's reduce-scatter + all-gather moves the same
2(N1-1)/N1 as DP's all-reduce (ZeRO-1's all-reduce + all-gather more) and N2-way SDP still keeps the
parameters at 1/N2 where pure N-way SDP keeps every state at 1/N. Without Takeaway 3 they stay: ZeRO over
the dp replicas of states SDP already sharded (hierarchical sharding, priced the same way). On 8 devices
the 22 Takeaway-3 strategies without checkpointing include 9 with dp > 1 (PP1: DP8, and DP2 or DP4 with TP
on either side; PP2: DP4, and DP2 with TP2 on either side; PP4: DP2), so each flavour adds 9: 40 with both,
80 with checkpointing. SearchOptions' default dims leave them out (Galvatron-BMW's space); executors that
declare them, and what-if plans, bring them in.

Whole samples: DP and SDP split each micro-batch across their devices, so a strategy only applies to
micro-batches its dp x sdp divides (`splits`); a global batch no runnable configuration can split is
refused with the nearest sizes that work (`nearest_global_batches`).

Pure: no I/O, no grpc. ParallelDim enums (e.g. an executor's supported_parallelism) are accepted
wherever dim names are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import permutations

from ballast.v1 import common_pb2
from services.runtime.errors import InvalidArgument

DIMS = ("dp", "sdp", "tp")  # non-pipeline dims a layer can nest inside its stage's group
FLAVOURS = ("zero1", "zero2")  # DP flavours (cost.DpSharding values besides "plain"): capabilities, not dims
SEQUENCE = "sp"  # sequence parallelism on TP layers: a capability, not a dim (the search uses it where no slower)
CAPABILITIES = (*DIMS, *FLAVOURS, SEQUENCE)  # everything an executor may declare besides pipeline stages
PLAIN = "plain"
PARALLEL_DIM = {
    "dp": common_pb2.PARALLEL_DIM_DP,
    "sdp": common_pb2.PARALLEL_DIM_SDP,
    "tp": common_pb2.PARALLEL_DIM_TP,
    "pp": common_pb2.PARALLEL_DIM_PP,
    "zero1": common_pb2.PARALLEL_DIM_ZERO1,
    "zero2": common_pb2.PARALLEL_DIM_ZERO2,
    "sp": common_pb2.PARALLEL_DIM_SP,
}
_NAME_BY_ENUM = {v: k for k, v in PARALLEL_DIM.items()}


class InvalidSpace(InvalidArgument, ValueError):
    """Bad input to the space builders (an InvalidArgument for servicers, a ValueError for Python callers)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One layer's strategy: its stage's PP degree, nested dims outermost first, checkpointing, DP flavour."""

    pp: int
    dims: tuple[tuple[str, int], ...]
    checkpoint: bool = False
    dp_sharding: str = PLAIN  # "plain", or one of FLAVOURS (only with dp > 1)

    def degree(self, dim: str) -> int:
        return next((d for name, d in self.dims if name == dim), 1)

    @property
    def dp(self) -> int:
        return self.degree("dp")

    @property
    def sdp(self) -> int:
        return self.degree("sdp")

    @property
    def tp(self) -> int:
        return self.degree("tp")

    @property
    def order(self) -> tuple[str, ...]:
        """Dim names outermost first (LayerStrategy.order, via PARALLEL_DIM)."""
        return tuple(name for name, _ in self.dims)

    @property
    def batch_split(self) -> int:
        """Ways a micro-batch is split across the group (DP and SDP split samples; TP does not)."""
        return self.dp * self.sdp

    @property
    def group_size(self) -> int:
        """Devices per stage: the product of the degrees."""
        size = 1
        for _, d in self.dims:
            size *= d
        return size

    @property
    def label(self) -> str:
        """E.g. "PP2 · DP2×TP2 · ckpt", "PP1 · DP8 ZeRO-2"; "PP8 · none" for a one-device group."""
        inner = "×".join(f"{name.upper()}{d}" for name, d in self.dims) or "none"
        zero = f" ZeRO-{self.dp_sharding[-1]}" if self.dp_sharding != PLAIN else ""
        return f"PP{self.pp} · {inner}{zero}" + (" · ckpt" if self.checkpoint else "")


def executable_shape(order: Iterable[str], zero: bool) -> bool:
    """A layer shape Ballast's workers run (services/executor/train/hybrid.py): DP alone, TP innermost with DP
    outside it, or SDP alone over the whole group (no TP beside SDP, no DP inside TP), ZeRO-1/2 (`zero`) only on
    plain DP. `order`: the dims of degree > 1, outermost first."""
    names = tuple(order)
    if ("sdp" in names or "tp" in names) and zero:
        return False
    if "sdp" in names:
        return names == ("sdp",)
    return "tp" not in names or names[-1] == "tp"


def executable(c: Candidate) -> bool:
    return executable_shape(c.order, c.dp_sharding != PLAIN)


def _count_arg(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidSpace(f"must be a positive integer, got {value!r}", field=field, fix="pass at least 1")
    return value


def _dim_names(dims: Iterable[str | int]) -> frozenset[str]:
    names = set()
    for dim in (dims,) if isinstance(dims, str) else dims:
        if isinstance(dim, str):
            name = dim.lower().removeprefix("parallel_dim_")
        else:
            name = _NAME_BY_ENUM.get(dim) if isinstance(dim, int) and not isinstance(dim, bool) else None
        if name not in PARALLEL_DIM:
            raise InvalidSpace(f"unknown parallel dim {dim!r}", field="dims",
                               fix="use dp, sdp, tp, pp, zero1, zero2, sp or ParallelDim")
        names.add(name)
    return frozenset(names)


def _checkpoint_arg(checkpoint: Iterable[bool]) -> tuple[bool, ...]:
    flags = tuple(dict.fromkeys(checkpoint))
    if not flags or any(not isinstance(f, bool) for f in flags):
        raise InvalidSpace(f"got {checkpoint!r}", field="checkpoint", fix="a non-empty subset of (False, True)")
    return flags


def _ordered_factorizations(n: int, max_parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered tuples of factors >= 2 multiplying to n, at most max_parts long (() for n == 1)."""
    if n == 1:
        yield ()
        return
    if max_parts == 0:
        return
    for d in range(2, n + 1):
        if n % d == 0:
            for rest in _ordered_factorizations(n // d, max_parts - 1):
                yield (d, *rest)


def pipeline_degrees(num_devices: int, *, max_pp: int | None = None) -> list[int]:
    """PP degrees to try: every divisor of num_devices (equal groups), optionally capped (e.g. at the layer count)."""
    n = _count_arg(num_devices, "num_devices")
    cap = n if max_pp is None else _count_arg(max_pp, "max_pp")
    return [p for p in range(1, min(n, cap) + 1) if n % p == 0]


def layer_candidates(
    group_size: int,
    *,
    pp: int = 1,
    checkpoint: Iterable[bool] = (False, True),
    takeaway3: bool = True,
    dims: Iterable[str | int] = DIMS,
) -> list[Candidate]:
    """Every strategy of one layer on a group of `group_size` devices, restricted to `dims` ("pp" is ignored;
    "zero1" / "zero2" add those DP flavours of every shape with dp > 1, each right after its plain twin)."""
    size = _count_arg(group_size, "group_size")
    _count_arg(pp, "pp")
    names_given = _dim_names(dims)
    allowed = [d for d in DIMS if d in names_given]
    flavours = [f for f in FLAVOURS if f in names_given]
    flags = _checkpoint_arg(checkpoint)
    shapes: list[tuple[tuple[str, int], ...]] = []
    for degrees in _ordered_factorizations(size, len(allowed)):
        for names in permutations(allowed, len(degrees)):
            if takeaway3 and "dp" in names and "sdp" in names:
                continue
            shapes.append(tuple(zip(names, degrees, strict=True)))
    return [Candidate(pp, shape, ckpt, zero) for ckpt in flags for shape in shapes
            for zero in (PLAIN, *(flavours if any(name == "dp" for name, _ in shape) else ()))]


def strategy_space(
    num_devices: int,
    *,
    checkpoint: Iterable[bool] = (False, True),
    takeaway3: bool = True,
    dims: Iterable[str | int] = ("pp", *DIMS),
    max_pp: int | None = None,
) -> dict[int, list[Candidate]]:
    """Candidates per PP degree (the decision-tree forest). Without "pp" in dims only PP1 is tried;
    PP degrees whose group has no candidate under `dims` are left out."""
    names = _dim_names(dims)
    flags = _checkpoint_arg(checkpoint)
    degrees = pipeline_degrees(num_devices, max_pp=max_pp) if "pp" in names else [1]
    space = {}
    for pp in degrees:
        found = layer_candidates(num_devices // pp, pp=pp, checkpoint=flags, takeaway3=takeaway3, dims=names)
        if found:
            space[pp] = found
    return space


def count(
    num_devices: int,
    *,
    checkpoint: Iterable[bool] = (False, True),
    takeaway3: bool = True,
    dims: Iterable[str | int] = ("pp", *DIMS),
    max_pp: int | None = None,
) -> int:
    """Size of strategy_space(...) over all PP degrees."""
    space = strategy_space(num_devices, checkpoint=checkpoint, takeaway3=takeaway3, dims=dims, max_pp=max_pp)
    return sum(len(c) for c in space.values())


def splits(micro_batch_size: int, batch_split: int) -> bool:
    """Whether a micro-batch splits into whole samples over `batch_split` devices."""
    return micro_batch_size % batch_split == 0


def global_batch_fits(global_batch_size: int, num_devices: int, *, num_layers: int,
                      dims: Iterable[str | int] = ("pp", *DIMS)) -> bool:
    """Some PP degree and layer strategy split `global_batch_size` into whole samples per device: with micro-batch
    m = B / nm for any nm, that needs a candidate whose dp x sdp divides B."""
    space = strategy_space(num_devices, checkpoint=(False,), dims=dims, max_pp=num_layers)
    return any(global_batch_size % c.batch_split == 0 for found in space.values() for c in found)


def nearest_global_batches(global_batch_size: int, num_devices: int, *, num_layers: int,
                           dims: Iterable[str | int] = ("pp", *DIMS)) -> list[int]:
    """The closest valid global batch sizes below and above `global_batch_size` (below only if >= 1)."""
    space = strategy_space(num_devices, checkpoint=(False,), dims=dims, max_pp=num_layers)
    split_sizes = sorted({c.batch_split for found in space.values() for c in found})
    if not split_sizes:
        return []
    below = max((b for b in (global_batch_size // s * s for s in split_sizes) if b >= 1), default=None)
    above = min(-(-global_batch_size // s) * s for s in split_sizes)
    return [b for b in (below, above) if b is not None and b != global_batch_size]
