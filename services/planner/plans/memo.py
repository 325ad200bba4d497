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

from ballast.v1 import fleet_pb2, plan_pb2, profile_pb2
from services.planner.plans.make import PlanInputs, make_plan
from services.runtime.lru import BytesLRU
from services.runtime.metrics import PLAN_MEMO

KEPT = 256  # plans; most are a few KiB ...
KEPT_BYTES = 64 << 20  # ... but a model of thousands of layers makes large ones: the memo's bound in bytes


def memo_key(profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, inputs: PlanInputs) -> bytes:
    """A digest of everything make_plan reads (PlanInputs is a frozen dataclass: its repr is its value)."""
    digest = hashlib.sha256()
    for part in (profile.SerializeToString(deterministic=True), fleet.SerializeToString(deterministic=True),
                 repr(inputs).encode()):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


class PlanMemo:
    """make_plan, remembered for the last `kept` distinct requests within `kept_bytes` of serialized plans
    (least recently used goes first; a plan larger than the whole bound is not kept)."""

    def __init__(self, kept: int = KEPT, kept_bytes: int = KEPT_BYTES) -> None:
        self._plans = BytesLRU(kept, kept_bytes)

    def __len__(self) -> int:
        return len(self._plans)

    def plan(self, profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, inputs: PlanInputs) -> plan_pb2.Plan:
        """The plan make_plan gives for these arguments, as a copy the caller may change."""
        key = memo_key(profile, fleet, inputs)
        kept = self._plans.get(key)
        PLAN_MEMO.labels("hit" if kept is not None else "miss").inc()
        if kept is not None:
            return plan_pb2.Plan.FromString(kept)
        plan = make_plan(profile, fleet, inputs)  # a search may take seconds: nothing is locked meanwhile
        self._plans.put(key, plan.SerializeToString())
        return plan


PLANS = PlanMemo()  # one per process: the worker's searches
