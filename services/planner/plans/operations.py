"""PlannerService logic without grpc: check and queue a plan search, run it on a worker, read plans back.

A search is queued work (queue/durable.py): the servicer checks what is cheap to check (the profile exists and
is the caller's, the fleet has devices of the profile's kind) so bad input fails in the call, then
stores a "planner.plan" request; identical (profile, fleet, options, executors) from one tenant are one
request, hence one plan. A worker runs `run_plan`, which stores the plan under the request's id as
CreatePlan's idempotency key: a search re-run after its worker died (lease expired, broker redelivery)
gets the stored plan back instead of a second row. The worker acts for the platform, so `run_plan`
checks the profile belongs to the tenant that queued the request (the store recorded who), since a
tenant can enqueue a request of any kind directly in the store.

WhatIf is the same search run synchronously over the full strategy space and not stored: it answers
"what would this fleet give" for fleets nobody owns yet, and storing every exploration would bury the
plans jobs use; Plan stores.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import (
    fleet_pb2,
    plan_pb2,
    profile_pb2,
    queue_pb2,
    services_pb2,
    store_pb2,
)
from services.planner.plans.fleet import executor_dims
from services.planner.plans.make import PlanInputs, make_plan, search_dims
from services.planner.plans.memo import PLANS
from services.planner.queue import durable
from services.runtime.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from services.runtime.store_api import Store
from services.specs.ranges import check_bounds

KIND = "planner.plan"
MAX_COMPARED = 50
WHAT_IF_MAX_S = 300.0  # a WhatIf call without a deadline still ends
PROJECT_FIX = ("profile for the fleet's device: `ballast profile SPEC --project-to {kind}` (measured here, projected), "
               "ProfilerService.ProjectProfile, or ProfileRequest.analytical with device_kind={kind}")
Deadline = Callable[[], float | None]


def check_request(request: services_pb2.PlanRequest) -> None:
    """What needs no store: every number in its range, a profile id, a fleet with devices and memory, known enum
    values."""
    check_bounds(request)
    if not request.profile_id:
        raise InvalidArgument("required", field="profile_id", fix="profile the model first (`ballast profile`)")
    fleet = request.fleet
    if not request.HasField("fleet") or fleet.nodes < 1 or fleet.devices_per_node < 1:
        raise InvalidArgument("fleet has no devices", field="fleet", fix="set nodes and devices_per_node >= 1")
    if not fleet.device.kind:
        raise InvalidArgument("required", field="fleet.device.kind", fix="name a catalog device, e.g. A100-80GB")
    if not fleet.device.memory_bytes and not request.memory_budget_bytes:
        raise InvalidArgument("no device memory and no budget", field="memory_budget_bytes",
                              fix="set fleet.device.memory_bytes or memory_budget_bytes")
    if request.engine not in plan_pb2.PlanEngine.values():
        raise InvalidArgument(f"unknown engine {request.engine}", field="engine", fix="GALVATRON, VARUNA or unset")
    if request.schedule not in plan_pb2.Schedule.values():
        raise InvalidArgument(f"unknown schedule {request.schedule}", field="schedule", fix="GPIPE, 1F1B or VARUNA")


def check_profile(profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet) -> None:
    """A profile prices layers on its own device: planning another device's fleet with it would be wrong
    by the ratio of the two devices, silently. It must be measured on, or projected to, the fleet's kind."""
    if not profile.layers:
        raise FailedPrecondition(f"profile {profile.id} has no layers", field="profile_id",
                                 fix="profile the model again")
    if profile.device.kind != fleet.device.kind:
        raise FailedPrecondition(
            f"profile {profile.id} is for {profile.device.kind!r} but the fleet has {fleet.device.kind!r}",
            field="profile_id", fix=PROJECT_FIX.format(kind=fleet.device.kind),
        )


def payload_of(request: services_pb2.PlanRequest, dims: tuple[str, ...]) -> dict[str, Any]:
    """The queued request's JSON (its content is the dedupe key). No tenant: the store records the caller."""
    return {
        "profile_id": request.profile_id,
        "fleet": MessageToDict(request.fleet, preserving_proto_field_name=True),
        "global_batch_size": request.global_batch_size,
        "memory_budget_bytes": request.memory_budget_bytes,
        "engine": plan_pb2.PlanEngine.Name(request.engine),
        "schedule": plan_pb2.Schedule.Name(request.schedule),
        "runnable_dims": list(dims),
    }


def inputs_of(payload: dict[str, Any], *, what_if: bool = False):
    """PlanInputs from a payload (or from payload_of a PlanRequest, for WhatIf)."""
    return PlanInputs(
        global_batch_size=int(payload.get("global_batch_size", 0)),
        memory_budget_bytes=int(payload.get("memory_budget_bytes", 0)),
        engine=plan_pb2.PlanEngine.Value(payload.get("engine", "PLAN_ENGINE_UNSPECIFIED")),
        schedule=plan_pb2.Schedule.Value(payload.get("schedule", "SCHEDULE_UNSPECIFIED")),
        runnable_dims=search_dims(payload.get("runnable_dims", ("dp",)))[0],
        offload=search_dims(payload.get("runnable_dims", ()))[1],
        harmony=search_dims(payload.get("runnable_dims", ()))[2],
        what_if=what_if,
    )


def operation(request: queue_pb2.QueuedRequest) -> services_pb2.PlanOperation:
    op = services_pb2.PlanOperation(request=request)
    if request.state == queue_pb2.REQUEST_STATE_SUCCEEDED and request.result_json:
        op.plan_id = str(json.loads(request.result_json).get("plan_id", ""))
    return op


def submit(store: Store, request: services_pb2.PlanRequest,
           send: durable.Send) -> services_pb2.PlanOperation:
    """Check, then queue the search as the caller (`store` forwards the caller's token): another tenant's
    profile answers NOT_FOUND here, exactly like an unknown one."""
    check_request(request)
    profile = store.get_profile(store_pb2.GetRequest(id=request.profile_id))
    check_profile(profile, request.fleet)
    return operation(durable.submit(store, KIND, payload_of(request, executor_dims(store)), send))


def get_operation(store: Store, request: store_pb2.GetRequest) -> services_pb2.PlanOperation:
    queued = store.get_queued_request(request)
    if queued.kind != KIND:
        raise InvalidArgument(f"request {queued.id} is a {queued.kind!r} request, not a plan search", field="id",
                              fix="use GetQueuedRequest for other requests")
    return operation(queued)


def run_plan(payload: dict[str, Any], task: durable.Task) -> dict[str, Any]:
    """The worker side: search, then store once under the request's id. Errors from make_plan are final."""
    profile = task.store.get_profile(store_pb2.GetRequest(id=str(payload.get("profile_id", ""))))
    _check_owner(task.store, profile, task.request.tenant_id)
    fleet = ParseDict(payload.get("fleet", {}), fleet_pb2.Fleet())
    plan = PLANS.plan(profile, fleet, inputs_of(payload))
    if task.lease_lost.is_set():  # another worker runs it now; its CreatePlan would return ours anyway
        raise durable.LeaseLost()
    stored = task.store.create_plan(store_pb2.CreatePlanRequest(plan=plan, request_id=task.request.id))
    return {"plan_id": stored.id}


def _check_owner(store: Store, profile: profile_pb2.Profile, tenant_id: str) -> None:
    """Only the profile's tenant (or the platform admin) may plan it; others learn nothing of it."""
    if profile.tenant_id == tenant_id:
        return
    if not store.get_tenant(store_pb2.GetRequest(id=tenant_id)).admin:
        raise NotFound(f"profile {profile.id!r} not found", field="profile_id")


class WhatIf:
    """Synchronous searches, one at a time on a thread of their own, each bounded by its caller's deadline.

    make_plan cannot be interrupted: a search that outlives its deadline answers DEADLINE_EXCEEDED and
    finishes in the background (one at most; later ones wait their turn, and leave if their deadline
    passes first). Small spaces take about a second.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="what-if")

    def __call__(self, store: Store, request: services_pb2.PlanRequest,
                 remaining: Deadline) -> plan_pb2.Plan:
        check_request(request)
        profile = store.get_profile(store_pb2.GetRequest(id=request.profile_id))
        check_profile(profile, request.fleet)
        inputs = inputs_of(payload_of(request, executor_dims(store)), what_if=True)
        future = self._pool.submit(make_plan, profile, request.fleet, inputs)
        left = remaining()
        try:
            return future.result(timeout=WHAT_IF_MAX_S if left is None else left)
        except FutureTimeout:
            future.cancel()
            raise DeadlineExceeded("the what-if search did not finish within the call's deadline",
                                   fix="allow a longer deadline, or queue it with Plan") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def compare(store: Store,
            request: services_pb2.ComparePlansRequest) -> services_pb2.ComparePlansResponse:
    """Headline predictions of stored plans, in the order asked, relative to the fastest that fits."""
    if not 1 <= len(request.plan_ids) <= MAX_COMPARED:
        raise InvalidArgument(f"{len(request.plan_ids)} plan ids", field="plan_ids",
                              fix=f"send 1 to {MAX_COMPARED} plan ids")
    plans = [store.get_plan(store_pb2.GetRequest(id=plan_id)) for plan_id in request.plan_ids]
    fitting = [p for p in plans if not p.prediction.out_of_memory]
    best = max(fitting, key=lambda p: p.prediction.throughput_samples_per_s, default=None)
    top = best.prediction.throughput_samples_per_s if best else 0.0
    reply = services_pb2.ComparePlansResponse(best_plan_id=best.id if best else "")
    for p in plans:
        reply.plans.add(
            plan_id=p.id, engine=p.engine, profile_id=p.profile_id, fleet_name=p.fleet.name,
            devices=p.fleet.nodes * p.fleet.devices_per_node, global_batch_size=p.global_batch_size,
            micro_batch_size=p.micro_batch_size, num_micro_batches=p.num_micro_batches,
            pipeline_stages=len(p.stages), schedule=p.schedule, prediction=p.prediction,
            relative_throughput=(p.prediction.throughput_samples_per_s / top
                                 if top and not p.prediction.out_of_memory else 0.0),
        )
    return reply
