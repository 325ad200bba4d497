"""The audit log's writer and the one rule of which RPCs change state, then the log end to end: real servers
record who called what, when and how it ended, as rows anyone with the right role can read."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ballast.v1 import common_pb2, services_pb2, store_pb2
from services.runtime import rpcs
from services.runtime.audit import AuditLog
from services.runtime.auth import Principal
from tests.harness import Plane, in_process_cli, make_settings, proto_rpcs, start_plane, wait_for
from tests.store_builders import gpt, job_spec

# Every RPC that changes state, by name: a new RPC is classified here on purpose (viewers, audit, retries).
WRITES = {
    "ExecutorControl/Connect", "FleetService/SetPolicy", "JobService/Cancel", "JobService/Export",
    "JobService/Submit",
    "PlannerService/Echo", "PlannerService/Plan", "ProfilerService/Calibrate", "ProfilerService/Profile",
    "ProfilerService/ProfileStream", "ProfilerService/ProjectProfile", "StoreService/AcquireLeases",
    "StoreService/AppendJobEvent", "StoreService/ClaimRequest", "StoreService/ClearHostDegraded",
    "StoreService/CompleteRequest", "StoreService/CreateCheckpoint", "StoreService/CreateJob",
    "StoreService/CreateQueuedJob",
    "StoreService/CreateModel", "StoreService/CreatePlan", "StoreService/CreateProfile", "StoreService/CreateTenant",
    "StoreService/EndLeases", "StoreService/EnqueueRequest", "StoreService/MarkHostDegraded",
    "StoreService/MorphResumed", "StoreService/ReapExpiredLeases", "StoreService/RecordAudit",
    "StoreService/RecordCalibration", "StoreService/RecordEvaluation", "StoreService/RecordLayerMigration",
    "StoreService/RecordMorph",
    "StoreService/RecordWorkerHeartbeat", "StoreService/RegisterHost", "StoreService/RenewLease",
    "StoreService/RotateTenantToken", "StoreService/SetFleetPolicy", "StoreService/TouchHosts",
    "StoreService/TransitionJob",
    "StoreService/UpdateCheckpoints", "StoreService/UpdateHostState", "StoreService/WriteIterationMetrics",
}


def test_which_rpcs_change_state_is_decided_on_purpose() -> None:
    found = {rpc.removeprefix("ballast.v1.") for rpc in proto_rpcs() if rpcs.changes_state(rpc.split("/")[1])}
    assert found == WRITES


def test_platform_telemetry_is_audited_only_when_someone_else_writes_it() -> None:
    admin, member = Principal("t0", "admin", admin=True), Principal("t1", "team-a")
    assert not rpcs.audited("WriteIterationMetrics", admin) and rpcs.audited("WriteIterationMetrics", member)
    assert rpcs.audited("Submit", admin) and rpcs.audited("Submit", None)  # a refused caller too
    assert not rpcs.audited("ListJobs", member)
    beat = store_pb2.UpdateHostStateRequest(id="hst-1", heartbeat=True)
    assert not rpcs.audited("UpdateHostState", admin, beat) and rpcs.audited("UpdateHostState", member, beat)
    assert rpcs.audited("UpdateHostState", admin, store_pb2.UpdateHostStateRequest(id="hst-1", state=2))
    touch = store_pb2.TouchHostsRequest(host_ids=["hst-1"])
    assert not rpcs.audited("TouchHosts", admin, touch) and rpcs.audited("TouchHosts", member, touch)


def rec(n: int) -> store_pb2.AuditRecord:
    return store_pb2.AuditRecord(service="s", method=f"M{n}")


class Sink:
    def __init__(self) -> None:
        self.down = False
        self.batches: list[list[str]] = []

    def __call__(self, records: list[store_pb2.AuditRecord]) -> None:
        if self.down:
            raise ConnectionError("store down")
        self.batches.append([r.method for r in records])


def test_records_wait_while_the_store_is_down_and_are_sent_once_it_is_back() -> None:
    sink = Sink()
    audit = AuditLog(sink, "planner", flush_s=3600)  # the thread never flushes on its own here
    sink.down = True
    for n in range(3):
        audit.record(rec(n))
    assert not audit.flush() and audit.pending == 3
    sink.down = False
    assert audit.flush() and audit.pending == 0
    assert sink.batches == [["M0", "M1", "M2"]]
    audit.record(rec(3))
    audit.close()  # shutdown sends what is left
    assert sink.batches[-1] == ["M3"] and audit.pending == 0


def test_every_record_gets_a_uid_and_its_server() -> None:
    sink = Sink()
    audit = AuditLog(sink, "profiler", flush_s=3600)
    first, second = rec(0), rec(1)
    audit.record(first)
    audit.record(second)
    assert first.server == second.server == "profiler" and first.uid and first.uid != second.uid
    audit.close()


def test_a_full_buffer_drops_and_counts() -> None:
    sink = Sink()
    sink.down = True
    audit = AuditLog(sink, "store", flush_s=3600, max_pending=2)
    for n in range(5):
        audit.record(rec(n))
    assert (audit.pending, audit.dropped) == (2, 3)
    sink.down = False
    audit.close()
    assert sink.batches == [["M0", "M1"]]


# --- end to end ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plane() -> Iterator[Plane]:
    with tempfile.TemporaryDirectory() as data:
        plane = start_plane(make_settings(Path(data), sweep_interval_s=60.0), send=lambda request_id: None)
        try:
            yield plane
        finally:
            plane.stop()


def audit_rows(plane: Plane, **match: str) -> list[store_pb2.AuditRecord]:
    found = plane.store().list_audit(store_pb2.ListAuditRequest(
        page=common_pb2.PageRequest(page_size=1000))).records
    return [r for r in found if all(getattr(r, k) == v for k, v in match.items())]


def test_state_changing_calls_are_rows_with_who_what_when_and_result(plane: Plane) -> None:
    admin = plane.store()
    team = admin.create_tenant(store_pb2.CreateTenantRequest(name="audited"))
    dash = admin.create_tenant(store_pb2.CreateTenantRequest(name="audit-dash", role=common_pb2.TENANT_ROLE_VIEWER))
    with plane.client(team.token) as client:
        job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec("audited-job", model=gpt())))
        client.jobs.Get(store_pb2.GetRequest(id=job.id))  # a read: never a row
        client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=job.id, reason="done"))
        with pytest.raises(grpc.RpcError) as err:
            client.jobs.Cancel(services_pb2.CancelJobRequest(job_id="job-0000000000000000"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with plane.client(dash.token) as client, pytest.raises(grpc.RpcError) as err:
        client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec("viewer-job", model=gpt())))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with plane.client("blt_not-a-token") as client, pytest.raises(grpc.RpcError):
        client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=job.id))

    def planner_rows() -> list[store_pb2.AuditRecord]:
        return [r for r in audit_rows(plane, server="planner") if r.method in ("Submit", "Cancel")]

    wait_for(lambda: len(planner_rows()) >= 5, timeout=20, what="five planner rows in the audit log")
    rows = [(r.tenant_name, r.role, r.method, r.target, r.code) for r in reversed(planner_rows())]
    member, viewer = common_pb2.TENANT_ROLE_MEMBER, common_pb2.TENANT_ROLE_VIEWER
    assert rows == [
        ("audited", member, "Submit", job.id, "OK"),
        ("audited", member, "Cancel", job.id, "OK"),
        ("audited", member, "Cancel", "job-0000000000000000", "NOT_FOUND"),
        ("audit-dash", viewer, "Submit", "viewer-job", "PERMISSION_DENIED"),
        ("", common_pb2.TENANT_ROLE_UNSPECIFIED, "Cancel", job.id, "UNAUTHENTICATED"),
    ]
    submit = planner_rows()[-1]
    assert submit.at.seconds > 0 and submit.duration_ms > 0 and submit.peer and submit.service == (
        "ballast.v1.JobService")
    # the store records its own state-changing calls: the admin creating the tenants, the planner's writes
    wait_for(lambda: audit_rows(plane, server="store", method="CreateQueuedJob", target=job.id), timeout=20,
             what="the store's CreateQueuedJob row (Submit's job and its prepare request)")
    created = {r.target for r in audit_rows(plane, server="store", method="CreateTenant")}
    assert {team.tenant.id, dash.tenant.id} <= created
    # the member reads its own rows only; the viewer everyone's
    mine = plane.store(team.token).list_audit(store_pb2.ListAuditRequest()).records
    assert mine and {r.tenant_id for r in mine} == {team.tenant.id}
    everyone = plane.store(dash.token).list_audit(store_pb2.ListAuditRequest()).records
    assert {team.tenant.id, dash.tenant.id, ""} <= {r.tenant_id for r in everyone}


def test_sql_reads_the_audit_log(plane: Plane) -> None:
    wait_for(lambda: audit_rows(plane, method="CreateTenant"), timeout=20, what="a CreateTenant row")
    rows = plane.store().query(store_pb2.QueryRequest(
        sql="SELECT tenant_name, method, code FROM audit_log WHERE method = 'CreateTenant' ORDER BY id")).rows
    assert rows and all(list(r)[1:] == ["CreateTenant", "OK"] for r in rows)


def test_the_cli_creates_a_viewer_and_reads_the_audit_log(plane: Plane, monkeypatch, capsys) -> None:
    ballast = in_process_cli(plane.settings, monkeypatch, capsys)
    code, out, _ = ballast("tenant", "create", "cli-dash", "--role", "viewer")
    assert code == 0 and "viewer" in out
    token = out.strip().splitlines()[-1]
    assert plane.store().authenticate(store_pb2.AuthenticateRequest(token=token)).role == (
        common_pb2.TENANT_ROLE_VIEWER)
    wait_for(lambda: audit_rows(plane, method="CreateTenant", tenant_name="admin"), timeout=20,
             what="the CLI's CreateTenant row")
    code, out, _ = ballast("audit", "--method", "CreateTenant", "--json")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and records and all(r["method"] == "CreateTenant" for r in records)
    code, out, _ = ballast("audit", "--method", "CreateTenant", "--since", "10")
    assert code == 0 and "CreateTenant" in out and "admin" in out and "store" in out
