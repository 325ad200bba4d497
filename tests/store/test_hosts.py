"""Hosts are platform data: only the admin registers them, every tenant reads them."""

from __future__ import annotations

import pytest

from ballast.v1 import fleet_pb2, store_pb2
from services.runtime.errors import NotFound, PermissionDenied
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
