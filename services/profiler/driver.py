"""One ProfileRequest -> one measured Profile: sweep, measure, regress, trace, calibrate (Harmony §3, §4.2).

1. Identical layers. Layers with one structural signature (module class tree with each module's
   configuration, parameter shapes/dtypes, input tensor shapes/dtypes) cost the same, so only the
   first of them is probed and measured; the others reuse its rows with `measured_as` pointing at it.
   A 48-block model is then measured like a 1-block one.
2. Sweep. With `max_micro_batch_size` set, Harmony's slow start (`sweep.sweep`) finds the largest
   micro-batch m <= that cap such that every layer's forward+backward peak (`measure_layer`'s definition,
   from one untimed pass) fits the memory cap; a real out-of-memory error counts as a failure. Each layer
   must run on some device, so the largest per-layer peak decides. With `options.micro_batch_sizes` those
   sizes are measured instead of the strided ones; without `max_micro_batch_size` they are also the only
   sizes probed. With neither, the bounded default sweep (`bounded.ladder`) doubles m from 1, probing and
   measuring each size, until time per sample stops improving (Varuna §4.4), the time budget, a size that
   does not fit, or 1024. A time budget (`time_budget_s`) also bounds the measuring of the other two.
3. Measure each group's representative at the chosen sizes (`measure_layer`, one chain forward per
   size provides realistic inputs), fit a line per field (`sweep.fit_fields`) and fill the sizes up to
   the largest that fits with measured=False rows. After a capped sweep, measuring starts only once the
   sweep has run the largest sizes: on CPU the allocator's state (glibc raises its mmap threshold once large
   blocks were freed) changed layer times by ~15%, and that is the settled state a training process runs in
   (the worker's steady allocator settings, `services.runtime.allocator`, remove most of that effect, which
   lets the bounded sweep measure as it goes).
4. Trace non-model memory of one warm-up iteration at the largest measured size (PatrickStar §8.1)
   and optionally calibrate links (`calibrate.calibrate`); a calibration failure is recorded in
   `comm.unsupported`, never fatal.

A layer that does not fit at micro-batch 1 gets a note and no samples: then no micro-batch fits the
model on this device, and every layer's note says why. Intra-op threads are set for the process and
left set (a profiling worker runs one profile).
"""

from __future__ import annotations

import hashlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from google.protobuf.json_format import MessageToJson
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from ballast.v1 import fleet_pb2, model_pb2, profile_pb2, services_pb2
from services.profiler import calibrate as calibration
from services.profiler import noise, whole
from services.profiler.bounded import (
    CEILING,
    DEFAULT_TIME_BUDGET_S,
    Ladder,
    check_budget,
    expected_end,
    ladder,
    predicted_end,
)
from services.profiler.measure import (
    _backward,
    _cotangents,
    _gc_paused,
    _memory_pass,
    _precision,
    _prepare,
    iter_layer_args,
    measure_layer,
)
from services.profiler.measure_bytes import adam_bytes_per_param, as_dtype, parameters_of, proto_dtype, tensor_bytes
from services.profiler.memtrace import LiveTensorTracker, trace_iteration
from services.profiler.sweep import fit_fields, fit_samples, interpolate, is_oom, sweep
from services.profiler.versions import software
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.specs import catalog
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import Decomposition, build_model, check_spec, example_input
from services.zoo.graph import parameter_tensors

T = TypeVar("T")
log = logging.getLogger("ballast.profiler.driver")

MIN_REPEATS, MIN_WARMUP = 5, 2
TRACE_POINTS = 1024
MEASURE_COST = 8  # a measurement (warmup + repeats of 4 passes) vs one probe pass, for progress only
CALIBRATION_TIMEOUT_S = 120.0  # per group size
# A measured size whose forward+backward lies farther than this from the line through the other measured
# sizes is measured again (at most RECHECKS times per layer), and flagged if it still does, see _Session.recheck.
# 5%: on a quiet host a row's repeats spread 1-4%, and two profiles minutes apart put a row up to 15% apart when
# one was taken under a few seconds of interference (benchmarks/profile_repro.py).
RECHECK_TOLERANCE = 0.05
RECHECKS = 4
WHOLE_RETRIES = 2  # re-times of the whole step when its ratio to the layers is out of bounds
COMPOSITION_ROUNDS = 2  # alternating whole-pass / layers-alone measurements behind the composition factor
Progress = Callable[[services_pb2.ProfileProgress], None]


@dataclass
class Group:
    """Structurally identical layers; `rep` (the first) is the one probed and measured."""

    rep: int
    members: list[int]
    peaks: dict[int, int] = field(default_factory=dict)  # probed m -> peak bytes
    fit_max: int = 0  # largest probed m whose peak fit the cap
    failures: dict[int, str] = field(default_factory=dict)  # m -> why it failed (probe or measurement)
    samples: dict[int, profile_pb2.LayerSample] = field(default_factory=dict)  # measured m -> row


def layer_signature(module: nn.Module, n_activations: int, args: Sequence[object]) -> str:
    """Hash of what decides a layer's cost: module tree and configuration, parameters, input shapes."""
    parts = [f"activations={n_activations}"]
    for name, mod in module.named_modules():
        kind = f"{type(mod).__module__}.{type(mod).__qualname__}"
        config = sorted((k, repr(v)) for k, v in vars(mod).items() if not k.startswith("_") and _scalar(v))
        parts.append(f"{name}:{kind}({mod.extra_repr()}){config}")
        for pname, p in mod.named_parameters(recurse=False):
            parts.append(f"{name}.{pname}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}")
        for bname, b in mod.named_buffers(recurse=False):
            parts.append(f"{name}.{bname}:{tuple(b.shape)}:{b.dtype}")
    for a in args:
        parts.append(f"arg:{tuple(a.shape)}:{a.dtype}" if isinstance(a, Tensor) else f"arg:{type(a).__name__}:{a!r}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _scalar(value: object) -> bool:
    if isinstance(value, tuple | list):
        return all(_scalar(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def device_spec(device: torch.device, dtype: torch.dtype) -> fleet_pb2.DeviceSpec:
    """Catalog figures for the device measured on; memory is what this host really has."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        total = torch.cuda.get_device_properties(device).total_memory
        try:
            spec = catalog.to_proto(name, proto_dtype(dtype))
        except InvalidArgument:  # not in the catalog: what the driver says, no datasheet figures
            spec = fleet_pb2.DeviceSpec(kind=name)
        spec.memory_bytes = total
        return spec
    try:
        spec = catalog.to_proto("cpu", proto_dtype(dtype))
    except InvalidArgument:  # no modelled fp16/bf16 peak on CPU: keep the nominal fp32 figure
        spec = catalog.to_proto("cpu", "fp32")
    spec.memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return spec


class _Reporter:
    """Turns (phase, progress within phase) into ProfileProgress with a monotonic overall fraction."""

    def __init__(self, callback: Progress, layers_total: int, weights: dict[str, float]) -> None:
        total = sum(weights.values())
        self.callback, self.layers_total, self.start, self.width = callback, layers_total, {}, {}
        acc = 0.0
        for phase, w in weights.items():
            self.start[phase], self.width[phase] = acc / total, w / total
            acc += w
        self.fraction = 0.0

    def __call__(
        self, band: str, within: float, message: str = "", *, layer: int = 0, m: int = 0, phase: str = ""
    ) -> None:
        """Report progress `within` [0, 1] of `band` (a weighted phase); `phase` overrides the label."""
        value = 1.0 if band == "done" else self.start[band] + self.width[band] * min(1.0, max(0.0, within))
        self.fraction = max(self.fraction, min(value, 1.0))
        self.callback(
            services_pb2.ProfileProgress(
                phase=phase or band,
                layer_index=layer,
                layers_total=self.layers_total,
                micro_batch_size=m,
                fraction=self.fraction,
                message=message,
            )
        )


class _Session:
    """The built model, its groups of identical layers, and the probe / measure passes over sizes."""

    def __init__(
        self,
        spec: model_pb2.ModelSpec,
        decomposition: Decomposition,
        device: torch.device,
        dtype: torch.dtype,
        cap_bytes: int,
        user_inputs: UserInputs,
        repeats: int = MIN_REPEATS,
        warmup: int = MIN_WARMUP,
    ) -> None:
        self.spec, self.decomposition, self.device, self.dtype = spec, decomposition, device, dtype
        self.cap_bytes, self.user_inputs, self.repeats, self.warmup = cap_bytes, user_inputs, repeats, warmup
        self.on_measure: Callable[[Group, int], None] = lambda g, m: None
        self.groups = self._group()
        self.per_sample = example_input(spec, 1, user_inputs=user_inputs)  # batch fields of one sample
        self.group_of = {i: g for g in self.groups for i in g.members}

    def batch(self, m: int) -> dict[str, Tensor]:
        return example_input(self.spec, m, device=self.device, user_inputs=self.user_inputs)

    def _group(self) -> list[Group]:
        """Signatures from a micro-batch 1 pass (shapes only; the chain forward gives real inputs)."""
        found: dict[str, Group] = {}
        try:
            for i, args in iter_layer_args(self.decomposition, self.batch(1)):
                layer = self.decomposition.layers[i]
                key = layer_signature(layer.module, len(layer.inputs), args)
                found.setdefault(key, Group(rep=i, members=[])).members.append(i)
        except Exception as exc:  # not even the m=1 forward runs: nothing will fit, every layer alone
            if not is_oom(exc):
                raise
            _release()
            return [Group(rep=i, members=[i], failures={1: f"out of memory: {exc}"}) for i in range(self.n)]
        return list(found.values())

    @property
    def n(self) -> int:
        return len(self.decomposition.layers)

    def walk(self, m: int, groups: Iterable[Group]) -> Iterator[tuple[Group, tuple]]:
        """(group, args of its representative) at size m; the chain stops after the last one needed."""
        wanted = {g.rep: g for g in groups}
        if not wanted:
            return
        last = max(wanted)
        for i, args in iter_layer_args(self.decomposition, self.batch(m)):
            if i in wanted:
                yield wanted[i], args
            if i >= last:
                break

    def fits(self, m: int) -> bool:
        """Probe: does every layer's forward+backward peak at m fit the cap (no OOM either)?"""
        todo = [g for g in self.groups if m not in g.peaks and m not in g.failures]
        try:
            for g, args in self.walk(m, todo):
                g.peaks[m] = self.peak(g.rep, args, m)
        except Exception as exc:
            if not is_oom(exc):
                raise
            _release()
            for g in self.groups:
                if m not in g.peaks:
                    g.failures.setdefault(m, f"out of memory: {exc}")
        ok = True
        for g in self.groups:
            if m in g.peaks and g.peaks[m] > self.cap_bytes:
                g.failures.setdefault(m, f"peak {g.peaks[m]} B > memory cap {self.cap_bytes} B")
            if m in g.failures:
                ok = False
            else:
                g.fit_max = max(g.fit_max, m)
        return ok

    def peak(self, index: int, args: Sequence[object], m: int) -> int:
        """`measure_layer`'s peak_memory_bytes (same accounting, same seeded cotangents), untimed.

        On CPU the cotangents are drawn after the tracked forward instead of from an extra no_grad
        forward (they are resident either way, counted outside the tracker); on CUDA the allocator's
        peak would count them, so `measure`'s own memory pass is used.
        """
        layer = self.decomposition.layers[index]
        params = parameters_of(layer.module)
        prepared = _prepare(args, len(layer.inputs), self.device, self.dtype)
        activations, fields = prepared[: len(layer.inputs)], prepared[len(layer.inputs) :]
        wrt = [a for a in activations if isinstance(a, Tensor) and a.requires_grad]
        wrt += [p for p in params if p.requires_grad]
        with _precision(params, self.dtype), _gc_paused():
            if self.device.type == "cuda":
                cotangents = _cotangents(layer.module, prepared, 0)
                _, _, transient = _memory_pass(layer.module, prepared, params, wrt, cotangents, self.device)
            else:
                tracker = LiveTensorTracker()
                with tracker:
                    out = layer.module(*prepared)
                cotangents = _seeded_cotangents(out, 0)
                with tracker:
                    _backward(out, wrt, cotangents)
                    del out
                transient = tracker.peak_bytes
        resident = sum(p.numel() for p in params) * adam_bytes_per_param(self.dtype).param
        resident += tensor_bytes(a for a in activations if isinstance(a, Tensor))
        resident += tensor_bytes(a for a in fields if isinstance(a, Tensor)) + tensor_bytes(cotangents)
        log.debug("probe %s m=%d: %d B", layer.name, m, resident + transient)
        return resident + transient

    def measure(self, m: int, groups: Sequence[Group] | None = None) -> None:
        """Measure every group's representative at m unless measured or failed at m or below."""
        todo = [
            g for g in (self.groups if groups is None else groups)
            if m not in g.samples and not any(f <= m for f in g.failures)
        ]
        try:
            for g, args in self.walk(m, todo):
                self.on_measure(g, m)
                row = measure_layer(
                    self.decomposition, g.rep, args, repeats=self.repeats, warmup=self.warmup,
                    device=self.device, dtype=self.dtype, micro_batch_size=m,
                ).sample()
                g.peaks[m] = row.peak_memory_bytes
                if row.peak_memory_bytes > self.cap_bytes:
                    g.failures[m] = f"peak {row.peak_memory_bytes} B > memory cap {self.cap_bytes} B when measured"
                else:
                    g.samples[m] = row
        except Exception as exc:
            if not is_oom(exc):
                raise
            _release()
            for g in todo:
                if m not in g.samples:
                    g.failures.setdefault(m, f"out of memory while measuring: {exc}")

    def seconds(self, m: int) -> float | None:
        """The model's forward+backward at m, every layer counted (identical ones too); None if a layer failed."""
        if any(m not in g.samples for g in self.groups):
            return None
        return sum(len(g.members) * _total(g.samples[m]) for g in self.groups)

    def layers_alone_s(self, m: int) -> float:
        """Every layer's forward+backward at m measured alone now (identical layers counted by their group's
        representative), summed: the composition factor's denominator, taken beside the whole pass it divides."""
        total = 0.0
        for g, args in self.walk(m, self.groups):
            row = measure_layer(self.decomposition, g.rep, args, repeats=self.repeats, warmup=self.warmup,
                                device=self.device, dtype=self.dtype, micro_batch_size=m).sample()
            total += len(g.members) * _total(row)
        whole.release_gradients(self.decomposition)
        return total

    def remeasure(self, sizes: Sequence[int]) -> None:
        """Measure every group at `sizes` again and keep, per group and size, the faster row of the two passes
        (the first pass overlapped interference: noise.py)."""
        first = {id(g): {m: g.samples.pop(m) for m in sizes if m in g.samples} for g in self.groups}
        for m in sizes:
            self.measure(m, [g for g in self.groups if m in first[id(g)]])
        for g in self.groups:
            for m, row in first[id(g)].items():
                again = g.samples.get(m)
                if again is None or _total(row) <= _total(again):
                    g.samples[m] = row
                g.failures.pop(m, None)

    def recheck(self, sizes: Sequence[int]) -> list[tuple[str, int]]:
        """Measure again the size that is the odd one out of the line through the others.

        Interference on a shared host (another tenant, a neighbour VM) slows a whole measurement for
        seconds, longer than its repeats, so one size can come out 20-30% slow while the rest are
        fine, and the regression tilts. Layer time is close to linear in the micro-batch size, so the
        size whose removal leaves the straightest line, if it lies far off that line, is suspect: it is
        measured once more and the faster of
        the two rows is kept (interference only ever adds time). A row still off the line after that is
        flagged (LayerSample.off_line), so a reader knows which figure its repeats vouch for less than the
        rest. Returns what was re-measured.
        """
        redone = []
        for g in self.groups:
            for _ in range(RECHECKS):
                ms = sorted(m for m in g.samples if m in sizes)
                if len(ms) < 3:
                    break
                worst = min(ms, key=lambda m: (_rest_residual(g.samples, ms, m), -_loo_error(g.samples, ms, m)))
                error = _loo_error(g.samples, ms, worst)
                if error <= RECHECK_TOLERANCE:
                    break
                before = g.samples.pop(worst)
                self.measure(worst, [g])
                again = g.samples.get(worst)
                g.samples[worst] = before if again is None or _total(before) <= _total(again) else again
                g.failures.pop(worst, None)
                redone.append((self.decomposition.layers[g.rep].name, worst))
                log.info("re-measured %s at m=%d (%.0f%% off the line through the others)",
                         self.decomposition.layers[g.rep].name, worst, 100 * error)
            flag_off_line(g.samples, sorted(m for m in g.samples if m in sizes))
        return redone


def flag_off_line(samples: dict[int, profile_pb2.LayerSample], sizes: Sequence[int]) -> None:
    """Set each row's off_line: how far its forward or backward lies off the line between the nearest sizes below
    and above it, where that exceeds RECHECK_TOLERANCE; 0 otherwise. Judged locally, so a real curve (a GPU's flat
    start, the fixed cost that makes micro-batch 1 dear) is not flagged. The curve bends at the small end and is
    straight at the large end: the largest size is judged by the line through the two below it, the smallest
    not at all. The worst row is flagged first and left out of its neighbours' lines, so one slow row
    does not tilt theirs into a flag too."""
    for m in sizes:
        samples[m].off_line = 0.0
    rest = list(sizes)
    while len(rest) >= 3:
        worst = max(rest, key=lambda m: _local_error(samples, rest, m))
        error = _local_error(samples, rest, worst)
        if error <= RECHECK_TOLERANCE:
            return
        samples[worst].off_line = error
        rest.remove(worst)


def _local_error(samples: dict[int, profile_pb2.LayerSample], sizes: Sequence[int], m: int) -> float:
    """_loo_error of forward and of backward (the worse) against the line between the nearest sizes below and
    above m, or through the two below the largest (0 for the smallest)."""
    below, above = sorted(k for k in sizes if k < m), [k for k in sizes if k > m]
    if not below or (not above and len(below) < 2):
        return 0.0
    around = [below[-1], m, min(above)] if above else [*below[-2:], m]
    return max(_loo_error(samples, around, m, lambda r: r.forward_s),
               _loo_error(samples, around, m, lambda r: r.backward_s))


def _total(row: profile_pb2.LayerSample) -> float:
    return row.forward_s + row.backward_s


def _rest_residual(samples: dict[int, profile_pb2.LayerSample], sizes: Sequence[int], m: int) -> float:
    """RMS relative residual of the line through every size but m: lowest when m is the odd one out."""
    others = [k for k in sizes if k != m]
    fit = fit_samples([float(k) for k in others], [_total(samples[k]) for k in others])
    errors = [(fit.intercept + fit.slope * k) / _total(samples[k]) - 1.0 for k in others if _total(samples[k]) > 0]
    return (sum(e * e for e in errors) / len(errors)) ** 0.5 if errors else 0.0


def _loo_error(samples: dict[int, profile_pb2.LayerSample], sizes: Sequence[int], m: int,
               time: Callable[[profile_pb2.LayerSample], float] = _total) -> float:
    """How far size m's forward+backward (or another `time` of the row) is off the line through the other
    sizes, as a ratio - 1.

    Symmetric (a point 3x too slow and one 3x too fast both score 2), so a slowed point is not
    outscored by its neighbours, whose lines it tilts.
    """
    others = [k for k in sizes if k != m]
    fit = fit_samples([float(k) for k in others], [time(samples[k]) for k in others])
    predicted, measured = fit.intercept + fit.slope * m, time(samples[m])
    if measured <= 0:
        return 0.0
    return max(predicted, measured) / max(min(predicted, measured), 1e-12) - 1.0


def _seeded_cotangents(out: object, seed: int) -> list[Tensor]:
    """The cotangents `measure._cotangents` draws, from an output already at hand."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.ones_like(o) if o.dim() == 0 else torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)
        for o in tree_leaves(out)
        if isinstance(o, Tensor)
    ]


def _release() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_request(request: services_pb2.ProfileRequest) -> None:
    """Reject options the measurement would otherwise silently change; errors name the field."""
    opts = request.options
    if opts.repeats and opts.repeats < MIN_REPEATS:
        raise InvalidArgument(f"{opts.repeats} < {MIN_REPEATS}", field="options.repeats", fix="use 0 or >= 5")
    if opts.warmup and opts.warmup < MIN_WARMUP:
        raise InvalidArgument(f"{opts.warmup} < {MIN_WARMUP}", field="options.warmup", fix="use 0 or >= 2")
    if any(m < 1 for m in opts.micro_batch_sizes):
        raise InvalidArgument("sizes must be >= 1", field="options.micro_batch_sizes", fix="drop zeros")
    if any(n < 2 for n in opts.calibrate_group_sizes):
        raise InvalidArgument("group sizes must be >= 2", field="options.calibrate_group_sizes", fix="e.g. [2]")
    check_budget(request.time_budget_s)


def _torch_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(str(exc), field="device", fix="cpu or cuda[:index]") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FailedPrecondition("no CUDA device on this host", field="device", fix="profile on cpu")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"unsupported device {dev}", field="device", fix="cpu or cuda[:index]")
    return dev


def profile(
    spec: model_pb2.ModelSpec,
    request: services_pb2.ProfileRequest,
    *,
    device: str | torch.device = "cpu",
    user_inputs: UserInputs = NO_USER_INPUTS,
    progress: Progress = lambda p: None,
) -> profile_pb2.Profile:
    """Measure `spec` as `request` asks (see the module docstring); ids, model and signature are the
    caller's to fill. Raises InvalidArgument for a bad spec or option, never for a layer that does not fit."""
    t0 = time.perf_counter()
    check_request(request)
    check_spec(spec, user_inputs)  # before any progress line: a bad spec is the whole answer
    opts = request.options
    dev = _torch_device(device)
    try:
        dt = as_dtype(request.dtype or spec.dtype)
    except ValueError as exc:
        raise InvalidArgument(str(exc), field="dtype", fix="fp32, fp16 or bf16") from exc
    threads = opts.intra_op_threads or 1
    torch.set_num_threads(threads)
    repeats, warmup = opts.repeats or MIN_REPEATS, opts.warmup or MIN_WARMUP
    weights = {"building": 2.0, "measure": 83.0}  # "measure" covers the sweep's probes too
    if not opts.skip_memory_trace:
        weights["memory_trace"] = 5.0
    if opts.calibrate:
        weights["calibrate"] = 10.0
    hw = device_spec(dev, dt)
    cap_bytes = request.memory_cap_bytes or hw.memory_bytes

    report = _Reporter(progress, 0, weights)
    report("building", 0.0, f"building {spec.name or 'model'}")
    model = build_model(spec, device=dev, user_inputs=user_inputs, seed=0)  # InvalidArgument on a bad spec
    decomposition = model.decompose()
    report.layers_total = len(decomposition.layers)
    report("building", 0.5, f"built {spec.name or 'model'}: {len(decomposition.layers)} layers")
    session = _Session(spec, decomposition, dev, dt, cap_bytes, user_inputs, repeats, warmup)
    report("building", 1.0, f"{len(session.groups)} distinct layers of {session.n}")
    before = noise.probe_s(dev)
    top, to_measure = _sizes(session, request, report, t0)
    host_noise, passes = noise.moved(before, noise.probe_s(dev)), 1
    if host_noise > noise.NOISY and to_measure:  # not a quiet host: measure again, keep the faster rows
        report("measure", 1.0, f"the host was busy while measuring (a fixed workload moved {host_noise:.0%}); "
               "measuring again", phase="remeasure")
        before = noise.probe_s(dev)
        session.on_measure = lambda g, m: None  # the bar already stands at the end of measuring
        session.remeasure(to_measure)
        host_noise, passes = noise.moved(before, noise.probe_s(dev)), 2

    layers = [_layer_profile(session, i, top, dt) for i in range(session.n)]
    _parameter_tensors(layers, decomposition)
    measured = sorted({m for g in session.groups for m in g.samples if m <= top})
    out = profile_pb2.Profile(
        device=hw,
        dtype=proto_dtype(dt),
        software=software(spec, user_inputs),
        intra_op_threads=threads,
        layers=layers,
        measured_micro_batch_sizes=measured,
        memory_cap_bytes=request.memory_cap_bytes,
        host_noise=host_noise,
        noisy=host_noise > noise.NOISY,
        measure_passes=passes,
    )
    if measured and dt == torch.float32:  # the zoo builds fp32 weights; other precisions are cast per layer
        _whole_model(out, session, session.batch(measured[len(measured) // 2]), repeats)
    if not opts.skip_memory_trace and measured:
        report("memory_trace", 0.0, f"warm-up iteration at micro-batch {measured[-1]}", m=measured[-1])
        _trace(out, decomposition, session.batch(measured[-1]))
        report("memory_trace", 1.0, f"non-model peak {out.non_model_memory_bytes} B", m=measured[-1])
    if opts.calibrate:
        groups = sorted(set(opts.calibrate_group_sizes)) or [2]
        report("calibrate", 0.0, f"calibrating links for group sizes {groups}")
        out.comm.CopyFrom(_calibrate(groups))
        if measured and dt == torch.float32 and dev.type == "cpu":  # GPUs do not share compute
            out.comm.colocated_slowdown = whole.colocated_slowdown(
                MessageToJson(spec), decomposition, session.batch(measured[len(measured) // 2]), repeats,
                siblings=max(groups) - 1, user_inputs=user_inputs)
            whole.release_gradients(decomposition)
        report("calibrate", 1.0, f"{len(out.comm.fits)} fits")
    out.profiling_time_s = time.perf_counter() - t0
    report("done", 1.0, f"profiled {session.n} layers ({len(session.groups)} distinct) at sizes {measured} "
           f"in {out.profiling_time_s:.1f} s")
    return out


def _sizes(session: _Session, request: services_pb2.ProfileRequest, report: _Reporter,
           t0: float) -> tuple[int, list[int]]:
    """Sweep (or probe the explicit sizes), then measure; returns (largest size that fits, sizes measured).

    `t0` is when profiling started: the time budget counts from it.
    """
    if request.options.micro_batch_sizes or request.max_micro_batch_size:
        top, to_measure, why = _capped(session, request, report, t0)
    else:
        top, to_measure, why = _bounded(session, request.time_budget_s or DEFAULT_TIME_BUDGET_S, report, t0)
    session.recheck(to_measure)
    report("measure", 1.0, f"measured micro-batch sizes {to_measure}: {why}", phase="swept")
    return top, to_measure


def _bounded(session: _Session, budget_s: float, report: _Reporter, t0: float) -> tuple[int, list[int], str]:
    """The default sweep (`bounded.ladder`), measuring as it doubles. Its length is unknown until it stops, so
    progress is time spent over the time it should take if time per sample has stopped improving
    (`bounded.expected_end`, never past the budget): when a size still improves, the estimate grows and the bar
    waits for it (the reporter never moves it back)."""
    end = {"s": budget_s}  # until micro-batch 1 is measured, the budget is all that is known

    def at(message: str, m: int, layer: int = 0, phase: str = "measure") -> None:
        spent = time.perf_counter() - t0
        report("measure", 0.95 * spent / max(end["s"], spent, 1e-9), message, layer=layer, m=m, phase=phase)

    def step(state: Ladder) -> None:
        end["s"] = expected_end(time.perf_counter() - t0, budget_s, state.sizes[-1], state.last_step_s, state.stale)

    def fits(m: int) -> bool:
        at(f"probing micro-batch {m}", m, phase="sweep")
        return session.fits(m)

    def seconds(m: int) -> float | None:
        session.measure(m)
        return session.seconds(m)

    session.on_measure = lambda g, m: at(
        f"measuring {session.decomposition.layers[g.rep].name} at micro-batch {m}", m, layer=g.rep)
    result = ladder(fits, seconds, budget_s=budget_s, cap=CEILING, clock=time.perf_counter, start=t0, on_step=step)
    log.info("bounded sweep: measured %s, best time per sample at %d; %s", result.sizes, result.best, result.reason)
    top = result.sizes[-1] if result.sizes else 0
    return top, result.sizes, result.reason + (f"; best time per sample at micro-batch {result.best}"
                                               if result.best and "improving" not in result.reason else "")


def _capped(session: _Session, request: services_pb2.ProfileRequest, report: _Reporter,
            t0: float) -> tuple[int, list[int], str]:
    """Harmony's sweep up to max_micro_batch_size, or the explicit sizes; then measure, within the budget if any.

    Progress is work done over an estimate of the work (a probe at m costs m units, a measurement
    MEASURE_COST * m), re-estimated once the sweep knows the sizes; the reporter keeps it monotonic.
    """
    opts = request.options
    explicit = sorted(set(opts.micro_batch_sizes))
    sweeping = not explicit or request.max_micro_batch_size > 0
    cap = request.max_micro_batch_size or explicit[-1]
    probes = sum(1 << k for k in range(cap.bit_length())) + cap if sweeping else 0
    planned = [m for m in explicit if m <= cap] if explicit else [*range(1, cap + 1, opts.stride or 1), cap]
    work = {"done": 0.0, "total": float(probes + MEASURE_COST * sum(planned))}

    def on_measure(g: Group, m: int) -> None:
        name = session.decomposition.layers[g.rep].name
        report("measure", work["done"] / work["total"], f"measuring {name} at micro-batch {m}",
               layer=g.rep, m=m, phase="measure")
        work["done"] += MEASURE_COST * m / len(session.groups)

    def probe(m: int) -> bool:
        report("measure", work["done"] / work["total"], f"probing micro-batch {m}", m=m, phase="sweep")
        ok = session.fits(m)
        work["done"] += m
        return ok

    session.on_measure = on_measure
    if sweeping:
        result = sweep(probe, cap=cap, stride=opts.stride or 1)
        top, why = result.max_fit, result.reason
        to_measure = [m for m in explicit if m <= top] if explicit else result.sizes
        log.info("sweep: largest fit %d (%s); measuring %s", top, result.reason, to_measure)
    else:
        to_measure = []
        for m in explicit:
            if not probe(m):
                break
            to_measure.append(m)
        top = to_measure[-1] if to_measure else 0
        why = "the sizes asked for" if to_measure == explicit else f"micro-batch {explicit[len(to_measure)]} failed"
    work["total"] = work["done"] + MEASURE_COST * sum(to_measure) or 1.0
    measured: list[int] = []
    last = (0, 0.0)  # (size, seconds its measurement took)
    for m in to_measure:
        elapsed = time.perf_counter() - t0
        if request.time_budget_s and last[0] and predicted_end(elapsed, *last, m) > request.time_budget_s:
            why = (f"time budget {request.time_budget_s:g} s: stopped before micro-batch {m}, rows above "
                   f"{measured[-1]} are the regression's")
            break
        session.measure(m)
        last = (m, time.perf_counter() - t0 - elapsed)
        measured.append(m)
    return top, measured, why


def _parameter_tensors(layers: list[profile_pb2.LayerProfile], decomposition: Decomposition) -> None:
    """Each layer's parameter tensors as chunk offload lays them out (zoo.graph.parameter_tensors)."""
    params, used = parameter_tensors(decomposition)
    owned: set[int] = set()
    for layer, indices in zip(layers, used, strict=True):
        layer.parameter_tensors.extend(indices)
        mine = [i for i in indices if i not in owned]
        layer.parameter_numels.extend(params[i].numel() for i in mine)
        owned.update(mine)


def _layer_profile(session: _Session, index: int, top: int, dtype: torch.dtype) -> profile_pb2.LayerProfile:
    """The layer's own facts plus its group's rows: measured, and interpolated up to the largest fit."""
    layer = session.decomposition.layers[index]
    g = session.group_of[index]
    params = parameters_of(layer.module)
    count, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    per = adam_bytes_per_param(dtype)
    out = profile_pb2.LayerProfile(
        index=index,
        name=layer.name,
        kind=layer.kind,
        parameter_count=count,
        parameter_bytes=count * per.param,
        gradient_bytes=trainable * per.grad,
        optimizer_state_bytes=trainable * per.optimizer,
        extra_inputs=layer.extra_inputs,
        tied_with=layer.tied_with,
        tensor_parallel=layer.tensor_parallel,
        sequence_parallel=layer.sequence_parallel,
        measured_as=g.rep,
        batch_input_bytes=tensor_bytes(session.per_sample[k] for k in layer.batch_keys),  # per sample: scale by m
        max_micro_batch_size=g.fit_max,
    )
    failed = min(g.failures, default=0)
    upto = min(top, failed - 1) if failed else top
    rows = [g.samples[m] for m in sorted(g.samples) if m <= upto]
    if rows:
        out.samples.extend(interpolate(rows, range(1, upto + 1), fits=fit_fields(rows)))
    out.note = _note(session, g, top, upto)
    return out


def _note(session: _Session, g: Group, top: int, upto: int) -> str:
    if 1 in g.failures:
        return f"does not fit at micro-batch 1: {g.failures[1]}"
    if top == 0:
        worst = next((h for h in session.groups if 1 in h.failures), None)
        who = session.decomposition.layers[worst.rep].name if worst else "a layer"
        return f"not measured: {who} does not fit at micro-batch 1, so no micro-batch fits the model"
    if g.failures:  # this layer stopped the sweep (or its own rows) at the first size that failed
        m = min(g.failures)
        return f"rows stop at micro-batch {upto}: micro-batch {m} does not fit: {g.failures[m]}"
    return ""


def _unless_oom(what: str, measure: Callable[[], T]) -> T | None:
    """measure(), or None after an out-of-memory (released, logged): an optional check never fails a profile."""
    try:
        return measure()
    except Exception as exc:
        if not is_oom(exc):
            raise
        _release()
        log.warning("%s skipped: %s", what, exc)
        return None


def _trace(out: profile_pb2.Profile, decomposition: Decomposition, batch: dict[str, Tensor]) -> None:
    """Warm-up iteration in the model's fp32 weights (as `profile_model` does); OOM skips it."""
    trace = _unless_oom("memory trace", lambda: trace_iteration(decomposition, batch, max_points=TRACE_POINTS))
    if trace is None:
        return
    out.non_model_memory_bytes = trace.peak_non_model_bytes
    for p in trace.timeline:
        out.memory_trace.add(
            op_index=p.op_index,
            op=p.op,
            layer=p.layer,
            phase="optimizer" if p.phase == "step" else p.phase,
            non_model_bytes=p.non_model_bytes,
        )


def _whole_model(out: profile_pb2.Profile, session: _Session, batch: dict[str, Tensor], repeats: int) -> None:
    """Composition factor and per-layer optimizer step times (profiler/whole.py); OOM leaves them unset.

    The whole pass is compared with the layers alone measured right after it, in COMPOSITION_ROUNDS alternating
    rounds (the ratio of the medians), not with the sweep's rows taken minutes earlier: on a host whose speed
    drifts those gave 0.96 on one profile and 1.19 on the next (benchmarks/profile_repro.py)."""
    decomposition = session.decomposition
    m = next(iter(batch.values())).shape[0]
    try:
        steps = _unless_oom("whole-model check", lambda: whole.optimizer_step_s(decomposition, repeats))
    finally:
        whole.release_gradients(decomposition)
    if steps is None:
        return
    for layer, step in zip(out.layers, steps, strict=True):
        layer.optimizer_step_s = step
    for _ in range(1 + WHOLE_RETRIES):  # a burst of load on a shared host skews one round, rarely every one
        wholes, alones = [], []
        for _ in range(COMPOSITION_ROUNDS):
            try:
                seconds = _unless_oom("whole-model check", lambda: whole.whole_step_s(decomposition, batch, repeats))
            finally:
                whole.release_gradients(decomposition)
            layers_s = _unless_oom("layers alone", lambda: session.layers_alone_s(m))
            if seconds is None or not layers_s:
                return
            wholes.append(seconds)
            alones.append(layers_s)
        out.composition_factor = whole.composition_factor(statistics.median(wholes), statistics.median(alones))
        if out.composition_factor:
            return


def _calibrate(group_sizes: list[int]) -> profile_pb2.CommCalibration:
    """Link fits for the requested group sizes; a failure becomes an `unsupported` line, not an error."""
    try:
        cal = calibration.calibrate(group_sizes, timeout_s=CALIBRATION_TIMEOUT_S * len(group_sizes))
    except calibration.CalibrationError as exc:
        return profile_pb2.CommCalibration(unsupported=[str(exc)])
    comm = calibration.to_proto(cal)
    if not comm.fits:
        for f in cal.fits:
            comm.fits.add(
                collective=f.collective,
                group_size=f.group_size,
                latency_s=f.latency_s,
                bandwidth_bytes_per_s=f.bandwidth or 0.0,
                bus_bandwidth_bytes_per_s=f.bus_bandwidth or 0.0,
                r2=f.r2,
            )
    if not comm.unsupported:
        comm.unsupported.extend(f"{u.collective}@{u.group_size}: {u.reason}" for u in cal.unsupported)
    return comm
