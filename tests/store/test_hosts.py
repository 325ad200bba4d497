"""Hosts are platform data: only the admin registers them, every tenant reads them."""

from __future__ import annotations

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from ballast.v1 import fleet_pb2, store_pb2
from services.runtime.errors import InvalidArgument, NotFound, PermissionDenied
from tests.store_builders import host
from tests.store_fixtures import Store


def test_hosts_are_platform_data(store: Store):
    a, admin = store.as_(store.a), store.as_(store.admin)
    with pytest.raises(PermissionDenied):
        a.register_host(store_pb2.RegisterHostRequest(host=host("h1", ["cpu"])))
    h1 = admin.register_host(store_pb2.RegisterHostRequest(host=host("h1", ["cpu", "cpu"])))
    h2 = admin.register_host(store_pb2.RegisterHostRequest(host=host("h2", ["nvidia-h100"])))
    assert h1.id.startswith("hst-") and h1.state == fleet_pb2.HOST_STATE_ONLINE and len(h1.devices) == 2
    assert h1.labels == {"zone": "z1"} and h1.devices[1].spec.memory_bytes == 1 << 34
    store.clock.advance(10)
    again = admin.register_host(store_pb2.RegisterHostRequest(host=host("h1", ["nvidia-h100"])))
    assert again.id == h1.id and again.registered_at == h1.registered_at
    assert [d.spec.kind for d in again.devices] == ["nvidia-h100"]
    assert again.last_heartbeat_at.ToDatetime() > h1.last_heartbeat_at.ToDatetime()

    lost = admin.update_host_state(store_pb2.UpdateHostStateRequest(id=h2.id, state=fleet_pb2.HOST_STATE_LOST))
    assert lost.state == fleet_pb2.HOST_STATE_LOST and lost.last_heartbeat_at == h2.last_heartbeat_at
    with pytest.raises(PermissionDenied):
        a.update_host_state(store_pb2.UpdateHostStateRequest(id=h2.id, state=fleet_pb2.HOST_STATE_ONLINE))
    with pytest.raises(NotFound):
        admin.update_host_state(store_pb2.UpdateHostStateRequest(id="hst-x", state=fleet_pb2.HOST_STATE_LOST))

    def names(**kw):
        return [h.name for h in a.list_hosts(store_pb2.ListHostsRequest(**kw)).hosts]

    assert names() == ["h1", "h2"]  # any tenant reads hosts
    assert names(state=fleet_pb2.HOST_STATE_ONLINE) == ["h1"]
    assert names(device_kind="nvidia-h100") == ["h1", "h2"] and names(device_kind="cpu") == []
    assert store.as_(store.b).get_host(store_pb2.GetRequest(id=h1.id)) == again
    assert store.count("devices") == 2


def test_a_touch_sets_liveness_for_many_hosts_and_leaves_their_state(store: Store):
    a, admin = store.as_(store.a), store.as_(store.admin)
    ids = [admin.register_host(store_pb2.RegisterHostRequest(host=host(f"t{i}", ["cpu"]))).id for i in range(3)]
    admin.update_host_state(store_pb2.UpdateHostStateRequest(id=ids[2], state=fleet_pb2.HOST_STATE_OFFLINE))
    before = {i: admin.get_host(store_pb2.GetRequest(id=i)) for i in ids}
    store.clock.advance(30)
    reply = admin.touch_hosts(store_pb2.TouchHostsRequest(host_ids=[ids[0], ids[2], ids[0], "hst-gone"]))
    assert reply.touched == 2  # each once; an id the store does not hold is no error
    after = {i: admin.get_host(store_pb2.GetRequest(id=i)) for i in ids}
    assert after[ids[0]].last_heartbeat_at.ToDatetime() > before[ids[0]].last_heartbeat_at.ToDatetime()
    assert after[ids[1]].last_heartbeat_at == before[ids[1]].last_heartbeat_at  # not heard from
    assert after[ids[2]].state == fleet_pb2.HOST_STATE_OFFLINE  # a touch after its stream ended undoes nothing
    assert admin.touch_hosts(store_pb2.TouchHostsRequest()).touched == 0
    with pytest.raises(PermissionDenied):
        a.touch_hosts(store_pb2.TouchHostsRequest(host_ids=[ids[0]]))
    with pytest.raises(InvalidArgument, match="at most 65536") as info:
        admin.touch_hosts(store_pb2.TouchHostsRequest(host_ids=["hst-x"] * 65_537))
    assert info.value.field == "host_ids"


def test_hosts_changed_since_a_time_are_those_registered_moved_or_marked_since_and_not_those_touched(store: Store):
    admin = store.as_(store.admin)
    h1 = admin.register_host(store_pb2.RegisterHostRequest(host=host("c1", ["cpu"])))
    store.clock.advance(10)
    since = Timestamp()
    since.FromDatetime(store.clock())
    h2 = admin.register_host(store_pb2.RegisterHostRequest(host=host("c2", ["cpu"])))
    admin.touch_hosts(store_pb2.TouchHostsRequest(host_ids=[h1.id]))

    def changed() -> list[str]:
        return [h.name for h in admin.list_hosts(store_pb2.ListHostsRequest(changed_since=since)).hosts]

    assert changed() == ["c2"] and h2.changed_at.ToDatetime() >= since.ToDatetime()  # a heartbeat is no change
    store.clock.advance(1)
    admin.mark_host_degraded(store_pb2.MarkHostDegradedRequest(id=h1.id, reason="slow"))
    assert changed() == ["c1", "c2"]
    store.clock.advance(10)
    since.FromDatetime(store.clock())
    assert changed() == []
    store.clock.advance(1)
    admin.update_host_state(store_pb2.UpdateHostStateRequest(id=h2.id, state=fleet_pb2.HOST_STATE_OFFLINE))
    admin.clear_host_degraded(store_pb2.ClearHostDegradedRequest(id=h1.id, reason="fixed"))
    assert changed() == ["c1", "c2"]
