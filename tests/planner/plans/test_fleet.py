"""The online fleet as plan requests and job preparation see it: read whole once per store, then only the hosts
that changed (a prepare used to list every host three times), with a state change or a degraded mark seen at once."""

from __future__ import annotations

from ballast.v1 import fleet_pb2, store_pb2
from services.planner.plans.fleet import executor_dims, online_hosts
from tests.store_builders import host
from tests.store_fixtures import Store

H = fleet_pb2.HostState


class Counting:
    """The store, recording each ListHosts request (a unit test's window on what online_hosts asks)."""

    def __init__(self, store) -> None:
        self._store, self.requests = store, []

    def list_hosts(self, request: store_pb2.ListHostsRequest) -> store_pb2.ListHostsResponse:
        self.requests.append(request)
        return self._store.list_hosts(request)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_the_online_hosts_are_read_whole_once_then_only_as_they_change(store: Store) -> None:
    admin = store.as_(store.admin)
    a = admin.register_host(store_pb2.RegisterHostRequest(host=host("a", ["cpu"])))
    b = admin.register_host(store_pb2.RegisterHostRequest(host=host("b", ["cpu", "cpu"])))
    seen = Counting(admin)
    assert [h.name for h in online_hosts(seen)] == ["a", "b"]
    assert executor_dims(seen) == executor_dims(admin)
    assert [h.name for h in online_hosts(seen)] == ["a", "b"]
    assert [r.HasField("changed_since") for r in seen.requests] == [False, True, True]

    admin.update_host_state(store_pb2.UpdateHostStateRequest(id=b.id, state=H.HOST_STATE_OFFLINE))
    assert [h.name for h in online_hosts(seen)] == ["a"]
    admin.mark_host_degraded(store_pb2.MarkHostDegradedRequest(id=a.id, reason="slow"))
    assert online_hosts(seen) == []
    admin.update_host_state(store_pb2.UpdateHostStateRequest(id=b.id, state=H.HOST_STATE_ONLINE, heartbeat=True))
    assert [h.name for h in online_hosts(seen)] == ["b"]
    assert sum(not r.HasField("changed_since") for r in seen.requests) == 1
    fresh = Counting(admin)  # another store object has a reader of its own
    assert [h.name for h in online_hosts(fresh)] == ["b"] and not fresh.requests[0].HasField("changed_since")


def test_a_store_made_per_call_leaves_no_reader_behind(store: Store) -> None:
    import gc

    from services.planner.plans import fleet

    admin = store.as_(store.admin)
    admin.register_host(store_pb2.RegisterHostRequest(host=host("a", ["cpu"])))
    gc.collect()
    before = len(fleet._readers)
    for _ in range(5):
        assert [h.name for h in online_hosts(Counting(admin))] == ["a"]
    gc.collect()
    assert len(fleet._readers) == before
