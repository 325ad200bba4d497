"""Where an iteration's time went, on real gloo process groups: a 2-stage x 2-replica run reports forward,
backward, p2p wait, allreduce, optimizer and the rest per rank, summing to its wall time, and the agent's
StageStats and the planner's IterationMetric carry them beside the plan's per-stage predictions."""

from __future__ import annotations

import pytest
from google.protobuf.json_format import MessageToDict

from ballast.v1 import plan_pb2
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.workers import stage_stats
from services.planner.jobs.metrics import iteration_metric
from services.runtime.allocator import STEADY_ALLOCATOR
from tests.executor.train.test_stage import ADAM, GPT, PARTS, assert_parts_sum_to_the_iteration

BOUNDS = [[0, 2], [2, 4]]  # embed, block.0 | block.1, head (tied to the embedding)
REPLICAS, STEPS, NUM_MICRO = 2, 3, 2


@pytest.fixture(scope="module")
def iterations() -> list[list[dict]]:
    """Each rank's "iteration" events (rank = stage * REPLICAS + replica)."""
    template = WorkerConfig(
        job_id="job-breakdown", model=MessageToDict(GPT, preserving_proto_field_name=True), stage_bounds=BOUNDS,
        num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=2,
        num_micro_batches=NUM_MICRO, iterations=STEPS, init_method="", optimizer=ADAM, seed=3, timeout_s=60,
        checkpoint_layers=[1, 2])
    events = run_local(plan_configs(template, BOUNDS, REPLICAS), env=STEADY_ALLOCATOR, timeout_s=120)
    return [[e for e in rank if e["event"] == "iteration"] for rank in events]


def test_every_rank_reports_parts_that_sum_to_the_iteration(iterations):
    assert [len(its) for its in iterations] == [STEPS] * 4
    for its in iterations:
        for it in its:
            assert_parts_sum_to_the_iteration(it)


def test_both_stages_wait_on_p2p_and_every_replica_allreduces(iterations):
    for rank, its in enumerate(iterations):
        stage = rank // REPLICAS
        # stage 0 waits for gradients from stage 1, stage 1 for activations from stage 0
        assert sum(it["p2p_s"] for it in its) > 0, rank
        assert all(it["allreduce_s"] > 0 for it in its), rank  # replica and tied-embedding gradient sums
        assert all(it["replica_allreduces"] == 1 and it["tied_allreduces"] == 1 for it in its)
        assert all(it["optimizer_s"] > 0 and it["forward_s"] > 0 and it["backward_s"] > 0 for it in its)
        if stage == 0:  # block.0 is checkpointed and stage 0 recomputes before its gradient arrives
            assert all(it["recompute_s"] > 0 for it in its)


def test_the_breakdown_reaches_the_stored_row_beside_the_stage_predictions(iterations):
    plan = plan_pb2.Plan(version=1, num_micro_batches=NUM_MICRO, stages=[
        plan_pb2.Stage(index=0, layer_begin=0, layer_end=2, predicted_time_s=0.01,
                       predicted_peak_memory_bytes=3 << 20),
        plan_pb2.Stage(index=1, layer_begin=2, layer_end=4, predicted_time_s=0.02,
                       predicted_peak_memory_bytes=5 << 20)],
        prediction=plan_pb2.Prediction(iteration_time_s=0.1, peak_memory_bytes=5 << 20))
    for its in iterations:
        event = its[-1]
        stats = stage_stats({**event, "iteration": event["iteration"] - 1}, "job-breakdown")
        row = iteration_metric(stats, plan)
        assert (row.stage_index, row.replica_index) == (event["stage"], event["replica"])
        for key in (*PARTS, "recompute_s", "comm_s", "idle_s"):
            assert getattr(row, key) == event[key], key
        assert row.iteration_time_s == event["iteration_s"] and row.peak_memory_bytes == event["peak_memory_bytes"]
        assert row.predicted_peak_memory_bytes == (3 << 20, 5 << 20)[row.stage_index]
        assert row.predicted_stage_compute_s == pytest.approx((0.01, 0.02)[row.stage_index] * NUM_MICRO)
        assert row.predicted_iteration_time_s == 0.1
