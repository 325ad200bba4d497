"""A worker's per-iteration StageStats as the stored IterationMetric row, with the plan's predictions for the
same stage beside the measurements, so the estimator's error is a query and can be attributed to a part
(compute, p2p, allreduce, optimizer, the rest) and to memory. Pure: no store, no grpc."""

from __future__ import annotations

from ballast.v1 import executor_pb2, job_pb2, plan_pb2
from services.runtime.metrics import ITERATION_SECONDS, JOB_ITERATION_SECONDS


def plan_stage(plan: plan_pb2.Plan | None, stage_index: int) -> plan_pb2.Stage | None:
    """The plan's stage at `stage_index` (by its index field), if the plan has one."""
    if plan is None:
        return None
    return next((s for s in plan.stages if s.index == stage_index), None)


def predicted_memory(plan: plan_pb2.Plan | None, stage: plan_pb2.Stage | None) -> int:
    """The stage's predicted peak bytes per device; a plan without it gives its plan-wide peak (the largest
    stage's, an upper bound for this one); no plan gives 0."""
    if stage is not None and stage.predicted_peak_memory_bytes:
        return stage.predicted_peak_memory_bytes
    return plan.prediction.peak_memory_bytes if plan is not None else 0


def predicted_compute(plan: plan_pb2.Plan | None, stage: plan_pb2.Stage | None) -> float:
    """The stage's predicted forward + backward (with recompute) for one iteration: the plan prices one
    micro-batch (Stage.predicted_time_s) and each replica runs num_micro_batches of them. 0 when unknown."""
    if plan is None or stage is None:
        return 0.0
    return stage.predicted_time_s * plan.num_micro_batches


def iteration_metric(st: executor_pb2.StageStats, plan: plan_pb2.Plan | None) -> job_pb2.IterationMetric:
    """The row for one stage replica's iteration; `plan` is the plan version it ran under (None: unknown, the
    predictions are 0)."""
    stage = plan_stage(plan, st.stage_index)
    return job_pb2.IterationMetric(
        job_id=st.job_id, iteration=st.iteration, stage_index=st.stage_index, replica_index=st.replica_index,
        plan_version=st.plan_version, iteration_time_s=st.iteration_time_s, forward_s=st.forward_s,
        backward_s=st.backward_s, comm_s=st.comm_s, idle_s=st.idle_s, peak_memory_bytes=st.peak_memory_bytes,
        loss=st.loss if st.has_loss else 0.0, has_loss=st.has_loss,
        throughput_samples_per_s=st.throughput_samples_per_s,
        predicted_iteration_time_s=plan.prediction.iteration_time_s if plan is not None else 0.0,
        recompute_s=st.recompute_s, p2p_s=st.p2p_s, allreduce_s=st.allreduce_s, optimizer_s=st.optimizer_s,
        overhead_s=st.overhead_s, predicted_peak_memory_bytes=predicted_memory(plan, stage),
        predicted_stage_compute_s=predicted_compute(plan, stage))


def observe_iteration(row: job_pb2.IterationMetric) -> None:
    """A stored row, for Prometheus: the iteration-time histogram, and the job's latest measured and predicted
    time (from stage 0, replica 0, which sees the whole iteration)."""
    ITERATION_SECONDS.observe(row.iteration_time_s)
    if row.stage_index == 0 and row.replica_index == 0:
        JOB_ITERATION_SECONDS.labels(row.job_id, "measured").set(row.iteration_time_s)
        if row.predicted_iteration_time_s > 0:
            JOB_ITERATION_SECONDS.labels(row.job_id, "predicted").set(row.predicted_iteration_time_s)
