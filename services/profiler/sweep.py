"""Harmony's micro-batch sweep (§4.2) and the regression that fills in unsampled sizes.

"Brute-force profiling with every possible microbatch size is impractical" (from 1 to 8196 for every
one of 1024 layers, its appendix says), so Harmony:

1. finds the largest micro-batch that fits "by using a process similar to TCP slow start
   (multiplicative increase of microbatch size, halving at the first OoM, and then additive
   increase until the next OoM)";
2. "profiles layers for each microbatch size from 1 to this max size at fixed stride intervals";
3. "uses a simple regression model to interpolate each layer's characteristics for microbatch
   sizes that it does not sample" -- "a linear regression" (appendix), so here: least squares
   `value = intercept + slope * m`, reported with R^2 and its largest relative error on the samples.

The profiler runs this sweep when a request sets a cap (max_micro_batch_size); without one it runs the bounded
sweep of services/profiler/bounded.py, which stops where time per sample stops improving or at a time budget.

A failure is a probe returning False (e.g. peak memory over a cap) or raising an out-of-memory error
(torch.OutOfMemoryError or a RuntimeError saying "out of memory"); other exceptions propagate. No
size at or above a failure is ever probed again. Torch is imported only to recognise its OOM type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ballast.v1 import profile_pb2

TIME_FIELDS = ("forward_s", "backward_s", "recompute_s")
BYTE_FIELDS = ("boundary_activation_bytes", "stashed_activation_bytes", "output_bytes", "peak_memory_bytes")


def is_oom(exc: BaseException) -> bool:
    """True for a device out-of-memory error (CUDA's OutOfMemoryError or an allocator RuntimeError)."""
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency; keep the sweep importable without it
        pass
    return isinstance(exc, RuntimeError | MemoryError) and "out of memory" in str(exc).lower()


def _release_cached_memory() -> None:
    """After a CUDA OOM, return the allocator's cached blocks so the next, smaller probe starts clean."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


@dataclass(frozen=True)
class Probe:
    size: int
    fits: bool
    phase: str  # "multiplicative", "halving", "additive"
    reason: str = ""  # why it failed: "probe said no" or the OOM message


@dataclass
class Sweep:
    """Outcome of a sweep: every probe in order, the largest size that fit and the sizes to measure."""

    probes: list[Probe] = field(default_factory=list)
    max_fit: int = 0  # 0: nothing fits
    sizes: list[int] = field(default_factory=list)  # ascending; all <= max_fit
    reason: str = ""  # why the sweep stopped

    @property
    def fits(self) -> bool:
        return self.max_fit > 0


def sweep(probe: Callable[[int], bool], *, start: int = 1, cap: int = 1024, stride: int = 1, step: int = 1) -> Sweep:
    """Slow-start search for the largest micro-batch <= `cap` that fits, then the sizes to measure.

    Doubles from `start` until a failure or `cap`; at the first failure falls back to half the failed
    size (the last success, not probed again; if `start` itself failed, keeps halving down to 1);
    then adds `step` until the next failure or `cap`. Sizes to measure are 1, 1 + stride, 1 + 2 stride,
    ... up to the largest fitting size, which is always included.
    """
    if start < 1 or cap < 1 or stride < 1 or step < 1:
        raise ValueError("start, cap, stride and step must be >= 1")
    out = Sweep()
    best, failed = 0, cap + 1

    def attempt(m: int, phase: str) -> bool:
        nonlocal best, failed
        try:
            ok, reason = bool(probe(m)), "probe said no"
        except Exception as exc:
            if not is_oom(exc):
                raise
            ok, reason = False, f"out of memory: {exc}"
            _release_cached_memory()
        out.probes.append(Probe(m, ok, phase, "" if ok else reason))
        if ok:
            best = max(best, m)
        else:
            failed = min(failed, m)
        return ok

    m = min(start, cap)
    while attempt(m, "multiplicative") and m < cap:
        m = min(2 * m, cap)
    while best == 0 and m > 1:  # `start` itself failed: halve until something fits
        m //= 2
        attempt(m, "halving")
    if best == 0:
        out.reason = f"does not fit at micro-batch 1: {out.probes[-1].reason}"
        return out
    m = best + step
    while m < failed and m <= cap and attempt(m, "additive"):
        m += step
    out.max_fit = best
    out.reason = "reached cap" if best == cap else f"failed at {failed}"
    out.sizes = sorted(set(range(1, best + 1, stride)) | {best})
    return out


def sweep_sizes(
    probe: Callable[[int], bool], *, start: int = 1, cap: int = 1024, stride: int = 1, step: int = 1
) -> list[int]:
    """The sizes to measure (see `sweep`); empty when even micro-batch 1 does not fit."""
    return sweep(probe, start=start, cap=cap, stride=stride, step=step).sizes


@dataclass(frozen=True)
class Fit:
    """Least-squares line `intercept + slope * m` with its goodness on the samples it was fit to."""

    slope: float
    intercept: float
    r2: float
    max_rel_error: float  # max |fit - value| / |value| over samples with value != 0
    n: int

    def __call__(self, m: float) -> float:
        return self.intercept + self.slope * m


def fit_samples(sizes: Sequence[float], values: Sequence[float]) -> Fit:
    """Linear regression of `values` on `sizes` (Harmony's choice). One sample: a line through 0."""
    if len(sizes) != len(values) or not sizes:
        raise ValueError("need as many values as sizes, at least one")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    if sxx == 0:  # one distinct size: proportional to m (activations and time scale with the batch)
        slope, intercept = (my / mx if mx else 0.0), 0.0
    else:
        slope = sum((x - mx) * (y - my) for x, y in zip(sizes, values, strict=True)) / sxx
        intercept = my - slope * mx
    predicted = [intercept + slope * x for x in sizes]
    ss_res = sum((y - p) ** 2 for y, p in zip(values, predicted, strict=True))
    ss_tot = sum((y - my) ** 2 for y in values)
    r2 = 1.0 - ss_res / ss_tot if ss_tot else (1.0 if ss_res == 0 else 0.0)
    errors = [abs(p - y) / abs(y) for y, p in zip(values, predicted, strict=True) if y]
    return Fit(slope, intercept, r2, max(errors, default=0.0), n)


def fit_fields(measured: Sequence[profile_pb2.LayerSample]) -> dict[str, Fit]:
    """One regression per LayerSample time and byte field, over the measured rows."""
    rows = [s for s in measured if s.measured]
    if not rows:
        raise ValueError("no measured samples to fit")
    sizes = [float(s.micro_batch_size) for s in rows]
    return {f: fit_samples(sizes, [float(getattr(s, f)) for s in rows]) for f in TIME_FIELDS + BYTE_FIELDS}


def interpolate(
    measured: Sequence[profile_pb2.LayerSample], sizes: Iterable[int], *, fits: dict[str, Fit] | None = None
) -> list[profile_pb2.LayerSample]:
    """Rows for `sizes`, ascending: measured rows as they are, the rest predicted with measured=False.

    Predictions are clamped at 0 (a line may dip below it far outside the samples); bytes are rounded.
    """
    fits = fits or fit_fields(measured)
    by_size = {s.micro_batch_size: s for s in measured if s.measured}
    rows = []
    for m in sorted(set(sizes)):
        if m in by_size:
            rows.append(by_size[m])
            continue
        row = profile_pb2.LayerSample(micro_batch_size=m, measured=False)
        for f in TIME_FIELDS:
            setattr(row, f, max(0.0, fits[f](m)))
        for f in BYTE_FIELDS:
            setattr(row, f, max(0, round(fits[f](m))))
        rows.append(row)
    return rows


@dataclass
class LayerSweep:
    """A layer's sweep: its samples (measured and interpolated) and per-field fits; `fits` False if none."""

    sweep: Sweep
    samples: list[profile_pb2.LayerSample]
    fits: dict[str, Fit]

    @property
    def fit(self) -> bool:
        return self.sweep.fits

    @property
    def reason(self) -> str:
        return self.sweep.reason


def sweep_layer(
    measure: Callable[[int], profile_pb2.LayerSample],
    *,
    cap: int = 1024,
    memory_cap_bytes: int | None = None,
    start: int = 1,
    stride: int = 1,
    step: int = 1,
    report: Iterable[int] | None = None,
) -> LayerSweep:
    """Sweep one layer with `measure(m)` as the probe, then measure the strided sizes and interpolate.

    A size fails when `measure` runs out of memory or its peak_memory_bytes exceeds `memory_cap_bytes`.
    Each size is measured at most once (probes are reused as samples). `report` lists the sizes to
    return rows for (default: every size from 1 to the largest that fits; larger ones are dropped).
    """
    done: dict[int, profile_pb2.LayerSample] = {}

    def probe(m: int) -> bool:
        if m not in done:
            done[m] = measure(m)
        return memory_cap_bytes is None or done[m].peak_memory_bytes <= memory_cap_bytes

    result = sweep(probe, start=start, cap=cap, stride=stride, step=step)
    if not result.fits:
        return LayerSweep(result, [], {})
    for m in result.sizes:
        probe(m)
    measured = [done[m] for m in sorted(done) if m <= result.max_fit]
    fits = fit_fields(measured)
    wanted = [m for m in report if 1 <= m <= result.max_fit] if report is not None else range(1, result.max_fit + 1)
    return LayerSweep(result, interpolate(measured, wanted, fits=fits), fits)
