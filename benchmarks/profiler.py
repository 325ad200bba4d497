"""Profiler acceptance (issue 3): profile a 12-layer GPT on CPU, check interpolation, calibrate links.

Targets: profiling a 12-layer GPT (hidden 256, sequence 256, vocabulary 8192, micro-batch sweep capped
at 64, >= 5 repeats, one thread) completes within 60 s; interpolated times at >= 3 unsampled
micro-batch sizes are within 10% of measured; calibration fits on 2 gloo processes reach R^2 >= 0.9
(3 and 4 processes are reported without a target).

Which sizes are measured, and why. The sweep probes 1, 2, 4, ..., 64 (every layer's forward+backward
peak must fit) and rows are produced for every size 1..64. A strided measurement (`options.stride`)
always includes the largest size that fits, 64, and one `measure_layer` of the head at 64 (16384
tokens x 8192 logits, 2 warm-up + 5 timed repeats of forward, backward, no-grad forward and
recompute) alone takes longer than the 60 s budget on one core of this machine (the check below
measures it and prints its time). So the benchmark measures the geometric subset 1, 2, 4, 8
(`options.micro_batch_sizes` with `max_micro_batch_size` 64) and the regression fills in the rest,
as Harmony measures a subset and regresses. Sizes 3, 5, 6 and 7 are interpolated inside the measured
range (the target); 16, 32 and 64 are extrapolated and reported, without a target, with their errors.
The validation measurements below are real `measure_layer` runs with the same options, not timed
against the budget.

Run: .venv/bin/python benchmarks/profiler.py   (about 6 minutes; --skip-calibration, --check to shorten)

The profiling worker runs with the allocator settings of services.runtime.allocator.STEADY_ALLOCATOR; this
script re-executes itself with them (unless they are already set) so it measures what the service measures.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from google.protobuf.json_format import ParseDict  # noqa: E402

from ballast.v1 import model_pb2, profile_pb2, services_pb2  # noqa: E402
from services.profiler import driver  # noqa: E402
from services.profiler.calibrate import CalibrationError, calibrate  # noqa: E402
from services.profiler.measure import iter_layer_args, measure_layer  # noqa: E402
from services.profiler.sweep import fit_samples  # noqa: E402
from services.zoo import build_model, example_input  # noqa: E402

GPT = {
    "name": "gpt-12x256",
    "family": "MODEL_FAMILY_GPT",
    "transformer": {"num_layers": 12, "hidden_size": 256, "num_heads": 8, "vocab_size": 8192, "seq_length": 256},
}
TARGET_S, TARGET_ERROR, TARGET_R2 = 60.0, 0.10, 0.9
CHECK_LAYERS = ("embed", "block.0", "head")


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"nproc {os.cpu_count()}, {model}, {memory:.1f} GiB, torch {torch.__version__}, "
            f"python {platform.python_version()}, load average {load}")


def timed_profile(spec: model_pb2.ModelSpec, args: argparse.Namespace) -> tuple[profile_pb2.Profile, float]:
    """driver.profile as the worker runs it, with a breakdown of where the time went."""
    request = services_pb2.ProfileRequest(
        max_micro_batch_size=args.cap,
        options=services_pb2.ProfileOptions(repeats=args.repeats, micro_batch_sizes=args.sizes, intra_op_threads=1),
    )
    events: list[tuple[float, str]] = []

    def seen(p: services_pb2.ProfileProgress) -> None:
        if p.phase == "sweep":
            what = f"probe m={p.micro_batch_size}"
        elif p.phase == "measure" and p.micro_batch_size:
            what = f"measure {p.message.split()[1]}"
        else:
            what = p.phase
        events.append((time.perf_counter(), what))

    t0 = time.perf_counter()
    prof = driver.profile(spec, request, progress=seen)
    wall = time.perf_counter() - t0
    spent: dict[str, float] = {}
    for (t, what), (t_next, _) in zip(events, events[1:], strict=False):
        spent[what] = spent.get(what, 0.0) + t_next - t
    rows = max(s.micro_batch_size for s in prof.layers[0].samples)
    print(f"profile: {wall:.1f} s wall (driver reports {prof.profiling_time_s:.1f} s); measured sizes "
          f"{list(prof.measured_micro_batch_sizes)}, rows 1..{rows}, "
          f"{len({layer.measured_as for layer in prof.layers})} distinct of {len(prof.layers)} layers")
    print("where the time went:")
    for what, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        if seconds >= 0.05:
            print(f"  {what:<22}{seconds:7.1f} s")
    return prof, wall


def reference(decomposition, index: int, layer_args, m: int, args: argparse.Namespace):
    """The direct measurement to compare with: the fastest of `--reference-runs` independent
    `measure_layer` medians. Interference from other tenants of the host only ever adds time and can
    last longer than one measurement's repeats, so the fastest median is the best estimate of the
    layer's own time (the profiler keeps the faster row for the same reason, driver._Session.recheck)."""
    runs = [measure_layer(decomposition, index, layer_args, repeats=args.repeats, warmup=2, micro_batch_size=m)
            for _ in range(args.reference_runs)]
    return min(runs, key=lambda r: r.forward_s + r.backward_s)


def check_interpolation(
    spec: model_pb2.ModelSpec, prof: profile_pb2.Profile, args: argparse.Namespace
) -> dict[str, list[int]]:
    """Measure unsampled sizes directly; returns, per criterion, the in-range sizes within the target.

    Criteria: "all" (embed, block.0 and head, forward and backward), "block+head" (the layers with
    millisecond times; embed's are sub-millisecond) and "model" (fwd+bwd summed over all 14 layers).
    """
    decomposition = build_model(spec, seed=0).decompose()
    index = {layer.name: layer.index for layer in decomposition.layers}
    lo, hi = min(prof.measured_micro_batch_sizes), max(prof.measured_micro_batch_sizes)
    print(f"\ninterpolation vs direct measure_layer (repeats {args.repeats}, warmup 2, 1 thread, fastest of "
          f"{args.reference_runs} runs); "
          f"measured sizes {list(prof.measured_micro_batch_sizes)}")
    print(f"{'m':>3} {'where':<12}{'layer':<9}{'fwd interp':>11}{'fwd meas':>10}{'err':>8}"
          f"{'bwd interp':>12}{'bwd meas':>10}{'err':>8}{'measure s':>11}")
    good: dict[str, list[int]] = {"all": [], "block+head": [], "model": []}
    for m in args.check:
        inside = lo < m < hi
        where = "interpolated" if inside else "extrapolated"
        errors: list[float] = []
        model_pred = sum(s.forward_s + s.backward_s for layer in prof.layers for s in layer.samples
                         if s.micro_batch_size == m)
        model_meas = 0.0
        wanted = {index[name] for name in CHECK_LAYERS}
        for i, layer_args in iter_layer_args(decomposition, example_input(spec, m)):
            if i not in wanted:
                continue
            t0 = time.perf_counter()
            meas = reference(decomposition, i, layer_args, m, args)
            took = time.perf_counter() - t0
            row = next(s for s in prof.layers[i].samples if s.micro_batch_size == m)
            assert not row.measured, f"m={m} was measured by the profile; pick an unsampled size"
            ef = row.forward_s / meas.forward_s - 1
            eb = row.backward_s / meas.backward_s - 1
            errors += [(decomposition.layers[i].name, ef), (decomposition.layers[i].name, eb)]
            copies = sum(1 for layer in prof.layers if layer.measured_as == i)
            model_meas += copies * (meas.forward_s + meas.backward_s)
            print(f"{m:>3} {where:<12}{decomposition.layers[i].name:<9}{row.forward_s * 1e3:9.2f}ms"
                  f"{meas.forward_s * 1e3:8.2f}ms{ef:+8.1%}{row.backward_s * 1e3:10.2f}ms"
                  f"{meas.backward_s * 1e3:8.2f}ms{eb:+8.1%}{took:10.1f}s")
            if i == max(wanted):
                break
        em = model_pred / model_meas - 1
        print(f"{m:>3} {where:<12}{'model':<9}{'fwd+bwd of all 14 layers':>29}{model_pred * 1e3:10.1f}ms"
              f"{model_meas * 1e3:8.1f}ms{em:+8.1%}")
        ok = all(abs(e) <= TARGET_ERROR for _, e in errors)
        big = all(abs(e) <= TARGET_ERROR for name, e in errors if name != "embed")
        for key, passed in (("all", ok), ("block+head", big), ("model", abs(em) <= TARGET_ERROR)):
            if inside and passed:
                good[key].append(m)
        print(f"    m={m}: largest |error| {max(abs(e) for _, e in errors):.1%} -> "
              f"{'within' if ok else 'NOT within'} {TARGET_ERROR:.0%}")
    return good


def heldout_interpolation(spec: model_pb2.ModelSpec, args: argparse.Namespace) -> dict[str, list[int]]:
    """The regression against real measurements taken in the same profiling session: one driver run
    measures the fit sizes AND the in-range check sizes; the fit uses only the fit sizes' rows and is
    compared with the check sizes' rows. Both sides share the process and allocator state, so this
    isolates the regression's error from run-to-run measurement drift (see noise_floor)."""
    inside = [m for m in args.check if min(args.sizes) < m < max(args.sizes)]
    sizes = sorted(set(args.sizes) | set(inside))
    request = services_pb2.ProfileRequest(options=services_pb2.ProfileOptions(
        repeats=args.repeats, micro_batch_sizes=sizes, intra_op_threads=1, skip_memory_trace=True))
    t0 = time.perf_counter()
    prof = driver.profile(spec, request)
    print(f"\nheld-out check: one session measured {sizes} in {time.perf_counter() - t0:.1f} s; the fit uses "
          f"{sorted(args.sizes)} only")
    print(f"  {'m':>3} {'layer':<8}{'fwd fit':>10}{'fwd meas':>10}{'err':>8}{'bwd fit':>10}{'bwd meas':>10}{'err':>8}")
    good: dict[str, list[int]] = {"all": [], "block+head": [], "model": []}
    by_name = {layer.name: layer for layer in prof.layers}
    for m in inside:
        worst = {"all": 0.0, "block+head": 0.0}
        model_fit = model_meas = 0.0
        for layer in prof.layers:
            rows = {s.micro_batch_size: s for s in layer.samples}
            fit_rows = [rows[k] for k in args.sizes if k in rows]
            for field in ("forward_s", "backward_s"):
                fit = fit_samples([r.micro_batch_size for r in fit_rows], [getattr(r, field) for r in fit_rows])
                model_fit += fit(m)
                model_meas += getattr(rows[m], field)
        for name in CHECK_LAYERS:
            rows = {s.micro_batch_size: s for s in by_name[name].samples}
            fit_rows = [rows[k] for k in args.sizes]
            errs = []
            cells = []
            for field in ("forward_s", "backward_s"):
                fit = fit_samples([r.micro_batch_size for r in fit_rows], [getattr(r, field) for r in fit_rows])
                meas = getattr(rows[m], field)
                errs.append(fit(m) / meas - 1)
                cells += [f"{fit(m) * 1e3:9.2f}ms", f"{meas * 1e3:8.2f}ms", f"{errs[-1]:+7.1%}"]
            print(f"  {m:>3} {name:<8}" + "".join(f"{c:>10}" if i % 3 != 2 else f"{c:>8}" for i, c in enumerate(cells)))
            worst["all"] = max(worst["all"], *map(abs, errs))
            if name != "embed":
                worst["block+head"] = max(worst["block+head"], *map(abs, errs))
        model_err = model_fit / model_meas - 1
        print(f"  {m:>3} {'model':<8} fwd+bwd of all layers {model_fit * 1e3:9.1f}ms vs {model_meas * 1e3:9.1f}ms "
              f"{model_err:+7.1%}")
        for key in ("all", "block+head"):
            if worst[key] <= TARGET_ERROR:
                good[key].append(m)
        if abs(model_err) <= TARGET_ERROR:
            good["model"].append(m)
    return good


def noise_floor(spec: model_pb2.ModelSpec, prof: profile_pb2.Profile, m: int, runs: int = 3) -> None:
    """Repeat the direct measurement of a measured size: how far apart two honest measurements land."""
    decomposition = build_model(spec, seed=0).decompose()
    print(f"\nnoise floor: {runs} direct measure_layer runs at measured size m={m} vs the profile's row")
    for i, layer_args in iter_layer_args(decomposition, example_input(spec, m)):
        name = decomposition.layers[i].name
        if name not in CHECK_LAYERS:
            continue
        row = next(s for s in prof.layers[i].samples if s.micro_batch_size == m)
        runs_ = [measure_layer(decomposition, i, layer_args, micro_batch_size=m) for _ in range(runs)]
        for field, profiled in (("forward", row.forward_s), ("backward", row.backward_s)):
            values = [getattr(r, f"{field}_s") for r in runs_]
            spread = max(values) / min(values) - 1
            print(f"  {name:<8} {field:<9} profile {profiled * 1e3:8.2f} ms; direct "
                  + ", ".join(f"{v * 1e3:.2f}" for v in values) + f" ms; max/min - 1 = {spread:.1%}")


def check_calibration(groups: list[int]) -> dict[int, float]:
    """R^2 per collective for each group size (separate runs); returns the worst R^2 per group size."""
    worst: dict[int, float] = {}
    for n in groups:
        t0 = time.perf_counter()
        try:
            cal = calibrate([n], timeout_s=300)
        except CalibrationError as exc:
            print(f"\ncalibration n={n}: FAILED: {exc}")
            worst[n] = float("nan")
            continue
        print(f"\ncalibration n={n} ({cal.backend}, {time.perf_counter() - t0:.1f} s):")
        for f in cal.fits:
            bw = f"{f.bandwidth / 1e6:9.1f} MB/s" if f.bandwidth else f"{'-':>14}"
            print(f"  {f.collective:<15}n={f.group_size}  R2 {f.r2:.4f}  latency {f.latency_s * 1e6:8.1f} us  {bw}")
        for u in cal.unsupported:
            print(f"  {u.collective:<15}n={u.group_size}  unsupported: {u.reason}")
        worst[n] = min(f.r2 for f in cal.fits if f.group_size == n)
    return worst


def steady_allocator() -> None:
    """Re-exec under the profiling worker's allocator settings (glibc reads them only at start-up)."""
    from services.runtime.allocator import STEADY_ALLOCATOR

    if any(key not in os.environ for key in STEADY_ALLOCATOR):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**STEADY_ALLOCATOR, **os.environ})


def main(argv: list[str] | None = None) -> int:
    steady_allocator()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batch sizes to measure")
    ap.add_argument("--cap", type=int, default=64, help="max_micro_batch_size of the sweep")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reference-runs", type=int, default=3, help="direct measurements per check (fastest kept)")
    ap.add_argument("--check", type=int, nargs="*", default=[3, 5, 6, 7, 16, 32, 64], help="unsampled sizes to verify")
    ap.add_argument("--cpu", type=int, default=None, help="pin profiling and checks to this CPU (not calibration)")
    ap.add_argument("--groups", type=int, nargs="*", default=[2, 3, 4], help="calibration group sizes")
    ap.add_argument("--skip-calibration", action="store_true")
    args = ap.parse_args(argv)
    print("command:", shlex.join([".venv/bin/python", "benchmarks/profiler.py", *sys.argv[1:]]))
    print("date:", datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    print("machine:", machine())
    settings = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
    print("allocator:", " ".join(f"{k}={os.environ.get(k, '')}" for k in settings))
    torch.set_num_threads(1)
    print(f"threads: 1 intra-op (torch.get_num_threads() = {torch.get_num_threads()})")
    everywhere = os.sched_getaffinity(0)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    print(f"affinity: {'CPU ' + str(args.cpu) if args.cpu is not None else 'not pinned'}")
    spec = ParseDict(GPT, model_pb2.ModelSpec())

    prof, wall = timed_profile(spec, args)
    good = check_interpolation(spec, prof, args) if args.check else {"all": [], "block+head": [], "model": []}
    if args.check:
        noise_floor(spec, prof, 4 if 4 in args.sizes else args.sizes[-1])
    held = heldout_interpolation(spec, args) if args.check else {"all": [], "block+head": [], "model": []}
    os.sched_setaffinity(0, everywhere)  # calibration ranks need every core
    worst = {} if args.skip_calibration else check_calibration(args.groups)

    print("\nsummary:")
    print(f"  profile time {wall:.1f} s: {'within' if wall <= TARGET_S else 'MISSED'} the {TARGET_S:.0f} s target")
    inside = sum(1 for m in args.check if min(args.sizes) < m < max(args.sizes))
    print(f"  interpolation, every checked layer (embed, block.0, head) fwd and bwd within {TARGET_ERROR:.0%}: "
          f"{len(good['all'])} of {inside} in-range sizes {good['all']}: "
          f"{'target met' if len(good['all']) >= 3 else 'target MISSED'} (needs >= 3)")
    print(f"    block.0 and head only: {good['block+head']}; whole-model fwd+bwd: {good['model']}")
    print(f"  held-out (same session) every checked layer within {TARGET_ERROR:.0%}: {held['all']} "
          f"({'>= 3: target met this way' if len(held['all']) >= 3 else 'fewer than 3'}); block.0+head "
          f"{held['block+head']}; whole model {held['model']}")
    if 2 in worst:
        ok = worst[2] >= TARGET_R2
        print(f"  calibration n=2: worst R2 {worst[2]:.4f}: {'target met' if ok else 'target MISSED'} (>= {TARGET_R2})")
    for n in sorted(k for k in worst if k != 2):
        print(f"  calibration n={n}: worst R2 {worst[n]:.4f} (reported, no target)")
    met = wall <= TARGET_S and len(good["all"]) >= 3 and (args.skip_calibration or worst.get(2, 0.0) >= TARGET_R2)
    print(f"RESULT: {'all targets met' if met else 'some target missed'}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
