"""The fleet the executors offer right now: which hosts are online and which parallel dims (and DP flavours,
ZeRO-1/2) they all run.

Plan requests and job preparation both confine their search to this; it lives apart from either so
neither reaches into the other for it.
"""

from __future__ import annotations

import threading
import weakref

from ballast.v1 import common_pb2, fleet_pb2
from services.planner.jobs.fleet_hosts import HostReader
from services.planner.plans.make import HARMONY, OFFLOAD, offload_runnable, runnable_dims
from services.runtime.store_api import Store

# One host reader per store (a worker or planner process holds one or two): preparing a job read every host
# three times, whole; at 1,024 hosts that was 33 ListHosts pages and most of a prepare that found its plan in
# the memo. A reader re-reads only the hosts changed since its last read (ListHosts changed_since: a state,
# a degradation or a registration; a heartbeat is no change), so each call is one small read.
_readers: weakref.WeakKeyDictionary[Store, HostReader] = weakref.WeakKeyDictionary()
_readers_lock = threading.Lock()


def usable(host: fleet_pb2.Host) -> bool:
    """ONLINE and not marked degraded (a straggler's devices are planned for and given to no job until an
    operator clears the mark or its parole is served)."""
    return host.state == fleet_pb2.HOST_STATE_ONLINE and not host.degraded_reason


def online_hosts(store: Store) -> list[fleet_pb2.Host]:
    """Every executor host the store has `usable`, by name, as of now (a read of what changed since the last)."""
    with _readers_lock:
        reader = _readers.get(store)
        if reader is None:
            # through a proxy: a reader holding its store would keep its own key alive, and a store made per
            # call (a plan request's, acting as its caller) would leave a reader behind on every call
            reader = _readers[store] = HostReader(weakref.proxy(store))
    return [h for h in reader.read().hosts if usable(h)]


def executor_dims(store: Store) -> tuple[str, ...]:
    """Parallel dims and DP flavours every online executor host runs (make.runnable_dims), "chunks" when every
    one runs chunk offload (PlanInputs.offload) and "harmony" when every one runs Harmony's swap schedule
    (PlanInputs.harmony); none online: ("dp",)."""
    hosts = [list(h.supported_parallelism) for h in online_hosts(store)]
    return (runnable_dims(hosts) + ((OFFLOAD,) if offload_runnable(hosts) else ())
            + ((HARMONY,) if offload_runnable(hosts, common_pb2.PARALLEL_DIM_HARMONY) else ()))
