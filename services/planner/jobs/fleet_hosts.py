"""The fleet's hosts as each admission pass sees them, kept current by reading only what changed (changes.py;
`ListHosts changed_since`: a heartbeat is no change). A host's slots and device kinds are built once per change
of the host, not once per pass: at 4,096 hosts and 32,768 devices, every half second, rebuilding them was most of
an idle planner's CPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import timestamp_pb2

from ballast.v1 import fleet_pb2, store_pb2
from services.planner import admission as adm
from services.planner.jobs.changes import ChangeReader, Read, paged
from services.runtime.store_api import Store


@dataclass(frozen=True)
class FleetHosts:
    """Every registered host, by name, with what admission derives from each. A host's last_heartbeat_at is
    as of its last change: liveness is the agent's stream (`AgentRegistry.connected`), not this."""

    hosts: list[fleet_pb2.Host] = field(default_factory=list)
    by_id: dict[str, fleet_pb2.Host] = field(default_factory=dict)
    slots: dict[str, tuple[adm.Slot, ...]] = field(default_factory=dict)  # host id -> one per device
    kinds: dict[str, frozenset[str]] = field(default_factory=dict)  # host id -> its device kinds
    offered: Counter[str] = field(default_factory=Counter)  # device kind -> devices registered
    widest: dict[str, int] = field(default_factory=dict)  # device kind -> most of it on one host

    @classmethod
    def of(cls, hosts: dict[str, fleet_pb2.Host], known: FleetHosts) -> FleetHosts:
        """The view of `hosts`, reusing `known`'s derived parts for hosts that did not change."""
        slots, kinds = {}, {}
        for host_id, host in hosts.items():
            held = known.by_id.get(host_id)
            if held is not None and held.changed_at == host.changed_at:  # a re-read of an unchanged host
                slots[host_id], kinds[host_id] = known.slots[host_id], known.kinds[host_id]
            else:
                slots[host_id] = tuple(adm.Slot(host.id, d.index, d.spec.kind, host.name) for d in host.devices)
                kinds[host_id] = frozenset(d.spec.kind for d in host.devices)
        offered = Counter(s.kind for host_slots in slots.values() for s in host_slots)
        widest: dict[str, int] = {}
        for host_slots in slots.values():
            for kind, n in Counter(s.kind for s in host_slots).items():
                widest[kind] = max(widest.get(kind, 0), n)
        return cls(sorted(hosts.values(), key=lambda h: h.name), dict(hosts), slots, kinds, offered, widest)


class HostReader(ChangeReader[fleet_pb2.Host]):
    """Keeps a FleetHosts current with the store; `read()` is safe from several threads."""

    def __init__(self, store: Store, **timing: Any):
        super().__init__(**timing)
        self._store = store
        self._view = FleetHosts()
        self._built_from: dict[str, fleet_pb2.Host] | None = None

    def read_whole(self) -> Read[fleet_pb2.Host]:
        return paged(self._store.list_hosts, store_pb2.ListHostsRequest(), "hosts")

    def read_changed(self, since: timestamp_pb2.Timestamp) -> Read[fleet_pb2.Host]:
        return paged(self._store.list_hosts, store_pb2.ListHostsRequest(changed_since=since), "hosts")

    def same(self, held: fleet_pb2.Host, fresh: fleet_pb2.Host) -> bool:
        return held.changed_at == fresh.changed_at

    def read(self) -> FleetHosts:
        self.refresh()
        with self._lock:
            if self._built_from is not self.rows:  # the rows dict is replaced, never changed, on a change
                self._view, self._built_from = FleetHosts.of(self.rows, self._view), self.rows
            return self._view
