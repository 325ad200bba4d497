"""A model over the devices' memory trains end to end through Submit (issue 19): on the 2-agent CPU plane (real gRPC
servers, a Celery worker, worker processes over gloo) a job whose memory budget fits no plan in device memory is
planned with chunk offload (PatrickStar) or, asked for, Harmony's swap schedule instead of refused, trains to the
end under the enforced budget, and stores each iteration's measured swap bytes beside the plan's predicted ones."""

from __future__ import annotations

import uuid

import pytest

from ballast.v1 import job_pb2, model_pb2, plan_pb2, services_pb2, store_pb2
from tests.harness import executor_plane, job_story, wait_for, worker_pids

pytestmark = pytest.mark.slow

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
# 12.8 MB of fp32 parameters (51 MB of model states under Adam) against an 11 MB budget per device.
MODEL = model_pb2.ModelSpec(name="offload-e2e", family=model_pb2.MODEL_FAMILY_GPT,
                            transformer=model_pb2.TransformerConfig(num_layers=4, hidden_size=256, num_heads=2,
                                                                    vocab_size=128, seq_length=8,
                                                                    tie_embeddings=True))
BUDGET = 11_000_000


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    with executor_plane(tmp_path_factory.mktemp("offload"), f"offload-{uuid.uuid4().hex[:8]}") as plane:
        yield plane


def test_a_model_over_device_memory_is_planned_with_chunks_and_trains(plane):
    client = plane.client()
    spec = job_pb2.JobSpec(name="offload", model=MODEL, global_batch_size=4, iterations=4, seed=7,
                           min_devices=2, max_devices=2, memory_budget_bytes=BUDGET)
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec))
    done = wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job.id))).state in ENDED and j,
                    timeout=300, what="the offloaded job to end",
                    story=lambda: job_story(client, job.id, plane.settings.data_dir))
    assert done.state == S.JOB_STATE_SUCCEEDED, done.message
    plan = client.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
    assert plan.engine == plan_pb2.PLAN_ENGINE_PATRICKSTAR and plan.HasField("offload")
    assert plan.offload.device_budget_bytes == BUDGET and plan.offload.predicted_to_device_bytes > 0
    assert "chunk offload (PatrickStar)" in plan.explanation
    rows = client.iteration_metrics(done.id)
    assert sorted({m.iteration for m in rows}) == list(range(4)) and len(rows) == 4 * 2
    for m in rows:
        assert m.swap_in_bytes > 0 and m.swap_out_bytes > 0 and m.swap_s > 0
        assert m.predicted_swap_in_bytes == plan.offload.predicted_to_device_bytes
    steady = [m for m in rows if m.iteration > 0 and m.replica_index == 0]  # the plan predicts rank 0's steady state
    for m in steady:
        assert abs(m.swap_in_bytes - m.predicted_swap_in_bytes) <= 0.10 * m.swap_in_bytes
        assert abs(m.swap_out_bytes - m.predicted_swap_out_bytes) <= 0.10 * m.swap_out_bytes
    losses = [m for m in rows if m.has_loss]
    assert sorted({m.iteration for m in losses}) == list(range(4)) and all(0 < m.loss < 10 for m in losses)
    assert worker_pids(done.id) == []


def test_a_model_over_device_memory_trains_on_harmonys_schedule_when_asked(plane):
    from pathlib import Path

    from tests.executor.train.test_harmony import BUDGET as CHAIN_BUDGET
    from tests.executor.train.test_harmony import SPEC as CHAIN

    client = plane.client()
    spec = job_pb2.JobSpec(name="harmony", model=CHAIN, global_batch_size=4, iterations=3, seed=7, min_devices=1,
                           max_devices=1, memory_budget_bytes=CHAIN_BUDGET, engine=plan_pb2.PLAN_ENGINE_HARMONY)
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec))
    done = wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job.id))).state in ENDED and j,
                    timeout=300, what="the Harmony job to end",
                    story=lambda: job_story(client, job.id, plane.settings.data_dir))
    assert done.state == S.JOB_STATE_SUCCEEDED, done.message
    plan = client.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
    assert plan.engine == plan_pb2.PLAN_ENGINE_HARMONY and plan.HasField("harmony") and plan.harmony.devices == 1
    assert "Harmony's swap schedule" in plan.explanation
    rows = client.iteration_metrics(done.id)
    assert sorted(m.iteration for m in rows) == list(range(3))
    for m in rows:  # one device: what it moved is the whole schedule's traffic, to the byte
        assert m.swap_in_bytes == m.predicted_swap_in_bytes == plan.harmony.predicted_to_device_bytes > 0
        assert m.swap_out_bytes == m.predicted_swap_out_bytes == plan.harmony.predicted_to_host_bytes > 0
        assert m.has_loss and 0 < m.loss < 10
    assert worker_pids(done.id) == []
    assert not list(Path("/dev/shm").glob(f"ballast-harmony-{done.id}*"))  # the host store went with the job
