"""Prediction fidelity (services/planner/plans/fidelity.py): runs from metrics (warm-up, slowest rank, peaks,
host class) and groups (signed error, mean absolute error, memory), from constructed protos."""

from __future__ import annotations

import pytest

from ballast.v1 import fleet_pb2, job_pb2, plan_pb2
from services.planner.plans.fidelity import CALIBRATED, Run, report, run_of, runs_of_job, signed_error

MiB = 1 << 20


def plan(version: int = 1, micro_batches: int = 4, kind: str = "cpu", per_node: int = 2,
         explanation: str = "") -> plan_pb2.Plan:
    return plan_pb2.Plan(version=version, num_micro_batches=micro_batches, explanation=explanation,
                         fleet=fleet_pb2.Fleet(device=fleet_pb2.DeviceSpec(kind=kind), devices_per_node=per_node))


def metric(iteration: int, seconds: float, stage: int = 0, replica: int = 0, version: int = 1,
           predicted: float = 1.0, peak_mib: int = 0, predicted_peak_mib: int = 0) -> job_pb2.IterationMetric:
    return job_pb2.IterationMetric(
        iteration=iteration, stage_index=stage, replica_index=replica, plan_version=version, iteration_time_s=seconds,
        predicted_iteration_time_s=predicted, peak_memory_bytes=peak_mib * MiB,
        predicted_peak_memory_bytes=predicted_peak_mib * MiB)


def cpu_host(name: str, address: str, devices: int, cores: str) -> fleet_pb2.Host:
    return fleet_pb2.Host(id=name, address=address, labels={"cpu_cores": cores},
                          devices=[fleet_pb2.Device(index=i, spec=fleet_pb2.DeviceSpec(kind="cpu"))
                                   for i in range(devices)])


def run(model: str = "gpt", predicted: float = 1.0, measured: float = 1.0, host_class: str = "cpu/4c/2w",
        stages: int = 1, peaks: tuple[tuple[int, int], ...] = (), calibrated: bool = False) -> Run:
    return Run(job_id="job-1", plan_version=1, model=model, stages=stages, replicas=1, micro_batches=4,
               host_class=host_class, calibrated=calibrated, iterations=5, predicted_s=predicted, measured_s=measured,
               peaks=peaks)


def test_signed_error_is_positive_when_the_plan_promised_more_time_than_the_run_took() -> None:
    assert signed_error(1.2, 1.0) == pytest.approx(0.2)
    assert signed_error(0.8, 1.0) == pytest.approx(-0.2)
    assert signed_error(1.0, 1.0) == 0.0


def test_the_first_three_iterations_are_warm_up_and_the_slowest_rank_times_an_iteration() -> None:
    rows = [metric(i, 9.0, replica=r) for i in range(3) for r in (0, 1)]  # warm-up: 9 s, left out
    rows += [metric(3, 1.0), metric(3, 1.4, replica=1), metric(4, 1.2), metric(4, 1.0, replica=1)]
    found = run_of("job-1", "gpt", plan(), rows, [])
    assert found is not None
    assert found.measured_s == pytest.approx(1.3)  # mean of the slowest ranks, 1.4 and 1.2
    assert (found.iterations, found.stages, found.replicas, found.micro_batches) == (2, 1, 2, 4)
    assert found.error == pytest.approx((1.0 - 1.3) / 1.3)


def test_warm_up_counts_from_each_plan_versions_first_iteration() -> None:
    """After a morph the version resumes at its checkpoint (iteration 10 here): its own first 3 are warm-up."""
    rows = [metric(i, 1.0) for i in range(5)] + [metric(i, 5.0 if i < 13 else 2.0, version=2) for i in range(10, 15)]
    runs = runs_of_job("job-1", "gpt", [plan(2), plan(1)], rows, [])
    assert [(r.plan_version, r.iterations, r.measured_s) for r in runs] == [(1, 2, 1.0), (2, 2, 2.0)]


def test_a_run_with_only_warm_up_or_without_its_plan_is_left_out() -> None:
    assert run_of("job-1", "gpt", plan(), [metric(i, 1.0) for i in range(3)], []) is None
    assert runs_of_job("job-1", "gpt", [plan(1)], [metric(i, 1.0, version=2) for i in range(6)], []) == []


def test_host_class_is_the_calibrations_key_over_the_leased_hosts() -> None:
    """Two agents on one machine (one address): 3 cpu devices there, the fewest cores; 2 workers of the run."""
    hosts = [cpu_host("a", "10.0.0.5", 2, "16"), cpu_host("b", "10.0.0.5", 1, "8")]
    rows = [metric(i, 1.0, replica=r) for i in range(4) for r in (0, 1)]
    assert run_of("job-1", "gpt", plan(), rows, hosts).host_class == "cpu/8c/2w"
    # without a leased host: no core count, and at most the fleet's devices per node share a machine
    assert run_of("job-1", "gpt", plan(per_node=1), rows, []).host_class == "cpu/0c/1w"


def test_peaks_are_per_stage_the_largest_measured_beside_the_prediction() -> None:
    rows = [metric(i, 1.0, stage=s, replica=r, peak_mib=100 + 10 * i + r, predicted_peak_mib=90 + s)
            for i in range(3, 6) for s in (0, 1) for r in (0, 1)]
    rows += [metric(i, 1.0, stage=2, peak_mib=500) for i in range(3, 6)]  # recorded without a prediction
    rows += [metric(0, 1.0, peak_mib=999, predicted_peak_mib=90)]  # warm-up
    found = run_of("job-1", "gpt", plan(), rows, [])
    assert found.peaks == ((90 * MiB, 151 * MiB), (91 * MiB, 151 * MiB))


def test_runs_group_by_model_layout_and_host_class_with_means_over_runs() -> None:
    runs = [run(predicted=1.0, measured=1.2, calibrated=True), run(predicted=1.0, measured=0.8),
            run(host_class="cpu/4c/1w", predicted=2.0, measured=1.0), run(model="bert", predicted=1.0, measured=2.0),
            run(stages=2, predicted=3.0, measured=3.0)]
    rep = report(runs)
    assert [(g.model, g.layout, g.host_class, g.runs, g.calibrated, g.iterations) for g in rep.groups] == [
        ("bert", "1x1 m4", "cpu/4c/2w", 1, 0, 5), ("gpt", "1x1 m4", "cpu/4c/1w", 1, 0, 5),
        ("gpt", "1x1 m4", "cpu/4c/2w", 2, 1, 10), ("gpt", "2x1 m4", "cpu/4c/2w", 1, 0, 5)]
    assert [g.error for g in rep.groups] == pytest.approx([-0.5, 1.0, 0.0, 0.0])
    assert rep.groups[2].measured_s == pytest.approx(1.0)
    assert rep.mae == pytest.approx((0.5 + 1.0 + 0.0 + 0.0) / 4)


def test_memory_error_is_over_stages_with_a_prediction_and_its_mae_over_groups_that_have_one() -> None:
    runs = [run(peaks=((100, 120), (100, 80))), run(peaks=((200, 150),)), run(model="bert")]
    rep = report(runs)
    bert, gpt = rep.groups
    assert bert.memory_error is None and bert.predicted_peak_bytes is None
    assert (gpt.predicted_peak_bytes, gpt.measured_peak_bytes) == pytest.approx((400 / 3, 350 / 3))
    assert gpt.memory_error == pytest.approx(50 / 350)
    assert rep.memory_mae == pytest.approx(50 / 350)
    assert report([run()]).memory_mae is None


def test_a_plan_is_calibrated_when_its_explanation_says_so() -> None:
    rows = [metric(i, 1.0) for i in range(4)]
    note = f"Predicted 1 s.\n{CALIBRATED} cal-1 (version 2 for cpu/4c/1w, fitted on 40 iterations of 2 run(s))"
    assert run_of("job-1", "gpt", plan(explanation=note), rows, []).calibrated
    assert not run_of("job-1", "gpt", plan(explanation="Not calibrated: ..."), rows, []).calibrated


def test_a_window_of_steady_iterations_weighs_as_the_iterations_it_covers() -> None:
    """Iterations 3..9 in one row (their mean, 1.2 s) count as seven steady iterations beside 10 (2.0 s)."""
    rows = [metric(i, 5.0) for i in range(3)] + [metric(10, 2.0)]
    window = metric(9, 1.2)
    window.first_iteration, window.iterations = 3, 7
    got = run_of("job-1", "gpt", plan(), [*rows, window], [])
    assert got.iterations == 8 and got.measured_s == pytest.approx((7 * 1.2 + 2.0) / 8)
