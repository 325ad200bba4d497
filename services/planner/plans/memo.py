"""Searches already done: a job submitted again with the same model, fleet and options is not searched again.

make_plan is pure and deterministic ((profile, fleet, inputs) in, plan out), so a repeated search gives the
same plan. Tenants resubmit the same job often (a sweep over seeds, a retry after a cancel); on a shared
plane each search takes CPU from everyone's calls, so a worker keeps the last `KEPT` plans by content.
The key is the whole profile (its id and tenant included), the fleet and every input, so one tenant's
search never answers another's: neither a plan nor how fast it came back tells a tenant what another
submitted. Errors are not kept: a request that fails is searched again, and fails the same way.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from ballast.v1 import fleet_pb2, plan_pb2, profile_pb2
from services.planner.plans.make import PlanInputs, make_plan
from services.runtime.metrics import PLAN_MEMO

KEPT = 256  # plans of a few KiB to a few hundred KiB each: tens of MiB at most


def memo_key(profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, inputs: PlanInputs) -> bytes:
    """A digest of everything make_plan reads (PlanInputs is a frozen dataclass: its repr is its value)."""
    digest = hashlib.sha256()
    for part in (profile.SerializeToString(deterministic=True), fleet.SerializeToString(deterministic=True),
                 repr(inputs).encode()):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


class PlanMemo:
    """make_plan, remembered for the last `kept` distinct requests (least recently used goes first)."""

    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._plans: OrderedDict[bytes, plan_pb2.Plan] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def plan(self, profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, inputs: PlanInputs) -> plan_pb2.Plan:
        """The plan make_plan gives for these arguments, as a copy the caller may change."""
        key = memo_key(profile, fleet, inputs)
        with self._lock:
            found = self._plans.get(key)
            if found is not None:
                self._plans.move_to_end(key)
        PLAN_MEMO.labels("hit" if found is not None else "miss").inc()
        if found is None:
            found = make_plan(profile, fleet, inputs)  # outside the lock: a search may take seconds
            with self._lock:
                self._plans[key] = found
                while len(self._plans) > self._kept:
                    self._plans.popitem(last=False)
        copy = plan_pb2.Plan()
        copy.CopyFrom(found)
        return copy


PLANS = PlanMemo()  # one per process: the worker's searches
