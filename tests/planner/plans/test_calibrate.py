"""From stored runs to a calibration: a run whose stages measure a known distortion of the cost model's
prediction yields that distortion back, and the calibrated simulation meets the measured iteration."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf.json_format import ParseDict

from ballast.v1 import fleet_pb2, job_pb2, model_pb2
from services.planner.cost.calibration import Calibration, HostClass, apply
from services.planner.plans.calibrate import (
    WARMUP,
    Run,
    calibrate,
    from_proto,
    host_class,
    simulated_s,
    to_proto,
    uncalibrated,
)
from services.planner.plans.make import PlanInputs, make_plan
from services.profiler.projection import analytical_profile
from services.specs.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[3]
GPT = {"name": "gpt-cal", "family": "MODEL_FAMILY_GPT", "dtype": "DTYPE_FP32",
       "transformer": {"num_layers": 6, "hidden_size": 256, "num_heads": 4, "vocab_size": 4096, "seq_length": 128}}
TRUTH = Calibration(host_class="x", forward_scale=1.3, forward_fixed_s=0.002, backward_scale=1.3,
                    backward_fixed_s=0.004, allreduce_scale=1.5, update_scale=2.0, memory_scale=1.1,
                    memory_fixed_bytes=30 << 20)
EXTRA_S = 0.01  # what no stage part explains: the per-iteration fixed cost to recover


def planned(stages: int, micro_batches: int = 0):
    profile = analytical_profile(ParseDict(GPT, model_pb2.ModelSpec()), "nvidia-titan-rtx-24gb", "fp32")
    profile.id = "prf-cal"
    fleet = load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")
    fleet.nodes, fleet.devices_per_node = 1, 4
    plan = make_plan(profile, fleet, PlanInputs(global_batch_size=32, pipeline_stages=stages, runnable_dims=("dp",),
                                                overlap_grad_sync=False, micro_batches=micro_batches))
    plan.version = 1
    return profile, plan


@pytest.fixture(scope="module")
def case():
    return planned(2)


@pytest.fixture(scope="module")
def shallow():
    return planned(1)


def measured(profile, plan, iterations: int = 20) -> list[job_pb2.IterationMetric]:
    """What the workers would report if the runtime were TRUTH applied to the cost model, plus EXTRA_S."""
    pipe, run = uncalibrated(profile, plan)
    nm, iteration_s = run.num_micro_batches, simulated_s(profile, plan, TRUTH) + EXTRA_S
    from services.planner.sim import SimOptions, simulate

    peaks = simulate(pipe, SimOptions(schedule=run.schedule, keep_timeline=False)).peak_memory_bytes  # as planned
    rows = []
    for i in range(iterations):
        for s, stage in enumerate(pipe.stages):
            true = apply(stage, TRUTH)
            for r in range(run.replicas):
                rows.append(job_pb2.IterationMetric(
                    job_id="job-a", iteration=i, stage_index=s, replica_index=r, plan_version=plan.version,
                    iteration_time_s=iteration_s, forward_s=nm * true.forward_s,
                    backward_s=nm * (true.backward_s + true.recompute_s), allreduce_s=true.allreduce_s,
                    optimizer_s=stage.update_s * TRUTH.update_scale, overhead_s=0.0,
                    peak_memory_bytes=int(TRUTH.memory_scale * peaks[s]) + TRUTH.memory_fixed_bytes))
    return rows


def test_runs_of_two_layouts_give_back_the_distortion_they_measured(case, shallow):
    """Stages of different size (one and two pipeline stages) separate the scale from the fixed cost."""
    runs = [Run(f"job-{n}", p, plan, measured(p, plan)) for n, (p, plan) in enumerate((case, shallow))]
    cal, before, after = calibrate(runs, HostClass("nvidia-titan-rtx-24gb", 16, 4))
    assert (cal.forward_scale, cal.forward_fixed_s) == pytest.approx((1.3, 0.002), rel=1e-3, abs=1e-6)
    assert (cal.backward_scale, cal.backward_fixed_s) == pytest.approx((1.3, 0.004), rel=1e-3, abs=1e-6)
    # an analytical profile prices no optimizer step, so there is nothing to scale (a measured one has it)
    assert cal.update_scale == 1.0 and cal.memory_scale == pytest.approx(1.1, rel=1e-3)
    assert cal.iteration_fixed_s == pytest.approx(EXTRA_S, rel=0.05)
    assert cal.iterations == 20 - WARMUP
    assert before > 0.2 and after < 0.01  # the uncalibrated model was off by > 20%; calibrated, < 1%


def test_one_balanced_run_fits_a_ratio_that_still_meets_its_own_iteration(case):
    """Balanced stages predict about the same backward: scale and fixed cost cannot be told apart there, and
    sub-millisecond predictions under a 4 ms fixed cost make the median difference the fixed cost; the run it
    came from is still met."""
    profile, plan = case
    cal, before, after = calibrate([Run("job-a", profile, plan, measured(profile, plan))], HostClass("k", 1, 1))
    assert cal.backward_scale == 1.0 and cal.backward_fixed_s == pytest.approx(0.004, rel=0.05)
    assert before > 0.2 and after < 0.05


def test_a_cost_per_micro_batch_no_part_measures_is_met_at_two_micro_batch_counts():
    """A runtime that pays 1.5 ms per micro-batch outside every measured part (and 10 ms per iteration): one
    median gap would price Nm 2 high and Nm 8 low; split per iteration and per micro-batch, both runs are met."""
    per_micro_batch = 0.0015
    runs = []
    for nm in (2, 8):
        profile, plan = planned(1, micro_batches=nm)
        assert plan.num_micro_batches == nm
        rows = measured(profile, plan)
        for m in rows:
            m.iteration_time_s += nm * per_micro_batch
        runs.append(Run(f"job-{nm}", profile, plan, rows))
    cal, _, after = calibrate(runs, HostClass("k", 1, 1))
    for run in runs:
        truth = run.metrics[-1].iteration_time_s
        assert simulated_s(run.profile, run.plan, cal) == pytest.approx(truth, rel=0.01)
    assert cal.iteration_fixed_s == pytest.approx(EXTRA_S, rel=0.05)
    assert cal.forward_fixed_s == pytest.approx(TRUTH.forward_fixed_s + per_micro_batch, rel=0.05)
    assert after < 0.01


def test_warm_up_and_other_plan_versions_are_left_out(case):
    profile, plan = case
    rows = measured(profile, plan)
    for m in rows:
        if m.iteration < WARMUP:
            m.forward_s *= 50  # first iterations: allocations and first touch
    other = [replace_version(m, 7) for m in measured(profile, plan)]
    clean, _, _ = calibrate([Run("job-a", profile, plan, measured(profile, plan))], HostClass("k", 1, 1))
    noisy, _, _ = calibrate([Run("job-a", profile, plan, rows + other)], HostClass("k", 1, 1))
    assert noisy.forward_scale == pytest.approx(clean.forward_scale)


def replace_version(m: job_pb2.IterationMetric, version: int) -> job_pb2.IterationMetric:
    out = job_pb2.IterationMetric()
    out.CopyFrom(m)
    out.plan_version, out.forward_s = version, m.forward_s * 9
    return out


def test_host_class_counts_the_devices_sharing_a_machine_and_its_cores():
    fleet = fleet_pb2.Fleet(device=fleet_pb2.DeviceSpec(kind="cpu"), devices_per_node=2, nodes=1)
    cpu = fleet_pb2.Device(spec=fleet_pb2.DeviceSpec(kind="cpu"))
    hosts = [fleet_pb2.Host(id=f"h{i}", address="10.0.0.5", devices=[cpu], labels={"cpu_cores": "2"})
             for i in range(2)]
    assert host_class(fleet, hosts, 2).key == "cpu/2c/2w"
    assert host_class(fleet, hosts, 1).key == "cpu/2c/1w"  # a one-device plan has the machine to itself
    apart = [replace_address(h, f"10.0.0.{i}") for i, h in enumerate(hosts)]
    assert host_class(fleet, apart, 2).key == "cpu/2c/1w"  # one device per machine


def replace_address(h: fleet_pb2.Host, address: str) -> fleet_pb2.Host:
    out = fleet_pb2.Host()
    out.CopyFrom(h)
    out.address = address
    return out


def test_a_stored_calibration_round_trips():
    cal = replace(TRUTH, host_class="cpu/2c/2w", iteration_fixed_s=0.01, iterations=40)
    stored = to_proto(cal, HostClass("cpu", 2, 2), ["job-b", "job-a"], 0.3, 0.02)
    assert stored.residual_before == 0.3 and stored.residual == 0.02 and list(stored.job_ids) == ["job-b", "job-a"]
    assert replace(from_proto(stored), residual=cal.residual) == cal


def windowed(rows: list[job_pb2.IterationMetric], size: int) -> list[job_pb2.IterationMetric]:
    """The rows as the agents send them: each rank's first WARMUP iterations alone, then blocks of `size`
    iterations, each a row of the block's means (`measured` reports the same values every iteration)."""
    out = []
    for m in rows:
        block_end = (m.iteration // size + 1) * size - 1
        if m.iteration < WARMUP or m.iteration == block_end or m.iteration == max(r.iteration for r in rows):
            first = m.iteration if m.iteration < WARMUP else max(WARMUP, m.iteration // size * size)
            row = job_pb2.IterationMetric()
            row.CopyFrom(m)
            row.first_iteration, row.iterations = first, m.iteration - first + 1
            out.append(row)
    return out


def test_windows_of_iterations_calibrate_as_the_iterations_they_cover(case, shallow):
    """Rows that summarise windows weigh as the iterations they cover: the same fit, the same iteration count."""
    raw = [Run(f"job-{n}", p, plan, measured(p, plan)) for n, (p, plan) in enumerate((case, shallow))]
    summed = [replace(r, metrics=windowed(list(r.metrics), 8)) for r in raw]
    assert sum(len(r.metrics) for r in summed) < sum(len(r.metrics) for r in raw) / 2
    cls = HostClass("nvidia-titan-rtx-24gb", 16, 4)
    got, want = calibrate(summed, cls), calibrate(raw, cls)
    assert got[0] == want[0] and got[1:] == pytest.approx(want[1:]) and got[0].iterations == 20 - WARMUP
