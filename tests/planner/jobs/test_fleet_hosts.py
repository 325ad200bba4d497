"""The admission pass's view of the hosts, kept current by reading only what changed (ListHosts changed_since)
against a real store: a heartbeat changes nothing; a registration, a state or a degraded mark shows at the next
read; a change whose write landed behind the cursor is caught by the overlap, and the periodic whole read
reconciles the rest."""

from __future__ import annotations

from ballast.v1 import fleet_pb2, store_pb2
from services.planner.jobs.fleet_hosts import HostReader
from tests.store_builders import host
from tests.store_fixtures import Store


class Ticks:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_view_reads_whole_once_then_only_what_changed(store: Store) -> None:
    admin = store.as_(store.admin)
    a = admin.register_host(store_pb2.RegisterHostRequest(host=host("a", ["cpu", "cpu"])))
    b = admin.register_host(store_pb2.RegisterHostRequest(host=host("b", ["nvidia-h100"])))
    ticks = Ticks()
    reader = HostReader(admin, overlap_s=5.0, resync_s=60.0, clock=ticks, background=False)

    first = reader.read()
    assert [h.name for h in first.hosts] == ["a", "b"] and reader.reads == {"whole": 1}
    assert [(s.host_id, s.device_index, s.kind) for s in first.slots[a.id]] == [(a.id, 0, "cpu"), (a.id, 1, "cpu")]
    assert first.offered == {"cpu": 2, "nvidia-h100": 1} and first.kinds[b.id] == {"nvidia-h100"}

    store.clock.advance(30)  # beyond the overlap: the next read finds nothing
    admin.touch_hosts(store_pb2.TouchHostsRequest(host_ids=[a.id, b.id]))
    ticks.t = 1.0
    assert reader.read() is first and reader.reads == {"whole": 1, "changed": 1}  # heartbeats are no change

    c = admin.register_host(store_pb2.RegisterHostRequest(host=host("c", ["nvidia-h100"] * 2)))
    admin.mark_host_degraded(store_pb2.MarkHostDegradedRequest(id=a.id, reason="slow"))
    ticks.t = 2.0
    second = reader.read()
    assert [h.name for h in second.hosts] == ["a", "b", "c"] and second.offered["nvidia-h100"] == 3
    assert second.by_id[a.id].degraded_reason == "slow"
    assert second.slots[b.id] is first.slots[b.id]  # an unchanged host's slots are not rebuilt
    assert reader.reads == {"whole": 1, "changed": 2}

    store.clock.advance(30)
    admin.update_host_state(store_pb2.UpdateHostStateRequest(id=c.id, state=fleet_pb2.HOST_STATE_OFFLINE))
    ticks.t = 3.0
    assert reader.read().by_id[c.id].state == fleet_pb2.HOST_STATE_OFFLINE

    ticks.t = 70.0  # the resync: a whole read again
    assert [h.name for h in reader.read().hosts] == ["a", "b", "c"] and reader.reads["whole"] == 2


def test_a_change_stamped_behind_the_newest_one_seen_is_still_caught_within_the_overlap(store: Store) -> None:
    """A PostgreSQL transaction stamps now() when it begins: a registration that began before another one but
    committed after it carries the older time. The reader asks again from its newest time less the overlap; with
    too short an overlap only the whole read (the resync) would bring it."""
    admin = store.as_(store.admin)
    admin.register_host(store_pb2.RegisterHostRequest(host=host("a", ["cpu"])))
    ticks = Ticks()
    wide = HostReader(admin, overlap_s=5.0, resync_s=600.0, clock=ticks, background=False)
    narrow = HostReader(admin, overlap_s=1.0, resync_s=600.0, clock=ticks, background=False)
    store.clock.advance(10)
    admin.register_host(store_pb2.RegisterHostRequest(host=host("new", ["cpu"])))
    for reader in (wide, narrow):
        assert [h.name for h in reader.read().hosts] == ["a", "new"]
    store.clock.advance(-3)  # "late" is stamped 3 s before "new", and lands after the readers saw "new"
    admin.register_host(store_pb2.RegisterHostRequest(host=host("late", ["cpu"])))
    assert [h.name for h in wide.read().hosts] == ["a", "late", "new"]
    assert [h.name for h in narrow.read().hosts] == ["a", "new"]
    ticks.t = 600.0
    assert [h.name for h in narrow.read().hosts] == ["a", "late", "new"]
