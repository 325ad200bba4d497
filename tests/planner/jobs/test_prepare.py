"""prepare_job's own logic against a real store server: resuming after a transient failure, giving up
with the reason once attempts run out, a cancel that lands mid-step, and the fleet the online hosts form.
The profiler is a stand-in that serves analytical profiles (profiling itself is covered elsewhere)."""

from __future__ import annotations

import threading

import pytest

from ballast.v1 import fleet_pb2, job_pb2, model_pb2, queue_pb2, services_pb2, store_pb2
from services.planner.jobs import lifecycle as jobs
from services.planner.jobs.prepare import check_toggles, fleet_of_hosts, prepare_job, profile_request, shrink
from services.planner.queue import durable as queue
from services.profiler.projection import analytical_profile
from services.runtime.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.runtime.store_api import Store
from services.specs.fleet import load_fleet
from tests.harness import ROOT, make_settings, start_plane

S = job_pb2.JobState
FLEET = load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")


class Profiler:
    """Stores an analytical profile for the requested model and device; `before` runs first (faults, cancels)."""

    def __init__(self, store, before=None):
        self.store, self.before, self.calls = store, before, 0

    def Profile(self, request: services_pb2.ProfileRequest):  # noqa: N802 - the stub's method name
        self.calls += 1
        if self.before:
            self.before()
        model = self.store.GetModel(store_pb2.GetRequest(id=request.model_id))
        profile = analytical_profile(model.spec, request.device_kind, "fp32", model_id=model.id,
                                     model_signature=model.signature)
        return self.store.CreateProfile(store_pb2.CreateProfileRequest(profile=profile))


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = start_plane(make_settings(tmp_path_factory.mktemp("prepare")), services=("store",))
    yield plane
    plane.stop()


@pytest.fixture
def client(plane):
    return plane.client()


@pytest.fixture
def store(plane) -> Store:
    return plane.store()


def new_job(client, vocab: int, global_batch_size: int = 8, **spec_fields) -> job_pb2.Job:
    model = model_pb2.ModelSpec(
        name=f"gpt-{vocab}", family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=64, num_heads=2, vocab_size=vocab,
                                                seq_length=32))
    spec = job_pb2.JobSpec(name=f"job-{vocab}", global_batch_size=global_batch_size, iterations=3, fleet=FLEET,
                           model=model, **spec_fields)
    return client.store.CreateJob(store_pb2.CreateJobRequest(spec=spec))


def task(store: Store, job: job_pb2.Job, profiler, attempts: int = 1) -> queue.Task:
    request = queue_pb2.QueuedRequest(id=f"req-{job.id}", kind="jobs.prepare", tenant_id=job.tenant_id,
                                      attempts=attempts, max_attempts=3)
    return queue.Task(request, store, threading.Event(), profiler)


def states(client, job_id: str) -> list[tuple[str, int]]:
    events = client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events
    return [(e.type, e.state) for e in events]


def test_a_transient_failure_leaves_the_job_to_resume_where_it_stood(client, store):
    job = new_job(client, 320)

    def down():
        raise Unavailable("profiler restarting")

    with pytest.raises(Unavailable):
        prepare_job({"job_id": job.id}, task(store, job, Profiler(client.store, down), attempts=1))
    assert client.store.GetJob(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_PROFILING

    result = prepare_job({"job_id": job.id}, task(store, job, Profiler(client.store), attempts=2))
    done = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert done.state == S.JOB_STATE_SCHEDULED and result["plan_id"] == done.plan_id
    assert [t for t, _ in states(client, job.id)] == ["SUBMITTED", "STATE_CHANGED", "PROFILED", "PLAN_CHOSEN"]

    # A redelivery after success changes nothing and stores no second plan.
    again = prepare_job({"job_id": job.id}, task(store, job, Profiler(client.store), attempts=3))
    assert again["plan_id"] == done.plan_id
    assert len(client.store.ListPlans(store_pb2.ListPlansRequest(job_id=job.id)).plans) == 1


def test_the_first_plan_keeps_to_max_devices_and_a_pinned_micro_batch_count(client, store):
    """Eight devices in the fleet, at most two for the job, four micro-batches asked: that is what it gets."""
    job = new_job(client, 352, global_batch_size=16, min_devices=1, max_devices=2, pipeline_stages=1,
                  micro_batches=4)
    result = prepare_job({"job_id": job.id}, task(store, job, Profiler(client.store)))
    plan = client.store.GetPlan(store_pb2.GetRequest(id=result["plan_id"]))
    assert [s.devices for s in plan.stages] == [2] and plan.num_micro_batches == 4
    assert plan.micro_batch_size * plan.num_micro_batches == 16


def test_the_last_attempt_fails_the_job_with_the_reason(client, store):
    job = new_job(client, 384)

    def down():
        raise Unavailable("profiler unreachable")

    with pytest.raises(Unavailable):
        prepare_job({"job_id": job.id}, task(store, job, Profiler(client.store, down), attempts=3))
    failed = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert failed.state == S.JOB_STATE_FAILED
    assert failed.message.startswith("profiling failed:") and "profiler unreachable" in failed.message


def test_a_batch_no_configuration_divides_fails_with_the_nearest_sizes(client, store):
    """An analytical profile for a fleet not at hand (8 TITANs), a batch of 7 no layout divides."""
    job = new_job(client, 576, global_batch_size=7)
    with pytest.raises(InvalidArgument, match="use 6 or 8"):
        prepare_job({"job_id": job.id}, task(store, job, Profiler(client.store)))
    failed = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert failed.state == S.JOB_STATE_FAILED and failed.message.startswith("planning failed:"), failed.message
    assert "global_batch_size" in failed.message and "use 6 or 8" in failed.message, failed.message


def test_a_cancel_during_profiling_ends_cancelled_without_a_plan(client, store):
    job = new_job(client, 448)

    def cancel_now():
        jobs.cancel(store, services_pb2.CancelJobRequest(job_id=job.id, reason="not needed"))

    result = prepare_job({"job_id": job.id}, task(store, job, Profiler(client.store, cancel_now)))
    assert result["state"] == "JOB_STATE_CANCELLED"
    assert states(client, job.id)[-2:] == [("CANCEL_REQUESTED", S.JOB_STATE_CANCELLING),
                                           ("CANCELLED", S.JOB_STATE_CANCELLED)]
    assert not client.store.ListPlans(store_pb2.ListPlansRequest(job_id=job.id)).plans


class MovedUnderfoot:
    """The store, where a worker moves the job right after each of the first `times` reads of it: the race a
    cancel meets under load (the scheduler queueing the job, a worker starting to profile it)."""

    def __init__(self, store: Store, client, moves: list[int]):
        self._store, self._client, self._moves = store, client, list(moves)

    def get_job(self, request):
        job = self._store.get_job(request)
        if self._moves:
            self._client.store.TransitionJob(store_pb2.TransitionJobRequest(id=job.id, state=self._moves.pop(0)))
        return job

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_cancel_racing_a_worker_reads_the_job_again(client, store):
    job = new_job(client, 384)
    racing = MovedUnderfoot(store, client, [S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING])
    cancelled = jobs.cancel(racing, services_pb2.CancelJobRequest(job_id=job.id, reason="changed my mind"))
    assert cancelled.state == S.JOB_STATE_CANCELLING  # decided on PLANNING, the state it finally read
    assert [t for t, _ in states(client, job.id)].count("CANCEL_REQUESTED") == 1
    endless = new_job(client, 392)
    with pytest.raises(FailedPrecondition, match="re-read the job"):  # bounded: a job that never settles
        jobs.cancel(MovedUnderfoot(store, client, [S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING]),
                    services_pb2.CancelJobRequest(job_id=endless.id), attempts=2)


def test_another_tenants_request_cannot_prepare_the_job(client, store):
    job = new_job(client, 512)
    other = client.store.CreateTenant(store_pb2.CreateTenantRequest(name="someone-else")).tenant
    stranger = queue.Task(queue_pb2.QueuedRequest(id="req-x", tenant_id=other.id, attempts=1, max_attempts=3),
                          store, threading.Event(), Profiler(client.store))
    with pytest.raises(Exception, match="not found"):
        prepare_job({"job_id": job.id}, stranger)
    assert client.store.GetJob(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_SUBMITTED


def host(name: str, address: str, slots: int, kind: str = "cpu", memory: int = 8 << 30) -> fleet_pb2.Host:
    spec = fleet_pb2.DeviceSpec(kind=kind, memory_bytes=memory)
    return fleet_pb2.Host(name=name, address=address,
                          devices=[fleet_pb2.Device(index=i, spec=spec) for i in range(slots)])


def test_the_online_hosts_form_one_node_per_machine():
    fleet = fleet_of_hosts([host("a", "10.0.0.1", 2), host("b", "10.0.0.1", 1, memory=4 << 30)])
    assert (fleet.nodes, fleet.devices_per_node, fleet.device.kind) == (1, 3, "cpu")  # one machine standing in for two
    assert fleet.device.memory_bytes == 4 << 30
    assert fleet.intra_node.kind == fleet_pb2.LINK_KIND_SHARED_MEMORY
    apart = fleet_of_hosts([host("a", "10.0.0.1", 1), host("b", "10.0.0.2", 2), host("c", "10.0.0.2", 1)])
    assert (apart.nodes, apart.devices_per_node) == (2, 1)  # the smaller machine's count
    assert apart.inter_node.kind == fleet_pb2.LINK_KIND_ETHERNET
    assert fleet_of_hosts([host("a", "h", 2)]).nodes == 1


def test_a_cut_of_the_online_fleet_does_not_change_as_hosts_come_and_go():
    """The planner's memo keys on the whole fleet: a 16-device plan must look the same with 1,024 or 1,023 hosts."""
    kind = "nvidia-h100-sxm-80gb"

    def online(count: int) -> fleet_pb2.Fleet:
        return fleet_of_hosts([host(f"h{i}", f"10.0.{i // 250}.{i % 250}", 8, kind=kind, memory=80 << 30)
                               for i in range(count)])

    assert online(1024).name != online(1023).name
    cut = shrink(online(1024), 16, online=True)
    assert cut == shrink(online(1023), 16, online=True)
    assert (cut.nodes, cut.devices_per_node, cut.name) == (2, 8, f"online-2x8-{kind}")
    assert shrink(online(3), 4, online=True).name == f"online-1x4-{kind}"
    given = shrink(online(4), 16)  # a fleet the user named keeps its name, with the count it was cut to
    assert given.name == f"{online(4).name}-16"
    assert shrink(online(2), 16, online=True) == online(2)  # nothing to cut


def test_devices_sharing_a_node_get_a_calibrated_profile():
    job = job_pb2.Job(model_id="m", spec=job_pb2.JobSpec(global_batch_size=8))
    local = profile_request(job, fleet_of_hosts([host("a", "h", 1), host("b", "h", 1)]))
    assert not local.analytical and local.options.calibrate and list(local.options.calibrate_group_sizes) == [2]
    alone = profile_request(job, fleet_of_hosts([host("a", "h", 1)]))
    assert not alone.options.calibrate  # one device per node: no group on a node to calibrate
    gpus = fleet_of_hosts([host("a", "h", 2, kind="nvidia-titan-rtx-24gb")])
    assert profile_request(job, gpus).analytical and not profile_request(job, gpus).options.calibrate


@pytest.mark.parametrize("hosts, words", [
    ([], "no executor host"),
    ([host("a", "h", 1), host("b", "h", 1, kind="nvidia-titan-rtx-24gb")], "mix device kinds"),
    ([host("a", "h", 1, kind="nvidia-gpu")], "cannot plan for the online hosts"),
])
def test_hosts_that_cannot_form_a_fleet_say_why(hosts, words):
    with pytest.raises(FailedPrecondition) as err:
        fleet_of_hosts(hosts)
    assert words in str(err.value) and err.value.field == "spec.fleet"


def test_a_toggle_must_name_a_layer_of_the_profiled_model():
    spec = job_pb2.JobSpec(layer_toggles=[job_pb2.LayerToggle(layer_index=3), job_pb2.LayerToggle(layer_index=6)])
    check_toggles(job_pb2.JobSpec(layer_toggles=spec.layer_toggles[:1]), num_layers=6)
    with pytest.raises(InvalidArgument) as caught:
        check_toggles(spec, num_layers=6)
    assert caught.value.field == "spec.layer_toggles[1].layer_index" and "below 6" in caught.value.fix


@pytest.mark.parametrize("fleet,min_devices,hosts,refused", [
    ({"device": "cpu", "nodes": 1, "devices_per_node": 2}, 0, [("a", 1), ("b", 1)], None),
    ({"device": "cpu", "nodes": 1, "devices_per_node": 4}, 0, [("a", 1), ("b", 1)], "asks for 4 cpu"),
    ({"device": "cpu", "nodes": 1, "devices_per_node": 4}, 2, [("a", 1), ("b", 1)], None),  # may re-plan to 2
    ({"device": "titan rtx", "nodes": 1, "devices_per_node": 8}, 0, [("a", 1)], "8 nvidia-titan-rtx-24gb"),
    ({"device": "titan rtx", "nodes": 1, "devices_per_node": 8}, 0, [], None),  # no executor yet: it waits
])
def test_a_fleet_no_registered_executor_offers_is_refused_at_submit(fleet, min_devices, hosts, refused):
    from services.specs.fleet import fleet_from_dict

    spec = job_pb2.JobSpec(fleet=fleet_from_dict(fleet), min_devices=min_devices)
    registered = [host(name, "10.0.0.1", slots) for name, slots in hosts]
    if refused is None:
        jobs.check_offered(spec, registered)
        return
    with pytest.raises(FailedPrecondition, match=refused) as err:
        jobs.check_offered(spec, registered)
    assert err.value.field == "spec.fleet" and "the registered executors offer" in str(err.value)


def test_submit_reads_the_hosts_at_most_every_ttl_and_afresh_before_refusing(client, store):
    """HostsView: Submit's check of a job's fleet costs no store round trip within the TTL; a refusal is
    decided on a fresh read, so a host registered a moment ago is never refused for."""
    from services.specs.fleet import fleet_from_dict

    now = [0.0]
    view = jobs.HostsView(store, ttl_s=1.0, clock=lambda: now[0])
    client.store.RegisterHost(store_pb2.RegisterHostRequest(host=host("view-a", "10.9.9.9", 2)))
    assert "view-a" in [h.name for h in view.get()]
    client.store.RegisterHost(store_pb2.RegisterHostRequest(host=host("view-b", "10.9.9.8", 2)))
    assert "view-b" not in [h.name for h in view.get()]  # within the TTL: the view as it was
    sent = []
    model = model_pb2.ModelSpec(name="gpt-view", family=model_pb2.MODEL_FAMILY_GPT,
                                transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=64, num_heads=2,
                                                                        vocab_size=320, seq_length=32))
    four = job_pb2.JobSpec(name="four-cpus", model=model, global_batch_size=8, iterations=3,
                           fleet=fleet_from_dict({"device": "cpu", "nodes": 1, "devices_per_node": 4}))
    job = jobs.submit(store, services_pb2.SubmitJobRequest(spec=four), send=sent.append, hosts=view)
    assert job.state == S.JOB_STATE_SUBMITTED and len(sent) == 1  # 2 cpus in the view, 4 after a fresh read
    assert "view-b" in [h.name for h in view.get()]  # and the view kept the fresh read
    eight = job_pb2.JobSpec(name="eight-titans", model=model, global_batch_size=8, iterations=3, fleet=FLEET)
    with pytest.raises(FailedPrecondition, match="the registered executors offer"):
        jobs.submit(store, services_pb2.SubmitJobRequest(spec=eight), send=sent.append, hosts=view)
    assert len(sent) == 1
