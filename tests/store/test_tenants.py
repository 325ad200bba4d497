"""Tenants, tokens and isolation: every row is its tenant's, and only the admin sees across tenants."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from ballast.v1 import job_pb2, store_pb2
from services.runtime.auth import Principal, hash_token
from services.runtime.errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from tests.store_builders import gpt, page, plan_msg, profile_msg
from tests.store_fixtures import ADMIN_TOKEN, JS, Store, events, move, new_job


def test_authentication_and_tenants(store: Store):
    repo = store.repo
    admin, a = store.as_(store.admin), store.as_(store.a)

    def who(token: str) -> Principal:  # the Authenticate RPC other services' auth hooks call
        found = admin.authenticate(store_pb2.AuthenticateRequest(token=token))
        return Principal(found.tenant_id, found.tenant_name, found.admin)

    with pytest.raises(Unauthenticated) as err:
        who("blt_unknown")
    assert "ballast tenant create" in str(err.value)
    with pytest.raises(Unauthenticated):
        who("")
    assert who(ADMIN_TOKEN) == store.admin and store.admin.admin
    assert repo.principal_for_token(ADMIN_TOKEN) == store.admin  # what the store's own auth hook resolves
    assert repo.ensure_admin(ADMIN_TOKEN) == store.admin  # idempotent
    assert repo.ensure_admin("blt_rotated").tenant_id == store.admin.tenant_id  # re-keyed, same tenant
    store.rekey(store.admin, "blt_rotated")
    with pytest.raises(Unauthenticated):
        who(ADMIN_TOKEN)
    assert who("blt_rotated") == store.admin

    created = admin.create_tenant(store_pb2.CreateTenantRequest(name="team-c"))
    with store.engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT * FROM tenants WHERE name = 'team-c'")).mappings().one()
    assert stored["token_hash"] == hash_token(created.token)
    assert created.token not in {str(v) for v in stored.values()}

    with pytest.raises(AlreadyExists) as err:
        admin.create_tenant(store_pb2.CreateTenantRequest(name="team-c"))
    assert err.value.field == "name"
    with pytest.raises(InvalidArgument) as err:
        admin.create_tenant(store_pb2.CreateTenantRequest(name="Bad_Name"))
    assert err.value.field == "name"
    with pytest.raises(PermissionDenied):
        a.create_tenant(store_pb2.CreateTenantRequest(name="team-d"))
    with pytest.raises(PermissionDenied):
        a.list_tenants(store_pb2.ListTenantsRequest())

    assert a.get_tenant(store_pb2.GetRequest(id=store.a.tenant_id)).name == "team-a"
    with pytest.raises(NotFound):
        a.get_tenant(store_pb2.GetRequest(id=store.b.tenant_id))
    first = admin.list_tenants(store_pb2.ListTenantsRequest(page=page(2)))
    rest = admin.list_tenants(store_pb2.ListTenantsRequest(page=page(2, first.next_page_token)))
    names = [t.name for t in [*first.tenants, *rest.tenants]]
    assert names == ["admin", "team-a", "team-b", "team-c"] and rest.next_page_token == ""


def test_a_rotated_token_stops_authenticating_and_only_its_tenant_or_the_admin_rotates_it(store: Store):
    from services.runtime.errors import FailedPrecondition

    admin, a, b = store.as_(store.admin), store.as_(store.a), store.as_(store.b)
    old = store.tokens[store.a.tenant_id]
    fresh = a.rotate_tenant_token(store_pb2.RotateTenantTokenRequest(tenant_id=store.a.tenant_id))
    assert fresh.tenant.id == store.a.tenant_id and fresh.token and fresh.token != old
    assert store.repo.principal_for_token(fresh.token) == store.a
    with pytest.raises(Unauthenticated):  # revoked at once on the store
        store.repo.principal_for_token(old)
    store.rekey(store.a, fresh.token)
    with pytest.raises(NotFound) as err:  # another tenant's token: as if that tenant did not exist
        b.rotate_tenant_token(store_pb2.RotateTenantTokenRequest(tenant_id=store.a.tenant_id))
    assert err.value.field == "tenant_id"
    again = admin.rotate_tenant_token(store_pb2.RotateTenantTokenRequest(tenant_id=store.a.tenant_id))
    assert store.repo.principal_for_token(again.token) == store.a
    with pytest.raises(FailedPrecondition) as err:  # the admin's is BALLAST_TOKEN, which the services use
        admin.rotate_tenant_token(store_pb2.RotateTenantTokenRequest(tenant_id=store.admin.tenant_id))
    assert "BALLAST_TOKEN" in str(err.value)
    with pytest.raises(InvalidArgument):
        admin.rotate_tenant_token(store_pb2.RotateTenantTokenRequest())
    store.rekey(store.a, again.token)


def test_tenant_isolation_and_admin_visibility(store: Store):
    a, b, admin = store.as_(store.a), store.as_(store.b), store.as_(store.admin)
    model = a.create_model(store_pb2.CreateModelRequest(spec=gpt()))
    job = new_job(store)
    prof = a.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(model.id)))
    plan = a.create_plan(store_pb2.CreatePlanRequest(plan=plan_msg(model.id, job_id=job.id)))
    queued = a.enqueue_request(store_pb2.EnqueueRequestRequest(kind="diagnostic.echo", payload_json="{}"))
    ckp = a.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=job_pb2.Checkpoint(job_id=job.id)))

    for getter, id_ in [
        ("get_model", model.id),
        ("get_job", job.id),
        ("get_profile", prof.id),
        ("get_plan", plan.id),
        ("get_queued_request", queued.request.id),
        ("get_checkpoint", ckp.id),
    ]:
        with pytest.raises(NotFound) as theirs:
            getattr(b, getter)(store_pb2.GetRequest(id=id_))
        with pytest.raises(NotFound) as unknown:
            getattr(b, getter)(store_pb2.GetRequest(id=id_[:4] + "0" * 16))
        assert str(theirs.value).replace(id_, "X") == str(unknown.value).replace(id_[:4] + "0" * 16, "X")
        assert getattr(admin, getter)(store_pb2.GetRequest(id=id_)).id == id_

    assert not b.list_models(store_pb2.ListModelsRequest()).models
    assert not b.list_jobs(store_pb2.ListJobsRequest()).jobs
    assert not b.list_profiles(store_pb2.ListProfilesRequest()).profiles
    assert not b.list_plans(store_pb2.ListPlansRequest()).plans
    assert not b.list_requests(store_pb2.ListRequestsRequest()).requests
    assert [j.id for j in admin.list_jobs(store_pb2.ListJobsRequest()).jobs] == [job.id]
    assert len(admin.list_models(store_pb2.ListModelsRequest()).models) == 1

    # B cannot reference A's rows either.
    with pytest.raises(NotFound) as err:
        b.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(model.id)))
    assert err.value.field == "profile.model_id"
    with pytest.raises(NotFound):
        b.create_plan(store_pb2.CreatePlanRequest(plan=plan_msg(model.id)))
    with pytest.raises(NotFound):
        move(store, job.id, JS.JOB_STATE_PROFILING, who=store.b)
    with pytest.raises(NotFound):
        events(store, job.id, who=store.b)
    with pytest.raises(NotFound):
        b.append_job_event(store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type="X")))
    with pytest.raises(NotFound) as err:
        b.write_iteration_metrics(
            store_pb2.WriteIterationMetricsRequest(metrics=[job_pb2.IterationMetric(job_id=job.id)])
        )
    assert err.value.field == "metrics[0].job_id"
    for lister, req in [
        ("list_iteration_metrics", store_pb2.ListIterationMetricsRequest(job_id=job.id)),
        ("list_layer_migrations", store_pb2.ListLayerMigrationsRequest(job_id=job.id)),
        ("list_checkpoints", store_pb2.ListCheckpointsRequest(job_id=job.id)),
    ]:
        with pytest.raises(NotFound):
            getattr(b, lister)(req)
    with pytest.raises(NotFound):
        b.record_layer_migration(
            store_pb2.RecordLayerMigrationRequest(migration=job_pb2.LayerMigration(job_id=job.id))
        )
    # The same model spec under tenant B is B's own model.
    assert new_job(store, who=store.b).model_id != job.model_id
    assert store.count("job_events") == 2
