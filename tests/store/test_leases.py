"""Device leases and the fleet policy: the database itself refuses to double-book a device."""

from __future__ import annotations

import threading
from datetime import UTC

import pytest
import sqlalchemy as sa
from google.protobuf.timestamp_pb2 import Timestamp

from ballast.v1 import fleet_pb2, store_pb2
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from tests.store_builders import host
from tests.store_fixtures import JS, OVERLAPS, Store, move, new_job

R = fleet_pb2.LeaseEndReason


def overlaps(store: Store) -> int:
    with store.engine.connect() as conn:
        return conn.execute(sa.text(OVERLAPS)).scalar_one()


def devices(host_id: str, *indexes: int) -> list[fleet_pb2.DeviceRef]:
    return [fleet_pb2.DeviceRef(host_id=host_id, device_index=i) for i in indexes]


def acquire(store: Store, job_id: str, refs: list[fleet_pb2.DeviceRef]) -> store_pb2.AcquireLeasesResponse:
    return store.as_(store.admin).acquire_leases(store_pb2.AcquireLeasesRequest(job_id=job_id, devices=refs))


@pytest.fixture
def h1(store: Store) -> fleet_pb2.Host:
    return store.as_(store.admin).register_host(store_pb2.RegisterHostRequest(host=host("h1", ["cpu"] * 4)))


def set_policy(store: Store, **kw) -> fleet_pb2.FleetPolicy:
    from services.specs.policy import default_policy

    policy = default_policy()
    for key, value in kw.items():
        if key == "tenants":
            policy.tenants.extend(value)
        else:
            setattr(policy, key, value)
    return store.as_(store.admin).set_fleet_policy(store_pb2.SetFleetPolicyRequest(policy=policy))


def test_a_lease_is_all_or_nothing_and_a_busy_device_is_refused(store: Store, h1):
    first, second = new_job(store, name="one"), new_job(store, store.b, name="two")
    made = acquire(store, first.id, devices(h1.id, 0, 1))
    assert [lease.device.device_index for lease in made.leases] == [0, 1]
    assert all(lease.job_id == first.id and lease.device_kind == "cpu" and not lease.HasField("ended_at")
               for lease in made.leases)
    with pytest.raises(FailedPrecondition) as err:
        acquire(store, second.id, devices(h1.id, 2, 1))  # device 2 is free, device 1 is not: neither is leased
    assert err.value.field == "devices" and first.id in str(err.value)
    assert store.count("device_leases") == 2
    assert len(acquire(store, second.id, devices(h1.id, 2, 3)).leases) == 2
    assert overlaps(store) == 0


def test_bad_lease_requests_name_the_field(store: Store, h1):
    job = new_job(store)
    with pytest.raises(PermissionDenied):
        store.as_(store.a).acquire_leases(store_pb2.AcquireLeasesRequest(job_id=job.id, devices=devices(h1.id, 0)))
    with pytest.raises(InvalidArgument) as err:
        acquire(store, job.id, [])
    assert err.value.field == "devices"
    with pytest.raises(InvalidArgument):
        acquire(store, job.id, devices(h1.id, 0, 0))
    with pytest.raises(NotFound) as err:
        acquire(store, job.id, devices(h1.id, 0, 9))
    assert err.value.field == "devices[1]"
    with pytest.raises(NotFound):
        acquire(store, "job-nope", devices(h1.id, 0))
    move(store, job.id, JS.JOB_STATE_FAILED)
    with pytest.raises(FailedPrecondition) as err:
        acquire(store, job.id, devices(h1.id, 0))
    assert err.value.field == "job_id" and store.count("device_leases") == 0


def two_stage_placement(job_id: str, host_id: str, indexes: tuple[int, int]) -> fleet_pb2.JobPlacement:
    out = fleet_pb2.JobPlacement(job_id=job_id, plan_id="pln-1", plan_version=2, stages=2, replicas=1, world_size=2,
                                 rendezvous="10.0.0.1:29500", backend="gloo", micro_batch_size=4,
                                 num_micro_batches=2, global_batch_size=8)
    for rank, index in enumerate(indexes):
        out.ranks.add(rank=rank, stage_index=rank, replica_index=0, host_id=host_id, device_index=index)
    return out


def test_a_placement_is_stored_with_its_leases_and_read_back_whole(store: Store, h1):
    job = new_job(store)
    with pytest.raises(NotFound) as err:
        store.as_(store.admin).get_placement(store_pb2.GetPlacementRequest(job_id=job.id))
    assert err.value.field == "job_id"
    first = two_stage_placement(job.id, h1.id, (1, 0))
    made = store.as_(store.admin).acquire_leases(store_pb2.AcquireLeasesRequest(
        job_id=job.id, devices=devices(h1.id, 0, 1), placement=first))
    assert [(x.device.device_index, x.rank) for x in made.leases] == [(0, 1), (1, 0)]
    placement_id = made.placement.id
    assert placement_id.startswith("plc-") and {x.placement_id for x in made.leases} == {placement_id}
    got = store.as_(store.a).get_placement(store_pb2.GetPlacementRequest(job_id=job.id))  # its tenant reads it
    assert got == made.placement and got.HasField("created_at")
    got.ClearField("id")
    got.ClearField("created_at")
    assert got == first
    with pytest.raises(NotFound):  # another tenant's job is not there for it
        store.as_(store.b).get_placement(store_pb2.GetPlacementRequest(job_id=job.id))
    # started again elsewhere (a morph): the newest placement is the job's
    store.as_(store.admin).end_leases(store_pb2.EndLeasesRequest(job_id=job.id, reason=R.LEASE_END_REASON_MORPHED))
    second = two_stage_placement(job.id, h1.id, (2, 3))
    store.as_(store.admin).acquire_leases(store_pb2.AcquireLeasesRequest(
        job_id=job.id, devices=devices(h1.id, 2, 3), placement=second))
    assert store.as_(store.admin).get_placement(store_pb2.GetPlacementRequest(job_id=job.id)).ranks == second.ranks
    with store.engine.connect() as conn:  # which rank ran where is a join for SQL users
        rows = conn.execute(sa.text(
            "SELECT l.device_index, l.rank, p.world_size, p.global_batch_size FROM device_leases l "
            "JOIN job_placements p ON p.id = l.placement_id WHERE l.job_id = :job ORDER BY l.device_index"),
            {"job": job.id}).all()
    assert [tuple(r) for r in rows] == [(0, 1, 2, 8), (1, 0, 2, 8), (2, 0, 2, 8), (3, 1, 2, 8)]


def test_a_placement_that_does_not_match_its_devices_is_refused_and_nothing_is_leased(store: Store, h1):
    job = new_job(store)
    wrong = two_stage_placement(job.id, h1.id, (0, 2))
    with pytest.raises(InvalidArgument) as err:
        store.as_(store.admin).acquire_leases(store_pb2.AcquireLeasesRequest(
            job_id=job.id, devices=devices(h1.id, 0, 1), placement=wrong))
    assert err.value.field == "placement.ranks"
    assert store.count("device_leases") == 0 and store.count("job_placements") == 0


def test_a_jobs_end_ends_its_leases_in_the_same_transaction(store: Store, h1):
    done, preempted, cancelled = (new_job(store, name=n) for n in ("done", "preempted", "cancelled"))
    for job, index in ((done, 0), (preempted, 1), (cancelled, 2)):
        acquire(store, job.id, devices(h1.id, index))
        for state in (JS.JOB_STATE_PROFILING, JS.JOB_STATE_PLANNING, JS.JOB_STATE_SCHEDULED, JS.JOB_STATE_RUNNING):
            move(store, job.id, state)
    store.clock.advance(5)
    move(store, done.id, JS.JOB_STATE_SUCCEEDED)
    move(store, preempted.id, JS.JOB_STATE_QUEUED)
    move(store, cancelled.id, JS.JOB_STATE_CANCELLING)
    move(store, cancelled.id, JS.JOB_STATE_CANCELLED)
    leases = store.as_(store.admin).list_leases(store_pb2.ListLeasesRequest()).leases
    ends = {lease.job_id: lease.end_reason for lease in leases}
    assert ends == {done.id: R.LEASE_END_REASON_FINISHED, preempted.id: R.LEASE_END_REASON_PREEMPTED,
                    cancelled.id: R.LEASE_END_REASON_CANCELLED}
    assert all((lease.ended_at.ToDatetime() - lease.started_at.ToDatetime()).total_seconds() >= 5 for lease in leases)
    assert not store.as_(store.admin).list_leases(store_pb2.ListLeasesRequest(live_only=True)).leases
    # the device is free again: a new lease starts where the old one ended, never before
    again = acquire(store, new_job(store, name="next").id, devices(h1.id, 0)).leases[0]
    assert again.started_at.ToDatetime() >= leases[0].ended_at.ToDatetime() and overlaps(store) == 0


def test_end_leases_by_job_and_host(store: Store, h1):
    job = new_job(store)
    acquire(store, job.id, devices(h1.id, 0, 1))
    admin = store.as_(store.admin)
    with pytest.raises(InvalidArgument):
        admin.end_leases(store_pb2.EndLeasesRequest(job_id=job.id))
    ended = admin.end_leases(store_pb2.EndLeasesRequest(job_id=job.id, reason=R.LEASE_END_REASON_HOST_LOST,
                                                        host_id=h1.id))
    assert ended.ended == 2
    assert admin.end_leases(store_pb2.EndLeasesRequest(job_id=job.id, reason=R.LEASE_END_REASON_RELEASED)).ended == 0


def test_tenants_see_only_their_own_leases(store: Store, h1):
    mine, theirs = new_job(store, name="mine"), new_job(store, store.b, name="theirs")
    acquire(store, mine.id, devices(h1.id, 0))
    acquire(store, theirs.id, devices(h1.id, 1))
    seen = store.as_(store.a).list_leases(store_pb2.ListLeasesRequest()).leases
    assert [lease.job_id for lease in seen] == [mine.id]
    assert len(store.as_(store.admin).list_leases(store_pb2.ListLeasesRequest()).leases) == 2


def test_the_quota_is_checked_where_the_lease_is_made(store: Store, h1):
    set_policy(store, tenants=[fleet_pb2.TenantPolicy(tenant="team-a", device_quota=2)])
    big, small = new_job(store, name="big"), new_job(store, name="small")
    with pytest.raises(FailedPrecondition) as err:
        acquire(store, big.id, devices(h1.id, 0, 1, 2))
    assert err.value.field == "devices" and "quota 2" in str(err.value)
    acquire(store, small.id, devices(h1.id, 0, 1))
    with pytest.raises(FailedPrecondition):
        acquire(store, big.id, devices(h1.id, 2))
    acquire(store, new_job(store, store.b, name="other").id, devices(h1.id, 2, 3))  # team-b has no cap


@pytest.mark.parametrize("store_backend", ["sqlite", "postgresql"], indirect=True)
def test_racing_schedulers_cannot_double_book_a_device(store: Store, h1):
    """Two schedulers lease the same devices to different jobs at the same moment, many times over: the
    database lets exactly one through each round, and no two leases of a device ever overlap."""
    rounds, wins = 12, []
    for r in range(rounds):
        jobs = [new_job(store, name=f"r{r}-a"), new_job(store, store.b, name=f"r{r}-b")]
        barrier, outcome = threading.Barrier(2), {}

        def race(job_id: str, barrier: threading.Barrier = barrier, outcome: dict = outcome) -> None:
            barrier.wait()
            try:
                acquire(store, job_id, devices(h1.id, 0, 1))
                outcome[job_id] = True
            except FailedPrecondition:
                outcome[job_id] = False

        threads = [threading.Thread(target=race, args=(j.id,)) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcome.values()) == [False, True], outcome
        winner = next(j for j in jobs if outcome[j.id])
        wins.append(winner.id)
        store.clock.advance(1)
        store.as_(store.admin).end_leases(store_pb2.EndLeasesRequest(job_id=winner.id,
                                                                     reason=R.LEASE_END_REASON_FINISHED))
    assert store.count("device_leases") == 2 * rounds and overlaps(store) == 0


@pytest.mark.parametrize("store_backend", ["sqlite", "postgresql"], indirect=True)
def test_the_database_itself_refuses_a_second_live_lease(store: Store, h1):
    """Not the repository's check: a raw INSERT of a second live lease on a device fails in the database."""
    job = new_job(store)
    acquire(store, job.id, devices(h1.id, 0))
    row = ("INSERT INTO device_leases (id, job_id, tenant_id, host_id, device_index, device_kind, started_at) "
           "VALUES ('lse-raw', :job, :tenant, :host, 0, 'cpu', CURRENT_TIMESTAMP)")
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        conn.execute(sa.text(row), {"job": job.id, "tenant": store.a.tenant_id, "host": h1.id})
    assert store.count("device_leases") == 1


def test_the_policy_is_versioned_and_only_the_admin_changes_it(store: Store):
    admin = store.as_(store.admin)
    default = admin.get_fleet_policy(store_pb2.GetFleetPolicyRequest())
    assert default.version == 0 and default.default_priority_class == "normal"
    with pytest.raises(PermissionDenied):
        store.as_(store.a).set_fleet_policy(store_pb2.SetFleetPolicyRequest(policy=default))
    with pytest.raises(InvalidArgument) as err:
        set_policy(store, tenants=[fleet_pb2.TenantPolicy(tenant="no-such-team")])
    assert err.value.field == "policy.tenants[0].tenant"
    with pytest.raises(InvalidArgument) as err:
        set_policy(store, default_priority_class="urgent")
    assert err.value.field == "policy.default_priority_class"
    first = set_policy(store, tenants=[fleet_pb2.TenantPolicy(tenant="team-a", device_quota=2)])
    second = set_policy(store, fair_share_half_life_s=60)
    assert (first.version, second.version) == (1, 2) and second.created_by == "admin"
    assert admin.get_fleet_policy(store_pb2.GetFleetPolicyRequest(version=1)).tenants[0].device_quota == 2
    assert store.as_(store.a).get_fleet_policy(store_pb2.GetFleetPolicyRequest()).version == 2
    with pytest.raises(FailedPrecondition) as err:
        admin.set_fleet_policy(store_pb2.SetFleetPolicyRequest(policy=second, expected_version=1))
    assert err.value.field == "expected_version"
    with pytest.raises(NotFound):
        admin.get_fleet_policy(store_pb2.GetFleetPolicyRequest(version=9))
    assert store.count("fleet_policies") == 2


def test_submit_checks_the_priority_class_and_the_device_range(store: Store):
    set_policy(store, tenants=[fleet_pb2.TenantPolicy(tenant="team-a", max_priority_class="normal")])
    with pytest.raises(InvalidArgument) as err:
        new_job(store, name="x", priority_class="urgent")
    assert err.value.field == "spec.priority_class" and "low, normal, high" in err.value.fix
    with pytest.raises(FailedPrecondition) as err:
        new_job(store, name="x", priority_class="high")
    assert err.value.field == "spec.priority_class" and "--priority normal" in err.value.fix
    assert new_job(store, store.b, name="x", priority_class="normal").id  # team-b: the default ceiling
    with pytest.raises(InvalidArgument) as err:
        new_job(store, name="x", min_devices=4, max_devices=2)
    assert err.value.field == "spec.min_devices"
    with pytest.raises(InvalidArgument) as err:
        new_job(store, name="x", max_devices=2)
    assert err.value.field == "spec.min_devices"
    with pytest.raises(InvalidArgument) as err:  # elastic: resized within a range it must give
        new_job(store, name="x", elastic=True)
    assert err.value.field == "spec.min_devices" and "--elastic" in err.value.fix
    assert store.count("jobs") == 1
    job = new_job(store, name="ok", priority_class="low", min_devices=1, max_devices=2)
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT priority_class FROM jobs WHERE id = :id"), {"id": job.id}).scalar() == "low"


def test_leases_changed_since_a_time_are_those_that_started_or_ended_since(store: Store, h1):
    """What the admission pass's lease reader asks each half second (ListLeases changed_since)."""
    admin = store.as_(store.admin)
    first, second = new_job(store), new_job(store)
    acquire(store, first.id, devices(h1.id, 0, 1))
    store.clock.advance(10)
    since = Timestamp()
    since.FromDatetime(store.clock())

    def changed() -> list[tuple[str, int, bool]]:
        reply = admin.list_leases(store_pb2.ListLeasesRequest(changed_since=since))
        assert reply.read_at.ToDatetime(UTC) <= store.clock()
        return sorted((x.job_id, x.device.device_index, x.HasField("ended_at")) for x in reply.leases)

    assert changed() == []
    acquire(store, second.id, devices(h1.id, 2))
    assert changed() == [(second.id, 2, False)]
    store.clock.advance(1)
    admin.end_leases(store_pb2.EndLeasesRequest(job_id=first.id, reason=R.LEASE_END_REASON_FINISHED))
    assert changed() == sorted([(first.id, 0, True), (first.id, 1, True), (second.id, 2, False)])
    since.FromDatetime(store.clock())
    assert changed() == []
