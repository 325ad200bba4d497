"""What the store's tables say right now, as Prometheus gauges read at each scrape: jobs by state, the durable
queue's depth by kind and state (the planner workers' backlog), and live device leases by kind.

Three small GROUP BY queries per scrape (every 15 s or so), on the read connection."""

from __future__ import annotations

from collections.abc import Iterator

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.store import models as m
from services.store.repo.queue import QUEUED, RUNNING


class StoreGauges(Collector):
    def __init__(self, engine: sa.Engine):
        self._engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("ballast_jobs", "Jobs by state", labels=["state"])
        queued = GaugeMetricFamily("ballast_queued_requests", "Durable queue requests by kind and state",
                                   labels=["kind", "state"])
        leases = GaugeMetricFamily("ballast_leased_devices", "Devices under a live lease, by kind", labels=["kind"])
        t = m.QueuedRequest
        with self._engine.connect() as conn:
            for state, count in conn.execute(sa.select(m.Job.state, sa.func.count()).group_by(m.Job.state)):
                jobs.add_metric([state.removeprefix("JOB_STATE_").lower()], count)
            for kind, state, count in conn.execute(sa.select(t.kind, t.state, sa.func.count())
                                                   .where(t.state.in_((QUEUED, RUNNING)))
                                                   .group_by(t.kind, t.state)):
                queued.add_metric([kind, state.removeprefix("REQUEST_STATE_").lower()], count)
            for kind, count in conn.execute(sa.select(m.DeviceLease.device_kind, sa.func.count())
                                            .where(m.DeviceLease.ended_at.is_(None))
                                            .group_by(m.DeviceLease.device_kind)):
                leases.add_metric([kind], count)
        yield from (jobs, queued, leases)
