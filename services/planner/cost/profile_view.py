"""A read-only, interpolating view of a Profile: what each layer costs at any micro-batch size.

The profiler measures a layer at a few micro-batch sizes (Varuna Table 2: F(m), B(m) per cut-point;
Harmony §4.2: per-layer time and memory). Planners ask for sizes in between and beyond, and for the
per-device share of a micro-batch split by data parallelism, so every per-sample column is a
function of m:

* between samples: piecewise-linear interpolation (exact at the samples);
* below them: the line through the two smallest samples (times keep their fixed per-call cost);
* above them: the line from the largest sample back to the one at about half its size. A profile's rows
  are its measured sizes plus the regression's rows in between, and the largest row is measured: a line
  through its neighbour would turn that one row's noise (a few % on a shared host) into the slope, while
  the chord over the upper half divides it by half the size (exact either way when the rows are linear);
* both clamped at 0 (bytes never go negative);
* one sample only: proportional to m (Galvatron-BMW §V: time = batch size x per-sample time).

A layer with no samples (it did not fit at micro-batch 1) is flagged (`LayerView.fits`,
`ModelView.unfit_layers`) and asking it for a cost raises `LayerDoesNotFit` with the profiler's note,
so a search can drop the model instead of pricing a layer from nothing.

Everything is a frozen dataclass built once per profile (`from_profile`) or by hand in tests; the
per-(layer, m) points are memoised because dynamic programs ask for the same few sizes thousands of
times.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the proto is only needed by the converter
    from ballast.v1 import profile_pb2


class LayerDoesNotFit(ValueError):
    """A layer has no samples: the profiler could not run it at any micro-batch size."""


# Columns of a sample row, in LayerTable order.
COLUMNS = (
    "forward_s",
    "backward_s",
    "recompute_s",
    "boundary_bytes",
    "stashed_bytes",
    "output_bytes",
    "peak_bytes",
)


@dataclass(frozen=True, slots=True)
class LayerPoint:
    """One layer at one micro-batch size (interpolated; bytes as floats, rounded by callers)."""

    micro_batch_size: float
    forward_s: float
    backward_s: float
    recompute_s: float  # never 0 when forward_s > 0: a missing recompute time falls back to forward_s
    boundary_bytes: float  # inputs from earlier layers: what checkpointing keeps (Galvatron bnd_i)
    stashed_bytes: float  # intermediates saved for backward (Galvatron int_i)
    output_bytes: float
    peak_bytes: float


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), linear extrapolation outside (above: the chord from the largest
    sample back to the largest one at or below half its size), proportional with one point."""
    n = len(xs)
    if n == 1:
        return max(0.0, ys[0] * x / xs[0])
    i = bisect_left(xs, x)
    if i < n and xs[i] == x:
        return float(ys[i])
    if i >= n:
        j, k = min(max(bisect_right(xs, xs[-1] / 2) - 1, 0), n - 2), n - 1
    else:
        j = 0 if i == 0 else i - 1
        k = j + 1
    x0, x1, y0, y1 = xs[j], xs[k], ys[j], ys[k]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class LayerTable:
    """Samples of one layer, ascending by micro-batch size, one tuple per column."""

    micro_batch_sizes: tuple[int, ...] = ()
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()
    recompute_s: tuple[float, ...] = ()
    boundary_bytes: tuple[float, ...] = ()
    stashed_bytes: tuple[float, ...] = ()
    output_bytes: tuple[float, ...] = ()
    peak_bytes: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.micro_batch_sizes)
        for name in COLUMNS:
            col = getattr(self, name)
            if len(col) not in (0, n) or (name in ("forward_s", "backward_s") and len(col) != n):
                raise ValueError(f"column {name} has {len(col)} values for {n} micro-batch sizes")
            if any(v < 0 or not math.isfinite(v) for v in col):
                raise ValueError(f"column {name} must be finite and non-negative")
        sizes = self.micro_batch_sizes
        if any(m <= 0 for m in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"micro-batch sizes must be positive and strictly ascending, got {sizes}")

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[float]]) -> LayerTable:
        """Rows of (m, forward_s, backward_s, recompute_s, boundary, stashed, output, peak); any order."""
        data = sorted(tuple(r) for r in rows)
        if not data:
            return cls()
        width = 1 + len(COLUMNS)
        if any(len(r) != width for r in data):
            raise ValueError(f"each row needs {width} values (m and {', '.join(COLUMNS)})")
        cols = list(zip(*data, strict=True))
        return cls(tuple(int(m) for m in cols[0]), *(tuple(float(v) for v in c) for c in cols[1:]))

    def __len__(self) -> int:
        return len(self.micro_batch_sizes)

    def point(self, m: float) -> LayerPoint:
        if not self.micro_batch_sizes:
            raise LayerDoesNotFit("layer has no samples")
        if m <= 0:
            raise ValueError(f"micro-batch size must be positive, got {m}")
        xs = self.micro_batch_sizes

        def col(values: tuple[float, ...]) -> float:
            return _interp(xs, values, m) if values else 0.0

        fwd = col(self.forward_s)
        rec = col(self.recompute_s)
        return LayerPoint(
            micro_batch_size=m,
            forward_s=fwd,
            backward_s=col(self.backward_s),
            recompute_s=rec if rec > 0.0 else fwd,
            boundary_bytes=col(self.boundary_bytes),
            stashed_bytes=col(self.stashed_bytes),
            output_bytes=col(self.output_bytes),
            peak_bytes=col(self.peak_bytes),
        )


@dataclass(frozen=True)
class LayerView:
    """One layer: static sizes plus its sample table (see the module docstring for m-functions)."""

    index: int
    name: str = ""
    kind: str = "block"
    parameter_count: int = 0
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    table: LayerTable = field(default_factory=LayerTable)
    extra_inputs: tuple[int, ...] = ()  # earlier layers other than index-1 whose outputs this one reads
    tied_with: tuple[int, ...] = ()  # layers sharing weights with this one
    tensor_parallel: int = 0  # TP degrees dividing it are runnable by the executors (LayerProfile.tensor_parallel)
    sequence_parallel: int = 0  # ... with the sequence split too (LayerProfile.sequence_parallel)
    batch_input_bytes: int = 0
    max_micro_batch_size: int = 0
    note: str = ""
    optimizer_step_s: float = 0.0  # measured optimizer step over the whole layer, once per iteration
    parameter_numels: tuple[int, ...] = ()  # elements of the parameter tensors it owns (chunk offload's layout)
    parameter_tensors: tuple[int, ...] = ()  # model-wide indices of the parameter tensors it uses

    @property
    def fits(self) -> bool:
        return len(self.table) > 0

    def point(self, m: float) -> LayerPoint:
        try:
            return self.table.point(m)
        except LayerDoesNotFit:
            raise LayerDoesNotFit(f"layer {self.index} ({self.name or self.kind}) has no samples: "
                                  f"{self.note or 'not measured'}") from None

    def forward_s(self, m: float) -> float:
        return self.point(m).forward_s

    def backward_s(self, m: float) -> float:
        return self.point(m).backward_s

    def recompute_s(self, m: float) -> float:
        return self.point(m).recompute_s

    def boundary_bytes(self, m: float) -> float:
        return self.point(m).boundary_bytes

    def stashed_bytes(self, m: float) -> float:
        return self.point(m).stashed_bytes

    def output_bytes(self, m: float) -> float:
        return self.point(m).output_bytes

    def peak_bytes(self, m: float) -> float:
        return self.point(m).peak_bytes


@dataclass(frozen=True)
class MeasuredFit:
    """A calibrated ``t = latency + x / bandwidth`` line (profiler comm_fit conventions for x)."""

    collective: str  # p2p, allreduce, allgather, reduce_scatter, all_to_all
    group_size: int
    scope: str  # "intra_node" or "inter_node" (comm.Scope values)
    latency_s: float
    bandwidth_bytes_per_s: float
    r2: float = 1.0


@dataclass(frozen=True)
class ModelView:
    """All layers of a profile plus the model-wide facts the cost model needs."""

    layers: tuple[LayerView, ...]
    non_model_memory_bytes: int = 0
    overlap_slowdown: float | None = None  # measured compute slowdown under overlap; None if not measured
    colocated_slowdown: float | None = None  # measured compute slowdown with every device of a host busy
    composition_factor: float | None = None  # whole model over the sum of its layers alone (profiler/whole.py)
    comm_fits: tuple[MeasuredFit, ...] = ()
    dtype: str = ""  # "fp32", "fp16", "bf16" or "" when unknown
    device_kind: str = ""
    device_memory_bytes: int = 0
    profile_id: str = ""
    _points: dict[tuple[int, float], LayerPoint] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        for i, layer in enumerate(self.layers):
            if layer.index != i:
                raise ValueError(f"layer at position {i} has index {layer.index}; layers must be 0..L-1 in order")
            bad = [e for e in layer.extra_inputs if not 0 <= e < i - 1]
            if bad:
                raise ValueError(f"layer {i} extra_inputs {bad} must be earlier layers other than {i - 1}")

    def __len__(self) -> int:
        return len(self.layers)

    def point(self, index: int, m: float) -> LayerPoint:
        """Memoised `layers[index].point(m)`."""
        key = (index, m)
        p = self._points.get(key)
        if p is None:
            p = self._points[key] = self.layers[index].point(m)
        return p

    @property
    def unfit_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if not layer.fits)

    @cached_property
    def _last_reader(self) -> tuple[int, ...]:
        """For each layer, the last layer reading its output (index+1 for the plain chain)."""
        last = [i + 1 for i in range(len(self.layers))]
        for layer in self.layers:
            for e in layer.extra_inputs:
                last[e] = max(last[e], layer.index)
        return tuple(last)

    def crossing(self, cut: int) -> tuple[int, ...]:
        """Layers whose outputs cross the cut before layer `cut`: the predecessor plus relayed skip
        edges (a T5 encoder output read by decoder layers at or after `cut`)."""
        if not 0 < cut < len(self.layers):
            raise ValueError(f"cut must be in 1..{len(self.layers) - 1}, got {cut}")
        last = self._last_reader
        return tuple(e for e in range(cut) if e == cut - 1 or last[e] >= cut)


_DTYPES = {1: "fp32", 2: "fp16", 3: "bf16"}
_SCOPES = {1: "intra_node", 2: "inter_node"}


def _fits_from_proto(comm: profile_pb2.CommCalibration) -> tuple[MeasuredFit, ...]:
    """Usable fits with their scope; calibration runs on one host, so a fit without samples saying
    otherwise is intra-node. Fits with no positive bandwidth are dropped (they say nothing)."""
    scope_of: dict[tuple[str, int], str] = {}
    for s in comm.collectives:
        if s.scope in _SCOPES:
            scope_of[(s.collective, s.group_size)] = _SCOPES[s.scope]
    p2p_scopes = {_SCOPES[s.scope] for s in comm.links if s.scope in _SCOPES}
    out = []
    for f in comm.fits:
        if f.bandwidth_bytes_per_s <= 0 or f.group_size < 2:
            continue
        if f.collective == "p2p":
            scope = "inter_node" if p2p_scopes == {"inter_node"} else "intra_node"
        else:
            scope = scope_of.get((f.collective, f.group_size), "intra_node")
        out.append(MeasuredFit(f.collective, f.group_size, scope, max(0.0, f.latency_s), f.bandwidth_bytes_per_s, f.r2))
    return tuple(out)


def from_profile(profile: profile_pb2.Profile) -> ModelView:
    """The ModelView of a Profile proto (the only place this package reads profile messages)."""
    layers = []
    for i, lp in enumerate(profile.layers):
        if lp.index not in (0, i):
            raise ValueError(f"profile layer at position {i} says index {lp.index}; layers must be in order")
        rows: dict[int, profile_pb2.LayerSample] = {}
        for s in lp.samples:  # a duplicated size keeps the measured row over an interpolated one
            if s.micro_batch_size > 0 and (s.micro_batch_size not in rows or s.measured):
                rows[s.micro_batch_size] = s
        table = LayerTable.from_rows(
            (m, s.forward_s, s.backward_s, s.recompute_s, s.boundary_activation_bytes, s.stashed_activation_bytes,
             s.output_bytes, s.peak_memory_bytes)
            for m, s in rows.items()
        )
        layers.append(LayerView(
            index=i,
            name=lp.name,
            kind=lp.kind or "block",
            parameter_count=lp.parameter_count,
            parameter_bytes=lp.parameter_bytes,
            gradient_bytes=lp.gradient_bytes,
            optimizer_state_bytes=lp.optimizer_state_bytes,
            table=table,
            extra_inputs=tuple(lp.extra_inputs),
            tied_with=tuple(lp.tied_with),
            tensor_parallel=lp.tensor_parallel,
            sequence_parallel=lp.sequence_parallel,
            batch_input_bytes=lp.batch_input_bytes,
            max_micro_batch_size=lp.max_micro_batch_size,
            optimizer_step_s=lp.optimizer_step_s,
            parameter_numels=tuple(lp.parameter_numels),
            parameter_tensors=tuple(lp.parameter_tensors),
            note=lp.note,
        ))
    slowdown = profile.comm.overlap_slowdown
    return ModelView(
        layers=tuple(layers),
        non_model_memory_bytes=profile.non_model_memory_bytes,
        overlap_slowdown=slowdown if slowdown > 0 else None,
        colocated_slowdown=profile.comm.colocated_slowdown or None,
        composition_factor=profile.composition_factor or None,
        comm_fits=_fits_from_proto(profile.comm),
        dtype=_DTYPES.get(profile.dtype, ""),
        device_kind=profile.device.kind,
        device_memory_bytes=profile.device.memory_bytes,
        profile_id=profile.id,
    )
