"""StageStats -> IterationMetric (services/planner/jobs/metrics.py): every measured part carried over, and the
plan's predictions for the row's own stage beside them, with the documented fallbacks."""

from __future__ import annotations

import pytest

from ballast.v1 import executor_pb2, plan_pb2
from services.planner.jobs.metrics import iteration_metric

MEASURED = {"iteration_time_s": 1.0, "forward_s": 0.25, "backward_s": 0.375, "recompute_s": 0.125, "p2p_s": 0.25,
            "allreduce_s": 0.0625, "optimizer_s": 0.03125, "overhead_s": 0.03125, "comm_s": 0.3125,
            "idle_s": 0.03125, "peak_memory_bytes": 7 << 20, "throughput_samples_per_s": 8.0}


def stats(stage: int = 1, **changes) -> executor_pb2.StageStats:
    return executor_pb2.StageStats(job_id="job-1", stage_index=stage, replica_index=1, iteration=4, plan_version=2,
                                   **{**MEASURED, **changes})


def plan(memory: tuple[int, int] = (3 << 20, 6 << 20)) -> plan_pb2.Plan:
    stages = [plan_pb2.Stage(index=s, predicted_time_s=0.1 * (s + 1), predicted_peak_memory_bytes=m)
              for s, m in enumerate(memory)]
    return plan_pb2.Plan(version=2, num_micro_batches=4, stages=stages,
                         prediction=plan_pb2.Prediction(iteration_time_s=0.9, peak_memory_bytes=8 << 20))


def test_every_measured_part_and_the_stage_predictions_are_carried():
    row = iteration_metric(stats(), plan())
    assert (row.job_id, row.iteration, row.stage_index, row.replica_index, row.plan_version) == ("job-1", 4, 1, 1, 2)
    for name, value in MEASURED.items():
        assert getattr(row, name) == value, name
    assert row.predicted_iteration_time_s == 0.9
    assert row.predicted_peak_memory_bytes == 6 << 20  # stage 1's, not the plan-wide peak
    assert row.predicted_stage_compute_s == pytest.approx(0.2 * 4)  # per micro-batch x micro-batches
    assert not row.has_loss and row.loss == 0.0
    assert iteration_metric(stats(loss=2.5, has_loss=True), plan()).loss == 2.5


def test_fallbacks_without_a_stage_prediction():
    unpriced = iteration_metric(stats(), plan(memory=(3 << 20, 0)))
    assert unpriced.predicted_peak_memory_bytes == 8 << 20  # the plan-wide peak bounds every stage
    beyond = iteration_metric(stats(stage=5), plan())
    assert (beyond.predicted_peak_memory_bytes, beyond.predicted_stage_compute_s) == (8 << 20, 0.0)
    unknown = iteration_metric(stats(), None)
    assert (unknown.predicted_iteration_time_s, unknown.predicted_peak_memory_bytes,
            unknown.predicted_stage_compute_s) == (0.0, 0, 0.0)
    assert unknown.p2p_s == MEASURED["p2p_s"]
