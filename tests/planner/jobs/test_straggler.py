"""Fail-stutter for real (Varuna §4.6) on three executor agents, one of them slow (a fault hook makes its worker
take three times its compute time; on a 2-core machine shared by three workers a 2x fault reads as only ~1.6x,
too close to what a 3 -> 2 morph can gain to judge the verdict by): the planner finds the straggler from the
per-iteration compute times, marks its host degraded with the evidence in SQL, and the job morphs onto the two
healthy devices, drained at an iteration boundary so nothing is trained again; the degraded host gets no job
until it is cleared."""

from __future__ import annotations

import json
import uuid

import pytest

from ballast.v1 import fleet_pb2, job_pb2, model_pb2, services_pb2, store_pb2
from tests.harness import STRAGGLERS, executor_plane, job_story, restart_agent, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # its verdict reads measured speed: the machine to itself

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
SLOW = "stutter-gpt"


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    with executor_plane(tmp_path_factory.mktemp("stutter"), f"stutter-{uuid.uuid4().hex[:8]}", agents=3,
                        **STRAGGLERS) as plane:
        restart_agent(plane, 2, {"BALLAST_FAULTS": json.dumps([{"model": SLOW, "slow": 3.0}])})
        yield plane


@pytest.mark.timeout(600)  # its waits add up past the suite's 300 s default
def test_a_straggler_is_left_out_and_its_host_marked_degraded(plane):
    client = plane.client()
    model = model_pb2.ModelSpec(name=SLOW, family=model_pb2.MODEL_FAMILY_GPT,
                                transformer=model_pb2.TransformerConfig(num_layers=4, hidden_size=128, num_heads=4,
                                                                        vocab_size=512, seq_length=64))
    job_id = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_pb2.JobSpec(
        name="stutter", model=model, global_batch_size=48, iterations=160, seed=2, checkpoint_every=50,
        pipeline_stages=1,  # data parallel: replicas of one stage to compare
        # a row per iteration: with 10 s windows (50 iterations here) the verdict would come at iteration 50 or
        # later, too late in a 160-iteration run for the morph to pay (windows in the watch: test_scheduler_windows)
        raw_metrics=True))).id

    def story() -> str:
        return job_story(client, job_id, plane.settings.data_dir)

    wait_for(lambda: client.jobs.Get(store_pb2.GetRequest(id=job_id)).state in ENDED, timeout=400,
             what="the job to end", story=story)
    done = client.jobs.Get(store_pb2.GetRequest(id=job_id))
    assert done.state == S.JOB_STATE_SUCCEEDED, done.message
    log = list(client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events)
    found = next((e for e in log if e.type == "STRAGGLER" and e.attributes["left_out"] == "True"), None)
    assert found is not None, [e.message for e in log if e.type == "STRAGGLER"]
    assert float(found.attributes["ratio"]) > 1.5, found.message
    # the verdict came from the simulator's re-plan on the two devices left, and it predicts a gain
    assert "the simulator predicts" in found.message and "on the 2 device(s) left" in found.message, found.message
    assert 0 < float(found.attributes["predicted_without_s"]) < float(found.attributes["iteration_s"])

    hosts = {h.id: h for h in client.store.ListHosts(store_pb2.ListHostsRequest()).hosts}
    slow_host = found.attributes["host_id"]
    assert hosts[slow_host].degraded_reason and hosts[slow_host].name.endswith(
        str(plane.settings.executor_port + 2)), "the slow agent's host is the one marked"
    evidence = client.store.Query(store_pb2.QueryRequest(
        sql=f"SELECT job_id, reason FROM host_degradations WHERE host_id = '{slow_host}'")).rows
    assert [list(r)[0] for r in evidence] == [job_id]

    [row] = client.store.ListMorphs(store_pb2.ListMorphsRequest(job_id=job_id)).morphs
    assert row.cause == "straggler" and row.lost_iterations == 0
    assert row.from_stages * row.from_replicas == 3 and row.to_stages * row.to_replicas == 2
    window = int(found.attributes["window"])
    # found two windows in a row (judged every window after 2 warm-up iterations), then drained at a boundary;
    # on a loaded 2-core machine a window can read as noise (three agents share it), so allow a few more
    # windows, but it is still left out within the run's first fifth
    assert 2 * window <= row.failed_iteration <= 2 + 10 * window
    leases = client.fleet.ListLeases(store_pb2.ListLeasesRequest(job_id=job_id)).leases
    after = [x for x in leases if x.end_reason == fleet_pb2.LEASE_END_REASON_FINISHED]
    assert slow_host not in {x.device.host_id for x in after}  # it ran on without the degraded host

    # Until it is cleared, admission gives the degraded host's device to nobody.
    again = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_pb2.JobSpec(
        name="after", model=model, global_batch_size=48, iterations=5, seed=2))).id
    wait_for(lambda: client.jobs.Get(store_pb2.GetRequest(id=again)).state in ENDED, timeout=300,
             what="the next job to end")
    used = {x.device.host_id for x in client.fleet.ListLeases(store_pb2.ListLeasesRequest(job_id=again)).leases}
    assert used and slow_host not in used
