"""vPipe in the loop, end to end: a job submitted with online repartitioning and a dynamic workload is kept
balanced while it trains. Real store, profiler and planner gRPC servers, a real Celery worker, two executor
agents and their worker processes over gloo; the planner's monitor sees the imbalance, its SRP planner
prices a repartition, the workers migrate layers live, and every migration is a row in layer_migrations."""

from __future__ import annotations

import uuid

import pytest

from ballast.v1 import job_pb2, model_pb2, services_pb2, store_pb2
from tests.harness import executor_plane, job_story, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # its verdict reads measured speed: the machine to itself

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
ITERATIONS, SWITCH_ON = 110, 35  # time after the switch for the monitor's windows and a decision
LATE = (4, 5, 6)  # blocks of the second half, off until SWITCH_ON: the pipeline starts unbalanced


def online_spec() -> job_pb2.JobSpec:
    model = model_pb2.ModelSpec(
        name="online-gpt", family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=6, hidden_size=128, num_heads=4, vocab_size=256,
                                                seq_length=64))
    toggles = [job_pb2.LayerToggle(layer_index=i, iteration=0, active=False) for i in LATE]
    toggles += [job_pb2.LayerToggle(layer_index=i, iteration=SWITCH_ON, active=True) for i in LATE]
    return job_pb2.JobSpec(name="online", model=model, global_batch_size=8, iterations=ITERATIONS, seed=5,
                           pipeline_stages=2, online_repartition=True, layer_toggles=toggles)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    with executor_plane(tmp_path_factory.mktemp("online"), f"online-{uuid.uuid4().hex[:8]}") as plane:
        yield plane


def test_the_planner_rebalances_a_running_job_by_migrating_layers_live(plane):
    client = plane.client()
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=online_spec()))
    done = wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job.id))).state in ENDED and j,
                    timeout=240, what="the job to end",
                    story=lambda: job_story(client, job.id, plane.settings.data_dir))
    events = client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job.id)).events
    assert done.state == S.JOB_STATE_SUCCEEDED, (done.message, [(e.type, e.message) for e in events])
    # its monitor judged it iteration by iteration: an online job's rows stay one per iteration on a plane with
    # the product's telemetry windows
    assert all(m.iterations == 1 for m in client.iteration_metrics(job.id))
    kinds = [e.type for e in events]
    first = client.planner.GetPlan(store_pb2.GetRequest(id=events[kinds.index("PLAN_CHOSEN")].attributes["plan_id"]))
    assert len(first.stages) == 2

    # Every repartition: decided (with the simulator's prediction), migrated live, then in force -- but for one
    # the job's end overtook (decided in its last iterations), closed as failed just before SUCCEEDED.
    decided = [e for e in events if e.type == "REPARTITION"]
    applied = [e for e in events if e.type == "REPARTITIONED"]
    overtaken = [e for e in events if e.type == "REPARTITION_FAILED"]
    assert all("finished before" in e.message for e in overtaken) and len(overtaken) <= 1, kinds
    assert not overtaken or kinds[-2:] == ["REPARTITION_FAILED", "SUCCEEDED"], kinds
    assert decided and len(applied) + len(overtaken) == len(decided), kinds
    for e in decided:
        assert float(e.attributes["predicted_after_s"]) < float(e.attributes["predicted_before_s"])
        assert e.state == S.JOB_STATE_REPARTITIONING and e.attributes["moves"]
    assert done.plan_version == 1 + len(applied) and done.plan_id == applied[-1].attributes["plan_id"]
    final = client.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
    assert final.parent_plan_id and final.engine == 5  # PLAN_ENGINE_VPIPE

    # The unbalanced start is rebalanced well before the late blocks switch on, by moving layers into stage 1.
    rows = client.store.ListLayerMigrations(store_pb2.ListLayerMigrationsRequest(job_id=job.id)).migrations
    early = [m for m in rows if m.iteration < SWITCH_ON]
    assert early and all(m.from_stage == 0 and m.to_stage == 1 for m in early)
    assert all(m.bytes > 0 and m.duration_s > 0 and m.plan_version >= 2 for m in rows)
    # Switching the late blocks on makes stage 1 the heavy one: layers go back (the dynamic workload). The first
    # decision priced on a window measured after the switch (no inactive layers in it) moves them into stage 0.
    # None is decided on a window the switch would end before its move is measured
    # (tests/planner/online/test_toggles.py);
    # later ones follow what this busy 2-core host measures, so they are not pinned.
    moves = [(m.layer_index, m.from_stage, m.to_stage, m.iteration, m.plan_version) for m in rows]
    assert any(m.from_stage == 1 and m.to_stage == 0 for m in rows if m.iteration >= SWITCH_ON), moves
    after_switch = [e for e in decided if "inactive layers" not in e.message]
    assert after_switch and all(move.endswith(":1->0") for move in after_switch[0].attributes["moves"].split(",")), [
        e.message for e in decided]

    # The same rows through SQL, as a user would ask for them.
    table = client.store.Query(store_pb2.QueryRequest(
        sql=f"SELECT layer_index, from_stage, to_stage, bytes, iteration, plan_version FROM layer_migrations "
            f"WHERE job_id = '{job.id}' ORDER BY iteration, layer_index"))
    assert len(table.rows) == len(rows)

    # Each plan's layers are the ones its iterations' workers reported holding.
    metrics = client.iteration_metrics(job.id)
    assert {m.plan_version for m in metrics} == set(range(1, done.plan_version + 1)), [
        e.message for e in applied]
