"""The admission pass's kept queue and leases (jobs/active.py, admit.Reader) against a real store: after any run
of submits, queueing, starts, ends and cancellations, the snapshot a long-lived reader builds from the changes
it read is the one a new reader builds from whole reads."""

from __future__ import annotations

import random

import pytest

from ballast.v1 import fleet_pb2, job_pb2, store_pb2
from services.planner.jobs.admit import Reader, Snapshot
from services.runtime.errors import Unavailable
from tests.store_builders import host, plan_msg, profile_msg
from tests.store_fixtures import Store, move, new_job

S = job_pb2.JobState


class World:
    """Jobs moved through the states the scheduler moves them, on 3 hosts of 2 cpu devices."""

    def __init__(self, store: Store, rng: random.Random):
        self.store, self.rng = store, rng
        self.admin, self.a = store.as_(store.admin), store.as_(store.a)
        self.hosts = [self.admin.register_host(store_pb2.RegisterHostRequest(host=host(f"h{i}", ["cpu"] * 2)))
                      for i in range(3)]
        self.waiting: list[str] = []
        self.running: list[str] = []

    def submit(self) -> None:
        job = new_job(self.store, name=f"j{self.rng.randrange(1000)}")
        profile = self.a.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(job.model_id)))
        plan = self.a.create_plan(store_pb2.CreatePlanRequest(plan=plan_msg(job.model_id, job_id=job.id,
                                                                           profile_id=profile.id)))
        move(self.store, job.id, S.JOB_STATE_PROFILING)
        move(self.store, job.id, S.JOB_STATE_PLANNING)
        move(self.store, job.id, S.JOB_STATE_SCHEDULED, plan_id=plan.id)
        self.waiting.append(job.id)

    def queue(self) -> None:
        job_id = self.rng.choice(self.waiting)
        if self.a.get_job(store_pb2.GetRequest(id=job_id)).state == S.JOB_STATE_SCHEDULED:
            move(self.store, job_id, S.JOB_STATE_QUEUED)

    def start(self) -> None:
        leased = {(x.device.host_id, x.device.device_index) for x in self.admin.list_leases(
            store_pb2.ListLeasesRequest(live_only=True)).leases}
        free = [(h.id, d) for h in self.hosts for d in range(2) if (h.id, d) not in leased]
        if len(free) < 2:
            return
        job_id = self.waiting.pop(self.rng.randrange(len(self.waiting)))
        refs = [fleet_pb2.DeviceRef(host_id=h, device_index=d) for h, d in self.rng.sample(free, 2)]
        self.admin.acquire_leases(store_pb2.AcquireLeasesRequest(job_id=job_id, devices=refs))
        move(self.store, job_id, S.JOB_STATE_RUNNING)
        self.running.append(job_id)

    def end(self) -> None:
        job_id = self.running.pop(self.rng.randrange(len(self.running)))
        move(self.store, job_id, self.rng.choice((S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED)))

    def cancel(self) -> None:
        job_id = self.waiting.pop(self.rng.randrange(len(self.waiting)))
        if self.a.get_job(store_pb2.GetRequest(id=job_id)).state == S.JOB_STATE_SCHEDULED:
            move(self.store, job_id, S.JOB_STATE_CANCELLING)  # held a moment: the scheduler ends it
        move(self.store, job_id, S.JOB_STATE_CANCELLED)

    def step(self) -> None:
        moves = [self.submit] + [m for m, ok in ((self.queue, self.waiting), (self.start, self.waiting),
                                                 (self.cancel, self.waiting), (self.end, self.running)) if ok]
        self.rng.choice(moves)()


def seen(snap: Snapshot) -> dict:
    """What a pass decides on, comparable across readers."""
    return {
        "queue": sorted(snap.queue, key=lambda d: d.job_id),
        "running": sorted(snap.running, key=lambda h: h.job_id),
        "free": sorted(snap.free, key=lambda s: s.sort_key),
        "live": sorted(x.id for x in snap.live),
        "usage": {t: round(u, 6) for t, u in snap.usage.items()},
        "jobs": {job_id: (job.state, job.updated_at.ToNanoseconds()) for job_id, job in snap.jobs.items()},
        "plans": sorted(snap.plans), "classes": snap.classes, "unrunnable": snap.unrunnable,
    }


@pytest.mark.parametrize("resync", [False, True])
def test_a_kept_reader_sees_what_a_new_reader_reads_whole(store: Store, resync: bool) -> None:
    """Without a resync only what changed is read; with one every ~10 s of the store's clock, a whole re-read
    now and then is installed over what the reader kept (jobs started meanwhile leave the queue)."""
    world = World(store, random.Random(1))
    timing = dict(clock=lambda: store.clock().timestamp(), resync_s=10.0, background=False) if resync else \
        dict(clock=lambda: 0.0)
    kept = Reader(store.as_(store.admin), **timing)
    connected = {h.id for h in world.hosts}
    for _ in range(40):
        world.step()
        store.clock.advance(world.rng.choice((0.1, 0.5, 2.0, 7.0)))  # some steps beyond the re-read overlap
        now = store.clock().timestamp()
        mine = kept.snapshot(connected, set(), now=now)
        fresh = Reader(store.as_(store.admin)).snapshot(connected, set(), now=now)
        assert seen(mine) == seen(fresh)
    if resync:
        assert kept.jobs.reads["whole"] > 3 and kept.jobs.reads["changed"] > 10
    else:
        assert kept.jobs.reads["whole"] == 1 and kept.leases.reads["whole"] == 1  # it kept them: no re-read
        assert kept.jobs.reads["changed"] == 39


def test_plans_of_ended_jobs_leave_the_readers_cache(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PLANS_KEPT plans of jobs no longer waiting or running, the kept reader drops them (a long-lived
    planner reads every job's plan once); its snapshots still equal a fresh reader's."""
    from services.planner.jobs import admit

    monkeypatch.setattr(admit, "PLANS_KEPT", 0)
    world = World(store, random.Random(2))
    kept = Reader(store.as_(store.admin), clock=lambda: 0.0)
    connected = {h.id for h in world.hosts}
    for _ in range(40):
        world.step()
        now = store.clock().timestamp()
        mine = kept.snapshot(connected, set(), now=now)
        assert seen(mine) == seen(Reader(store.as_(store.admin)).snapshot(connected, set(), now=now))
        in_use = {job.plan_id for job in kept.jobs.rows.values()}
        assert set(kept._plans) <= in_use and set(kept._shapes) <= in_use
    ended = [job for state in (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
             for job in world.admin.list_jobs(store_pb2.ListJobsRequest(state=state)).jobs]
    assert ended and not {job.plan_id for job in ended} & set(kept._plans)  # their plans were dropped


def test_the_lease_book_counts_what_a_whole_read_counts_and_ages_out_what_fair_share_forgets(store: Store) -> None:
    """With a 1 s half-life fair share looks back 4 s: leases ended before that leave the book as they age."""
    world = World(store, random.Random(3))
    world.admin.set_fleet_policy(store_pb2.SetFleetPolicyRequest(policy=fleet_pb2.FleetPolicy(
        priority_classes=[fleet_pb2.PriorityClass(name="normal", priority=10)], default_priority_class="normal",
        fair_share_half_life_s=1.0)))
    kept = Reader(store.as_(store.admin), clock=lambda: 0.0)
    connected = {h.id for h in world.hosts}
    aged = 0
    for step in range(30):
        if step == 25:  # fair share looks back further: what aged out counts again
            world.admin.set_fleet_policy(store_pb2.SetFleetPolicyRequest(policy=fleet_pb2.FleetPolicy(
                priority_classes=[fleet_pb2.PriorityClass(name="normal", priority=10)],
                default_priority_class="normal", fair_share_half_life_s=100.0)))
        world.step()
        store.clock.advance(0.7)
        now = store.clock().timestamp()
        kept.snapshot(connected, set(), now=now)
        fresh = Reader(store.as_(store.admin))
        fresh.snapshot(connected, set(), now=now)
        for part in ("intervals", "leased", "held_on", "live"):
            assert getattr(kept.book, part) == getattr(fresh.book, part), part
        assert set(kept.leases.rows) == set(fresh.leases.rows)
        aged = max(aged, len(world.admin.list_leases(store_pb2.ListLeasesRequest()).leases) - len(kept.leases.rows))
    assert aged > 0  # some leases did age out of the book
    assert kept.leases.reads["whole"] == 2  # and were read again when the horizon moved back


class FlakyPlans:
    """The admin's store, whose ListPlans fails while `failing` (the store going away mid-pass)."""

    def __init__(self, store):
        self.store, self.failing = store, False

    def list_plans(self, request):
        if self.failing:
            raise Unavailable("the store is away")
        return self.store.list_plans(request)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_jobs_a_failed_pass_did_not_build_are_built_by_the_next(store: Store) -> None:
    world = World(store, random.Random(4))
    flaky = FlakyPlans(store.as_(store.admin))
    kept = Reader(flaky, clock=lambda: 0.0)
    connected = {h.id for h in world.hosts}
    kept.snapshot(connected, set())
    world.submit()
    world.submit()
    store.clock.advance(1)
    flaky.failing = True
    with pytest.raises(Unavailable):
        kept.snapshot(connected, set())
    flaky.failing = False
    now = store.clock().timestamp()
    mine = kept.snapshot(connected, set(), now=now)
    assert {d.job_id for d in mine.queue} == set(world.waiting) and len(mine.queue) == 2
    assert seen(mine) == seen(Reader(store.as_(store.admin)).snapshot(connected, set(), now=now))
