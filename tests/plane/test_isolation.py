"""Tenant isolation, proven over every RPC in the protos (issue 22).

The RPCs are enumerated from the generated descriptors, and each needs an entry in CASES saying what it is:
a tenant's call on its own resources (another tenant gets NOT_FOUND, with the very text an unknown id gets),
a list (another tenant sees none of the owner's rows), an admin or agent call (a tenant gets
PERMISSION_DENIED), a call on shared platform data, or a call on the caller's own namespace. An RPC added to a
.proto without an entry fails here by name. Every call goes to real servers on loopback, streams included.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory, text_format
from google.protobuf.message import Message

from ballast.transport import agent_transport
from ballast.v1 import common_pb2, executor_pb2, fleet_pb2, job_pb2, queue_pb2, services_pb2, store_pb2
from services.runtime.rpcs import changes_state
from tests.conftest import fresh_database
from tests.harness import Plane, make_settings, proto_rpcs, start_plane, wait_for
from tests.store_builders import gpt, host, job_spec, plan_msg, profile_msg

TIMEOUT_S = 30.0
Code = grpc.StatusCode

# Who serves which service; a service missing here fails test_every_rpc_has_a_case.
SERVER_OF = {
    "ballast.v1.StoreService": "store",
    "ballast.v1.ProfilerService": "profiler",
    "ballast.v1.PlannerService": "planner",
    "ballast.v1.JobService": "planner",
    "ballast.v1.FleetService": "planner",
    "ballast.v1.ExecutorControl": "planner_agent",  # the planner's mutual-TLS port for agents
}


RPCS = proto_rpcs()


@dataclass(frozen=True)
class World:
    """Tenant A's resources (what tenant B must not reach) and the three callers' tokens."""

    admin: str
    token_a: str
    token_b: str
    viewer: str
    tenant: str
    model: str
    profile: str
    plan: str
    job: str
    checkpoint: str
    request: str
    lease: str
    morph: str
    host: str

    def ids(self) -> list[str]:
        """A's ids (the host is platform data, the tokens are the callers')."""
        return [getattr(self, f.name) for f in fields(self) if f.name not in ("admin", "token_b", "viewer", "host")]

    def fake(self) -> World:
        """The same world with every id of A's replaced by an unknown one of the same shape."""
        swap = {f.name: f"{getattr(self, f.name).split('-')[0]}-{uuid.uuid4().hex[:16]}" for f in fields(self)
                if f.name not in ("admin", "token_a", "token_b", "viewer")}
        return replace(self, token_a="blt_" + uuid.uuid4().hex, **swap)


# Kinds of RPC.
TENANT = "tenant"  # acts on A's resource named in the request: B gets `expect` (NOT_FOUND)
LIST = "list"  # lists the caller's rows: B sees none of A's
ADMIN = "admin"  # platform admin only: a tenant gets PERMISSION_DENIED
AGENT = "agent"  # executor agents (platform token) only: a tenant gets PERMISSION_DENIED
SHARED = "shared"  # platform data any caller reads (hosts, device catalog, policy): none of A's ids in it
OWN = "own"  # acts in the caller's own namespace, naming nobody else's resource


@dataclass(frozen=True)
class Case:
    kind: str
    build: Callable[[World], Message | Iterator[Message]]
    expect: Code = Code.NOT_FOUND
    owner_reads: bool = False  # TENANT: A's own call succeeds (safe to repeat: a read)
    shows: str = ""  # LIST/SHARED: the World field A's (or the admin's) answer must contain


def fleet() -> fleet_pb2.Fleet:
    return fleet_pb2.Fleet(name="cpu2", device=fleet_pb2.DeviceSpec(kind="cpu", memory_bytes=8 << 30),
                          devices_per_node=2, nodes=1)


def get(field: str) -> Callable[[World], Message]:
    return lambda w: store_pb2.GetRequest(id=getattr(w, field))


def morph(w: World) -> job_pb2.Morph:
    mp = job_pb2.Morph(job_id=w.job, cause="worker_lost", to_stages=1, to_replicas=1, failed_iteration=2)
    mp.detected_at.GetCurrentTime()
    mp.resumed_at.GetCurrentTime()
    return mp


def agent_hello(w: World) -> Iterator[executor_pb2.AgentMessage]:
    yield executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(host=host("iso-agent", ["cpu"])))


S, P, J, F, R, X = ("ballast.v1." + s for s in ("StoreService", "PlannerService", "JobService", "FleetService",
                                               "ProfilerService", "ExecutorControl"))
CASES: dict[str, Case] = {
    # --- store: tenants and auth
    f"{S}/CreateTenant": Case(ADMIN, lambda w: store_pb2.CreateTenantRequest(name="iso-probe")),
    f"{S}/GetTenant": Case(TENANT, get("tenant"), owner_reads=True),
    # B may not rotate (revoke) A's token; A's own rotation is tested in test_store_tenants (it would end A's)
    f"{S}/RotateTenantToken": Case(TENANT, lambda w: store_pb2.RotateTenantTokenRequest(tenant_id=w.tenant)),
    f"{S}/ListTenants": Case(ADMIN, lambda w: store_pb2.ListTenantsRequest()),
    # Asking about another tenant's token answers exactly like an unknown token: no oracle.
    f"{S}/Authenticate": Case(TENANT, lambda w: store_pb2.AuthenticateRequest(token=w.token_a),
                              expect=Code.UNAUTHENTICATED, owner_reads=True),
    # --- models, profiles, plans
    f"{S}/CreateModel": Case(OWN, lambda w: store_pb2.CreateModelRequest(spec=gpt("iso-b-model", layers=3))),
    f"{S}/GetModel": Case(TENANT, get("model"), owner_reads=True),
    f"{S}/ListModels": Case(LIST, lambda w: store_pb2.ListModelsRequest(), shows="model"),
    f"{S}/CreateProfile": Case(TENANT, lambda w: store_pb2.CreateProfileRequest(profile=profile_msg(w.model))),
    f"{S}/GetProfile": Case(TENANT, get("profile"), owner_reads=True),
    f"{S}/ListProfiles": Case(LIST, lambda w: store_pb2.ListProfilesRequest(model_id=w.model), shows="profile"),
    f"{S}/CreatePlan": Case(TENANT, lambda w: store_pb2.CreatePlanRequest(
        plan=plan_msg(w.model, profile_id=w.profile))),
    f"{S}/GetPlan": Case(TENANT, get("plan"), owner_reads=True),
    f"{S}/ListPlans": Case(LIST, lambda w: store_pb2.ListPlansRequest(), shows="plan"),
    # --- hosts (platform data: anyone reads, the admin writes)
    f"{S}/RegisterHost": Case(ADMIN, lambda w: store_pb2.RegisterHostRequest(host=host("iso-probe", ["cpu"]))),
    f"{S}/UpdateHostState": Case(ADMIN, lambda w: store_pb2.UpdateHostStateRequest(
        id=w.host, state=fleet_pb2.HOST_STATE_ONLINE)),
    f"{S}/TouchHosts": Case(ADMIN, lambda w: store_pb2.TouchHostsRequest(host_ids=[w.host])),
    f"{S}/GetHost": Case(SHARED, get("host"), shows="host"),
    f"{S}/ListHosts": Case(SHARED, lambda w: store_pb2.ListHostsRequest(), shows="host"),
    f"{S}/MarkHostDegraded": Case(ADMIN, lambda w: store_pb2.MarkHostDegradedRequest(id="hst-none", reason="x")),
    f"{S}/ClearHostDegraded": Case(ADMIN, lambda w: store_pb2.ClearHostDegradedRequest(id="hst-none", reason="x")),
    # --- jobs, events, progress
    f"{S}/CreateJob": Case(OWN, lambda w: store_pb2.CreateJobRequest(spec=job_spec("iso-b"))),
    f"{S}/CreateQueuedJob": Case(OWN, lambda w: store_pb2.CreateQueuedJobRequest(spec=job_spec("iso-b"),
                                                                               kind="iso.probe")),
    f"{S}/GetJob": Case(TENANT, get("job"), owner_reads=True),
    f"{S}/ListJobs": Case(LIST, lambda w: store_pb2.ListJobsRequest(), shows="job"),
    f"{S}/TransitionJob": Case(TENANT, lambda w: store_pb2.TransitionJobRequest(
        id=w.job, state=job_pb2.JOB_STATE_CANCELLED)),
    f"{S}/AppendJobEvent": Case(TENANT, lambda w: store_pb2.AppendJobEventRequest(
        event=job_pb2.JobEvent(job_id=w.job, type="NOTE", message="from b"))),
    f"{S}/ListJobEvents": Case(TENANT, lambda w: store_pb2.ListJobEventsRequest(job_id=w.job), owner_reads=True),
    f"{S}/WriteIterationMetrics": Case(TENANT, lambda w: store_pb2.WriteIterationMetricsRequest(
        metrics=[job_pb2.IterationMetric(job_id=w.job, iteration=1, iteration_time_s=1.0)])),
    f"{S}/ListIterationMetrics": Case(TENANT, lambda w: store_pb2.ListIterationMetricsRequest(job_id=w.job),
                                      owner_reads=True),
    f"{S}/RecordLayerMigration": Case(TENANT, lambda w: store_pb2.RecordLayerMigrationRequest(
        migration=job_pb2.LayerMigration(job_id=w.job, layer_index=0, from_stage=0, to_stage=1))),
    f"{S}/ListLayerMigrations": Case(TENANT, lambda w: store_pb2.ListLayerMigrationsRequest(job_id=w.job),
                                     owner_reads=True),
    f"{S}/RecordEvaluation": Case(TENANT, lambda w: store_pb2.RecordEvaluationRequest(
        evaluation=job_pb2.Evaluation(job_id=w.job, iteration=3, loss=1.0))),
    f"{S}/ListEvaluations": Case(TENANT, lambda w: store_pb2.ListEvaluationsRequest(job_id=w.job), owner_reads=True),
    f"{S}/CreateCheckpoint": Case(TENANT, lambda w: store_pb2.CreateCheckpointRequest(
        checkpoint=job_pb2.Checkpoint(job_id=w.job, iteration=3))),
    f"{S}/GetCheckpoint": Case(TENANT, get("checkpoint"), owner_reads=True),
    f"{S}/ListCheckpoints": Case(TENANT, lambda w: store_pb2.ListCheckpointsRequest(job_id=w.job),
                                 owner_reads=True),
    # the services mark checkpoints deleted (retention) or exported: platform admin only
    f"{S}/UpdateCheckpoints": Case(ADMIN, lambda w: store_pb2.UpdateCheckpointsRequest(job_id="job-none")),
    f"{S}/RecordMorph": Case(ADMIN, lambda w: store_pb2.RecordMorphRequest(morph=morph(w))),
    f"{S}/MorphResumed": Case(ADMIN, lambda w: store_pb2.MorphResumedRequest(id="mph-none")),
    f"{S}/ListMorphs": Case(LIST, lambda w: store_pb2.ListMorphsRequest(job_id=w.job), shows="morph"),
    # --- the durable queue and its workers
    f"{S}/EnqueueRequest": Case(OWN, lambda w: store_pb2.EnqueueRequestRequest(kind="iso.probe",
                                                                              payload_json='{"b": 1}')),
    f"{S}/GetQueuedRequest": Case(TENANT, get("request"), owner_reads=True),
    f"{S}/ListRequests": Case(LIST, lambda w: store_pb2.ListRequestsRequest(), shows="request"),
    f"{S}/ClaimRequest": Case(ADMIN, lambda w: store_pb2.ClaimRequestRequest(id="req-none", worker="w",
                                                                            lease_seconds=5)),
    f"{S}/RenewLease": Case(ADMIN, lambda w: store_pb2.RenewLeaseRequest(id="req-none", lease_token="t",
                                                                        lease_seconds=5)),
    f"{S}/CompleteRequest": Case(ADMIN, lambda w: store_pb2.CompleteRequestRequest(id="req-none", lease_token="t")),
    f"{S}/ReapExpiredLeases": Case(ADMIN, lambda w: store_pb2.ReapExpiredLeasesRequest()),
    f"{S}/RecordWorkerHeartbeat": Case(ADMIN, lambda w: store_pb2.RecordWorkerHeartbeatRequest(
        heartbeat=queue_pb2.WorkerHeartbeat(name="iso-worker"))),
    f"{S}/ListWorkers": Case(SHARED, lambda w: store_pb2.ListWorkersRequest()),
    # --- the shared fleet
    f"{S}/AcquireLeases": Case(ADMIN, lambda w: store_pb2.AcquireLeasesRequest(
        job_id="job-none", devices=[fleet_pb2.DeviceRef(host_id="hst-none", device_index=0)])),
    f"{S}/EndLeases": Case(ADMIN, lambda w: store_pb2.EndLeasesRequest(job_id="job-none")),
    f"{S}/ListLeases": Case(LIST, lambda w: store_pb2.ListLeasesRequest(), shows="lease"),
    f"{S}/GetPlacement": Case(TENANT, lambda w: store_pb2.GetPlacementRequest(job_id=w.job)),
    f"{S}/GetFleetPolicy": Case(SHARED, lambda w: store_pb2.GetFleetPolicyRequest()),
    f"{S}/SetFleetPolicy": Case(ADMIN, lambda w: store_pb2.SetFleetPolicyRequest()),
    f"{S}/RecordCalibration": Case(ADMIN, lambda w: store_pb2.RecordCalibrationRequest()),
    f"{S}/GetCalibration": Case(ADMIN, lambda w: store_pb2.GetCalibrationRequest(host_class="none")),
    f"{S}/ListCalibrations": Case(ADMIN, lambda w: store_pb2.ListCalibrationsRequest()),
    # --- the audit log: the services record (admin); a member reads its own calls
    f"{S}/RecordAudit": Case(ADMIN, lambda w: store_pb2.RecordAuditRequest()),
    f"{S}/ListAudit": Case(LIST, lambda w: store_pb2.ListAuditRequest(method="CreateModel"), shows="model"),
    # --- the admin's window on the database
    f"{S}/Query": Case(ADMIN, lambda w: store_pb2.QueryRequest(sql="SELECT 1")),
    f"{S}/GetSchemaStatus": Case(SHARED, lambda w: store_pb2.SchemaStatusRequest()),
    # --- profiler
    f"{R}/Profile": Case(TENANT, lambda w: services_pb2.ProfileRequest(model_id=w.model, device_kind="cpu",
                                                                       analytical=True)),
    f"{R}/ProfileStream": Case(TENANT, lambda w: services_pb2.ProfileRequest(model_id=w.model, device_kind="cpu",
                                                                             analytical=True)),
    f"{R}/ProjectProfile": Case(TENANT, lambda w: services_pb2.ProjectProfileRequest(
        profile_id=w.profile, device=fleet_pb2.DeviceSpec(kind="A100-80GB"))),
    f"{R}/ListDeviceKinds": Case(SHARED, lambda w: services_pb2.ListDeviceKindsRequest()),
    f"{R}/GetProfile": Case(TENANT, get("profile"), owner_reads=True),
    # an operator's measurement of the host: admin only (the admin's control call is refused for its 1 rank)
    f"{R}/Calibrate": Case(ADMIN, lambda w: services_pb2.CalibrateRequest(group_sizes=[1])),
    # checks a model the caller sends (a meta-device build in a worker process): nobody's rows are read or written
    f"{R}/Inspect": Case(OWN, lambda w: services_pb2.InspectRequest(model=gpt("iso-inspect", layers=2))),
    # --- planner
    f"{P}/Plan": Case(TENANT, lambda w: services_pb2.PlanRequest(profile_id=w.profile, fleet=fleet(),
                                                                 global_batch_size=8)),
    f"{P}/GetPlanOperation": Case(TENANT, get("request"), owner_reads=True),
    f"{P}/Echo": Case(OWN, lambda w: services_pb2.EchoRequest(text="from b")),
    f"{P}/GetQueuedRequest": Case(TENANT, get("request"), owner_reads=True),
    f"{P}/GetPlan": Case(TENANT, get("plan"), owner_reads=True),
    f"{P}/WhatIf": Case(TENANT, lambda w: services_pb2.PlanRequest(profile_id=w.profile, fleet=fleet(),
                                                                   global_batch_size=8)),
    f"{P}/Compare": Case(TENANT, lambda w: services_pb2.ComparePlansRequest(plan_ids=[w.plan]), owner_reads=True),
    # --- jobs
    f"{J}/Submit": Case(OWN, lambda w: services_pb2.SubmitJobRequest(spec=job_spec("iso-b-submit"))),
    f"{J}/Get": Case(TENANT, get("job"), owner_reads=True),
    f"{J}/List": Case(LIST, lambda w: store_pb2.ListJobsRequest(), shows="job"),
    f"{J}/Watch": Case(TENANT, lambda w: services_pb2.WatchJobRequest(job_id=w.job), owner_reads=True),
    f"{J}/Cancel": Case(TENANT, lambda w: services_pb2.CancelJobRequest(job_id=w.job, reason="b says so")),
    f"{J}/Export": Case(TENANT, lambda w: services_pb2.ExportRequest(job_id=w.job)),
    # --- fleet
    f"{F}/ListQueue": Case(LIST, lambda w: services_pb2.ListQueueRequest()),
    # The scheduler soon ends A's lease (its job is not running), so GetFleet's redaction of another tenant's
    # live lease is proven on its own below (test_the_fleet_view_hides_another_tenants_lease).
    f"{F}/GetFleet": Case(SHARED, lambda w: services_pb2.GetFleetRequest()),
    f"{F}/ListLeases": Case(LIST, lambda w: store_pb2.ListLeasesRequest(), shows="lease"),
    f"{F}/GetPolicy": Case(SHARED, lambda w: store_pb2.GetFleetPolicyRequest()),
    f"{F}/SetPolicy": Case(ADMIN, lambda w: store_pb2.SetFleetPolicyRequest()),
    # --- executor agents
    f"{X}/Connect": Case(AGENT, agent_hello),
}


@dataclass
class Reply:
    code: Code
    details: str
    message: Message | None


def call(plane: Plane, channels: dict[str, grpc.Channel], rpc: str, request, token: str | None) -> Reply:
    """One call of `rpc` with `token` as bearer (None: no authorization header); a stream's first message."""
    method = RPCS[rpc]
    service = rpc.split("/")[0]
    channel = channels[SERVER_OF[service]]
    out = message_factory.GetMessageClass(method.output_type)
    kind = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming
                                                                       else "unary")
    stub = getattr(channel, kind)(f"/{rpc}", request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=out.FromString)
    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    try:
        if not method.server_streaming:
            return Reply(Code.OK, "", stub(request, metadata=metadata, timeout=TIMEOUT_S))
        stream = stub(request, metadata=metadata, timeout=TIMEOUT_S)
        try:
            return Reply(Code.OK, "", next(stream))
        except StopIteration:
            return Reply(Code.OK, "", None)
        finally:
            stream.cancel()
    except grpc.RpcError as exc:
        return Reply(exc.code(), exc.details() or "", None)


def build_world(plane: Plane) -> World:
    """Tenants team-a and team-b, and one of each resource kind owned by team-a."""
    admin = plane.store()
    a_token = admin.create_tenant(store_pb2.CreateTenantRequest(name="team-a")).token
    b_token = admin.create_tenant(store_pb2.CreateTenantRequest(name="team-b")).token
    viewer = admin.create_tenant(store_pb2.CreateTenantRequest(name="dashboard",
                                                               role=common_pb2.TENANT_ROLE_VIEWER)).token
    a = plane.store(a_token)
    tenant = a.authenticate(store_pb2.AuthenticateRequest(token=a_token)).tenant_id
    model = a.create_model(store_pb2.CreateModelRequest(spec=gpt()))
    profile = a.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(model.id)))
    plan = a.create_plan(store_pb2.CreatePlanRequest(plan=plan_msg(model.id, profile_id=profile.id)))
    job = a.create_job(store_pb2.CreateJobRequest(spec=job_spec("iso-a", model=gpt())))
    checkpoint = a.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=job_pb2.Checkpoint(
        job_id=job.id, iteration=2, plan_version=1, complete=True,
        layers=[job_pb2.LayerCheckpoint(layer_index=0, uri=f"file:///c/{job.id}/iter-00000002/layer-00000.pt",
                                        bytes=1, sha256="0" * 64)])))
    a.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(
        metrics=[job_pb2.IterationMetric(job_id=job.id, iteration=1, iteration_time_s=1.0)]))
    a.record_layer_migration(store_pb2.RecordLayerMigrationRequest(
        migration=job_pb2.LayerMigration(job_id=job.id, layer_index=0, from_stage=0, to_stage=1)))
    with plane.client(a_token) as client:
        operation = client.planner.Plan(services_pb2.PlanRequest(profile_id=profile.id, fleet=fleet(),
                                                                  global_batch_size=8))
    vm = admin.register_host(store_pb2.RegisterHostRequest(host=host("iso-vm", ["cpu", "cpu"])))
    lease = admin.acquire_leases(store_pb2.AcquireLeasesRequest(
        job_id=job.id, devices=[fleet_pb2.DeviceRef(host_id=vm.id, device_index=0)])).leases[0]
    world = World(admin=plane.token, token_a=a_token, token_b=b_token, viewer=viewer, tenant=tenant, model=model.id,
                  profile=profile.id, plan=plan.id, job=job.id, checkpoint=checkpoint.id,
                  request=operation.request.id, lease=lease.id, morph="", host=vm.id)
    mp = admin.record_morph(store_pb2.RecordMorphRequest(morph=morph(world)))
    # the store records A's calls in the background: wait for A's CreateModel to be in the audit log
    wait_for(lambda: a.list_audit(store_pb2.ListAuditRequest(method="CreateModel")).records, timeout=10,
             what="team-a's CreateModel in the audit log")
    return replace(world, morph=mp.id)


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def plane(request) -> Iterator[Plane]:
    """The whole matrix runs on each database: scoping is SQL, and the two dialects must agree."""
    with tempfile.TemporaryDirectory() as data, fresh_database(request.param, Path(data)) as url:
        # This matrix sends some 250 bad tokens from one address; the limit on them is tested on its own
        # (tests/runtime/test_auth_failures.py), so here it is off.
        settings = make_settings(Path(data), sweep_interval_s=60.0, database_url=url, auth_failure_rate=0)
        plane = start_plane(settings, send=lambda request_id: None)
        try:
            yield plane
        finally:
            plane.stop()


@pytest.fixture(scope="module")
def world(plane) -> World:
    return build_world(plane)


@pytest.fixture(scope="module")
def channels(plane) -> Iterator[dict[str, grpc.Channel]]:
    opened = {name: plane.tls_channel(name) for name in ("store", "profiler", "planner")}
    # an agent's channel: the client certificate the local CA issues for the host it registers (iso-agent)
    opened["planner_agent"] = grpc.secure_channel(plane.settings.address("planner_agent"),
                                                  agent_transport(plane.settings, "iso-agent").credentials())
    yield opened
    for channel in opened.values():
        channel.close()


def case_for(rpc: str) -> Case:
    if rpc not in CASES:
        pytest.fail(f"{rpc} has no isolation case: add one to CASES in tests/plane/test_isolation.py saying who may "
                    "call it and what another tenant gets")
    return CASES[rpc]


def leaks(reply: Reply, world: World, request) -> list[str]:
    """A's ids (and A's tenant) found in a reply B got, other than those B itself named in the request."""
    text = text_format.MessageToString(reply.message) if reply.message is not None else ""
    text += reply.details
    asked = text_format.MessageToString(request) if isinstance(request, Message) else ""
    return [i for i in world.ids() if i and i in text and i not in asked]


# --- the matrix ----------------------------------------------------------------------------------------------


def test_every_rpc_has_a_case() -> None:
    missing = sorted(set(RPCS) - set(CASES))
    stale = sorted(set(CASES) - set(RPCS))
    unserved = sorted({rpc.split("/")[0] for rpc in RPCS} - set(SERVER_OF))
    assert not missing, f"RPCs without an isolation case (add them to CASES): {missing}"
    assert not stale, f"CASES names RPCs the protos no longer have: {stale}"
    assert not unserved, f"services with no server in SERVER_OF: {unserved}"
    assert {rpc.split("/")[0] for rpc in RPCS} == set(SERVER_OF)  # every service found, not only some


@pytest.mark.parametrize("rpc", sorted(RPCS))
def test_no_token_or_a_bad_one_is_unauthenticated(plane, channels, world, rpc: str) -> None:
    case = case_for(rpc)
    for token in (None, "", "blt_not-a-real-token"):
        request = case.build(world)
        reply = call(plane, channels, rpc, request, token)
        assert reply.code == Code.UNAUTHENTICATED, f"{rpc} with token {token!r}: {reply.code} {reply.details}"
        assert not leaks(reply, world, request), rpc


@pytest.mark.parametrize("rpc", sorted(RPCS))
def test_another_tenant_reaches_nothing(plane, channels, world, rpc: str) -> None:
    case = case_for(rpc)
    request = case.build(world)
    reply = call(plane, channels, rpc, request, world.token_b)
    seen = f"{rpc} as team-b: {reply.code} {reply.details!r}"
    if case.kind in (ADMIN, AGENT):
        assert reply.code == Code.PERMISSION_DENIED, seen
        assert "admin" in reply.details or "platform" in reply.details, seen  # the text says what is needed
    elif case.kind == TENANT:
        assert reply.code == case.expect, seen
    else:  # LIST, SHARED, OWN: allowed, and nothing of A's in the answer
        assert reply.code in (Code.OK, Code.NOT_FOUND), seen
    assert not leaks(reply, world, request), f"{seen} shows team-a's {leaks(reply, world, request)}"


@pytest.mark.parametrize("rpc", sorted(r for r in RPCS if CASES.get(r, Case(OWN, None)).kind == TENANT))
def test_not_found_says_the_same_for_a_real_and_an_unknown_id(plane, channels, world, rpc: str) -> None:
    """B learns nothing from the error text: A's real id and an unknown id answer alike once the id is masked."""
    case = CASES[rpc]
    fake = world.fake()
    real = call(plane, channels, rpc, case.build(world), world.token_b)
    unknown = call(plane, channels, rpc, case.build(replace(fake, token_b=world.token_b)), world.token_b)

    def masked(reply: Reply, w: World) -> str:
        text = reply.details
        for i in w.ids():
            text = text.replace(i, "<id>") if i else text
        return text

    assert (real.code, masked(real, world)) == (unknown.code, masked(unknown, fake)), rpc


@pytest.mark.parametrize("rpc", sorted(r for r in RPCS if CASES.get(r, Case(OWN, None)).owner_reads
                                       or CASES.get(r, Case(OWN, None)).shows))
def test_the_owner_does_reach_it(plane, channels, world, rpc: str) -> None:
    """The matrix means something: what B cannot reach, A (or, for platform data, the admin) can."""
    case = CASES[rpc]
    token = world.admin if case.kind == SHARED else world.token_a
    reply = call(plane, channels, rpc, case.build(world), token)
    assert reply.code == Code.OK, f"{rpc}: {reply.code} {reply.details}"
    if case.shows:
        assert getattr(world, case.shows) in text_format.MessageToString(reply.message), rpc


@pytest.mark.parametrize("rpc", sorted(r for r in RPCS if CASES.get(r, Case(OWN, None)).kind == ADMIN))
def test_the_admin_passes_the_admin_check(plane, channels, world, rpc: str) -> None:
    reply = call(plane, channels, rpc, CASES[rpc].build(world), world.admin)
    assert reply.code not in (Code.PERMISSION_DENIED, Code.UNAUTHENTICATED), f"{rpc}: {reply.code} {reply.details}"


# --- the viewer role --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rpc", sorted(r for r in RPCS if changes_state(r.split("/")[1])))
def test_a_viewer_changes_nothing(plane, channels, world, rpc: str) -> None:
    request = case_for(rpc).build(world)
    reply = call(plane, channels, rpc, request, world.viewer)
    assert reply.code == Code.PERMISSION_DENIED and "viewer" in reply.details, f"{rpc}: {reply.code} {reply.details}"


# What a viewer reads unlike the admin: SQL reads past the API (token hashes), and another's token is no business
VIEWER_REFUSED = {f"{S}/Query": Code.PERMISSION_DENIED, f"{S}/Authenticate": Code.UNAUTHENTICATED}


@pytest.mark.parametrize("rpc", sorted(r for r in RPCS if not changes_state(r.split("/")[1])))
def test_a_viewer_reads_what_the_admin_reads(plane, channels, world, rpc: str) -> None:
    """Every read answers a viewer as it answers the admin, A's rows included (a dashboard sees the fleet)."""
    case = case_for(rpc)
    as_admin = call(plane, channels, rpc, case.build(world), world.admin)
    as_viewer = call(plane, channels, rpc, case.build(world), world.viewer)
    seen = f"{rpc}: admin {as_admin.code} {as_admin.details!r}, viewer {as_viewer.code} {as_viewer.details!r}"
    assert as_viewer.code == VIEWER_REFUSED.get(rpc, as_admin.code), seen
    if case.shows and as_viewer.code == Code.OK and case.kind != SHARED and rpc != f"{S}/ListAudit":
        assert getattr(world, case.shows) in text_format.MessageToString(as_viewer.message), seen


def test_the_fleet_view_hides_another_tenants_lease() -> None:
    """GetFleet shows a device another tenant leases as busy (kind, since when), never whose job holds it."""
    from services.planner.jobs.fleet_view import visible_lease
    from services.runtime.auth import Principal

    lease = fleet_pb2.DeviceLease(id="lse-1", job_id="job-a", tenant_id="tnt-a", device_kind="cpu",
                                  device=fleet_pb2.DeviceRef(host_id="hst-1", device_index=0))
    lease.started_at.FromSeconds(100)
    assert visible_lease(lease, Principal("tnt-a", "team-a")) == lease
    assert visible_lease(lease, Principal("tnt-x", "admin", admin=True)) == lease
    hidden = visible_lease(lease, Principal("tnt-b", "team-b"))
    assert (hidden.id, hidden.job_id, hidden.tenant_id) == ("", "", "")
    assert (hidden.device, hidden.device_kind, hidden.started_at.seconds) == (lease.device, "cpu", 100)


def test_a_rotated_token_is_refused_by_every_service_within_seconds(plane, channels) -> None:
    """Revocation: the store forgets the old token at once, the planner and profiler once their token cache
    (5 s) lapses; the new token works everywhere."""
    import time

    admin = plane.client()
    created = admin.store.CreateTenant(store_pb2.CreateTenantRequest(name="iso-rotating"))
    probes = {f"{S}/ListJobs": store_pb2.ListJobsRequest(), f"{J}/List": store_pb2.ListJobsRequest(),
              f"{R}/ListDeviceKinds": services_pb2.ListDeviceKindsRequest()}
    assert all(call(plane, channels, rpc, req, created.token).code == Code.OK for rpc, req in probes.items())
    fresh = admin.store.RotateTenantToken(store_pb2.RotateTenantTokenRequest(tenant_id=created.tenant.id))
    rotated = time.monotonic()
    for rpc, req in probes.items():
        while call(plane, channels, rpc, req, created.token).code != Code.UNAUTHENTICATED:
            assert time.monotonic() - rotated < 15, f"{rpc} still takes the revoked token"
            time.sleep(0.2)
        assert call(plane, channels, rpc, req, fresh.token).code == Code.OK, rpc
