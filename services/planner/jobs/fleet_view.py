"""FleetService logic: the queue in admission order with reasons and predicted starts, and every device with
who leases it. No grpc imports.

Both read one admission Snapshot (admit.py), so `ballast queue` shows what the next pass will decide. A
tenant sees every position (how long the line is) but the ids and details of its own jobs only.
"""

from __future__ import annotations

from ballast.v1 import fleet_pb2, services_pb2, store_pb2
from services.planner import admission as adm
from services.planner.jobs.admit import Snapshot, epoch_s
from services.planner.jobs.arrival import Gate
from services.runtime.auth import Principal
from services.runtime.store_api import Store, every_page

REASONS = {
    adm.DEVICES_BUSY: services_pb2.WAIT_REASON_DEVICES_BUSY,
    adm.QUOTA: services_pb2.WAIT_REASON_QUOTA,
    adm.JOB_AHEAD: services_pb2.WAIT_REASON_JOB_AHEAD,
    adm.NO_EXECUTOR: services_pb2.WAIT_REASON_NO_EXECUTOR,
    adm.PREEMPTED: services_pb2.WAIT_REASON_PREEMPTED,
    adm.REPLANNING: services_pb2.WAIT_REASON_REPLANNING,
    adm.CALIBRATING: services_pb2.WAIT_REASON_CALIBRATING,
}
HOUR_S = 3600.0


def list_queue(snap: Snapshot, caller: Principal, gate: Gate | None = None) -> services_pb2.ListQueueResponse:
    """The queue in admission order; `gate`: the scheduler's last hold for a host class calibrating on arrival."""
    decision = snap.decide(exact=True)
    if gate is not None and gate.reason:  # held back whatever admission would say (jobs/arrival.py)
        for job_id in decision.order:
            if job_id not in gate.workload:
                decision.waiting[job_id] = adm.Wait(adm.CALIBRATING, gate.reason, None)
    demands = {d.job_id: d for d in snap.queue}
    out = services_pb2.ListQueueResponse()
    for position, job_id in enumerate(decision.order, start=1):
        d, job = demands[job_id], snap.jobs[job_id]
        wait = decision.waiting.get(job_id)
        entry = services_pb2.QueueEntry(
            position=position, tenant_id=d.tenant_id, tenant=snap.tenant_names.get(d.tenant_id, ""),
            priority_class=snap.classes.get(job_id, ""), priority=d.priority, devices=d.devices, device_kind=d.kind,
            predicted_duration_s=d.duration_s,
            predicted_start_s=-1.0 if wait is not None and wait.predicted_start is None
            else max((wait.predicted_start if wait else snap.now) - snap.now, 0.0),
            preemptions=snap.preemptions.get(job_id, 0))
        entry.submitted_at.CopyFrom(job.created_at)
        if wait is not None:
            entry.reason = REASONS.get(wait.reason, services_pb2.WAIT_REASON_UNSPECIFIED)
        if caller.reads_all or caller.tenant_id == d.tenant_id:
            entry.job_id = job_id
            entry.detail = wait.detail if wait else "starting now"
        out.entries.append(entry)
    return out


def visible_lease(lease: fleet_pb2.DeviceLease, caller: Principal) -> fleet_pb2.DeviceLease:
    """The lease as `caller` may see it: another tenant's shows the device busy (kind, since when) but not
    its id, job or tenant, so the fleet view reveals no other tenant's jobs."""
    if caller.reads_all or caller.tenant_id == lease.tenant_id:
        return lease
    return fleet_pb2.DeviceLease(device=lease.device, started_at=lease.started_at, device_kind=lease.device_kind)


def get_fleet(snap: Snapshot, store: Store, caller: Principal) -> services_pb2.GetFleetResponse:
    """Every registered device, its live lease (as `caller` may see it), and the fraction of the last hour it
    was leased."""
    since = store_pb2.ListLeasesRequest()
    since.since.FromMicroseconds(int((snap.now - HOUR_S) * 1e6))
    busy: dict[tuple[str, int], float] = {}
    for page in every_page(store.list_leases, since):
        for x in page.leases:
            start = max(epoch_s(x.started_at), snap.now - HOUR_S)
            end = epoch_s(x.ended_at) if x.HasField("ended_at") else snap.now
            key = (x.device.host_id, x.device.device_index)
            busy[key] = busy.get(key, 0.0) + max(end - start, 0.0)
    live = {(x.device.host_id, x.device.device_index): x for x in snap.live}
    online = {s.host_id for s in snap.free} | {s.host_id for h in snap.running for s in h.slots}
    out = services_pb2.GetFleetResponse(policy=snap.fleet_policy)
    for host in sorted(snap.hosts.values(), key=lambda h: h.name):
        for d in host.devices:
            key = (host.id, d.index)
            device = services_pb2.FleetDevice(
                device=fleet_pb2.DeviceRef(host_id=host.id, device_index=d.index), host_name=host.name,
                device_kind=d.spec.kind, online=host.id in online or host.state == fleet_pb2.HOST_STATE_ONLINE,
                utilisation_last_hour=min(busy.get(key, 0.0) / HOUR_S, 1.0))
            if key in live:
                device.lease.CopyFrom(visible_lease(live[key], caller))
            out.devices.append(device)
    return out
