"""The fleet's hosts as each admission pass sees them, kept current by reading only what changed.

A pass used to read every host and its devices and rebuild every free slot from them: at 4,096 hosts and 32,768
devices, every half second, that was most of an idle planner's CPU and of the store reader's. Now the first read
is whole, and each later one asks only for hosts changed since the previous read began, by the store's own clock
(`ListHosts changed_since` and `read_at`; a heartbeat is no change), less OVERLAP_S, so that a change stamped when
its transaction began but committed after that read is still caught. Every RESYNC_S a whole read reconciles
anything missed. A host's slots and device kinds are built
once per change of the host, not once per pass.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from google.protobuf import timestamp_pb2

from ballast.v1 import fleet_pb2, store_pb2
from services.planner import admission as adm
from services.runtime.store_api import Store, every_page

OVERLAP_S = 5.0
RESYNC_S = 60.0


@dataclass(frozen=True)
class FleetHosts:
    """Every registered host, by name, with what admission derives from each. A host's last_heartbeat_at is
    as of its last change: liveness is the agent's stream (`AgentRegistry.connected`), not this."""

    hosts: list[fleet_pb2.Host] = field(default_factory=list)
    by_id: dict[str, fleet_pb2.Host] = field(default_factory=dict)
    slots: dict[str, tuple[adm.Slot, ...]] = field(default_factory=dict)  # host id -> one per device
    kinds: dict[str, frozenset[str]] = field(default_factory=dict)  # host id -> its device kinds
    offered: Counter[str] = field(default_factory=Counter)  # device kind -> devices registered

    @classmethod
    def of(cls, hosts: dict[str, fleet_pb2.Host], known: FleetHosts) -> FleetHosts:
        """The view of `hosts`, reusing `known`'s derived parts for hosts that did not change."""
        slots, kinds = {}, {}
        for host_id, host in hosts.items():
            if known.by_id.get(host_id) is host:
                slots[host_id], kinds[host_id] = known.slots[host_id], known.kinds[host_id]
            else:
                slots[host_id] = tuple(adm.Slot(host.id, d.index, d.spec.kind, host.name) for d in host.devices)
                kinds[host_id] = frozenset(d.spec.kind for d in host.devices)
        offered = Counter(s.kind for host_slots in slots.values() for s in host_slots)
        return cls(sorted(hosts.values(), key=lambda h: h.name), dict(hosts), slots, kinds, offered)


class HostReader:
    """Keeps a FleetHosts current with the store; `read()` is safe from several threads."""

    def __init__(self, store: Store, *, overlap_s: float = OVERLAP_S, resync_s: float = RESYNC_S,
                 clock: Callable[[], float] = time.monotonic):
        self._store, self._overlap_s, self._resync_s, self._clock = store, overlap_s, resync_s, clock
        self._view = FleetHosts()
        self._cursor: timestamp_pb2.Timestamp | None = None  # when the last read began, by the store's clock
        self._whole_at: float | None = None
        self._lock = threading.Lock()
        self.reads = Counter[str]()  # "whole" / "changed": how the view was kept (for tests and metrics)

    def read(self) -> FleetHosts:
        with self._lock:
            if self._whole_at is None or self._clock() - self._whole_at >= self._resync_s:
                self._read_whole()
            else:
                self._read_changed()
            return self._view

    def _read_whole(self) -> None:
        started = self._clock()
        pages = list(every_page(self._store.list_hosts, store_pb2.ListHostsRequest()))
        hosts = {h.id: h for page in pages for h in page.hosts}
        self._view = FleetHosts.of(hosts, self._view)
        self._cursor = pages[0].read_at
        self._whole_at = started
        self.reads["whole"] += 1

    def _read_changed(self) -> None:
        request = store_pb2.ListHostsRequest()
        assert self._cursor is not None
        request.changed_since.FromNanoseconds(self._cursor.ToNanoseconds() - int(self._overlap_s * 1e9))
        pages = list(every_page(self._store.list_hosts, request))
        changed = [h for page in pages for h in page.hosts]
        self._cursor = pages[0].read_at
        self.reads["changed"] += 1
        known = self._view.by_id
        fresh = [h for h in changed if h.id not in known or known[h.id].changed_at != h.changed_at]
        if not fresh:
            return
        hosts = dict(self._view.by_id)
        hosts.update((h.id, h) for h in fresh)
        self._view = FleetHosts.of(hosts, self._view)
