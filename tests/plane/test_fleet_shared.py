"""A shared fleet for real: several tenants' jobs at once on two executor agents (real gRPC servers, a Celery
worker, worker processes over gloo). Jobs never share a device (the lease table says so), queue when the
fleet is busy, a high-priority job preempts a running one, which resumes from its checkpoint and trains on to
the same losses as an uninterrupted run from that checkpoint, quotas hold, and a restarted planner loses no
job and double-books no device."""

from __future__ import annotations

import time
import uuid

import pytest

from ballast.v1 import fleet_pb2, job_pb2, model_pb2, services_pb2, store_pb2
from services.executor.train.reference import train_single
from services.planner.service import build_server as planner_server
from services.specs.policy import default_policy
from tests.harness import executor_plane, job_story, wait_for
from tests.store_fixtures import OVERLAPS

pytestmark = pytest.mark.slow

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
MODEL = model_pb2.ModelSpec(
    name="fleet-gpt", family=model_pb2.MODEL_FAMILY_GPT,
    transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=32, num_heads=2, vocab_size=128, seq_length=16))


def spec(name: str, iterations: int, **fields) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(name=name, model=MODEL, global_batch_size=4, iterations=iterations, seed=5, **fields)


def one_device() -> fleet_pb2.Fleet:
    """A one-device CPU fleet: the job's plan asks for one device, so two such jobs fit the two agents."""
    from services.specs.fleet import fleet_from_dict

    return fleet_from_dict({"device": "cpu", "nodes": 1, "devices_per_node": 1})


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    with executor_plane(tmp_path_factory.mktemp("fleet"), f"fleet-{uuid.uuid4().hex[:8]}") as plane:
        yield plane


@pytest.fixture(scope="module")
def tenants(plane):
    """Two tenants besides the admin, each with its own client."""
    admin = plane.client()
    out = {}
    for name in ("vision", "speech"):
        made = admin.store.CreateTenant(store_pb2.CreateTenantRequest(name=name))
        out[name] = plane.client(made.token)
    return out


def set_policy(plane, **kw) -> fleet_pb2.FleetPolicy:
    policy = default_policy()
    for key, value in kw.items():
        if key == "tenants":
            policy.tenants.extend(value)
        else:
            setattr(policy, key, value)
    return plane.client().fleet.SetPolicy(store_pb2.SetFleetPolicyRequest(policy=policy))


def get(client, job_id: str) -> job_pb2.Job:
    return client.jobs.Get(store_pb2.GetRequest(id=job_id))


def events(client, job_id: str) -> list[job_pb2.JobEvent]:
    return list(client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events)


def overlaps(plane) -> int:
    return int(plane.client().store.Query(store_pb2.QueryRequest(sql=OVERLAPS)).rows[0][0])


def wait_ended(plane, client, job_ids: list[str], timeout: float = 400) -> dict[str, job_pb2.Job]:
    def story() -> str:
        return "\n".join(job_story(plane.client(), j, plane.settings.data_dir) for j in job_ids)

    wait_for(lambda: all(get(client, j).state in ENDED for j in job_ids), timeout=timeout,
             what="every job to end", story=story)
    return {j: get(client, j) for j in job_ids}


def unleased_iterations(plane, job_ids: list[str]) -> int:
    """Iterations a job recorded outside every lease it held (a job runs only on devices it leases)."""
    quoted = ", ".join(f"'{j}'" for j in job_ids)
    sql = f"""
SELECT count(*) FROM iteration_metrics m WHERE m.job_id IN ({quoted}) AND NOT EXISTS (
  SELECT 1 FROM device_leases l WHERE l.job_id = m.job_id AND l.started_at <= m.recorded_at
    AND (l.ended_at IS NULL OR m.recorded_at <= l.ended_at))"""
    return int(plane.client().store.Query(store_pb2.QueryRequest(sql=sql)).rows[0][0])


def test_jobs_submitted_at_once_never_share_a_device(plane, tenants):
    submitted = []
    for i in range(6):
        client = tenants["vision" if i % 2 else "speech"]
        job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec(f"at-once-{i}", iterations=8)))
        submitted.append((client, job.id))
    ended = {}
    for client, job_id in submitted:
        ended.update(wait_ended(plane, client, [job_id]))
    assert all(j.state == S.JOB_STATE_SUCCEEDED for j in ended.values()), {j: x.message for j, x in ended.items()}
    assert overlaps(plane) == 0
    admin = plane.client()
    queued = 0
    for client, job_id in submitted:
        types = [e.type for e in events(client, job_id)]
        assert "ADMITTED" in types and types.index("ADMITTED") < types.index("ASSIGNED")
        queued += "QUEUED" in types
        leases = admin.fleet.ListLeases(store_pb2.ListLeasesRequest(job_id=job_id)).leases
        assert leases and all(x.end_reason == fleet_pb2.LEASE_END_REASON_FINISHED for x in leases)
    # Every iteration ran while its job held its leases, and no lease overlapped another: each job trained
    # alone on its devices (the speed that buys, measured against the prediction: benchmarks/fleet_shared.py).
    assert unleased_iterations(plane, [j for _, j in submitted]) == 0
    assert queued >= 1  # six jobs on two devices: some waited their turn


def test_a_tenant_at_its_quota_waits_and_never_exceeds_it(plane, tenants):
    set_policy(plane, tenants=[fleet_pb2.TenantPolicy(tenant="vision", device_quota=1)])
    try:
        client = tenants["vision"]
        jobs = [client.jobs.Submit(services_pb2.SubmitJobRequest(
            spec=spec(f"quota-{i}", iterations=30, fleet=one_device()))).id for i in range(2)]
        waited = wait_for(lambda: next((e for j in jobs for e in events(client, j) if e.type == "QUEUED"
                                        and e.attributes.get("reason") == "quota"), None), timeout=120,
                          what="a job waiting for its tenant's quota")
        assert waited.attributes["reason"] == "quota"
        listing = client.fleet.ListQueue(services_pb2.ListQueueRequest())
        mine = [e for e in listing.entries if e.job_id in jobs]
        assert mine and mine[0].reason == services_pb2.WAIT_REASON_QUOTA, listing
        ended = wait_ended(plane, client, jobs)
        assert all(j.state == S.JOB_STATE_SUCCEEDED for j in ended.values())
        # under the quota, never two of vision's leases live at the same time
        ids = ", ".join(f"'{j}'" for j in jobs)
        together = plane.client().store.Query(store_pb2.QueryRequest(sql=f"""
            SELECT count(*) FROM device_leases a JOIN device_leases b ON a.id < b.id
            WHERE a.job_id IN ({ids}) AND b.job_id IN ({ids})
              AND (b.ended_at IS NULL OR a.started_at < b.ended_at)
              AND (a.ended_at IS NULL OR b.started_at < a.ended_at)"""))
        assert int(together.rows[0][0]) == 0
    finally:
        set_policy(plane)


VICTIM_ITERATIONS = 1500  # long enough to be still running when the urgent job is planned


def test_a_high_priority_job_preempts_and_the_victim_resumes_to_the_same_losses(plane, tenants):
    set_policy(plane, tenants=[fleet_pb2.TenantPolicy(tenant="speech", max_priority_class="high")])
    try:
        low_client, high_client = tenants["vision"], tenants["speech"]
        # The urgent job's profile is measured once beforehand (a fleet's usual models are profiled already):
        # what is timed below is admission and preemption, not a first profile on a busy CPU.
        warm = high_client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("warm", iterations=1))).id
        assert wait_ended(plane, high_client, [warm])[warm].state == S.JOB_STATE_SUCCEEDED
        low = low_client.jobs.Submit(services_pb2.SubmitJobRequest(
            spec=spec("victim", iterations=VICTIM_ITERATIONS, priority_class="low",
                                raw_metrics=True))).id  # its losses step by step, and its progress at once
        wait_for(lambda: any(m.iteration >= 5 for m in low_client.iteration_metrics(low)), timeout=180,
                 what="the low-priority job to train a few iterations",
                 story=lambda: job_story(plane.client(), low, plane.settings.data_dir))
        t0 = time.monotonic()
        high = high_client.jobs.Submit(services_pb2.SubmitJobRequest(
            spec=spec("urgent", iterations=6, priority_class="high"))).id
        wait_for(lambda: get(high_client, high).state in (S.JOB_STATE_RUNNING, *ENDED), timeout=60,
                 what="the high-priority job to run", story=lambda: job_story(plane.client(), low,
                                                                               plane.settings.data_dir))
        started_s = time.monotonic() - t0
        print(f"high-priority job running {started_s:.2f} s after submit")
        ended = wait_ended(plane, low_client, [low]) | wait_ended(plane, high_client, [high])
        assert all(j.state == S.JOB_STATE_SUCCEEDED for j in ended.values()), {j: x.message for j, x in ended.items()}
        assert started_s <= 10.0, f"high-priority job running {started_s:.1f} s after submit"

        types = [e.type for e in events(low_client, low)]
        assert types.count("ADMITTED") == 1 and "PREEMPTING" in types and "PREEMPTED" in types and "RESUMED" in types
        preempted = next(e for e in events(low_client, low) if e.type == "PREEMPTED")
        resumed_at = int(preempted.attributes["checkpoint_iteration"])
        assert 0 < resumed_at < VICTIM_ITERATIONS
        reasons = [x.end_reason for x in plane.client().fleet.ListLeases(
            store_pb2.ListLeasesRequest(job_id=low)).leases]
        assert fleet_pb2.LEASE_END_REASON_PREEMPTED in reasons and fleet_pb2.LEASE_END_REASON_FINISHED in reasons
        assert overlaps(plane) == 0

        # After the resume: the same per-step losses as an uninterrupted run from that checkpoint.
        checkpoint = next(c for c in low_client.store.ListCheckpoints(
            store_pb2.ListCheckpointsRequest(job_id=low)).checkpoints if c.iteration == resumed_at)
        directory = checkpoint.layers[0].uri.removeprefix("file://").rsplit("/", 1)[0]
        job_spec = get(low_client, low).spec
        reference = train_single(job_spec.model, {}, job_spec.seed, job_spec.global_batch_size,
                                 job_spec.iterations, {"name": "adam", "learning_rate": 1e-3, "weight_decay": 0.0},
                                 resume_from=directory)
        measured = {}
        for m in low_client.iteration_metrics(low):
            if m.has_loss and m.iteration >= resumed_at:
                measured.setdefault(m.iteration, m.loss)
        assert sorted(measured) == list(range(resumed_at, VICTIM_ITERATIONS))
        assert [measured[i] for i in sorted(measured)] == pytest.approx(reference, rel=1e-5)
    finally:
        set_policy(plane)


def test_a_restarted_planner_loses_no_job_and_double_books_no_device(plane, tenants):
    client = tenants["vision"]
    jobs = [client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec(f"restart-{i}", iterations=40))).id
            for i in range(3)]
    wait_for(lambda: any(get(client, j).state == S.JOB_STATE_RUNNING for j in jobs)
             and any(get(client, j).state == S.JOB_STATE_QUEUED for j in jobs), timeout=180,
             what="one job running and another queued")
    old = plane.servers["planner"]
    old.stop(0.5)
    time.sleep(1.0)
    plane.servers["planner"] = planner_server(plane.settings).server.start()
    ended = wait_ended(plane, client, jobs)
    assert all(j.state == S.JOB_STATE_SUCCEEDED for j in ended.values()), {j: x.message for j, x in ended.items()}
    assert overlaps(plane) == 0
    live = plane.client().fleet.ListLeases(store_pb2.ListLeasesRequest(live_only=True)).leases
    assert not live


def test_a_job_with_a_device_range_is_replanned_for_the_devices_free(plane, tenants):
    client = tenants["vision"]
    holder = client.jobs.Submit(services_pb2.SubmitJobRequest(
        spec=spec("holder", iterations=5000, fleet=one_device()))).id
    wait_for(lambda: get(client, holder).state == S.JOB_STATE_RUNNING, timeout=120, what="one device held")
    flexible = client.jobs.Submit(services_pb2.SubmitJobRequest(
        spec=spec("flexible", iterations=6, min_devices=1, max_devices=2, pipeline_stages=2))).id
    done = wait_ended(plane, client, [flexible])[flexible]
    assert done.state == S.JOB_STATE_SUCCEEDED, done.message
    types = [e.type for e in events(client, flexible)]
    story = [(e.type, e.message) for e in events(client, flexible) + events(client, holder)]
    assert "REPLANNING" in types and types.count("PLAN_CHOSEN") == 2, story
    plans = client.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
    assert plans.version == 2 and sum(s.devices for s in plans.stages) == 1  # the plan it ran, beside version 1
    assert get(client, holder).state == S.JOB_STATE_RUNNING  # it did not wait for the holder
    client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=holder))
    wait_ended(plane, client, [holder])
    assert overlaps(plane) == 0
