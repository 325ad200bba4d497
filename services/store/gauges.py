"""What the store's tables say right now, as Prometheus gauges read at each scrape: jobs by state, the durable
queue's depth by kind and state (the planner workers' backlog), and live device leases by kind.

Three small GROUP BY queries per scrape (every 15 s or so), on the read connection. Beside them, what the data
dir says: the free space left on its file system (a full disk stops the store's writes; better seen coming) and,
on the embedded plane, how often the supervisor restarted each process (<data-dir>/run/state.json)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.store import models as m
from services.store.repo.queue import QUEUED, RUNNING


class StoreGauges(Collector):
    def __init__(self, engine: sa.Engine, data_dir: Path | None = None):
        self._engine, self._data_dir = engine, data_dir

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
        if self._data_dir is not None:
            yield from self._data_dir_gauges(self._data_dir)

    @staticmethod
    def _data_dir_gauges(data_dir: Path) -> Iterator[GaugeMetricFamily]:
        free = GaugeMetricFamily("ballast_data_dir_free_bytes", "Bytes free on the data dir's file system (the "
                                 "database, checkpoints and logs live there)")
        try:
            stat = os.statvfs(data_dir)
            free.add_metric([], stat.f_bavail * stat.f_frsize)
        except OSError:
            pass
        restarts = GaugeMetricFamily("ballast_component_restarts", "Times the embedded plane's supervisor started a "
                                     "process again after it died, by component", labels=["component"])
        try:
            children = json.loads((data_dir / "run" / "state.json").read_text())["children"]
            for child in children:
                restarts.add_metric([child["name"]], child.get("restarts", 0))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not an embedded plane, or the file is being replaced
        yield from (free, restarts)
