"""Fair share: decayed past usage per tenant, and the order in which queued jobs are considered."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from services.planner.admission.model import Demand, Policy

LN2 = math.log(2.0)


def decayed_usage(
    intervals: Iterable[tuple[str, float, float | None]], now: float, half_life_s: float
) -> dict[str, float]:
    """Device-seconds per tenant, each second at time t weighted 2^(-(now - t) / half_life_s).

    `intervals` are (tenant_id, start, end or None while live), one per device lease; the parts after
    `now` count for nothing. The weight integrates in closed form, so the cost is one exp per lease:
    ∫_s^e 2^(-(now-t)/h) dt = h/ln2 · (2^(-(now-e)/h) − 2^(-(now-s)/h)). A half-life ≤ 0 means no decay.
    """
    return counted_usage(((i, 1) for i in intervals), now, half_life_s)


def counted_usage(
    intervals: Iterable[tuple[tuple[str, float, float | None], int]], now: float, half_life_s: float
) -> dict[str, float]:
    """`decayed_usage` of (interval, how many leases share it): a job's devices are leased together, so the
    planner keeps its leases counted by interval, and a pass costs one exp per job, not per device."""
    usage: dict[str, float] = {}
    k = LN2 / half_life_s if half_life_s > 0 else 0.0
    for (tenant, start, end), count in intervals:
        stop = now if end is None else min(end, now)
        if stop <= start:
            usage.setdefault(tenant, 0.0)
            continue
        amount = (math.exp(-k * (now - stop)) - math.exp(-k * (now - start))) / k if k else stop - start
        usage[tenant] = usage.get(tenant, 0.0) + amount * count
    return usage


def share(tenant_id: str, usage: Mapping[str, float], policy: Policy) -> float:
    """A tenant's usage per unit of weight: the lower, the more it is owed."""
    return usage.get(tenant_id, 0.0) / policy.weight(tenant_id)


def admission_order(queue: Sequence[Demand], usage: Mapping[str, float], policy: Policy) -> list[Demand]:
    """Priority first (higher first), then fair share (lower first), then submission time, then job id,
    so the order is total and a pass is deterministic whatever order the queue arrives in."""
    shares = {tenant: share(tenant, usage, policy) for tenant in {d.tenant_id for d in queue}}
    return sorted(queue, key=lambda d: (-d.priority, shares[d.tenant_id], d.submitted_at, d.job_id))
