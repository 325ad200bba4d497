"""Elastic jobs for real (issue 20, live mode): on two executor agents (one device each), an elastic job runs on
both; a second elastic job arrives, and the scheduler's elastic pass -- the allocation policy the fleet
simulator replays -- shrinks the first to one device by morphing it (drained at a boundary, nothing trained
again) so that the second starts on the other. Watch (the job's events) and SQL (job_morphs) show the resize
with its predicted effect, and both jobs succeed with every iteration stored once."""

from __future__ import annotations

import uuid

import pytest

from ballast.v1 import job_pb2, model_pb2, services_pb2, store_pb2
from tests.harness import executor_plane, job_story, lineage_problems, wait_for

pytestmark = pytest.mark.slow
S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
MODEL = model_pb2.ModelSpec(name="elastic-gpt", family=model_pb2.MODEL_FAMILY_GPT,
                            transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=32, num_heads=2,
                                                                    vocab_size=128, seq_length=16))
FIRST, SECOND = 1500, 40  # iterations


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    with executor_plane(tmp_path_factory.mktemp("elastic"), f"elastic-{uuid.uuid4().hex[:8]}",
                        # decide every second; no hysteresis and no fairness guard: jobs this short are all
                        # "behind" on profiling and planning alone (the policy's guards:
                        # tests/planner/jobs/test_elastic.py)
                        elastic_interval_s=1.0, elastic_min_resize_interval_s=0.0,
                        elastic_fairness_bound=0.0) as plane:
        yield plane


def submit(plane, name: str, iterations: int, **fields) -> str:
    spec = job_pb2.JobSpec(name=name, model=MODEL, global_batch_size=4, iterations=iterations, seed=5,
                           checkpoint_every=10, elastic=True, min_devices=1, max_devices=2, **fields)
    return plane.client().jobs.Submit(services_pb2.SubmitJobRequest(spec=spec)).id


def events(plane, job_id: str) -> list[job_pb2.JobEvent]:
    return list(plane.client().store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events)


def rows(plane, sql: str) -> list[list[str]]:
    return [list(r) for r in plane.client().store.Query(store_pb2.QueryRequest(sql=sql)).rows]


def wait_ended(plane, job_id: str) -> job_pb2.Job:
    client = plane.client()
    wait_for(lambda: client.jobs.Get(store_pb2.GetRequest(id=job_id)).state in ENDED, timeout=600,
             what=f"job {job_id} to end", story=lambda: job_story(client, job_id, plane.settings.data_dir))
    return client.jobs.Get(store_pb2.GetRequest(id=job_id))


@pytest.mark.timeout(900)
def test_an_elastic_job_shrinks_by_morphing_so_that_an_arriving_one_starts(plane):
    client = plane.client()
    first = submit(plane, "elastic-first", FIRST, pipeline_stages=2)  # two stages: it starts on both devices
    wait_for(lambda: sum(1 for m in client.iteration_metrics(first) if m.stage_index == 0) >= 15, timeout=300,
             what="the first job to run steadily on both devices",
             story=lambda: job_story(client, first, plane.settings.data_dir))
    second = submit(plane, "elastic-second", SECOND)

    done = wait_ended(plane, second), wait_ended(plane, first)
    assert [j.state for j in done] == [S.JOB_STATE_SUCCEEDED] * 2, [j.message for j in done]

    # Watch: the first job's MORPHING event says it was resized by the elastic allocation, with the prediction
    resize = next(e for e in events(plane, first) if e.type == "MORPHING")
    assert resize.attributes["cause"] == "resize" and resize.attributes["to_devices"] == "1"
    assert "elastic allocation: 2 -> 1 device(s): predicted" in resize.message
    assert "queued elastic job(s) start now" in resize.message and second in resize.message
    # SQL: the morph row with its layouts and the prediction; drained at a boundary, nothing trained again
    morph = rows(plane, f"SELECT cause, from_stages * from_replicas, to_stages * to_replicas, lost_iterations, "
                        f"detail FROM job_morphs WHERE job_id = '{first}' ORDER BY detected_at")[0]
    assert [morph[0], *map(int, morph[1:4])] == ["resize", 2, 1, 0] and "predicted" in morph[4]
    # the second job started on the device the resize freed, while the first still ran
    admitted = next(e for e in events(plane, second) if e.type == "ADMITTED")
    assert admitted.attributes["devices"] == "1"
    for job_id, iterations in ((first, FIRST), (second, SECOND)):
        # each iteration once per (stage, replica), counting the iterations each window row covers
        assert lineage_problems(plane.client().iteration_metrics(job_id), iterations) == []
