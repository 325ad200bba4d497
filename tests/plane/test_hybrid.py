"""A hybrid plan runs end to end through Submit (issue 18): on the 2-agent CPU plane (real gRPC servers, a Celery
worker, worker processes over gloo), a memory budget under which plain DP and ZeRO do not fit makes the default
search shard layers with SDP (or split them with TP); the job trains to the end on that plan and stores its
measured iteration time and per-rank peak memory beside the plan's predictions.

The budget is found the way the planner would: a first job of the same model profiles it (and runs plain), then
the job path's own search (`plan_inputs` + `make_plan`, with every strategy the agents declare) is run over that
stored profile at falling budgets until its plan uses SDP or TP; the second job is submitted with that budget."""

from __future__ import annotations

import uuid

import pytest

from ballast.v1 import job_pb2, model_pb2, services_pb2, store_pb2
from services.executor.inventory import SUPPORTED
from services.planner.jobs.prepare import plan_inputs
from services.planner.plans.make import make_plan, runnable_dims
from services.runtime.errors import FailedPrecondition
from tests.harness import executor_plane, job_story, wait_for, worker_pids

pytestmark = pytest.mark.slow

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
# Untied, so every layer may be sharded; wide enough that model states dominate the activations.
MODEL = model_pb2.ModelSpec(name="hybrid-e2e", family=model_pb2.MODEL_FAMILY_GPT,
                            transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=256, num_heads=4,
                                                                    vocab_size=512, seq_length=16))


def spec(name: str, iterations: int, budget: int = 0) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(name=name, model=MODEL, global_batch_size=4, iterations=iterations, seed=7,
                           pipeline_stages=1, min_devices=2, max_devices=2, memory_budget_bytes=budget)


def run(plane, job_spec: job_pb2.JobSpec) -> job_pb2.Job:
    client = plane.client()
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec))
    done = wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job.id))).state in ENDED and j,
                    timeout=300, what=f"job {job_spec.name} to end",
                    story=lambda: job_story(client, job.id, plane.settings.data_dir))
    assert done.state == S.JOB_STATE_SUCCEEDED, done.message
    return done


def hybrid_budget(first: job_pb2.Job, profile, fleet) -> int:
    """The largest budget (in 2% steps down from the first plan's peak) at which the job path's search uses SDP
    or TP for some layer. Near the leanest budget only sharding fits, so if the steps reach a budget nothing fits
    without finding one, the last 2% is bisected: some budget just above the floor must shard."""
    dims = runnable_dims([list(SUPPORTED)])

    def hybrid(budget: int) -> bool:
        plan = make_plan(profile, fleet, plan_inputs(
            job_pb2.Job(spec=spec("probe", 1, budget), model_id=first.model_id), dims))
        return any(x.tp > 1 or x.sdp > 1 for x in plan.layers)

    fits = make_plan(profile, fleet, plan_inputs(first, dims)).prediction.peak_memory_bytes
    while fits > 1 << 20:
        budget = int(fits * 0.98)
        try:
            if hybrid(budget):
                return budget
        except FailedPrecondition:
            break
        fits = budget
    low = budget
    for _ in range(24):
        middle = (low + fits) // 2
        try:
            if hybrid(middle):
                return middle
            fits = middle
        except FailedPrecondition:
            low = middle
    raise AssertionError(f"no budget between {low} and {fits} bytes makes the search use SDP or TP")


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    with executor_plane(tmp_path_factory.mktemp("hybrid"), f"hybrid-{uuid.uuid4().hex[:8]}") as plane:
        yield plane


def test_a_hybrid_plan_runs_through_submit_with_its_predictions_beside_what_it_measured(plane):
    client = plane.client()
    first = run(plane, spec("plain-first", iterations=3))
    first_plan = client.planner.GetPlan(store_pb2.GetRequest(id=first.plan_id))
    # Unconstrained, DP is usually cheaper on CPU, but the measured profile decides (noise can tip it to SDP).
    profile = client.store.GetProfile(store_pb2.GetRequest(id=first_plan.profile_id))
    assert [layer.tensor_parallel for layer in profile.layers] == [0, 4, 4, 0]  # gcd(4 heads, MLP 1024)
    assert [layer.sequence_parallel for layer in profile.layers] == [0, 4, 4, 0]  # and of its 16 tokens
    budget = hybrid_budget(first, profile, first_plan.fleet)

    done = run(plane, spec("hybrid", iterations=4, budget=budget))
    plan = client.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
    hybrid = [x for x in plan.layers if x.tp > 1 or x.sdp > 1]
    assert hybrid and plan.profile_id == first_plan.profile_id
    assert all(x.sequence_parallel for x in hybrid if x.tp > 1)  # the default search splits TP layers' sequence
    assert len(plan.stages) == 1 and plan.stages[0].devices == 2
    rows = client.iteration_metrics(done.id)
    assert sorted({m.iteration for m in rows}) == list(range(4)) and len(rows) == 4 * 2
    assert all(m.iteration_time_s > 0 and m.predicted_iteration_time_s == plan.prediction.iteration_time_s
               for m in rows)
    predicted_peak = plan.stages[0].predicted_peak_memory_bytes
    assert 0 < predicted_peak <= budget
    assert all(m.peak_memory_bytes > 0 and m.predicted_peak_memory_bytes == predicted_peak for m in rows)
    losses = [m for m in rows if m.has_loss]  # one stage: both of its ranks report the global loss
    assert sorted({m.iteration for m in losses}) == list(range(4)) and all(0 < m.loss < 10 for m in losses)
    assert worker_pids(done.id) == []
