"""The shared fleet as Prometheus gauges, read at each scrape from the scheduler's latest admission snapshot
(no store reads of its own): jobs waiting by tenant and priority class and the longest wait, and the devices
of online hosts, leased or idle, by kind."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.planner.jobs.admit import Snapshot


class FleetGauges(Collector):
    """`name_tenants` False (a plaintext plane, whose metrics port asks for no certificate): every tenant's jobs
    are one line, tenant "-"."""

    def __init__(self, latest: Callable[[], Snapshot | None], name_tenants: bool = True):
        self._latest, self._name_tenants = latest, name_tenants

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queued = GaugeMetricFamily("ballast_queue_jobs", "Jobs waiting for devices, by tenant and priority class",
                                   labels=["tenant", "priority_class"])
        waited = GaugeMetricFamily("ballast_queue_oldest_wait_seconds",
                                   "Seconds the longest-waiting job has waited since it was submitted, by tenant "
                                   "and priority class", labels=["tenant", "priority_class"])
        devices = GaugeMetricFamily("ballast_devices", "Devices of online hosts by kind, leased or idle",
                                    labels=["kind", "state"])
        snap = self._latest()
        if snap is not None:
            lines: dict[tuple[str, str], list[float]] = {}
            for d in snap.queue:
                tenant = snap.tenant_names.get(d.tenant_id, d.tenant_id) if self._name_tenants else "-"
                key = (tenant, snap.classes.get(d.job_id, ""))
                lines.setdefault(key, []).append(max(snap.now - d.submitted_at, 0.0))
            for key, waits in sorted(lines.items()):
                queued.add_metric(list(key), len(waits))
                waited.add_metric(list(key), max(waits))
            counts: dict[tuple[str, str], int] = {}
            for slot in snap.free:
                counts[(slot.kind, "idle")] = counts.get((slot.kind, "idle"), 0) + 1
            for holding in snap.running:
                for slot in holding.slots:
                    counts[(slot.kind, "leased")] = counts.get((slot.kind, "leased"), 0) + 1
            for key, count in sorted(counts.items()):
                devices.add_metric(list(key), count)
        yield from (queued, waited, devices)
