"""Plans: exact round trips, per-job versions that the database keeps unique, and request-id idempotency."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

from ballast.v1 import common_pb2, plan_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import AlreadyExists, InvalidArgument, NotFound
from tests.store_builders import page, plan_msg, profile_msg
from tests.store_fixtures import JS, Store, events, move, new_job


def test_plan_round_trip_versions_and_filters(store: Store):
    a = store.as_(store.a)
    job = new_job(store)
    prof = a.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(job.model_id)))
    sent = plan_msg(job.model_id, job_id=job.id, profile_id=prof.id)
    first = a.create_plan(store_pb2.CreatePlanRequest(plan=sent))
    assert first.id.startswith("pln-") and first.version == 1
    expected = plan_pb2.Plan()
    expected.CopyFrom(sent)
    expected.id, expected.tenant_id, expected.version = first.id, store.a.tenant_id, 1
    expected.created_at.CopyFrom(first.created_at)
    assert first == expected == a.get_plan(store_pb2.GetRequest(id=first.id))

    derived = plan_msg(job.model_id, job_id=job.id, profile_id=prof.id)
    derived.engine, derived.parent_plan_id = plan_pb2.PLAN_ENGINE_VPIPE, first.id
    second = a.create_plan(store_pb2.CreatePlanRequest(plan=derived))
    what_if = a.create_plan(store_pb2.CreatePlanRequest(plan=plan_msg(job.model_id)))
    assert second.version == 2 and what_if.version == 1 and what_if.job_id == ""

    def ids(**kw):
        return [p.id for p in a.list_plans(store_pb2.ListPlansRequest(**kw)).plans]

    assert ids() == [first.id, second.id, what_if.id]
    assert ids(job_id=job.id) == [first.id, second.id]
    assert ids(engine=plan_pb2.PLAN_ENGINE_VPIPE) == [second.id]
    assert ids(model_id=job.model_id, page=page(1)) == [first.id]
    assert ids(ids=[what_if.id, first.id, "pln-unknown"]) == [first.id, what_if.id]  # by id, in one call
    assert store.as_(store.b).list_plans(store_pb2.ListPlansRequest(ids=[first.id])).plans == []  # scoped
    with pytest.raises(InvalidArgument, match="at most 1000") as info:
        a.list_plans(store_pb2.ListPlansRequest(ids=[first.id] * 1001))
    assert info.value.field == "ids"

    adopted = move(store, job.id, JS.JOB_STATE_PROFILING)
    adopted = move(store, job.id, JS.JOB_STATE_PLANNING)
    adopted = move(store, job.id, JS.JOB_STATE_SCHEDULED, plan_id=second.id, event_type="PLAN_CHOSEN")
    assert (adopted.plan_id, adopted.plan_version) == (second.id, 2)
    assert events(store, job.id)[-1].attributes["plan_id"] == second.id
    with store.engine.connect() as conn:
        row = conn.execute(sa.text(f"SELECT engine, pipeline_degree FROM plans WHERE id = '{second.id}'")).one()
    assert tuple(row) == ("PLAN_ENGINE_VPIPE", 2)


def test_a_layer_keeps_its_dp_flavour(store: Store):
    """ZeRO-1 / ZeRO-2 layers read back as such (plan_layers.dp_sharding); an unknown flavour is refused."""
    a, job = store.as_(store.a), new_job(store)
    sent = plan_msg(job.model_id, job_id=job.id, layers=3)
    for layer, flavour in zip(sent.layers, (0, common_pb2.DP_SHARDING_ZERO1, common_pb2.DP_SHARDING_ZERO2),
                              strict=True):
        layer.dp, layer.dp_sharding = 2, flavour
    stored = a.get_plan(store_pb2.GetRequest(id=a.create_plan(store_pb2.CreatePlanRequest(plan=sent)).id))
    assert [x.dp_sharding for x in stored.layers] == [0, common_pb2.DP_SHARDING_ZERO1, common_pb2.DP_SHARDING_ZERO2]
    with store.engine.connect() as conn:
        names = conn.execute(sa.text(f"SELECT dp_sharding FROM plan_layers WHERE plan_id = '{stored.id}' "
                                     "ORDER BY layer_index")).scalars().all()
    assert names == ["DP_SHARDING_UNSPECIFIED", "DP_SHARDING_ZERO1", "DP_SHARDING_ZERO2"]
    sent.layers[2].dp_sharding = 77
    with pytest.raises(InvalidArgument) as err:
        a.create_plan(store_pb2.CreatePlanRequest(plan=sent))
    assert err.value.field == "plan.layers[2].dp_sharding"


def test_a_layer_keeps_its_sequence_parallelism(store: Store):
    a, job = store.as_(store.a), new_job(store)
    sent = plan_msg(job.model_id, job_id=job.id, layers=2)
    sent.layers[1].tp, sent.layers[1].sequence_parallel = 2, True
    stored = a.get_plan(store_pb2.GetRequest(id=a.create_plan(store_pb2.CreatePlanRequest(plan=sent)).id))
    assert [x.sequence_parallel for x in stored.layers] == [False, True]
    with store.engine.connect() as conn:
        flags = conn.execute(sa.text(f"SELECT sequence_parallel FROM plan_layers WHERE plan_id = '{stored.id}' "
                                     "ORDER BY layer_index")).scalars().all()
    assert [bool(f) for f in flags] == [False, True]


def test_create_plan_with_invalid_layer_writes_nothing(store: Store):
    job = new_job(store)
    for mutate, field in [
        (lambda pl: setattr(pl.layers[1], "layer_index", 0), "plan.layers[1].layer_index"),
        (lambda pl: setattr(pl.layers[1], "stage_index", 7), "plan.layers[1].stage_index"),
        (lambda pl: setattr(pl.layers[0], "tp", 0), "plan.layers[0].tp"),
    ]:
        bad = plan_msg(job.model_id, job_id=job.id)
        mutate(bad)
        with pytest.raises(InvalidArgument) as err:
            store.as_(store.a).create_plan(store_pb2.CreatePlanRequest(plan=bad))
        assert err.value.field == field
    assert store.count("plans") == store.count("plan_layers") == store.count("plan_candidates") == 0


# --- (job_id, version) is unique -------------------------------------------------------------------


def test_plan_versions_are_unique_per_job(store: Store):
    a = store.as_(store.a)
    job = new_job(store)

    def plan(**kw) -> plan_pb2.Plan:
        pl = plan_msg(job.model_id, **kw)
        return a.create_plan(store_pb2.CreatePlanRequest(plan=pl))

    seven = plan_msg(job.model_id, job_id=job.id)
    seven.version = 7
    assert a.create_plan(store_pb2.CreatePlanRequest(plan=seven)).version == 7
    with pytest.raises(AlreadyExists) as err:
        a.create_plan(store_pb2.CreatePlanRequest(plan=seven))
    assert err.value.field == "plan.version" and err.value.fix
    assert plan(job_id=job.id).version == 8  # version 0: the job's next
    assert [plan().version for _ in range(3)] == [1, 1, 1]  # what-if plans (no job) are unconstrained
    other = new_job(store, name="other")
    seven.job_id = other.id
    assert a.create_plan(store_pb2.CreatePlanRequest(plan=seven)).version == 7  # per job
    assert store.count("plans") == 6 and store.count("plan_layers") == 12
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:  # the database enforces it too
        conn.execute(sa.text(f"UPDATE plans SET version = 7 WHERE job_id = '{job.id}' AND version = 8"))


# --- CreatePlan is idempotent by request_id --------------------------------------------------------


def test_create_plan_with_a_request_id_stores_one_plan(store: Store):
    """A re-run search (same queued request id) gets the stored plan back; the key is per tenant."""
    a = store.as_(store.a)
    job = new_job(store)
    prof = a.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(job.model_id)))
    sent = plan_msg(job.model_id, profile_id=prof.id)

    def create(who: Principal, plan: plan_pb2.Plan, key: str = "req-1") -> plan_pb2.Plan:
        return store.as_(who).create_plan(store_pb2.CreatePlanRequest(plan=plan, request_id=key))

    first = create(store.a, sent)
    assert create(store.a, sent) == first
    assert create(store.admin, sent) == first  # the worker acts as the platform; the key is the model tenant's
    assert store.count("plans") == 1 and store.count("plan_layers") == 2 and store.count("plan_candidates") == 1
    assert create(store.a, sent, key="req-2").id != first.id  # another key, another plan
    other = plan_msg(job.model_id)  # no profile: not the plan stored under req-1
    with pytest.raises(AlreadyExists) as err:
        create(store.a, other)
    assert err.value.field == "request_id"
    b_job = new_job(store, who=store.b)
    b_plan = create(store.b, plan_msg(b_job.model_id))  # b's req-1 is its own key, and says nothing of a's
    assert b_plan.tenant_id == store.b.tenant_id and b_plan.id != first.id
    with pytest.raises(NotFound):  # and a's stored plan stays invisible to b through the key
        create(store.b, sent)
    assert store.count("plans") == 3
    plain = [a.create_plan(store_pb2.CreatePlanRequest(plan=sent)) for _ in range(2)]  # no key: no dedup
    assert plain[0].id != plain[1].id
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:  # the database enforces the key
        conn.execute(sa.text(f"UPDATE plans SET request_id = 'req-1' WHERE id = '{plain[0].id}'"))


def test_concurrent_create_plan_with_one_request_id_stores_one_plan(store: Store):
    """Two workers racing to store one request's plan: the loser of the insert gets the winner's plan."""
    job = new_job(store)
    sent = plan_msg(job.model_id)
    admin = store.as_(store.admin)
    barrier = threading.Barrier(4)
    ids: list[str] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            ids.append(admin.create_plan(store_pb2.CreatePlanRequest(plan=sent, request_id="req-race")).id)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(ids)) == 1 and len(ids) == 4
    assert store.count("plans") == 1


def test_offload_and_harmony_plans_read_back_exactly(store: Store):
    """Plan.offload (chunks) and Plan.harmony (Harmony's swap schedule) are kept whole (plans.offload / harmony)."""
    a, job = store.as_(store.a), new_job(store)
    chunked = plan_msg(job.model_id, job_id=job.id)
    chunked.offload.CopyFrom(plan_pb2.ChunkOffload(chunk_bytes=1 << 20, device_budget_bytes=8 << 20, chunks=12,
                                                   predicted_to_device_bytes=5 << 20))
    swapped = plan_msg(job.model_id, job_id=job.id)
    swapped.harmony.CopyFrom(plan_pb2.HarmonySwap(
        forward_micro_batch=2, forward_packs=[plan_pb2.LayerSpan(begin=0, end=3)], backward_micro_batch=1,
        backward_packs=[plan_pb2.LayerSpan(begin=0, end=2), plan_pb2.LayerSpan(begin=2, end=4)], devices=2,
        prefetch=True, device_budget_bytes=4 << 20, predicted_peer_bytes=65536, predicted_iteration_s=0.25,
        configurations_explored=18))
    for sent in (chunked, swapped):
        stored = a.create_plan(store_pb2.CreatePlanRequest(plan=sent))
        back = a.get_plan(store_pb2.GetRequest(id=stored.id))
        assert back.offload == sent.offload and back.harmony == sent.harmony
        assert back.HasField("offload") == sent.HasField("offload")
        assert back.HasField("harmony") == sent.HasField("harmony")


def test_a_searched_plan_reads_back_as_create_plan_answered(store: Store):
    """CreatePlan answers without reading its rows again: what it answers is what GetPlan and ListPlans read, for
    a plan the planner searched (alternatives whose predictions keep only their headline numbers, stages, fleet)."""
    from benchmarks.hot_paths import job_plan
    from benchmarks.workload import spec

    a = store.as_(store.a)
    job = a.create_queued_job(store_pb2.CreateQueuedJobRequest(spec=spec("searched"), kind="jobs.prepare")).job
    sent = job_plan(job)
    assert any(alt.prediction.bubble_fraction for alt in sent.alternatives)  # not a headline number
    answered = a.create_plan(store_pb2.CreatePlanRequest(plan=sent, request_id="searched-1"))
    assert answered == a.get_plan(store_pb2.GetRequest(id=answered.id))
    assert answered == a.list_plans(store_pb2.ListPlansRequest(job_id=job.id)).plans[0]
    assert answered == a.create_plan(store_pb2.CreatePlanRequest(plan=sent, request_id="searched-1"))  # idempotent
    shuffled = plan_pb2.Plan()
    shuffled.CopyFrom(sent)
    del shuffled.layers[:]
    shuffled.layers.extend(reversed(sent.layers))  # layers sent out of order are answered in order, as read back
    again = a.create_plan(store_pb2.CreatePlanRequest(plan=shuffled, request_id="searched-2"))
    assert again == a.get_plan(store_pb2.GetRequest(id=again.id)) and list(again.layers) == list(answered.layers)
