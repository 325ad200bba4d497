"""PlannerService over real gRPC with real Celery workers: Plan -> GetPlanOperation -> GetPlan, tenancy,
fail-fast checks, final failures, WhatIf without the queue, Compare, and exactly one plan per request
when the worker that stored it is killed before it could complete the request."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from ballast.v1 import model_pb2, plan_pb2, queue_pb2, services_pb2, store_pb2
from services.planner.celery_app import HOLD_AFTER_ENV, TASK, make_app
from services.profiler.projection import analytical_profile
from services.specs.fleet import load_fleet
from tests.harness import ROOT, kill_group, make_settings, spawn_cli, start_plane, wait_for

pytestmark = pytest.mark.slow

TITAN = "nvidia-titan-rtx-24gb"
FLEET = load_fleet(ROOT / "examples" / "fleet-8xTITAN.yaml", dtype="fp32")
DONE = (queue_pb2.REQUEST_STATE_SUCCEEDED, queue_pb2.REQUEST_STATE_FAILED)


def gpt(name: str) -> model_pb2.ModelSpec:
    """gpt-tiny's shape; the vocabulary differs per name, as the store matches identical specs by content."""
    vocab = 1024 + 64 * (int.from_bytes(name.encode(), "big") % 997)
    return model_pb2.ModelSpec(
        name=name, family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=4, hidden_size=128, num_heads=4, vocab_size=vocab,
                                                seq_length=128, tie_embeddings=True))


def stored_profile(client, name: str):
    """A small analytical GPT profile on the fleet's device, stored through the store as the caller."""
    model = client.store.CreateModel(store_pb2.CreateModelRequest(spec=gpt(name)))
    profile = analytical_profile(gpt(name), TITAN, "fp32", model_id=model.id, model_signature=model.signature)
    return client.store.CreateProfile(store_pb2.CreateProfileRequest(profile=profile))


def plan_request(profile_id: str, **kw) -> services_pb2.PlanRequest:
    return services_pb2.PlanRequest(profile_id=profile_id, fleet=FLEET, **kw)


def settle(client, request_id: str) -> services_pb2.PlanOperation:
    return wait_for(lambda: (op := client.planner.GetPlanOperation(store_pb2.GetRequest(id=request_id)))
                    .request.state in DONE and op, what=f"request {request_id} to finish")


def count(client, sql: str) -> int:
    return int(client.store.Query(store_pb2.QueryRequest(sql=sql)).rows[0][0])


def expect(code: grpc.StatusCode, fn, *args, **kw) -> str:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def settings_for(tmp: Path):
    return make_settings(tmp, queue=f"planner-{uuid.uuid4().hex[:8]}", lease_seconds=2.0, sweep_interval_s=0.5,
                         visibility_timeout_s=6.0, worker_heartbeat_s=0.5)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = start_plane(settings_for(tmp_path_factory.mktemp("plans")), services=("store", "planner"))
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def worker(plane, tmp_path_factory):
    proc = spawn_cli(plane.settings, "worker", log=tmp_path_factory.mktemp("worker") / "worker.log")
    yield proc
    kill_group(proc)


@pytest.fixture(scope="module")
def tenants(plane):
    with plane.client() as admin:
        return tuple(admin.store.CreateTenant(store_pb2.CreateTenantRequest(name=n)).token
                     for n in ("plan-a", "plan-b"))


def test_plan_round_trip_through_a_real_worker(plane, worker, tenants) -> None:
    token_a, token_b = tenants
    with plane.client(token=token_a) as a, plane.client(token=token_b) as b, plane.client() as admin:
        profile = stored_profile(a, "gpt-round-trip")
        op = a.planner.Plan(plan_request(profile.id, global_batch_size=64))
        assert op.request.kind == "planner.plan" and not op.plan_id
        done = settle(a, op.request.id)
        assert done.request.state == queue_pb2.REQUEST_STATE_SUCCEEDED, done.request.error
        assert done.plan_id and done.request.attempts == 1
        plan = a.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
        assert plan.tenant_id == profile.tenant_id and plan.profile_id == profile.id
        assert plan.model_id == profile.model_id and not plan.job_id and plan.global_batch_size == 64
        assert [layer.layer_index for layer in plan.layers] == list(range(len(profile.layers)))
        assert plan.explanation.startswith("Chosen: ") and plan.fleet == FLEET
        assert {"DDP", "ZeRO-3"} <= {alt.name for alt in plan.alternatives}
        # Executors on no host yet: pipeline x data parallel only (the plan must be runnable).
        assert all(layer.tp == 1 and layer.sdp == 1 for layer in plan.layers)

        again = a.planner.Plan(plan_request(profile.id, global_batch_size=64))  # same content: same request
        assert again.request.id == op.request.id and again.plan_id == done.plan_id
        assert count(admin, f"SELECT count(*) FROM plans WHERE request_id = '{op.request.id}'") == 1
        assert count(admin, f"SELECT count(*) FROM plan_layers WHERE plan_id = '{done.plan_id}'") == len(plan.layers)
        assert count(admin, f"SELECT count(*) FROM plan_candidates WHERE plan_id = '{done.plan_id}'") == len(
            plan.alternatives)

        compared = a.planner.Compare(services_pb2.ComparePlansRequest(plan_ids=[done.plan_id]))
        assert compared.best_plan_id == done.plan_id and compared.plans[0].relative_throughput == 1.0
        assert compared.plans[0].prediction == plan.prediction and compared.plans[0].devices == 8

        # Tenant b sees none of it, exactly like unknown ids.
        expect(grpc.StatusCode.NOT_FOUND, b.planner.GetPlan, store_pb2.GetRequest(id=done.plan_id))
        expect(grpc.StatusCode.NOT_FOUND, b.planner.GetPlanOperation, store_pb2.GetRequest(id=op.request.id))
        expect(grpc.StatusCode.NOT_FOUND, b.planner.Compare,
               services_pb2.ComparePlansRequest(plan_ids=[done.plan_id]))


def test_another_tenants_profile_is_not_found_and_nothing_is_queued(plane, tenants) -> None:
    token_a, token_b = tenants
    with plane.client(token=token_a) as a, plane.client(token=token_b) as b:
        profile = stored_profile(a, "gpt-private")
        for rpc in (b.planner.Plan, b.planner.WhatIf):
            assert "profile" in expect(grpc.StatusCode.NOT_FOUND, rpc, plan_request(profile.id))
        mine = b.store.ListRequests(store_pb2.ListRequestsRequest(kind="planner.plan")).requests
        assert not [r for r in mine if profile.id in r.payload_json]


def test_bad_requests_fail_fast_naming_the_field(plane) -> None:
    with plane.client() as client:
        profile = stored_profile(client, "gpt-bad-input")
        empty_fleet = plan_request(profile.id)
        empty_fleet.fleet.nodes = 0
        assert "fleet" in expect(grpc.StatusCode.INVALID_ARGUMENT, client.planner.Plan, empty_fleet)
        other_device = plan_request(profile.id)
        other_device.fleet.CopyFrom(load_fleet(ROOT / "examples" / "fleet-2x8xA100.yaml", dtype="fp32"))
        details = expect(grpc.StatusCode.FAILED_PRECONDITION, client.planner.Plan, other_device)
        assert "profile_id" in details and "nvidia-a100-80gb" in details and "project" in details
        expect(grpc.StatusCode.NOT_FOUND, client.planner.Plan, plan_request("prf-doesnotexist"))
        assert "plan_ids" in expect(grpc.StatusCode.INVALID_ARGUMENT, client.planner.Compare,
                                    services_pb2.ComparePlansRequest())
        echo = client.planner.Echo(services_pb2.EchoRequest(text="not a plan"))
        expect(grpc.StatusCode.INVALID_ARGUMENT, client.planner.GetPlanOperation, store_pb2.GetRequest(id=echo.id))
        assert count(client, f"SELECT count(*) FROM queued_requests WHERE payload_json LIKE '%{profile.id}%'") == 0


def test_a_search_that_cannot_succeed_fails_once_with_its_reason(plane, worker) -> None:
    """Nothing fits 1 MiB per device: deterministic, so the request is FAILED at once, not retried."""
    with plane.client() as client:
        profile = stored_profile(client, "gpt-too-big")
        op = client.planner.Plan(plan_request(profile.id, memory_budget_bytes=1 << 20, global_batch_size=8))
        done = settle(client, op.request.id)
        assert done.request.state == queue_pb2.REQUEST_STATE_FAILED and not done.plan_id
        assert done.request.attempts == 1 and "memory_budget_bytes" in done.request.error
        assert "MiB per device" in done.request.error
        assert count(client, f"SELECT count(*) FROM plans WHERE profile_id = '{profile.id}'") == 0


def test_a_request_enqueued_by_hand_for_another_tenants_profile_fails(plane, worker, tenants) -> None:
    """A tenant can store any request kind directly; the worker (acting for the platform) checks ownership."""
    token_a, token_b = tenants
    with plane.client(token=token_a) as a, plane.client(token=token_b) as b, plane.client() as admin:
        profile = stored_profile(a, "gpt-smuggled")
        payload = {"profile_id": profile.id, "fleet": MessageToDict(FLEET, preserving_proto_field_name=True)}
        stored = b.store.EnqueueRequest(store_pb2.EnqueueRequestRequest(
            kind="planner.plan", payload_json=json.dumps(payload))).request
        make_app(plane.settings).send_task(TASK, args=[stored.id], queue=plane.settings.queue)
        done = settle(b, stored.id)
        assert done.request.state == queue_pb2.REQUEST_STATE_FAILED and "not found" in done.request.error
        assert count(admin, f"SELECT count(*) FROM plans WHERE profile_id = '{profile.id}'") == 0


def test_what_if_answers_without_the_queue_and_stores_nothing(plane) -> None:
    with plane.client() as client:
        profile = stored_profile(client, "gpt-what-if")
        before = [count(client, f"SELECT count(*) FROM {t}") for t in ("queued_requests", "plans")]
        plan = client.planner.WhatIf(plan_request(profile.id, global_batch_size=32), timeout=60)
        assert not plan.id and plan.profile_id == profile.id and plan.global_batch_size == 32
        assert plan.explanation.startswith("Chosen: ") and plan.layers
        assert [count(client, f"SELECT count(*) FROM {t}") for t in ("queued_requests", "plans")] == before


def test_a_worker_killed_after_storing_its_plan_leaves_exactly_one_plan(tmp_path: Path) -> None:
    """SIGKILL between CreatePlan and CompleteRequest: the re-run finds the plan under the request's id."""
    plane = start_plane(settings_for(tmp_path / "data"), services=("store", "planner"))
    doomed = spawn_cli(plane.settings, "worker", extra_env={HOLD_AFTER_ENV: "120"}, log=tmp_path / "doomed.log")
    rescuer = None
    try:
        with plane.client() as client:
            profile = stored_profile(client, "gpt-survivor")
            op = client.planner.Plan(plan_request(profile.id, global_batch_size=64))
            rows = f"SELECT count(*) FROM plans WHERE request_id = '{op.request.id}'"
            wait_for(lambda: count(client, rows) == 1, what="the doomed worker to store its plan")
            running = client.planner.GetPlanOperation(store_pb2.GetRequest(id=op.request.id)).request
            assert running.state == queue_pb2.REQUEST_STATE_RUNNING and running.lease_owner.endswith(f":{doomed.pid}")
            stored_id = client.store.Query(store_pb2.QueryRequest(
                sql=f"SELECT id FROM plans WHERE request_id = '{op.request.id}'")).rows[0][0]
            kill_group(doomed)  # stored, never completed: no ack, no completion, no renewal
            rescuer = spawn_cli(plane.settings, "worker", log=tmp_path / "rescuer.log")
            done = settle(client, op.request.id)
            assert done.request.state == queue_pb2.REQUEST_STATE_SUCCEEDED, done.request.error
            assert done.request.attempts == 2 and done.request.requeues >= 1
            assert done.plan_id == stored_id and count(client, rows) == 1
            assert count(client, f"SELECT count(*) FROM plans WHERE profile_id = '{profile.id}'") == 1
            plan = client.planner.GetPlan(store_pb2.GetRequest(id=done.plan_id))
            assert plan.engine != plan_pb2.PLAN_ENGINE_UNSPECIFIED
    finally:
        kill_group(doomed)
        if rescuer:
            kill_group(rescuer)
        plane.stop()
