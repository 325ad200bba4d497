"""The closed loop (issue 17): a job that succeeds recalibrates its host class from its own measurements, and
the next job of that class is planned with the calibration (named in its explanation). Real plane: a Celery
worker, two executor agents, real worker processes."""

from __future__ import annotations

import uuid

import pytest

from ballast.cli.demo import calibration_outcome
from ballast.v1 import job_pb2, model_pb2, plan_pb2, services_pb2, store_pb2
from tests.harness import executor_plane, job_story, wait_for

pytestmark = pytest.mark.slow

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
ITERATIONS = 24


def spec(name: str) -> job_pb2.JobSpec:
    model = model_pb2.ModelSpec(
        name="loop-gpt", family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=64, num_heads=2, vocab_size=256,
                                                seq_length=32))
    # Varuna's P x D plans only: with the first calibration applied, the search may otherwise choose SDP over
    # the two devices, a run the calibration refuses to fit ("TP or SDP layers"), and no version 2 would come
    return job_pb2.JobSpec(name=name, model=model, global_batch_size=8, iterations=ITERATIONS, seed=5,
                           engine=plan_pb2.PLAN_ENGINE_VARUNA)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    with executor_plane(tmp_path_factory.mktemp("loop"), f"loop-{uuid.uuid4().hex[:8]}",
                        calibration_min_iterations=10) as plane:
        yield plane


def run(plane, name: str) -> job_pb2.Job:
    client = plane.client()
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec(name)))
    done = wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job.id))).state in ENDED and j,
                    timeout=240, what=f"job {name} to end", story=lambda: job_story(client, job.id,
                                                                                   plane.settings.data_dir))
    assert done.state == S.JOB_STATE_SUCCEEDED, done.message
    return done


def calibrations(plane) -> list:
    return list(plane.client().store.ListCalibrations(store_pb2.ListCalibrationsRequest()).calibrations)


def queue_story(plane) -> str:
    """What the queue and the worker did with the calibration requests, for a wait that timed out (read as
    `ballast sql` reads it)."""
    found = plane.client().store.Query(store_pb2.QueryRequest(
        sql="SELECT kind, state, attempts, result_json, error, created_at, updated_at FROM queued_requests "
            "ORDER BY created_at"))
    lines = [f"  request {kind} {state} attempts={int(attempts)} {created}..{updated}: {(result or error or '')[:300]}"
             for kind, state, attempts, result, error, created, updated in (list(r) for r in found.rows)]
    log = plane.settings.data_dir / "worker.log"
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else ["(no worker.log)"]
    return "\n".join(["queued requests:", *lines, "--- worker.log (tail)", *tail])


def test_a_succeeded_run_calibrates_its_host_class_and_the_next_plan_uses_it(plane):
    client = plane.client()
    first = run(plane, "calibrating")
    found = wait_for(lambda: calibrations(plane), timeout=120, what="the first calibration",
                     story=lambda: queue_story(plane))
    (cal,) = found
    assert cal.version == 1 and list(cal.job_ids) == [first.id]
    assert cal.host_class == f"{cal.device_kind}/{cal.cores}c/{cal.colocated}w" and cal.device_kind == "cpu"
    assert cal.cores >= 1 and cal.colocated >= 1
    assert ITERATIONS - 3 - 1 <= cal.iterations <= ITERATIONS  # the steady iterations (warm-up left out)
    assert cal.residual_before > 0 and cal.residual >= 0 and cal.forward_scale > 0
    first_plan = client.planner.GetPlan(store_pb2.GetRequest(id=first.plan_id))
    assert "Calibrated from earlier runs" not in first_plan.explanation

    second = run(plane, "calibrated")
    plan = client.planner.GetPlan(store_pb2.GetRequest(id=second.plan_id))
    assert f"Calibrated from earlier runs: {cal.id} (version 1 for {cal.host_class}" in plan.explanation
    assert plan.prediction.iteration_time_s != pytest.approx(first_plan.prediction.iteration_time_s, rel=1e-3)

    outcome = wait_for(lambda: calibration_outcome(client, second.id), timeout=120,
                       what="the second run's calibration task", story=lambda: queue_story(plane))
    if outcome["calibrated"]:  # the new fit beat version 1 on the same two runs
        [newer] = [c for c in calibrations(plane) if c.version == 2]
        assert list(newer.job_ids) == [second.id, first.id]  # its provenance: this run and the last one's
    else:  # version 1 was as good on them: kept, and the task says so
        assert "is no better than version 1 on the same runs" in outcome["why"], outcome
        assert [c.version for c in calibrations(plane)] == [1]
