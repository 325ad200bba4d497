"""The fleet the executors offer right now: which hosts are online and which parallel dims (and DP flavours,
ZeRO-1/2) they all run.

Plan requests and job preparation both confine their search to this; it lives apart from either so
neither reaches into the other for it.
"""

from __future__ import annotations

from ballast.v1 import common_pb2, fleet_pb2, store_pb2
from services.planner.plans.make import HARMONY, OFFLOAD, offload_runnable, runnable_dims
from services.runtime.store_api import Store, every_page


def usable(host: fleet_pb2.Host) -> bool:
    """ONLINE and not marked degraded (a straggler's devices are planned for and given to no job until an
    operator clears the mark or its parole is served)."""
    return host.state == fleet_pb2.HOST_STATE_ONLINE and not host.degraded_reason


def online_hosts(store: Store) -> list[fleet_pb2.Host]:
    """Every executor host the store has `usable` (all pages)."""
    request = store_pb2.ListHostsRequest(state=fleet_pb2.HOST_STATE_ONLINE)
    return [h for page in every_page(store.list_hosts, request) for h in page.hosts if usable(h)]


def executor_dims(store: Store) -> tuple[str, ...]:
    """Parallel dims and DP flavours every online executor host runs (make.runnable_dims), "chunks" when every
    one runs chunk offload (PlanInputs.offload) and "harmony" when every one runs Harmony's swap schedule
    (PlanInputs.harmony); none online: ("dp",)."""
    hosts = [list(h.supported_parallelism) for h in online_hosts(store)]
    return (runnable_dims(hosts) + ((OFFLOAD,) if offload_runnable(hosts) else ())
            + ((HARMONY,) if offload_runnable(hosts, common_pb2.PARALLEL_DIM_HARMONY) else ()))
