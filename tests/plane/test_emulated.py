"""Emulated hosts through the live plane (issue 43): agents that are real to the planner -- mTLS identity, Connect
stream, registration, heartbeats, assign and stop -- with workers that advance at the plan's predicted time. A job
on an emulated H100 fleet is profiled (analytically), planned, leased, runs to SUCCEEDED with its metrics stored,
and a lost emulated host morphs a job onto the others."""

from __future__ import annotations

import uuid

import pytest

from ballast.v1 import fleet_pb2, job_pb2, model_pb2, services_pb2, store_pb2
from tests.harness import covered, emulated_plane, job_story, wait_for

pytestmark = pytest.mark.slow

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
HOSTS, DEVICES = 6, 4


def spec(name: str, iterations: int, devices: int) -> job_pb2.JobSpec:
    model = model_pb2.ModelSpec(
        name="emulated-gpt", family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32000,
                                                seq_length=1024))
    return job_pb2.JobSpec(name=name, model=model, global_batch_size=64, iterations=iterations, seed=1,
                           min_devices=devices, max_devices=devices, checkpoint_every=20)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    with emulated_plane(tmp_path_factory.mktemp("emulated"), f"emu-{uuid.uuid4().hex[:8]}", HOSTS, DEVICES,
                        host_lost_s=3.0) as found:
        yield found


def ended(client, job_id: str, data_dir, timeout: float = 120) -> job_pb2.Job:
    return wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job_id))).state in ENDED and j,
                    timeout=timeout, what=f"job {job_id} to end", story=lambda: job_story(client, job_id, data_dir))


def test_emulated_hosts_register_as_the_fleet_they_claim(emulated):
    plane, _ = emulated
    hosts = plane.client().store.ListHosts(store_pb2.ListHostsRequest(state=fleet_pb2.HOST_STATE_ONLINE)).hosts
    assert len(hosts) == HOSTS and len({h.address for h in hosts}) == HOSTS  # distinct machines to the planner
    assert {d.spec.kind for h in hosts for d in h.devices} == {"nvidia-h100-sxm-80gb"}
    assert all(len(h.devices) == DEVICES and h.labels["emulated"] == "true" for h in hosts)


def test_a_job_on_emulated_hosts_runs_at_its_predicted_time_to_success(emulated):
    plane, _ = emulated
    client = plane.client()
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("emulated-run", 40, 2 * DEVICES)))
    done = ended(client, job.id, plane.settings.data_dir)
    assert done.state == S.JOB_STATE_SUCCEEDED, done.message
    plan = client.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
    metrics = list(client.iteration_metrics(job.id))
    # each rank's iterations arrive in windows (the first 3 alone, then blocks that end at the 20-iteration
    # checkpoint cadence), and every iteration of every rank is stored exactly once
    ranks = covered(metrics)
    assert len(ranks) == 2 * DEVICES and all(its == list(range(40)) for its in ranks.values())
    assert len(metrics) < 2 * DEVICES * 40 and {m.iteration for m in metrics if m.iterations > 1} <= {19, 39}
    assert all(m.iteration_time_s == pytest.approx(plan.prediction.iteration_time_s) for m in metrics)
    assert all(m.iteration_time_p50_s <= m.iteration_time_p95_s <= m.iteration_time_max_s for m in metrics)
    leases = client.store.ListLeases(store_pb2.ListLeasesRequest(job_id=job.id)).leases
    assert len(leases) == 2 * DEVICES and all(x.end_reason == fleet_pb2.LEASE_END_REASON_FINISHED for x in leases)
    checkpoints = client.store.ListCheckpoints(store_pb2.ListCheckpointsRequest(job_id=job.id)).checkpoints
    assert any(c.complete and c.iteration == 20 for c in checkpoints)


def test_a_lost_emulated_host_morphs_its_job_onto_the_others(emulated):
    plane, fleet = emulated
    client = plane.client()
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("emulated-morph", 400, 2 * DEVICES)))
    wait_for(lambda: any(m.iteration >= 30 for m in client.iteration_metrics(job.id)), timeout=60,
             what="the job to train past its first checkpoint")
    leases = client.store.ListLeases(store_pb2.ListLeasesRequest(job_id=job.id)).leases
    victim = client.store.GetHost(store_pb2.GetRequest(id=leases[0].device.host_id)).name
    assert fleet.lose(victim) > 0
    done = ended(client, job.id, plane.settings.data_dir, timeout=180)
    assert done.state == S.JOB_STATE_SUCCEEDED, done.message
    events = [e.type for e in client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job.id)).events]
    assert events.count("ASSIGNED") >= 2  # started again after the loss
    final = client.store.ListLeases(store_pb2.ListLeasesRequest(job_id=job.id)).leases
    hosts_after = {client.store.GetHost(store_pb2.GetRequest(id=x.device.host_id)).name for x in final
                   if x.end_reason == fleet_pb2.LEASE_END_REASON_FINISHED}
    assert victim not in hosts_after
    # the windows the lost host's ranks had sent past the checkpoint went with the morph (none straddles a
    # checkpoint): the first rank's 400 iterations are each stored exactly once, across both placements
    assert covered(client.iteration_metrics(job.id))[(0, 0)] == list(range(400))
