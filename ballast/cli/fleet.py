"""`ballast queue`, `ballast fleet [clear]` and `ballast policy show|set`: the shared fleet as its users see it.

The formatting is pure (protos in, rows and text out) so it is tested without servers; the commands only
fetch, format and print.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from pathlib import Path

import grpc
import yaml
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ballast.client import Client, pages
from ballast.config import Settings
from ballast.v1 import fleet_pb2, job_pb2, services_pb2, store_pb2
from services.runtime.errors import InvalidArgument
from services.specs.policy import load_policy_file

console = Console()
err = Console(stderr=True)
W = services_pb2.WaitReason
REASONS = {
    W.WAIT_REASON_UNSPECIFIED: "starting",  # no wait: the next admission pass starts it
    W.WAIT_REASON_DEVICES_BUSY: "devices busy",
    W.WAIT_REASON_QUOTA: "quota",
    W.WAIT_REASON_JOB_AHEAD: "job ahead",
    W.WAIT_REASON_NO_EXECUTOR: "no executor",
    W.WAIT_REASON_PREEMPTED: "preempted",
    W.WAIT_REASON_REPLANNING: "replanning",
    W.WAIT_REASON_CALIBRATING: "calibrating",
}
HIDDEN = "—"  # another tenant's job: its position shows, its id does not


# --- arguments ----------------------------------------------------------------------------------------------
def add_queue_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the queue as JSON (one object per entry)")


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the devices and the policy as JSON")
    actions = p.add_subparsers(dest="action", metavar="{clear,simulate,trace}")  # optional: plain `fleet` shows it
    clear = actions.add_parser("clear", help="clear a host's degraded mark, giving its devices back (platform admin)")
    clear.add_argument("host", help="host name or id (as `ballast fleet` shows it)")
    clear.add_argument("--reason", required=True, help='why it is healthy again, e.g. "replaced the GPU"')
    clear.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS,
                       help="data directory (default $BALLAST_DATA_DIR or ~/.ballast)")
    from ballast.cli.fleet_simulate import add_arguments as add_simulate_arguments

    add_simulate_arguments(actions)


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True, metavar="{show,set}")
    show = actions.add_parser("show", help="print the policy as YAML (the format `policy set` reads)")
    show.add_argument("--version", type=int, default=0, help="an older version (default: the one in force)")
    put = actions.add_parser("set", help="store FILE as the new policy version (platform admin)")
    put.add_argument("file", type=Path, help="policy YAML (see services/specs/policy.py)")
    put.add_argument("--expected-version", type=int, default=0,
                     help="refuse unless this is the version in force (compare-and-set; default: no check)")
    for action in (show, put):  # `ballast policy show --data-dir D` as well as `ballast policy --data-dir D show`
        action.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS,
                            help="data directory (default $BALLAST_DATA_DIR or ~/.ballast)")


# --- formatting (pure) --------------------------------------------------------------------------------------
def seconds(ts: Timestamp) -> float:
    return ts.ToMicroseconds() / 1e6


def duration(s: float) -> str:
    """42 s, 12 min, 3.5 h, 2.1 d."""
    s = max(s, 0.0)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    if s < 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def predicted_start(s: float) -> str:
    """'unknown' (< 0), 'now' (under a second), else 'in 42 s'."""
    if s < 0:
        return "unknown"
    if s < 1:
        return "now"
    return f"in {duration(s)}"


def reason_words(reason: int) -> str:
    return REASONS.get(reason, "waiting")


def queue_records(entries: Iterable[services_pb2.QueueEntry], now: float) -> list[dict]:
    """One JSON-ready record per entry, in admission order; None where a value is unknown."""
    out = []
    for e in entries:
        out.append({
            "position": e.position, "job_id": e.job_id or None, "tenant": e.tenant, "tenant_id": e.tenant_id,
            "priority_class": e.priority_class, "priority": e.priority, "devices": e.devices,
            "device_kind": e.device_kind, "reason": reason_words(e.reason), "detail": e.detail or None,
            "predicted_start_s": e.predicted_start_s if e.predicted_start_s >= 0 else None,
            "predicted_duration_s": e.predicted_duration_s,
            "submitted_at": e.submitted_at.ToJsonString() if e.HasField("submitted_at") else None,
            "waited_s": round(now - seconds(e.submitted_at), 3) if e.HasField("submitted_at") else None,
            "preemptions": e.preemptions,
        })
    return out


QUEUE_COLUMNS = ("#", "job", "tenant", "class", "devices", "reason", "starts", "waited", "preempted")


def queue_rows(entries: Iterable[services_pb2.QueueEntry], now: float) -> list[tuple[str, ...]]:
    """Table rows: position, job, tenant, class, devices (kind), reason, predicted start, waited, preemptions."""
    rows = []
    for e in entries:
        waited = duration(now - seconds(e.submitted_at)) if e.HasField("submitted_at") else "-"
        rows.append((str(e.position), e.job_id or HIDDEN, e.tenant or e.tenant_id, e.priority_class or "-",
                     f"{e.devices} × {e.device_kind}" if e.device_kind else str(e.devices),
                     reason_words(e.reason), predicted_start(e.predicted_start_s), waited,
                     str(e.preemptions) if e.preemptions else "-"))
    return rows


def queue_table(entries: Iterable[services_pb2.QueueEntry], now: float) -> Table:
    table = Table(*QUEUE_COLUMNS, title="queue (admission order)")
    for row in queue_rows(entries, now):
        table.add_row(*(escape(cell) for cell in row))
    return table


def lease_holder(lease: fleet_pb2.DeviceLease, tenants: dict[str, str]) -> str:
    if not lease.job_id:  # another tenant's lease: the planner shows the device busy, not whose
        return OTHER_TENANT
    return f"{lease.job_id} ({tenants.get(lease.tenant_id, lease.tenant_id)})"


OTHER_TENANT = "another tenant"


FLEET_COLUMNS = ("host", "device", "kind", "online", "leased to", "since", "used last hour")
DEGRADED = "degraded"


def online_words(online: bool, degraded: bool) -> str:
    """'yes' / 'no'; a degraded host's devices (which no job is given) say 'degraded' instead of 'yes'."""
    if degraded:
        return DEGRADED if online else f"no ({DEGRADED})"
    return "yes" if online else "no"


def fleet_rows(devices: Iterable[services_pb2.FleetDevice], now: float, tenants: dict[str, str] | None = None,
               degraded: dict[str, fleet_pb2.Host] | None = None) -> list[tuple[str, ...]]:
    """Table rows: host, index, kind, online (or degraded), leased to (job, tenant), lease age, utilisation over
    the last hour. `degraded` holds the degraded hosts by id."""
    tenants, degraded = tenants or {}, degraded or {}
    rows = []
    for d in devices:
        leased = d.HasField("lease")
        rows.append((d.host_name or d.device.host_id, str(d.device.device_index), d.device_kind,
                     online_words(d.online, d.device.host_id in degraded),
                     lease_holder(d.lease, tenants) if leased else "-",
                     f"{duration(now - seconds(d.lease.started_at))} ago" if leased else "-",
                     f"{d.utilisation_last_hour * 100:.0f} %"))
    return rows


def fleet_records(devices: Iterable[services_pb2.FleetDevice], now: float, tenants: dict[str, str] | None = None,
                  degraded: dict[str, fleet_pb2.Host] | None = None) -> list[dict]:
    tenants, degraded = tenants or {}, degraded or {}
    out = []
    for d in devices:
        leased = d.HasField("lease")
        mark = degraded.get(d.device.host_id)
        out.append({
            "host_id": d.device.host_id, "host": d.host_name, "index": d.device.device_index,
            "kind": d.device_kind, "online": d.online,
            "lease": {"id": d.lease.id or None, "job_id": d.lease.job_id or None,
                      "tenant_id": d.lease.tenant_id or None,
                      "tenant": tenants.get(d.lease.tenant_id), "started_at": d.lease.started_at.ToJsonString(),
                      "age_s": round(now - seconds(d.lease.started_at), 3)} if leased else None,
            "utilisation_last_hour": d.utilisation_last_hour,
            "degraded": {"reason": mark.degraded_reason, "since": mark.degraded_at.ToJsonString(),
                         "age_s": round(now - seconds(mark.degraded_at), 3)} if mark else None,
        })
    return out


def fleet_table(devices: Iterable[services_pb2.FleetDevice], now: float, tenants: dict[str, str] | None = None,
                degraded: dict[str, fleet_pb2.Host] | None = None) -> Table:
    table = Table(*FLEET_COLUMNS, title="fleet")
    for row in fleet_rows(devices, now, tenants, degraded):
        cells = [escape(cell) for cell in row]
        colour = "green" if row[3] == "yes" else "yellow" if row[3] == DEGRADED else "red"
        cells[3] = f"[{colour}]{cells[3]}[/{colour}]"
        table.add_row(*cells)
    return table


def degraded_lines(hosts: Iterable[fleet_pb2.Host], now: float) -> list[str]:
    """One line per degraded host: since when, why, and the command that gives it back."""
    return [f"{h.name} degraded {duration(now - seconds(h.degraded_at))} ago: {h.degraded_reason}; "
            f"`ballast fleet clear {h.name} --reason ...` gives it back" for h in hosts if h.HasField("degraded_at")]


def resolve_host(hosts: Iterable[fleet_pb2.Host], text: str) -> fleet_pb2.Host | str:
    """The host whose id or name is `text`, else the message naming the hosts there are."""
    hosts = list(hosts)
    for h in hosts:
        if text in (h.id, h.name):
            return h
    known = ", ".join(f"{h.name} ({h.id})" for h in hosts) or "none registered yet"
    return f"no host {text!r}; known hosts: {known}"


def _num(value: float) -> str:
    return f"{value:g}"


def policy_summary(policy: fleet_pb2.FleetPolicy) -> str:
    """One line: version, classes (default and preempting marked), tenant rules, fair share, preemption cap."""
    classes = ", ".join(f"{c.name}={c.priority}" + "".join(
        f" ({tag})" for tag, on in (("default", c.name == policy.default_priority_class), ("preempts", c.preempts))
        if on) for c in sorted(policy.priority_classes, key=lambda c: -c.priority))
    origin = (f"v{policy.version} by {policy.created_by or 'admin'}" if policy.version
              else "built-in default (no policy stored)")
    tenants = ", ".join(
        f"{t.tenant} (" + ", ".join(x for x in (f"quota {t.device_quota}" if t.device_quota else "",
                                                f"weight {_num(t.weight or 1)}",
                                                f"max {t.max_priority_class}" if t.max_priority_class else "") if x)
        + ")" for t in policy.tenants) or "all alike (weight 1, no quota)"
    return (f"policy {origin}: classes {classes}; tenants {tenants}; fair-share half-life "
            f"{_num(policy.fair_share_half_life_s or 3600)} s; at most "
            f"{policy.max_preemptions_per_hour or 2} preemptions per job per hour")


def _flow(values: dict) -> str:
    return yaml.safe_dump(values, default_flow_style=True, sort_keys=False, width=10**6).strip()


def _scalar(key: str, value: object) -> str:
    return yaml.safe_dump({key: value}, default_flow_style=False, sort_keys=False, width=10**6).strip()


def policy_yaml(policy: fleet_pb2.FleetPolicy) -> str:
    """The policy as the YAML `load_policy_file` reads (version and authorship as comments)."""
    if policy.version:
        stored = policy.created_at.ToJsonString() if policy.HasField("created_at") else "?"
        lines = [f"# fleet policy version {policy.version}, stored by {policy.created_by or '?'} at {stored}"]
    else:
        lines = ["# the built-in default policy (no policy stored yet)"]
    lines.append(_scalar("default_priority_class", policy.default_priority_class))
    lines.append("priority_classes:")
    for c in policy.priority_classes:
        lines.append("  - " + _flow({"name": c.name, "priority": c.priority, **({"preempts": True} if c.preempts
                                                                                 else {})}))
    if policy.tenants:
        lines.append("tenants:")
        for t in policy.tenants:
            entry: dict[str, object] = {"tenant": t.tenant}
            if t.device_quota:
                entry["device_quota"] = t.device_quota
            if t.weight:
                entry["weight"] = t.weight
            if t.max_priority_class:
                entry["max_priority_class"] = t.max_priority_class
            lines.append("  - " + _flow(entry))
    else:
        lines.append("tenants: []")
    if policy.fair_share_half_life_s:
        lines.append(_scalar("fair_share_half_life_s", policy.fair_share_half_life_s))
    else:
        lines.append("# fair_share_half_life_s: 3600 (the default)")
    if policy.max_preemptions_per_hour:
        lines.append(_scalar("max_preemptions_per_hour", policy.max_preemptions_per_hour))
    else:
        lines.append("# max_preemptions_per_hour: 2 (the default)")
    return "\n".join(lines) + "\n"


# --- commands -----------------------------------------------------------------------------------------------
def _client(settings: Settings) -> Client:
    return Client.of(settings, ("store", "planner"))


def _failed(exc: grpc.RpcError) -> int:
    err.print(f"[red]error[/red] {exc.code().name}: {escape(exc.details() or '')}")
    return 1


PREPARING = (job_pb2.JOB_STATE_SUBMITTED, job_pb2.JOB_STATE_PROFILING, job_pb2.JOB_STATE_PLANNING)


def run_queue(settings: Settings, args: argparse.Namespace) -> int:
    with _client(settings) as client:
        try:
            entries = client.queue()
            preparing = sum(len(page.jobs) for s in PREPARING
                            for page in pages(client.store.ListJobs, store_pb2.ListJobsRequest(state=s)))
        except grpc.RpcError as exc:
            return _failed(exc)
    now = time.time()
    if args.json:
        print(json.dumps(queue_records(entries, now)))
        return 0
    if not entries:
        console.print("the queue is empty: no job is waiting for devices")
    else:
        console.print(queue_table(entries, now))
    if preparing:  # a job joins the queue once it has a plan, so a fresh submit is not in it yet
        console.print(f"{preparing} job(s) still being profiled or planned: each joins the queue with its plan")
    return 0


def list_hosts(client: Client) -> list[fleet_pb2.Host]:
    """Every registered host from the store, with its degraded mark (the planner's fleet view has none)."""
    return [h for page in pages(client.store.ListHosts, store_pb2.ListHostsRequest()) for h in page.hosts]


def tenant_names(client: Client) -> dict[str, str]:
    """Tenant id -> name where the caller may list tenants (the platform admin); else empty (ids are shown)."""
    names: dict[str, str] = {}
    request = store_pb2.ListTenantsRequest()
    try:
        while True:
            reply = client.store.ListTenants(request)
            names.update({t.id: t.name for t in reply.tenants})
            if not reply.next_page_token:
                return names
            request.page.page_token = reply.next_page_token
    except grpc.RpcError:
        return names


def run_fleet(settings: Settings, args: argparse.Namespace) -> int:
    action = getattr(args, "action", None)
    if action == "clear":
        return run_fleet_clear(settings, args)
    if action in ("simulate", "trace"):  # local: no server
        from ballast.cli.fleet_simulate import run_simulate, run_trace

        return run_simulate(args) if action == "simulate" else run_trace(args)
    with _client(settings) as client:
        try:
            reply = client.fleet_view()
            degraded = {h.id: h for h in list_hosts(client) if h.HasField("degraded_at")}
        except grpc.RpcError as exc:
            return _failed(exc)
        tenants = tenant_names(client) if any(d.lease.tenant_id for d in reply.devices) else {}
    now = time.time()
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps({"devices": fleet_records(reply.devices, now, tenants, degraded),
                          "policy": MessageToDict(reply.policy, preserving_proto_field_name=True)}))
        return 0
    if reply.devices:
        console.print(fleet_table(reply.devices, now, tenants, degraded))
        leased = sum(1 for d in reply.devices if d.HasField("lease"))
        online = sum(1 for d in reply.devices if d.online)
        held = sum(1 for d in reply.devices if d.device.host_id in degraded)
        console.print(f"{len(reply.devices)} device(s), {online} online, {leased} leased"
                      + (f", {held} on degraded hosts (given to no job)" if held else ""))
    else:
        console.print("no devices registered yet: start executor agents (`ballast up --executors N`)")
    for line in degraded_lines(sorted(degraded.values(), key=lambda h: h.name), now):
        console.print(escape(line))
    console.print(escape(policy_summary(reply.policy)))
    return 0


def run_fleet_clear(settings: Settings, args: argparse.Namespace) -> int:
    """Resolve HOST by name or id, then ClearHostDegraded: only the platform admin may vouch for a host."""
    with _client(settings) as client:
        try:
            found = resolve_host(list_hosts(client), args.host)
            if isinstance(found, str):
                err.print(f"[red]error[/red] {escape(found)}")
                return 1
            cleared = client.store.ClearHostDegraded(store_pb2.ClearHostDegradedRequest(id=found.id,
                                                                                        reason=args.reason))
        except grpc.RpcError as exc:
            return _failed(exc)
    was = (f", marked degraded {duration(time.time() - seconds(found.degraded_at))} ago: {found.degraded_reason}"
           if found.HasField("degraded_at") else "")
    console.print(escape(f"cleared {cleared.name} ({cleared.id}){was}; its devices can go to jobs again"))
    return 0


def run_policy(settings: Settings, args: argparse.Namespace) -> int:
    if args.action == "set":
        try:
            policy = load_policy_file(args.file)  # a bad file fails here, before any RPC
        except InvalidArgument as exc:
            err.print(f"[red]error[/red] {escape(str(exc))}")
            return 2
    with _client(settings) as client:
        try:
            if args.action == "show":
                policy = client.fleet.GetPolicy(store_pb2.GetFleetPolicyRequest(version=args.version))
                print(policy_yaml(policy), end="")
                return 0
            before = client.fleet.GetPolicy(store_pb2.GetFleetPolicyRequest())
            stored = client.fleet.SetPolicy(store_pb2.SetFleetPolicyRequest(
                policy=policy, expected_version=args.expected_version))
        except grpc.RpcError as exc:
            return _failed(exc)
    console.print(f"stored fleet policy version {stored.version} (was "
                  f"{before.version if before.version else 'the built-in default'}); the planner applies it "
                  "from its next admission pass")
    console.print(escape(policy_summary(stored)))
    return 0
