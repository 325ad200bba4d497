"""JobService end to end up to a chosen plan, over real gRPC servers, a real Celery worker and real
executor agents: Submit -> PROFILING -> PLANNING -> SCHEDULED with one event per step, a measured CPU
profile for the online hosts' fleet, a fleet no executor offers refused at submit, failures that say why
and in which step, and a cancel before a worker ran."""

from __future__ import annotations

import uuid

import grpc
import pytest

from ballast.v1 import fleet_pb2, job_pb2, model_pb2, queue_pb2, services_pb2, store_pb2
from services.planner.celery_app import HOLD_ENV
from services.specs.fleet import load_fleet
from tests.harness import ROOT, kill_group, make_settings, spawn_cli, start_plane, wait_for

pytestmark = pytest.mark.slow

S = job_pb2.JobState
PREPARING = (S.JOB_STATE_SUBMITTED, S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING)
PLANNED = (S.JOB_STATE_SCHEDULED, S.JOB_STATE_RUNNING, S.JOB_STATE_SUCCEEDED)  # the scheduler takes it on at once


def tiny_gpt(vocab: int = 256) -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(
        name=f"tiny-{vocab}", family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=64, num_heads=2, vocab_size=vocab,
                                                seq_length=32))


def spec(name: str, vocab: int = 256, **kw) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(name=name, model=tiny_gpt(vocab), global_batch_size=kw.pop("global_batch_size", 4),
                           iterations=5, **kw)


def settled(client, job_id: str, timeout: float = 120.0) -> job_pb2.Job:
    return wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job_id))).state not in PREPARING
                    and j, timeout=timeout, what=f"job {job_id} to be scheduled or to end")


def events(client, job_id: str) -> list[job_pb2.JobEvent]:
    return list(client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events)


def prepare_request(client, job_id: str) -> queue_pb2.QueuedRequest:
    rows = client.store.ListRequests(store_pb2.ListRequestsRequest(kind="jobs.prepare")).requests
    [row] = [r for r in rows if f'"{job_id}"' in r.payload_json]
    return row


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("jobs"), queue=f"jobs-{uuid.uuid4().hex[:8]}",
                             lease_seconds=5.0, sweep_interval_s=0.5, worker_heartbeat_s=0.5)
    plane = start_plane(settings)
    log = settings.data_dir / "worker.log"
    worker = spawn_cli(settings, "worker", log=log)
    yield plane
    kill_group(worker)
    plane.stop()


def test_no_executor_online_and_no_fleet_fails_in_the_fleet_step(plane):
    client = plane.client()
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("nowhere", vocab=264)))
    assert job.state == S.JOB_STATE_SUBMITTED
    done = settled(client, job.id)
    assert done.state == S.JOB_STATE_FAILED
    assert "fleet failed" in done.message and "no executor host" in done.message
    assert "ballast up --executors" in done.message
    last = events(client, job.id)[-1]
    assert (last.type, last.attributes["step"]) == ("FAILED", "fleet")
    # the worker fails the job, then completes its request: a moment apart on a loaded machine
    wait_for(lambda: prepare_request(client, job.id).state == queue_pb2.REQUEST_STATE_FAILED, timeout=30,
             what="the prepare request to end FAILED")


@pytest.fixture(scope="module")
def agents(plane):
    procs = [spawn_cli(plane.settings, "serve", "executor", "--index", str(i)) for i in range(2)]
    client = plane.client()
    wait_for(lambda: len(client.store.ListHosts(store_pb2.ListHostsRequest(state=fleet_pb2.HOST_STATE_ONLINE))
                         .hosts) == 2, what="two executor agents online")
    yield procs
    for proc in procs:
        kill_group(proc)


def test_submit_profiles_plans_and_schedules_on_the_online_hosts(plane, agents):
    client = plane.client()
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("on-hosts")))
    done = settled(client, job.id, timeout=300)
    assert done.state in PLANNED, done.message
    log = events(client, job.id)[:4]
    assert [e.type for e in log] == ["SUBMITTED", "STATE_CHANGED", "PROFILED", "PLAN_CHOSEN"]
    assert [e.state for e in log] == [S.JOB_STATE_SUBMITTED, S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING,
                                      S.JOB_STATE_SCHEDULED]
    assert log[1].attributes["profile"] == "measured" and log[1].attributes["device_kind"] == "cpu"

    profile = client.profiler.GetProfile(store_pb2.GetRequest(id=log[2].attributes["profile_id"]))
    assert profile.device.kind == "cpu" and not profile.source_profile_id
    assert profile.comm.fits and profile.comm.colocated_slowdown >= 1  # two devices of one machine: calibrated
    assert profile.model_id == done.model_id and profile.tenant_id == done.tenant_id

    plan = client.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
    assert log[3].attributes["plan_id"] == plan.id and plan.job_id == job.id and plan.profile_id == profile.id
    # The two local agents share this machine: one node of two devices.
    assert (plan.fleet.nodes, plan.fleet.devices_per_node, plan.fleet.device.kind) == (1, 2, "cpu")
    assert plan.global_batch_size == 4 and plan.prediction.iteration_time_s > 0
    assert plan.micro_batch_size * plan.num_micro_batches * max(s.devices for s in plan.stages) >= 4
    assert prepare_request(client, job.id).state == queue_pb2.REQUEST_STATE_SUCCEEDED

    # The same model again: the profile comes from the cache, and a second job gets a plan of its own.
    again = settled(client, client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("again"))).id)
    # planned; QUEUED while the first job still holds both devices (its 5 iterations may outlast the planning)
    assert again.state in (*PLANNED, S.JOB_STATE_QUEUED) and again.plan_id and again.plan_id != done.plan_id
    assert events(client, again.id)[2].attributes["profile_id"] == profile.id


def test_a_fleet_no_executor_offers_is_refused_at_submit(plane, agents):
    """Asked for 8 TITANs where the registered executors offer 2 CPU slots: refused at once, nothing stored."""
    client = plane.client()
    fleet = load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")
    before = client.store.ListJobs(store_pb2.ListJobsRequest()).jobs
    with pytest.raises(grpc.RpcError) as err:
        client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("titan", vocab=512, fleet=fleet)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "spec.fleet" in err.value.details() and "8 nvidia-titan-rtx-24gb" in err.value.details()
    assert "offer 2 cpu" in err.value.details() and "ballast plan --fleet" in err.value.details()
    assert len(client.store.ListJobs(store_pb2.ListJobsRequest()).jobs) == len(before)
    # What the executors do offer is accepted: a CPU fleet of their size
    cpu = fleet_pb2.Fleet(device=fleet_pb2.DeviceSpec(kind="cpu"), nodes=1, devices_per_node=2)
    accepted = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("cpu-fleet", fleet=cpu)))
    client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=accepted.id, reason="only its acceptance was tested"))


def test_nothing_fits_fails_in_the_planning_step_with_the_smallest_memory(plane, agents):
    client = plane.client()
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("tight", memory_budget_bytes=1 << 16)))
    done = settled(client, job.id, timeout=300)
    assert done.state == S.JOB_STATE_FAILED
    assert done.message.startswith("planning failed:") and "memory_budget_bytes" in done.message
    assert "per device" in done.message  # the leanest configuration's need, in MiB/GiB
    assert [e.type for e in events(client, job.id)][-2:] == ["PROFILED", "FAILED"]
    assert not client.store.ListPlans(store_pb2.ListPlansRequest(job_id=job.id)).plans


def test_cancel_before_a_worker_picked_it_up(plane, agents, tmp_path):
    """A second worker holds its task before running it; the job is cancelled meanwhile and stays so."""
    client = plane.client()
    held = spawn_cli(plane.settings, "worker", extra_env={HOLD_ENV: "3"}, log=tmp_path / "held.log")
    try:
        job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("cancel-me", vocab=320)))
        cancelled = client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=job.id, reason="changed my mind"))
        assert cancelled.state == S.JOB_STATE_CANCELLED
        row = wait_for(lambda: (r := prepare_request(client, job.id)).state == queue_pb2.REQUEST_STATE_SUCCEEDED
                       and r, what="the preparation request to finish")
        assert '"JOB_STATE_CANCELLED"' in row.result_json
        assert client.jobs.Get(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_CANCELLED
        assert not client.store.ListPlans(store_pb2.ListPlansRequest(job_id=job.id)).plans
    finally:
        kill_group(held)
