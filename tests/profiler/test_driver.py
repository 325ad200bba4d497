"""Profiling driver and its worker process on tiny models: sweep, identical layers, caps, JSON lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from google.protobuf.json_format import MessageToDict, ParseDict
from torch import nn

from ballast.v1 import common_pb2, model_pb2, profile_pb2, services_pb2
from services.profiler import driver
from services.profiler.measure import iter_layer_args, measure_layer
from services.profiler.whole import COMPOSITION_BOUNDS
from services.specs.user_inputs import UserInputs
from services.zoo import build_model, example_input

ROOT = Path(__file__).resolve().parents[2]
GPT = {
    "name": "gpt-test",
    "family": "MODEL_FAMILY_GPT",
    "transformer": {"num_layers": 3, "hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_length": 16},
}


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def spec(raw: dict = GPT) -> model_pb2.ModelSpec:
    return ParseDict(raw, model_pb2.ModelSpec())


def request(max_micro_batch_size: int = 0, memory_cap_bytes: int = 0, **options) -> services_pb2.ProfileRequest:
    return services_pb2.ProfileRequest(
        max_micro_batch_size=max_micro_batch_size,
        memory_cap_bytes=memory_cap_bytes,
        options=services_pb2.ProfileOptions(**{"repeats": 5, "intra_op_threads": 1, **options}),
    )


def run(req: services_pb2.ProfileRequest) -> tuple[profile_pb2.Profile, list[services_pb2.ProfileProgress]]:
    seen: list[services_pb2.ProfileProgress] = []
    return driver.profile(spec(), req, progress=seen.append), seen


@pytest.fixture(scope="module")
def explicit():
    torch.set_num_threads(1)
    return run(request(micro_batch_sizes=[1, 2]))


def test_explicit_sizes_one_row_set_per_layer(explicit):
    prof, _ = explicit
    assert [layer.name for layer in prof.layers] == ["embed", "block.0", "block.1", "block.2", "head"]
    assert list(prof.measured_micro_batch_sizes) == [1, 2]
    assert prof.device.kind == "cpu" and prof.device.memory_bytes > 0
    assert prof.dtype == common_pb2.DTYPE_FP32 and prof.intra_op_threads == 1
    assert prof.software.startswith("torch ") and prof.profiling_time_s > 0
    assert prof.memory_cap_bytes == 0 and not prof.HasField("comm")
    for layer in prof.layers:
        assert [s.micro_batch_size for s in layer.samples] == [1, 2]
        assert all(s.measured and s.forward_s > 0 and s.backward_s > 0 and s.peak_memory_bytes for s in layer.samples)
        assert layer.note == "" and layer.max_micro_batch_size == 2
        assert layer.parameter_bytes == 4 * layer.parameter_count
    embed, head = prof.layers[0], prof.layers[-1]
    assert embed.batch_input_bytes == 16 * 8 and head.batch_input_bytes == 16 * 8  # int64 ids / labels per sample
    assert prof.layers[2].batch_input_bytes == 0
    # the blocks are the zoo's attention + MLP block: the executors can split them tensor-parallel 2 or 4 ways
    assert [layer.tensor_parallel for layer in prof.layers] == [0, 4, 4, 4, 0]  # gcd(4 heads, MLP 128)
    assert [layer.sequence_parallel for layer in prof.layers] == [0, 4, 4, 4, 0]  # and their 16 tokens


def test_identical_blocks_reuse_the_first_blocks_rows(explicit):
    prof, _ = explicit
    assert [layer.measured_as for layer in prof.layers] == [0, 1, 1, 1, 4]
    first = prof.layers[1]
    for layer in prof.layers[2:4]:
        assert list(layer.samples) == list(first.samples)
        assert layer.parameter_count == first.parameter_count


def test_whole_model_composition_and_optimizer_steps_are_measured(explicit):
    """The whole-model pass is taken: its factor is a ratio within the trusted bounds, or 0 (not trusted) when
    load skewed every pass -- which one is the machine's business, so the measured value itself is
    benchmarks/profile_repro.py's to report, not this test's; every layer with parameters has an Adam step time."""
    prof, _ = explicit
    low, high = COMPOSITION_BOUNDS
    assert prof.composition_factor == 0.0 or low <= prof.composition_factor <= high
    assert all(layer.optimizer_step_s > 0 for layer in prof.layers)


def test_composition_factor_rejects_a_measurement_gone_wrong():
    from services.profiler.whole import composition_factor

    assert composition_factor(1.1, 1.0) == pytest.approx(1.1)
    assert composition_factor(5.0, 1.0) == 0.0 and composition_factor(1.0, 0.0) == 0.0


def test_memory_trace_peak_is_the_non_model_memory(explicit):
    prof, _ = explicit
    assert prof.non_model_memory_bytes > 0 and len(prof.memory_trace) > 10
    assert max(p.non_model_bytes for p in prof.memory_trace) == prof.non_model_memory_bytes
    assert {p.phase for p in prof.memory_trace} == {"forward", "backward", "optimizer"}


def test_progress_is_monotonic_and_ends_at_one(explicit):
    _, seen = explicit
    fractions = [p.fraction for p in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and seen[-1].phase == "done"
    assert {"building", "measure", "memory_trace", "done"} <= {p.phase for p in seen}
    measuring = [(p.layer_index, p.micro_batch_size) for p in seen if p.phase == "measure" and p.micro_batch_size]
    assert measuring == [(0, 1), (1, 1), (4, 1), (0, 2), (1, 2), (4, 2)]
    assert all(p.layers_total == 5 for p in seen[1:])


def test_sweep_with_stride_measures_some_sizes_and_interpolates_the_rest():
    prof, seen = run(request(max_micro_batch_size=8, stride=2, skip_memory_trace=True))
    assert list(prof.measured_micro_batch_sizes) == [1, 3, 5, 7, 8]
    assert prof.non_model_memory_bytes == 0 and not prof.memory_trace
    for layer in prof.layers:
        assert [s.micro_batch_size for s in layer.samples] == list(range(1, 9))
        assert [s.micro_batch_size for s in layer.samples if not s.measured] == [2, 4, 6]
        assert all(s.forward_s > 0 and s.peak_memory_bytes > 0 for s in layer.samples)
        assert layer.max_micro_batch_size == 8
    assert [p.micro_batch_size for p in seen if p.phase == "sweep"] == [1, 2, 4, 8]


def test_memory_cap_stops_the_sweep_where_the_largest_layer_peak_fits():
    measured, _ = run(request(micro_batch_sizes=[3], skip_memory_trace=True))
    cap = max(layer.samples[-1].peak_memory_bytes for layer in measured.layers)
    prof, _ = run(request(max_micro_batch_size=8, memory_cap_bytes=cap, skip_memory_trace=True))
    assert prof.memory_cap_bytes == cap and list(prof.measured_micro_batch_sizes) == [1, 2, 3]
    for layer in prof.layers:
        assert [s.micro_batch_size for s in layer.samples] == [1, 2, 3]
        assert all(s.peak_memory_bytes <= cap for s in layer.samples)
        assert layer.max_micro_batch_size >= 3
    stopped = [layer for layer in prof.layers if layer.max_micro_batch_size == 3]  # the layers that stopped it
    assert stopped and all(layer.note.startswith("rows stop at micro-batch 3: micro-batch 4 does not fit: peak")
                           for layer in stopped)
    assert all(layer.note == "" for layer in prof.layers if layer.max_micro_batch_size > 3)


def linear_times(monkeypatch, per_sample_s: float = 1e-3) -> None:
    """Real measurements with exactly linear times (µs layers are too noisy to test a stopping rule on)."""
    import dataclasses

    from services.profiler.measure_timing import Summary

    real = driver.measure_layer

    def linear(decomposition, index, args, **kw):
        m = kw["micro_batch_size"]
        return dataclasses.replace(real(decomposition, index, args, **kw), forward=Summary(per_sample_s * m, 5, ()),
                                   backward=Summary(2 * per_sample_s * m, 5, ()))

    monkeypatch.setattr(driver, "measure_layer", linear)


def test_default_sweep_stops_when_time_per_sample_stops_improving(monkeypatch):
    """No cap, no sizes: double from 1; a constant time per sample is no gain at 2 and 4, so it stops at 4."""
    linear_times(monkeypatch)
    prof, seen = run(request(skip_memory_trace=True))
    assert list(prof.measured_micro_batch_sizes) == [1, 2, 4]
    assert [p.micro_batch_size for p in seen if p.phase == "sweep"] == [1, 2, 4]  # probed as it went, no further
    for layer in prof.layers:
        assert [s.micro_batch_size for s in layer.samples] == [1, 2, 3, 4] and layer.max_micro_batch_size == 4
        assert [s.measured for s in layer.samples] == [True, True, False, True]
    (swept,) = [p for p in seen if p.phase == "swept"]
    assert "stopped improving after micro-batch 1" in swept.message


def test_default_sweep_within_a_budget_measures_micro_batch_one_at_least():
    prof, seen = run(services_pb2.ProfileRequest(time_budget_s=1e-9, options=services_pb2.ProfileOptions(
        repeats=5, intra_op_threads=1, skip_memory_trace=True)))
    assert list(prof.measured_micro_batch_sizes) == [1]
    assert all([s.micro_batch_size for s in layer.samples] == [1] for layer in prof.layers)
    (swept,) = [p for p in seen if p.phase == "swept"]
    assert swept.message.startswith("measured micro-batch sizes [1]: time budget 1e-09 s: micro-batch 2 would end")
    fractions = [p.fraction for p in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0


def test_a_budget_bounds_explicit_sizes_too_and_the_regression_fills_the_rest():
    req = request(micro_batch_sizes=[1, 2, 3, 4], skip_memory_trace=True)
    req.time_budget_s = 1e-9
    prof, seen = run(req)
    assert list(prof.measured_micro_batch_sizes) == [1]
    for layer in prof.layers:
        assert [(s.micro_batch_size, s.measured) for s in layer.samples] == [(1, True), (2, False), (3, False),
                                                                             (4, False)]
    (swept,) = [p for p in seen if p.phase == "swept"]
    assert "time budget 1e-09 s: stopped before micro-batch 2" in swept.message


def test_a_bad_budget_is_refused_before_anything_runs():
    with pytest.raises(driver.InvalidArgument, match="time_budget_s"):
        driver.profile(spec(), services_pb2.ProfileRequest(time_budget_s=-1.0))


@pytest.mark.parametrize("sizes", [[], [1, 2]])
def test_nothing_fits_at_micro_batch_one_gives_notes_not_a_crash(sizes):
    prof, seen = run(request(max_micro_batch_size=0 if sizes else 4, memory_cap_bytes=1024, micro_batch_sizes=sizes))
    assert not prof.measured_micro_batch_sizes and not prof.memory_trace
    for layer in prof.layers:
        assert not layer.samples and layer.max_micro_batch_size == 0
        assert layer.note.startswith("does not fit at micro-batch 1: peak ") and "memory cap 1024 B" in layer.note
    assert seen[-1].fraction == 1.0


def test_probe_peak_is_the_measured_peak():
    model_spec = spec()
    decomposition = build_model(model_spec, seed=0).decompose()
    session = driver._Session(model_spec, decomposition, torch.device("cpu"), torch.float32, 2**40, UserInputs())
    for i, args in iter_layer_args(decomposition, example_input(model_spec, 2)):
        assert session.peak(i, args, 2) == measure_layer(decomposition, i, args).peak_memory_bytes


def test_signature_sees_configuration_not_just_shapes():
    x = (torch.zeros(2, 4),)
    same = driver.layer_signature(nn.Linear(4, 4), 1, x) == driver.layer_signature(nn.Linear(4, 4), 1, x)
    assert same
    assert driver.layer_signature(nn.Dropout(0.1), 1, x) != driver.layer_signature(nn.Dropout(0.2), 1, x)
    assert driver.layer_signature(nn.Linear(4, 4), 1, x) != driver.layer_signature(nn.Linear(4, 4), 1, (x[0][:1],))
    assert driver.layer_signature(nn.GELU(), 1, x) != driver.layer_signature(nn.GELU("tanh"), 1, x)


def test_bad_options_name_the_field():
    with pytest.raises(driver.InvalidArgument, match="options.repeats"):
        driver.profile(spec(), request(repeats=3))


# --- worker process ---------------------------------------------------------------------------------


def job(raw_spec: dict, req: services_pb2.ProfileRequest) -> str:
    return json.dumps(
        {"request": MessageToDict(req), "spec": MessageToDict(spec(raw_spec)), "user_inputs": {}, "device": "cpu"}
    )


def worker(**kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "services.profiler.worker"],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )


def test_worker_round_trips_a_profile_as_json_lines():
    proc = worker()
    out, err = proc.communicate(job(GPT, request(micro_batch_sizes=[1, 2])), timeout=120)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert all(set(line) == {"progress"} for line in lines[:-1]) and set(lines[-1]) == {"profile"}
    progress = [ParseDict(line["progress"], services_pb2.ProfileProgress()) for line in lines[:-1]]
    assert progress[-1].fraction == 1.0
    prof = ParseDict(lines[-1]["profile"], profile_pb2.Profile())
    assert len(prof.layers) == 5 and list(prof.measured_micro_batch_sizes) == [1, 2]
    assert [layer.measured_as for layer in prof.layers] == [0, 1, 1, 1, 4]


def test_worker_reports_a_bad_spec_as_invalid_argument():
    bad = {**GPT, "transformer": {**GPT["transformer"], "num_heads": 3}}
    proc = worker()
    out, _ = proc.communicate(job(bad, request(micro_batch_sizes=[1])), timeout=120)
    assert proc.returncode == 1
    (line,) = [json.loads(line) for line in out.splitlines()]  # refused before any progress
    assert line["error"]["code"] == "INVALID_ARGUMENT"
    assert "num_heads" in line["error"]["message"]


def test_worker_killed_mid_run_is_a_nonzero_exit():
    proc = worker()
    proc.stdin.write(job(GPT, request(micro_batch_sizes=[1], repeats=1_000_000)))
    proc.stdin.close()
    first = json.loads(proc.stdout.readline())
    assert "progress" in first
    os.kill(proc.pid, signal.SIGKILL)
    rest = proc.stdout.read()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert '"profile"' not in rest
    proc.stdout.close()
    proc.stderr.close()


def test_a_size_measured_slow_is_measured_again_and_the_faster_row_kept(monkeypatch):
    """Interference that slows one whole measurement is caught by the leave-one-out line check."""
    import dataclasses

    from services.profiler.measure_timing import Summary

    real = driver.measure_layer
    calls: dict[tuple[int, int], int] = {}
    slowed: dict[int, float] = {}

    def interfered(decomposition, index, args, **kw):
        """The real measurement with exactly linear times (µs layers are too noisy to test on), except
        that the first measurement at 3 ran beside a noisy neighbour."""
        got = real(decomposition, index, args, **kw)
        m = kw["micro_batch_size"]
        calls[index, m] = calls.get((index, m), 0) + 1
        slow = 3.0 if m == 3 and calls[index, m] == 1 else 1.0
        if slow > 1:
            slowed[index] = 1e-3 * m * slow
        return dataclasses.replace(
            got, forward=Summary(1e-3 * m * slow, 5, ()), backward=Summary(2e-3 * m + 1e-3, 5, ())
        )

    monkeypatch.setattr(driver, "measure_layer", interfered)
    # only the sweep's measurements counted: no second pass for a busy host, no layers-alone pass beside the whole
    monkeypatch.setattr(driver.noise, "probe_s", lambda device: 1.0)
    monkeypatch.setattr(driver, "_whole_model", lambda *args: None)
    profile, _ = run(request(micro_batch_sizes=[1, 2, 3, 4]))
    assert slowed and all(calls[rep, 3] == 2 for rep in slowed), calls
    for layer in profile.layers:
        if layer.index in slowed:
            row = next(s for s in layer.samples if s.micro_batch_size == 3)
            assert row.measured and row.forward_s == pytest.approx(3e-3)


def test_leave_one_out_error_of_a_point_on_the_line_is_zero():
    rows = {m: profile_pb2.LayerSample(micro_batch_size=m, forward_s=0.001 * m, backward_s=0.002 * m + 0.01)
            for m in (1, 2, 4, 8)}
    assert all(driver._loo_error(rows, [1, 2, 4, 8], m) < 1e-9 for m in rows)
    rows[8].forward_s *= 2
    assert driver._loo_error(rows, [1, 2, 4, 8], 8) > 0.15


def test_calibrated_cpu_profile_measures_co_location_on_the_model():
    """With calibration, a sibling process runs the same whole steps: the slowdown is measured, and >= 1."""
    torch.set_num_threads(1)
    prof, _ = run(request(micro_batch_sizes=[2], calibrate=True, calibrate_group_sizes=[2]))
    assert prof.comm.colocated_slowdown >= 1.0
    assert prof.composition_factor > 0 and all(layer.optimizer_step_s > 0 for layer in prof.layers)


def test_a_whole_step_skewed_by_load_is_timed_again(monkeypatch):
    """A burst of load during the one whole-step pass would leave the factor unmeasured; it is re-timed instead."""
    from services.profiler import whole

    timed, ratios = [], iter([0.0, 1.25])  # the first ratio out of bounds, the re-timed one plausible
    real_whole_step_s = whole.whole_step_s
    monkeypatch.setattr(whole, "whole_step_s", lambda *a: timed.append(real_whole_step_s(*a)) or timed[-1])
    monkeypatch.setattr(whole, "composition_factor", lambda whole_s, layers_s: next(ratios))
    torch.set_num_threads(1)
    prof, _ = run(request(micro_batch_sizes=[1]))
    assert len(timed) == 2 * driver.COMPOSITION_ROUNDS and prof.composition_factor == 1.25  # two attempts
