"""A job's placement is computed once when the scheduler starts it, stored with its leases, sent whole to every
agent, and read back by a restarted planner (issue 42, item 1). The store is real (SQLite, PostgreSQL, remote);
the agents are a list of the messages they were sent."""

from __future__ import annotations

from ballast.v1 import executor_pb2, fleet_pb2, job_pb2, store_pb2
from services.planner.jobs.scheduler import Scheduler
from services.specs import placement as placement_spec
from tests.store_builders import host, plan_msg, profile_msg
from tests.store_fixtures import Store, move, new_job

S = job_pb2.JobState


def local_host(store: Store) -> fleet_pb2.Host:
    registered = host("h1", ["cpu"] * 2)
    registered.address = "127.0.0.1"  # as an agent on this machine advertises itself
    return store.as_(store.admin).register_host(store_pb2.RegisterHostRequest(host=registered))


def scheduled_job(store: Store) -> job_pb2.Job:
    """A job planned for two stages of one device each (plan_msg), waiting for its devices."""
    a = store.as_(store.a)
    job = new_job(store)
    profile = a.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(job.model_id)))
    plan = a.create_plan(store_pb2.CreatePlanRequest(plan=plan_msg(job.model_id, job_id=job.id,
                                                                   profile_id=profile.id)))
    move(store, job.id, S.JOB_STATE_PROFILING)
    move(store, job.id, S.JOB_STATE_PLANNING)
    return move(store, job.id, S.JOB_STATE_SCHEDULED, plan_id=plan.id)


def test_a_started_job_is_placed_once_stored_with_its_leases_and_taken_back_from_it(store: Store, tmp_path):
    admin = store.as_(store.admin)
    h1 = local_host(store)
    job = scheduled_job(store)
    sent: list[tuple[str, executor_pb2.PlannerMessage]] = []
    scheduler = Scheduler(admin, lambda host_id, message: sent.append((host_id, message)), lambda: [h1.id], tmp_path)
    scheduler.tick()

    assigns = [(h, m.assign) for h, m in sent if m.HasField("assign")]
    assert [h for h, _ in assigns] == [h1.id]
    placed = admin.get_placement(store_pb2.GetPlacementRequest(job_id=job.id))
    sent_placement = assigns[0][1].placement
    assert sent_placement == placed  # the stored one, id and all: nothing derived on the way
    assert (placed.stages, placed.replicas, placed.world_size, placed.backend) == (2, 1, 2, "gloo")
    assert placed.rendezvous.startswith("127.0.0.1:")  # rank 0's host
    assert (placed.micro_batch_size, placed.num_micro_batches, placed.global_batch_size) == (2, 4, 8)
    assert list(assigns[0][1].workers) == placement_spec.workers_on(placed, h1.id)
    leases = admin.list_leases(store_pb2.ListLeasesRequest(job_id=job.id, live_only=True)).leases
    assert sorted((x.device.device_index, x.rank, x.placement_id) for x in leases) == sorted(
        (r.device_index, r.rank, placed.id) for r in placed.ranks)
    assigned = [e for e in admin.list_job_events(store_pb2.ListJobEventsRequest(job_id=job.id)).events
                if e.type == "ASSIGNED"]
    assert assigned[0].attributes["placement_id"] == placed.id
    assert assigned[0].attributes["rendezvous"] == placed.rendezvous

    # A planner that starts afresh follows the job from the stored placement.
    again = Scheduler(admin, lambda host_id, message: None, lambda: [h1.id], tmp_path)
    running = again._tracked(job.id)
    assert running is not None and running.placement == placed
    assert (running.hosts, running.world, running.ranks) == ([h1.id], 2, {h1.id: [0, 1]})


def test_a_job_started_before_placements_were_stored_is_taken_back_from_its_assigned_event(store: Store,
                                                                                          tmp_path):
    admin = store.as_(store.admin)
    h1 = local_host(store)
    job = scheduled_job(store)
    admin.acquire_leases(store_pb2.AcquireLeasesRequest(job_id=job.id, devices=[
        fleet_pb2.DeviceRef(host_id=h1.id, device_index=i) for i in (0, 1)]))
    move(store, job.id, S.JOB_STATE_RUNNING, who=store.admin, event_type="ASSIGNED",
         attributes={"hosts": h1.id, "world_size": "2", "rendezvous": "127.0.0.1:29500", "ranks": f"{h1.id}:0,1"})
    running = Scheduler(admin, lambda host_id, message: None, lambda: [h1.id], tmp_path)._tracked(job.id)
    assert running is not None and (running.hosts, running.world, running.ranks) == ([h1.id], 2, {h1.id: [0, 1]})
    assert [(r.rank, r.stage_index) for r in running.placement.ranks] == [(0, 0), (1, 1)]
