"""Repository behaviour on SQLite and PostgreSQL: the same tests, through `empty_database_url`."""

from __future__ import annotations

import base64
import json
import math
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from google.protobuf import timestamp_pb2

from ballast.v1 import common_pb2, fleet_pb2, job_pb2, model_pb2, plan_pb2, profile_pb2, queue_pb2, store_pb2
from services.runtime.auth import Principal, hash_token
from services.runtime.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SchemaOutOfDate,
    Unauthenticated,
    Unavailable,
)
from services.store import schema
from services.store.db import create_engine
from services.store.repository import Repository

JS = job_pb2.JobState
ADMIN_TOKEN = "blt_test-admin-token"
FACTORY = "mypkg.models:build"


class FakeClock:
    """Advances one microsecond per reading so creation order is strict; tests jump it explicitly."""

    def __init__(self) -> None:
        self.t = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.t += timedelta(microseconds=1)
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += timedelta(seconds=seconds)


@dataclass
class Store:
    repo: Repository
    engine: sa.Engine
    clock: FakeClock
    admin: Principal
    a: Principal
    b: Principal

    def count(self, table: str) -> int:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()


@pytest.fixture
def store(empty_database_url):
    schema.upgrade(empty_database_url)
    engine = create_engine(empty_database_url)
    clock = FakeClock()
    repo = Repository(engine, now=clock, allowed_factories=(FACTORY,))
    admin = repo.ensure_admin(ADMIN_TOKEN)
    tenants = [
        repo.create_tenant(admin, store_pb2.CreateTenantRequest(name=name)) for name in ("team-a", "team-b")
    ]
    a, b = (repo.authenticate(t.token) for t in tenants)
    yield Store(repo, engine, clock, admin, a, b)
    engine.dispose()


def gpt(name: str = "gpt-tiny", layers: int = 2, hidden: int = 64) -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(
        name=name,
        family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(
            num_layers=layers, hidden_size=hidden, num_heads=4, vocab_size=128, seq_length=32
        ),
    )


def job_spec(name: str = "train", model: model_pb2.ModelSpec | None = None) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(name=name, model=model or gpt(), global_batch_size=8, iterations=10)


def profile_msg(model_id: str, kind: str = "cpu", layers: int = 2) -> profile_pb2.Profile:
    pr = profile_pb2.Profile(
        model_id=model_id,
        device=fleet_pb2.DeviceSpec(kind=kind, memory_bytes=8 << 30, peak_flops=1e12),
        dtype=common_pb2.DTYPE_FP32,
        software="torch 2.13.0",
        intra_op_threads=2,
        non_model_memory_bytes=123,
        comm=profile_pb2.CommCalibration(
            links=[
                profile_pb2.LinkSample(scope=profile_pb2.LINK_SCOPE_INTRA_NODE, bytes=1 << 20, seconds=0.001)
            ],
            overlap_slowdown=1.2,
        ),
    )
    for i in range(layers):
        pr.layers.add(
            index=i,
            name=f"block.{i}",
            kind="block",
            parameter_count=1000 + i,
            parameter_bytes=4000,
            gradient_bytes=4000,
            optimizer_state_bytes=8000,
            extra_inputs=[0] if i else [],
            tied_with=[],
            samples=[
                profile_pb2.LayerSample(
                    micro_batch_size=mbs, measured=True, forward_s=0.01 * mbs, backward_s=0.02
                )
                for mbs in (1, 2, 4)
            ],
        )
    return pr


def plan_msg(model_id: str, *, job_id: str = "", profile_id: str = "", layers: int = 2) -> plan_pb2.Plan:
    pl = plan_pb2.Plan(
        model_id=model_id,
        job_id=job_id,
        profile_id=profile_id,
        engine=plan_pb2.PLAN_ENGINE_GALVATRON,
        global_batch_size=8,
        micro_batch_size=2,
        num_micro_batches=4,
        schedule=plan_pb2.SCHEDULE_1F1B,
        fleet=fleet_pb2.Fleet(
            name="cpu2", device=fleet_pb2.DeviceSpec(kind="cpu"), devices_per_node=2, nodes=1
        ),
        stages=[
            plan_pb2.Stage(index=0, layer_begin=0, layer_end=1, devices=1, predicted_time_s=0.5),
            plan_pb2.Stage(index=1, layer_begin=1, layer_end=layers, devices=1, predicted_time_s=0.5),
        ],
        prediction=plan_pb2.Prediction(
            iteration_time_s=2.0, throughput_samples_per_s=4.0, peak_memory_bytes=1 << 30
        ),
        explanation="balanced two-stage pipeline",
        memory_budget_bytes=8 << 30,
        alternatives=[
            plan_pb2.PlanAlternative(
                name="DDP",
                engine=plan_pb2.PLAN_ENGINE_BASELINE,
                global_batch_size=8,
                reason="out of memory",
                prediction=plan_pb2.Prediction(iteration_time_s=3.0, out_of_memory=True),
            )
        ],
    )
    for i in range(layers):
        pl.layers.add(
            layer_index=i,
            stage_index=min(i, 1),
            dp=1,
            sdp=1,
            tp=1,
            order=[common_pb2.PARALLEL_DIM_DP],
            checkpoint=i == 0,
        )
    return pl


def new_job(st: Store, who: Principal | None = None, name: str = "train", **kw) -> job_pb2.Job:
    return st.repo.create_job(who or st.a, store_pb2.CreateJobRequest(spec=job_spec(name, **kw)))


def move(st: Store, job_id: str, state: int, who: Principal | None = None, **kw) -> job_pb2.Job:
    return st.repo.transition_job(who or st.a, store_pb2.TransitionJobRequest(id=job_id, state=state, **kw))


def events(st: Store, job_id: str, who: Principal | None = None, **kw) -> list[job_pb2.JobEvent]:
    req = store_pb2.ListJobEventsRequest(job_id=job_id, **kw)
    return list(st.repo.list_job_events(who or st.a, req).events)


def page(size: int, token: str = "") -> common_pb2.PageRequest:
    return common_pb2.PageRequest(page_size=size, page_token=token)


# --- tenants and auth --------------------------------------------------------------------------


def test_authentication_and_tenants(store: Store):
    repo = store.repo
    with pytest.raises(Unauthenticated) as err:
        repo.authenticate("blt_unknown")
    assert "ballast tenant create" in str(err.value)
    with pytest.raises(Unauthenticated):
        repo.authenticate("")
    assert repo.authenticate(ADMIN_TOKEN) == store.admin and store.admin.admin
    assert repo.ensure_admin(ADMIN_TOKEN) == store.admin  # idempotent
    assert repo.ensure_admin("blt_rotated").tenant_id == store.admin.tenant_id  # re-keyed, same tenant
    with pytest.raises(Unauthenticated):
        repo.authenticate(ADMIN_TOKEN)

    created = repo.create_tenant(store.admin, store_pb2.CreateTenantRequest(name="team-c"))
    with store.engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT * FROM tenants WHERE name = 'team-c'")).mappings().one()
    assert stored["token_hash"] == hash_token(created.token)
    assert created.token not in {str(v) for v in stored.values()}

    with pytest.raises(AlreadyExists) as err:
        repo.create_tenant(store.admin, store_pb2.CreateTenantRequest(name="team-c"))
    assert err.value.field == "name"
    with pytest.raises(InvalidArgument) as err:
        repo.create_tenant(store.admin, store_pb2.CreateTenantRequest(name="Bad_Name"))
    assert err.value.field == "name"
    with pytest.raises(PermissionDenied):
        repo.create_tenant(store.a, store_pb2.CreateTenantRequest(name="team-d"))
    with pytest.raises(PermissionDenied):
        repo.list_tenants(store.a, store_pb2.ListTenantsRequest())

    assert repo.get_tenant(store.a, store_pb2.GetRequest(id=store.a.tenant_id)).name == "team-a"
    with pytest.raises(NotFound):
        repo.get_tenant(store.a, store_pb2.GetRequest(id=store.b.tenant_id))
    first = repo.list_tenants(store.admin, store_pb2.ListTenantsRequest(page=page(2)))
    rest = repo.list_tenants(store.admin, store_pb2.ListTenantsRequest(page=page(2, first.next_page_token)))
    names = [t.name for t in [*first.tenants, *rest.tenants]]
    assert names == ["admin", "team-a", "team-b", "team-c"] and rest.next_page_token == ""


# --- models ------------------------------------------------------------------------------------


def test_model_round_trip_filters_and_paging(store: Store):
    repo, a = store.repo, store.a
    made = [
        repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt(f"gpt-{i}", layers=i + 1)))
        for i in range(5)
    ]
    vit = model_pb2.ModelSpec(
        name="vit",
        family=model_pb2.MODEL_FAMILY_VIT,
        vision=model_pb2.VisionConfig(
            image_size=32, patch_size=8, channels=3, num_classes=10, hidden_size=64, num_layers=2, num_heads=4
        ),
    )
    repo.create_model(a, store_pb2.CreateModelRequest(spec=vit))
    got = repo.get_model(a, store_pb2.GetRequest(id=made[0].id))
    assert got == made[0] and got.spec == gpt("gpt-0", layers=1) and got.id.startswith("mdl-")
    assert len(got.signature) == 64 and got.tenant_id == a.tenant_id

    gpts = store_pb2.ListModelsRequest(family=model_pb2.MODEL_FAMILY_GPT, page=page(2))
    seen, pages = [], 0
    while True:
        resp = repo.list_models(a, gpts)
        seen += [m.spec.name for m in resp.models]
        pages += 1
        if not resp.next_page_token:
            break
        gpts.page.page_token = resp.next_page_token
    assert seen == [f"gpt-{i}" for i in range(5)] and pages == 3
    assert [m.spec.name for m in repo.list_models(a, store_pb2.ListModelsRequest(name="vit")).models] == [
        "vit"
    ]
    with pytest.raises(InvalidArgument) as err:
        repo.list_models(a, store_pb2.ListModelsRequest(page=page(2, "not-a-token")))
    assert err.value.field == "page.page_token"

    # Same spec and name: idempotent. Same spec, other name; or same name, other spec: refused.
    assert repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt("gpt-0", layers=1))).id == made[0].id
    with pytest.raises(AlreadyExists) as err:
        repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt("other", layers=1)))
    assert err.value.field == "spec"
    with pytest.raises(AlreadyExists) as err:
        repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt("gpt-0", layers=9)))
    assert err.value.field == "spec.name"
    with pytest.raises(InvalidArgument) as err:
        repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt(hidden=66)))
    assert err.value.field == "spec.transformer.num_heads"
    custom = model_pb2.ModelSpec(
        name="c", family=model_pb2.MODEL_FAMILY_CUSTOM, custom=model_pb2.CustomModel(factory="evil.mod:run")
    )
    with pytest.raises(InvalidArgument) as err:
        repo.create_model(a, store_pb2.CreateModelRequest(spec=custom))
    assert err.value.field == "spec.custom.factory" and "BALLAST_ALLOWED_MODEL_FACTORIES" in str(err.value)
    custom.custom.factory = FACTORY
    custom.custom.kwargs.update({"width": 8, "tag": "x"})
    assert repo.create_model(a, store_pb2.CreateModelRequest(spec=custom)).spec == custom


# --- isolation ---------------------------------------------------------------------------------


def test_tenant_isolation_and_admin_visibility(store: Store):
    repo, a, b, admin = store.repo, store.a, store.b, store.admin
    model = repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt()))
    job = new_job(store)
    prof = repo.create_profile(a, store_pb2.CreateProfileRequest(profile=profile_msg(model.id)))
    plan = repo.create_plan(a, store_pb2.CreatePlanRequest(plan=plan_msg(model.id, job_id=job.id)))
    queued = repo.enqueue_request(
        a, store_pb2.EnqueueRequestRequest(kind="diagnostic.echo", payload_json="{}")
    )
    ckp = repo.create_checkpoint(
        a, store_pb2.CreateCheckpointRequest(checkpoint=job_pb2.Checkpoint(job_id=job.id))
    )

    for getter, id_ in [
        (repo.get_model, model.id),
        (repo.get_job, job.id),
        (repo.get_profile, prof.id),
        (repo.get_plan, plan.id),
        (repo.get_queued_request, queued.request.id),
        (repo.get_checkpoint, ckp.id),
    ]:
        with pytest.raises(NotFound) as theirs:
            getter(b, store_pb2.GetRequest(id=id_))
        with pytest.raises(NotFound) as unknown:
            getter(b, store_pb2.GetRequest(id=id_[:4] + "0" * 16))
        assert str(theirs.value).replace(id_, "X") == str(unknown.value).replace(id_[:4] + "0" * 16, "X")
        assert getter(admin, store_pb2.GetRequest(id=id_)).id == id_

    assert not repo.list_models(b, store_pb2.ListModelsRequest()).models
    assert not repo.list_jobs(b, store_pb2.ListJobsRequest()).jobs
    assert not repo.list_profiles(b, store_pb2.ListProfilesRequest()).profiles
    assert not repo.list_plans(b, store_pb2.ListPlansRequest()).plans
    assert not repo.list_requests(b, store_pb2.ListRequestsRequest()).requests
    assert [j.id for j in repo.list_jobs(admin, store_pb2.ListJobsRequest()).jobs] == [job.id]
    assert len(repo.list_models(admin, store_pb2.ListModelsRequest()).models) == 1

    # B cannot reference A's rows either.
    with pytest.raises(NotFound) as err:
        repo.create_profile(b, store_pb2.CreateProfileRequest(profile=profile_msg(model.id)))
    assert err.value.field == "profile.model_id"
    with pytest.raises(NotFound):
        repo.create_plan(b, store_pb2.CreatePlanRequest(plan=plan_msg(model.id)))
    with pytest.raises(NotFound):
        move(store, job.id, JS.JOB_STATE_PROFILING, who=b)
    with pytest.raises(NotFound):
        events(store, job.id, who=b)
    with pytest.raises(NotFound):
        repo.append_job_event(
            b, store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type="X"))
        )
    with pytest.raises(NotFound) as err:
        repo.write_iteration_metrics(
            b, store_pb2.WriteIterationMetricsRequest(metrics=[job_pb2.IterationMetric(job_id=job.id)])
        )
    assert err.value.field == "metrics[0].job_id"
    for lister, req in [
        (repo.list_iteration_metrics, store_pb2.ListIterationMetricsRequest(job_id=job.id)),
        (repo.list_layer_migrations, store_pb2.ListLayerMigrationsRequest(job_id=job.id)),
        (repo.list_checkpoints, store_pb2.ListCheckpointsRequest(job_id=job.id)),
    ]:
        with pytest.raises(NotFound):
            lister(b, req)
    with pytest.raises(NotFound):
        repo.record_layer_migration(
            b, store_pb2.RecordLayerMigrationRequest(migration=job_pb2.LayerMigration(job_id=job.id))
        )
    # The same model spec under tenant B is B's own model.
    assert new_job(store, who=b).model_id != job.model_id
    assert store.count("job_events") == 2


# --- profiles, hosts, plans ----------------------------------------------------------------------


def test_profile_round_trip_and_filters(store: Store):
    repo, a = store.repo, store.a
    model = repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt()))
    sent = profile_msg(model.id)
    prof = repo.create_profile(a, store_pb2.CreateProfileRequest(profile=sent))
    gpu = repo.create_profile(
        a, store_pb2.CreateProfileRequest(profile=profile_msg(model.id, kind="nvidia-h100"))
    )
    got = repo.get_profile(a, store_pb2.GetRequest(id=prof.id))
    assert got == prof and got.id.startswith("prf-") and got.model_signature == model.signature
    expected = profile_pb2.Profile()
    expected.CopyFrom(sent)
    expected.id, expected.tenant_id, expected.model_signature = got.id, a.tenant_id, model.signature
    expected.created_at.CopyFrom(got.created_at)
    assert got == expected
    assert repo.get_model(a, store_pb2.GetRequest(id=model.id)).parameter_count == 1000 + 1001

    def ids(**kw):
        return [p.id for p in repo.list_profiles(a, store_pb2.ListProfilesRequest(**kw)).profiles]

    assert ids() == [prof.id, gpu.id]
    assert ids(device_kind="nvidia-h100") == [gpu.id]
    assert ids(model_id=model.id, model_signature=model.signature, device_kind="cpu") == [prof.id]
    assert ids(model_signature="0" * 64) == []

    bad = profile_msg(model.id)
    bad.layers[1].index = 5
    with pytest.raises(InvalidArgument) as err:
        repo.create_profile(a, store_pb2.CreateProfileRequest(profile=bad))
    assert err.value.field == "profile.layers[1].index"
    assert store.count("profiles") == 2 and store.count("profile_layers") == 4


def detailed_profile_msg(model_id: str, kind: str = "cpu") -> profile_pb2.Profile:
    """profile_msg with every field added in 0004 (and CommCalibration's fits/unsupported) set."""
    pr = profile_msg(model_id, kind=kind, layers=3)
    pr.memory_trace.extend(
        profile_pb2.MemoryTracePoint(op_index=i, op=op, layer=layer, phase=phase, non_model_bytes=size)
        for i, (op, layer, phase, size) in enumerate(
            [
                ("aten::embedding", "embed", "forward", 1 << 20),
                ("aten::mm", "block.0", "backward", (1 << 63) - 1),
                ("aten::add_", "", "optimizer", 0),
            ]
        )
    )
    pr.measured_micro_batch_sizes.extend([1, 4])
    pr.memory_cap_bytes = (1 << 63) - 1
    pr.profiling_time_s = 12.5
    pr.comm.fits.add(
        collective="allreduce", group_size=2, latency_s=1e-5, bandwidth_bytes_per_s=2e9,
        bus_bandwidth_bytes_per_s=2e9, r2=0.999,
    )  # fmt: skip
    pr.comm.fits.add(collective="p2p", group_size=2)  # a fit with no positive slope keeps its zeros
    pr.comm.unsupported.extend(["reduce_scatter@2: not supported by gloo", "all_to_all@2: ✗"])
    pr.layers[0].note = "does not fit at micro-batch 8: out of memory ✗"
    pr.layers[0].measured_as = 0
    pr.layers[0].batch_input_bytes = 256
    pr.layers[0].max_micro_batch_size = 4
    pr.layers[1].measured_as = 1
    pr.layers[1].max_micro_batch_size = 2**31 - 1
    pr.layers[2].measured_as = 1  # reused layer 1's rows
    pr.layers[2].batch_input_bytes = (1 << 63) - 1
    del pr.layers[2].samples[:]
    pr.layers[2].note = "reused block.1"
    return pr


def test_profile_details_round_trip(store: Store):
    repo, a = store.repo, store.a
    model = repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt()))
    sent = detailed_profile_msg(model.id)
    prof = repo.create_profile(a, store_pb2.CreateProfileRequest(profile=sent))
    expected = profile_pb2.Profile()
    expected.CopyFrom(sent)
    expected.id, expected.tenant_id, expected.model_signature = prof.id, a.tenant_id, model.signature
    expected.created_at.CopyFrom(prof.created_at)
    got = repo.get_profile(a, store_pb2.GetRequest(id=prof.id))
    listed = repo.list_profiles(a, store_pb2.ListProfilesRequest()).profiles
    for out in (prof, got, listed[0]):
        assert out == expected
    assert list(got.measured_micro_batch_sizes) == [1, 4] and got.memory_cap_bytes == (1 << 63) - 1
    assert [pt.op for pt in got.memory_trace] == ["aten::embedding", "aten::mm", "aten::add_"]
    assert got.memory_trace[1].non_model_bytes == (1 << 63) - 1 and got.profiling_time_s == 12.5
    assert [f.collective for f in got.comm.fits] == ["allreduce", "p2p"] and got.comm.fits[0].r2 == 0.999
    assert list(got.comm.unsupported) == list(sent.comm.unsupported)
    assert [(ly.note, ly.measured_as, ly.batch_input_bytes, ly.max_micro_batch_size) for ly in got.layers] == [
        (sent.layers[0].note, 0, 256, 4),
        ("", 1, 0, 2**31 - 1),
        ("reused block.1", 1, (1 << 63) - 1, 0),
    ]
    with store.engine.connect() as conn:  # an empty note is stored as NULL, like other optional text
        notes = conn.execute(
            sa.text(f"SELECT layer_index, note FROM profile_layers WHERE profile_id = '{prof.id}' ORDER BY 1")
        ).all()
    assert [n for _, n in notes] == [sent.layers[0].note, None, "reused block.1"]

    plain = repo.create_profile(a, store_pb2.CreateProfileRequest(profile=profile_msg(model.id)))
    bare = repo.get_profile(a, store_pb2.GetRequest(id=plain.id))  # unset details read back as empty
    assert not bare.memory_trace and not bare.measured_micro_batch_sizes and not bare.comm.fits
    assert bare.memory_cap_bytes == 0 and bare.profiling_time_s == 0.0 and not bare.comm.unsupported
    assert all((ly.note, ly.measured_as, ly.batch_input_bytes, ly.max_micro_batch_size) == ("", 0, 0, 0)
               for ly in bare.layers)  # fmt: skip


def test_profile_details_out_of_range_are_invalid_argument(store: Store):
    repo, a = store.repo, store.a
    model = repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt()))

    def bad(field: str, change: Callable[[profile_pb2.Profile], Any]) -> None:
        pr = detailed_profile_msg(model.id)
        change(pr)
        with pytest.raises(InvalidArgument) as err:
            repo.create_profile(a, store_pb2.CreateProfileRequest(profile=pr))
        assert err.value.field == field and err.value.fix, (field, str(err.value))

    bad("profile.memory_cap_bytes", lambda pr: setattr(pr, "memory_cap_bytes", 2**64 - 1))
    bad("profile.profiling_time_s", lambda pr: setattr(pr, "profiling_time_s", math.nan))
    bad("profile.profiling_time_s", lambda pr: setattr(pr, "profiling_time_s", math.inf))
    bad("profile.layers[1].measured_as", lambda pr: setattr(pr.layers[1], "measured_as", 2**32 - 1))
    bad("profile.layers[0].batch_input_bytes", lambda pr: setattr(pr.layers[0], "batch_input_bytes", 2**64 - 1))
    bad("profile.layers[2].max_micro_batch_size", lambda pr: setattr(pr.layers[2], "max_micro_batch_size", 2**31))
    bad("profile.layers[0].note", lambda pr: setattr(pr.layers[0], "note", "a\x00b"))
    assert store.count("profiles") == 0 and store.count("profile_layers") == 0


def test_profile_list_filters_dtype_software_projected(store: Store):
    repo, a, b = store.repo, store.a, store.b
    model = repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt()))

    def create(who: Principal = a, model_id: str = model.id, kind: str = "cpu", **kw) -> str:
        pr = profile_msg(model_id, kind=kind)
        for key, value in kw.items():
            setattr(pr, key, value)
        return repo.create_profile(who, store_pb2.CreateProfileRequest(profile=pr)).id

    fp32 = create()
    bf16 = create(dtype=common_pb2.DTYPE_BF16)
    newer = create(software="torch 2.14.0")
    projected = create(kind="nvidia-h100", projected=True, source_profile_id=fp32)
    projected_cpu = create(projected=True, source_profile_id=fp32)
    other_model = create(model_id=repo.create_model(a, store_pb2.CreateModelRequest(spec=gpt("other", 4))).id)
    b_model = repo.create_model(b, store_pb2.CreateModelRequest(spec=gpt()))
    other_tenant = create(b, b_model.id)

    def ids(who: Principal = a, **kw) -> list[str]:
        return [p.id for p in repo.list_profiles(who, store_pb2.ListProfilesRequest(**kw)).profiles]

    everything = [fp32, bf16, newer, projected, projected_cpu, other_model]
    assert ids() == everything
    assert ids(dtype=common_pb2.DTYPE_FP32) == [fp32, newer, projected, projected_cpu, other_model]
    assert ids(dtype=common_pb2.DTYPE_BF16) == [bf16]
    assert ids(dtype=common_pb2.DTYPE_FP16) == []
    assert ids(software="torch 2.14.0") == [newer]
    assert ids(software="torch 2.13.0") == [fp32, bf16, projected, projected_cpu, other_model]
    assert ids(software="torch") == []  # exact match, not a prefix
    assert ids(projected=True) == [projected, projected_cpu]
    assert ids(projected=False) == [fp32, bf16, newer, other_model]  # False filters; unset means both
    assert ids(dtype=common_pb2.DTYPE_UNSPECIFIED, software="") == everything  # proto3 defaults filter nothing

    # The profiler's cache lookup: tenant's model signature + device kind + dtype + software, measured only.
    lookup = dict(
        model_signature=model.signature, device_kind="cpu", dtype=common_pb2.DTYPE_FP32,
        software="torch 2.13.0", projected=False,
    )  # fmt: skip
    assert ids(**lookup) == [fp32]
    assert ids(b, **lookup) == [other_tenant]  # same signature, another tenant's own profile
    assert ids(store.admin, **lookup) == [fp32, other_tenant]
    with pytest.raises(InvalidArgument) as err:
        ids(dtype=99)
    assert err.value.field == "dtype"


def test_profile_cache_lookup_index_exists(store: Store):
    indexes = {ix["name"]: ix["column_names"] for ix in sa.inspect(store.engine).get_indexes("profiles")}
    assert indexes["ix_profiles_cache_lookup"] == ["tenant_id", "model_signature", "device_kind", "dtype"]


def test_hosts_are_platform_data(store: Store):
    repo, a, admin = store.repo, store.a, store.admin

    def host(name: str, kinds: list[str], **kw) -> fleet_pb2.Host:
        return fleet_pb2.Host(
            name=name,
            address=f"{name}:29500",
            agent_port=50060,
            agent_version="0.1.0",
            labels={"zone": "z1"},
            supported_parallelism=[common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_PP],
            devices=[
                fleet_pb2.Device(
                    index=i, uuid=f"u{i}", spec=fleet_pb2.DeviceSpec(kind=k, memory_bytes=1 << 34)
                )
                for i, k in enumerate(kinds)
            ],
            **kw,
        )

    with pytest.raises(PermissionDenied):
        repo.register_host(a, store_pb2.RegisterHostRequest(host=host("h1", ["cpu"])))
    h1 = repo.register_host(admin, store_pb2.RegisterHostRequest(host=host("h1", ["cpu", "cpu"])))
    h2 = repo.register_host(admin, store_pb2.RegisterHostRequest(host=host("h2", ["nvidia-h100"])))
    assert h1.id.startswith("hst-") and h1.state == fleet_pb2.HOST_STATE_ONLINE and len(h1.devices) == 2
    assert h1.labels == {"zone": "z1"} and h1.devices[1].spec.memory_bytes == 1 << 34
    store.clock.advance(10)
    again = repo.register_host(admin, store_pb2.RegisterHostRequest(host=host("h1", ["nvidia-h100"])))
    assert again.id == h1.id and again.registered_at == h1.registered_at
    assert [d.spec.kind for d in again.devices] == ["nvidia-h100"]
    assert again.last_heartbeat_at.ToDatetime() > h1.last_heartbeat_at.ToDatetime()

    lost = repo.update_host_state(
        admin, store_pb2.UpdateHostStateRequest(id=h2.id, state=fleet_pb2.HOST_STATE_LOST)
    )
    assert lost.state == fleet_pb2.HOST_STATE_LOST and lost.last_heartbeat_at == h2.last_heartbeat_at
    with pytest.raises(PermissionDenied):
        repo.update_host_state(
            a, store_pb2.UpdateHostStateRequest(id=h2.id, state=fleet_pb2.HOST_STATE_ONLINE)
        )
    with pytest.raises(NotFound):
        repo.update_host_state(
            admin, store_pb2.UpdateHostStateRequest(id="hst-x", state=fleet_pb2.HOST_STATE_LOST)
        )

    def names(**kw):
        return [h.name for h in repo.list_hosts(a, store_pb2.ListHostsRequest(**kw)).hosts]

    assert names() == ["h1", "h2"]  # any tenant reads hosts
    assert names(state=fleet_pb2.HOST_STATE_ONLINE) == ["h1"]
    assert names(device_kind="nvidia-h100") == ["h1", "h2"] and names(device_kind="cpu") == []
    assert repo.get_host(store.b, store_pb2.GetRequest(id=h1.id)) == again
    assert store.count("devices") == 2


def test_plan_round_trip_versions_and_filters(store: Store):
    repo, a = store.repo, store.a
    job = new_job(store)
    prof = repo.create_profile(a, store_pb2.CreateProfileRequest(profile=profile_msg(job.model_id)))
    sent = plan_msg(job.model_id, job_id=job.id, profile_id=prof.id)
    first = repo.create_plan(a, store_pb2.CreatePlanRequest(plan=sent))
    assert first.id.startswith("pln-") and first.version == 1
    expected = plan_pb2.Plan()
    expected.CopyFrom(sent)
    expected.id, expected.tenant_id, expected.version = first.id, a.tenant_id, 1
    expected.created_at.CopyFrom(first.created_at)
    assert first == expected == repo.get_plan(a, store_pb2.GetRequest(id=first.id))

    derived = plan_msg(job.model_id, job_id=job.id, profile_id=prof.id)
    derived.engine, derived.parent_plan_id = plan_pb2.PLAN_ENGINE_VPIPE, first.id
    second = repo.create_plan(a, store_pb2.CreatePlanRequest(plan=derived))
    what_if = repo.create_plan(a, store_pb2.CreatePlanRequest(plan=plan_msg(job.model_id)))
    assert second.version == 2 and what_if.version == 1 and what_if.job_id == ""

    def ids(**kw):
        return [p.id for p in repo.list_plans(a, store_pb2.ListPlansRequest(**kw)).plans]

    assert ids() == [first.id, second.id, what_if.id]
    assert ids(job_id=job.id) == [first.id, second.id]
    assert ids(engine=plan_pb2.PLAN_ENGINE_VPIPE) == [second.id]
    assert ids(model_id=job.model_id, page=page(1)) == [first.id]

    adopted = move(store, job.id, JS.JOB_STATE_PROFILING)
    adopted = move(store, job.id, JS.JOB_STATE_PLANNING)
    adopted = move(store, job.id, JS.JOB_STATE_SCHEDULED, plan_id=second.id, event_type="PLAN_CHOSEN")
    assert (adopted.plan_id, adopted.plan_version) == (second.id, 2)
    assert events(store, job.id)[-1].attributes["plan_id"] == second.id
    with store.engine.connect() as conn:
        row = conn.execute(
            sa.text(f"SELECT engine, pipeline_degree FROM plans WHERE id = '{second.id}'")
        ).one()
    assert tuple(row) == ("PLAN_ENGINE_VPIPE", 2)


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
            store.repo.create_plan(store.a, store_pb2.CreatePlanRequest(plan=bad))
        assert err.value.field == field
    assert store.count("plans") == store.count("plan_layers") == store.count("plan_candidates") == 0


# --- jobs --------------------------------------------------------------------------------------


def test_create_job_round_trip_and_listing(store: Store):
    repo, a = store.repo, store.a
    job = new_job(store, name="first")
    assert job.id.startswith("job-") and job.state == JS.JOB_STATE_SUBMITTED and job.spec == job_spec("first")
    assert repo.get_job(a, store_pb2.GetRequest(id=job.id)) == job
    model = repo.get_model(a, store_pb2.GetRequest(id=job.model_id))
    assert model.spec == gpt()
    # The same model content is matched, not stored twice; a nameless model gets a derived name.
    second = new_job(store, name="second")
    unnamed = new_job(store, name="third", model=gpt(name="", layers=3))
    assert second.model_id == job.model_id and unnamed.model_id != job.model_id
    assert repo.get_model(a, store_pb2.GetRequest(id=unnamed.model_id)).spec.name.startswith("gpt-")
    assert [e.type for e in events(store, job.id)] == ["SUBMITTED"]

    move(store, second.id, JS.JOB_STATE_PROFILING)
    listed = repo.list_jobs(a, store_pb2.ListJobsRequest()).jobs
    assert [j.spec.name for j in listed] == ["third", "second", "first"]  # newest first
    assert [
        j.id for j in repo.list_jobs(a, store_pb2.ListJobsRequest(state=JS.JOB_STATE_PROFILING)).jobs
    ] == [second.id]
    by_model = repo.list_jobs(a, store_pb2.ListJobsRequest(model_id=job.model_id, page=page(1)))
    assert [j.id for j in by_model.jobs] == [second.id]
    rest = repo.list_jobs(
        a, store_pb2.ListJobsRequest(model_id=job.model_id, page=page(1, by_model.next_page_token))
    )
    assert [j.id for j in rest.jobs] == [job.id] and rest.next_page_token == ""

    bad = job_spec()
    bad.iterations = 0
    with pytest.raises(InvalidArgument) as err:
        repo.create_job(a, store_pb2.CreateJobRequest(spec=bad))
    assert err.value.field == "spec.iterations"
    with store.engine.connect() as conn:
        assert (
            conn.execute(sa.text(f"SELECT state FROM jobs WHERE id = '{job.id}'")).scalar()
            == "JOB_STATE_SUBMITTED"
        )


def test_create_job_with_clashing_model_name_writes_nothing(store: Store):
    store.repo.create_model(store.a, store_pb2.CreateModelRequest(spec=gpt("gpt-tiny", layers=2)))
    with pytest.raises(AlreadyExists) as err:
        new_job(store, model=gpt("gpt-tiny", layers=4))
    assert err.value.field == "spec.model.name"
    assert store.count("jobs") == 0 and store.count("job_events") == 0 and store.count("models") == 1


def test_job_state_machine_events_and_compare_and_set(store: Store):
    job = new_job(store)
    with pytest.raises(FailedPrecondition) as err:
        move(store, job.id, JS.JOB_STATE_RUNNING)
    assert err.value.field == "state"
    with pytest.raises(FailedPrecondition) as err:
        move(store, job.id, JS.JOB_STATE_PROFILING, expected_state=JS.JOB_STATE_PLANNING)
    assert err.value.field == "expected_state"
    assert store.repo.get_job(store.a, store_pb2.GetRequest(id=job.id)).state == JS.JOB_STATE_SUBMITTED

    before = store.repo.get_job(store.a, store_pb2.GetRequest(id=job.id))
    moved = move(store, job.id, JS.JOB_STATE_PROFILING, expected_state=JS.JOB_STATE_SUBMITTED, message="go")
    assert moved.message == "go" and moved.updated_at.ToDatetime() > before.updated_at.ToDatetime()
    for state in (JS.JOB_STATE_PLANNING, JS.JOB_STATE_SCHEDULED, JS.JOB_STATE_RUNNING):
        move(store, job.id, state)
    ev = store.repo.append_job_event(
        store.a,
        store_pb2.AppendJobEventRequest(
            event=job_pb2.JobEvent(
                job_id=job.id, type="MIGRATION", message="layer 3", attributes={"layer": "3"}
            )
        ),
    )
    assert ev.seq == 6 and ev.state == JS.JOB_STATE_RUNNING and ev.attributes == {"layer": "3"}
    move(store, job.id, JS.JOB_STATE_REPARTITIONING, attributes={"why": "skew"})
    move(store, job.id, JS.JOB_STATE_RUNNING)
    done = move(store, job.id, JS.JOB_STATE_SUCCEEDED)
    assert done.state == JS.JOB_STATE_SUCCEEDED

    for target in (JS.JOB_STATE_RUNNING, JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLING):
        with pytest.raises(FailedPrecondition):
            move(store, job.id, target)
    with pytest.raises(InvalidArgument):
        move(store, job.id, JS.JOB_STATE_UNSPECIFIED)

    log = events(store, job.id)
    assert [e.seq for e in log] == list(range(1, 10))
    assert [e.type for e in log][:2] == ["SUBMITTED", "STATE_CHANGED"]
    assert log[-1].state == JS.JOB_STATE_SUCCEEDED and log[6].attributes == {"why": "skew"}
    assert [e.seq for e in events(store, job.id, after_seq=7)] == [8, 9]
    first = store.repo.list_job_events(store.a, store_pb2.ListJobEventsRequest(job_id=job.id, page=page(4)))
    second = store.repo.list_job_events(
        store.a, store_pb2.ListJobEventsRequest(job_id=job.id, page=page(4, first.next_page_token))
    )
    assert [e.seq for e in first.events] == [1, 2, 3, 4] and [e.seq for e in second.events] == [5, 6, 7, 8]
    assert events(store, job.id) == log  # append-only: history unchanged by reads

    cancelled = new_job(store, name="c")
    assert move(store, cancelled.id, JS.JOB_STATE_CANCELLED).state == JS.JOB_STATE_CANCELLED


def test_concurrent_events_are_gapless(store: Store):
    job = new_job(store)
    errors: list[BaseException] = []

    def append(n: int) -> None:
        try:
            for i in range(5):
                store.repo.append_job_event(
                    store.a,
                    store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type=f"T{n}.{i}")),
                )
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=append, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [e.seq for e in events(store, job.id, page=page(100))] == list(range(1, 22))


# --- metrics, migrations, checkpoints ------------------------------------------------------------


def test_iteration_metrics_bulk_write_is_idempotent(store: Store):
    repo, a = store.repo, store.a
    job = new_job(store)

    def row(it: int, stage: int, loss: float | None = None) -> job_pb2.IterationMetric:
        r = job_pb2.IterationMetric(
            job_id=job.id,
            iteration=it,
            stage_index=stage,
            plan_version=1,
            iteration_time_s=1.5,
            peak_memory_bytes=5 << 30,
            predicted_iteration_time_s=1.4,
        )
        if loss is not None:
            r.loss, r.has_loss = loss, True
        return r

    batch = [row(it, st, loss=2.0 - it if st == 1 else None) for it in range(3) for st in range(2)]
    assert repo.write_iteration_metrics(a, store_pb2.WriteIterationMetricsRequest(metrics=batch)).written == 6
    again = [*batch, row(3, 0), row(3, 0)]
    assert repo.write_iteration_metrics(a, store_pb2.WriteIterationMetricsRequest(metrics=again)).written == 1
    assert store.count("iteration_metrics") == 7
    assert repo.get_job(a, store_pb2.GetRequest(id=job.id)).iteration == 3

    def listed(**kw):
        return list(
            repo.list_iteration_metrics(a, store_pb2.ListIterationMetricsRequest(job_id=job.id, **kw)).metrics
        )

    everything = listed()
    assert [(m.iteration, m.stage_index) for m in everything] == [
        (i, s) for i in range(3) for s in range(2)
    ] + [(3, 0)]
    assert everything[1].has_loss and everything[1].loss == 2.0 and not everything[0].has_loss
    assert everything[0].peak_memory_bytes == 5 << 30 and everything[0].recorded_at.seconds > 0
    assert [
        (m.iteration, m.stage_index) for m in listed(from_iteration=1, to_iteration=3, stage_index=1)
    ] == [
        (1, 1),
        (2, 1),
    ]
    assert [m.iteration for m in listed(stage_index=0, page=page(2))] == [0, 1]

    other = new_job(store, who=store.b)
    mixed = [row(9, 0), job_pb2.IterationMetric(job_id=other.id)]
    with pytest.raises(NotFound) as err:
        repo.write_iteration_metrics(a, store_pb2.WriteIterationMetricsRequest(metrics=mixed))
    assert err.value.field == "metrics[1].job_id" and store.count("iteration_metrics") == 7
    assert repo.write_iteration_metrics(a, store_pb2.WriteIterationMetricsRequest()).written == 0


def test_layer_migrations_and_checkpoints(store: Store):
    repo, a = store.repo, store.a
    job = new_job(store)
    sent = job_pb2.LayerMigration(
        job_id=job.id, layer_index=3, from_stage=0, to_stage=1, bytes=1 << 33, duration_s=0.2, iteration=5
    )
    mig = repo.record_layer_migration(a, store_pb2.RecordLayerMigrationRequest(migration=sent))
    assert mig.id.startswith("mig-") and mig.bytes == 1 << 33
    listed = repo.list_layer_migrations(a, store_pb2.ListLayerMigrationsRequest(job_id=job.id)).migrations
    assert list(listed) == [mig]

    def ckp(it: int, complete: bool) -> job_pb2.Checkpoint:
        layers = [
            job_pb2.LayerCheckpoint(layer_index=i, uri=f"file:///c/{it}/{i}.pt", bytes=10, sha256="ab")
            for i in (0, 1)
        ]
        c = job_pb2.Checkpoint(job_id=job.id, iteration=it, plan_version=1, complete=complete, layers=layers)
        return repo.create_checkpoint(a, store_pb2.CreateCheckpointRequest(checkpoint=c))

    c10, c20, c30 = ckp(10, True), ckp(20, True), ckp(30, False)
    assert c10.id.startswith("ckp-") and [layer.uri for layer in c10.layers][1] == "file:///c/10/1.pt"
    assert repo.get_checkpoint(a, store_pb2.GetRequest(id=c20.id)) == c20

    def ids(**kw):
        return [
            c.id
            for c in repo.list_checkpoints(
                a, store_pb2.ListCheckpointsRequest(job_id=job.id, **kw)
            ).checkpoints
        ]

    assert ids() == [c30.id, c20.id, c10.id]
    assert ids(complete_only=True) == [c20.id, c10.id]
    dup = job_pb2.Checkpoint(job_id=job.id, layers=[job_pb2.LayerCheckpoint(layer_index=0)] * 2)
    with pytest.raises(InvalidArgument):
        repo.create_checkpoint(a, store_pb2.CreateCheckpointRequest(checkpoint=dup))
    with pytest.raises(NotFound):
        repo.get_checkpoint(a, store_pb2.GetRequest(id="ckp-missing"))


# --- queue -------------------------------------------------------------------------------------


def enqueue(st: Store, payload: str, who: Principal | None = None, **kw) -> store_pb2.EnqueueRequestResponse:
    req = store_pb2.EnqueueRequestRequest(kind="planner.search", payload_json=payload, **kw)
    return st.repo.enqueue_request(who or st.a, req)


def claim(st: Store, id_: str, worker: str, lease: float = 30.0) -> store_pb2.ClaimRequestResponse:
    return st.repo.claim_request(
        st.admin, store_pb2.ClaimRequestRequest(id=id_, worker=worker, lease_seconds=lease)
    )


def complete(st: Store, id_: str, token: str, result: str = '{"ok": true}') -> queue_pb2.QueuedRequest:
    req = store_pb2.CompleteRequestRequest(id=id_, lease_token=token, result_json=result)
    return st.repo.complete_request(st.admin, req)


def test_enqueue_deduplicates_by_content(store: Store):
    first = enqueue(store, '{"a": 1, "b": [1, 2]}')
    assert first.created and first.request.id.startswith("req-") and first.request.max_attempts == 3
    assert first.request.state == queue_pb2.REQUEST_STATE_QUEUED and len(first.request.dedupe_key) == 64
    same = enqueue(store, '{"b":[1,2],"a":1}')
    assert not same.created and same.request.id == first.request.id
    assert enqueue(store, '{"a": 2}').created
    assert enqueue(store, '{"a": 1, "b": [1, 2]}', who=store.b).created  # other tenant, other request
    with pytest.raises(InvalidArgument) as err:
        enqueue(store, "{not json")
    assert err.value.field == "payload_json"
    echo = store.repo.enqueue_request(
        store.a, store_pb2.EnqueueRequestRequest(kind="diagnostic.echo", payload_json="1")
    )

    def ids(who: Principal, **kw):
        return [r.id for r in store.repo.list_requests(who, store_pb2.ListRequestsRequest(**kw)).requests]

    assert len(ids(store.a)) == 3 and len(ids(store.admin)) == 4
    assert ids(store.a, kind="diagnostic.echo") == [echo.request.id]
    claim(store, echo.request.id, "w1")
    assert ids(store.a, state=queue_pb2.REQUEST_STATE_RUNNING) == [echo.request.id]
    for call, req in [
        (
            store.repo.claim_request,
            store_pb2.ClaimRequestRequest(id=echo.request.id, worker="w", lease_seconds=1),
        ),
        (store.repo.reap_expired_leases, store_pb2.ReapExpiredLeasesRequest()),
        (
            store.repo.renew_lease,
            store_pb2.RenewLeaseRequest(id=echo.request.id, lease_token="x", lease_seconds=1),
        ),
        (store.repo.complete_request, store_pb2.CompleteRequestRequest(id=echo.request.id, lease_token="x")),
    ]:
        with pytest.raises(PermissionDenied):
            call(store.a, req)


def test_concurrent_identical_enqueues_store_one_request(store: Store):
    results: list[store_pb2.EnqueueRequestResponse] = []
    barrier = threading.Barrier(4)

    def go() -> None:
        barrier.wait()
        results.append(enqueue(store, '{"race": true}'))

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and sum(r.created for r in results) == 1
    assert len({r.request.id for r in results}) == 1 and store.count("queued_requests") == 1


def test_lease_claim_renew_expire_reap_reclaim_complete_once(store: Store):
    rid = enqueue(store, '{"job": 1}').request.id
    first = claim(store, rid, "w1", lease=30)
    assert first.claimed and first.request.lease_owner == "w1" and first.request.attempts == 1
    token1 = first.request.lease_token
    assert not claim(store, rid, "w2").claimed  # live lease
    store.clock.advance(20)
    renewed = store.repo.renew_lease(
        store.admin, store_pb2.RenewLeaseRequest(id=rid, lease_token=token1, lease_seconds=30)
    )
    assert renewed.lease_expires_at.ToDatetime(UTC) == store.clock.t + timedelta(seconds=30)
    with pytest.raises(FailedPrecondition) as err:
        store.repo.renew_lease(
            store.admin, store_pb2.RenewLeaseRequest(id=rid, lease_token="stale", lease_seconds=5)
        )
    assert err.value.field == "lease_token" and "lease lost" in str(err.value)

    store.clock.advance(25)
    assert not store.repo.reap_expired_leases(store.admin, store_pb2.ReapExpiredLeasesRequest()).requests
    store.clock.advance(10)  # now expired
    with pytest.raises(FailedPrecondition):
        store.repo.renew_lease(
            store.admin, store_pb2.RenewLeaseRequest(id=rid, lease_token=token1, lease_seconds=5)
        )
    reaped = store.repo.reap_expired_leases(store.admin, store_pb2.ReapExpiredLeasesRequest()).requests
    assert [r.id for r in reaped] == [rid]
    assert (
        reaped[0].state == queue_pb2.REQUEST_STATE_QUEUED
        and reaped[0].requeues == 1
        and not reaped[0].lease_token
    )
    assert not store.repo.reap_expired_leases(store.admin, store_pb2.ReapExpiredLeasesRequest()).requests

    second = claim(store, rid, "w2")
    assert second.claimed and second.request.attempts == 2 and second.request.lease_token != token1
    with pytest.raises(FailedPrecondition) as err:
        complete(store, rid, token1)  # w1 lost its lease
    assert err.value.field == "lease_token"
    done = complete(store, rid, second.request.lease_token)
    assert done.state == queue_pb2.REQUEST_STATE_SUCCEEDED and json.loads(done.result_json) == {"ok": True}
    with pytest.raises(FailedPrecondition):
        complete(store, rid, second.request.lease_token)  # exactly once
    after = claim(store, rid, "w3")
    assert not after.claimed and after.request.state == queue_pb2.REQUEST_STATE_SUCCEEDED

    failing = enqueue(store, '{"job": 2}').request.id
    lease = claim(store, failing, "w1").request.lease_token
    failed = store.repo.complete_request(
        store.admin, store_pb2.CompleteRequestRequest(id=failing, lease_token=lease, error="boom")
    )
    assert failed.state == queue_pb2.REQUEST_STATE_FAILED and failed.error == "boom"


def test_expired_lease_reclaimed_directly_and_max_attempts(store: Store):
    rid = enqueue(store, '{"x": 1}', max_attempts=2).request.id
    w1 = claim(store, rid, "w1", lease=5)
    store.clock.advance(6)
    w2 = claim(store, rid, "w2", lease=5)  # expired lease: claimable without a reap
    assert w2.claimed and w2.request.attempts == 2
    with pytest.raises(FailedPrecondition):
        complete(store, rid, w1.request.lease_token)
    store.clock.advance(6)
    out = claim(store, rid, "w3")
    assert (
        not out.claimed and out.request.state == queue_pb2.REQUEST_STATE_FAILED and out.request.attempts == 2
    )
    assert "attempts" in out.request.error
    with pytest.raises(NotFound):
        claim(store, "req-missing", "w1")
    with pytest.raises(InvalidArgument) as err:
        claim(store, rid, "w1", lease=0)
    assert err.value.field == "lease_seconds"


def test_worker_heartbeats(store: Store):
    repo, admin = store.repo, store.admin

    def beat(name: str, **kw) -> queue_pb2.WorkerHeartbeat:
        hb = queue_pb2.WorkerHeartbeat(name=name, pid=42, queues=["planner"], **kw)
        return repo.record_worker_heartbeat(admin, store_pb2.RecordWorkerHeartbeatRequest(heartbeat=hb))

    beat("w-old")
    store.clock.advance(120)
    beat("w1", current_request_id="req-1")
    updated = beat("w1")
    assert updated.current_request_id == "" and list(updated.queues) == ["planner"]

    def names(**kw):
        return [w.name for w in repo.list_workers(store.a, store_pb2.ListWorkersRequest(**kw)).workers]

    assert names() == ["w1"] and names(seen_within_s=300) == ["w-old", "w1"]
    with pytest.raises(PermissionDenied):
        repo.record_worker_heartbeat(
            store.a, store_pb2.RecordWorkerHeartbeatRequest(heartbeat=queue_pb2.WorkerHeartbeat(name="x"))
        )
    assert store.count("workers") == 2


# --- schema and failures -----------------------------------------------------------------------


def test_schema_upgrade_downgrade_and_check(empty_database_url):
    url = empty_database_url
    engine = create_engine(url)
    try:
        assert schema.current_revision(url) is None
        with pytest.raises(SchemaOutOfDate) as err:
            schema.check_schema(engine)
        assert "ballast db upgrade" in str(err.value) and err.value.current is None
        with pytest.raises(SchemaOutOfDate):  # an un-migrated database answers the same from the repository
            Repository(engine).authenticate("blt_x")

        schema.upgrade(url)
        assert schema.current_revision(engine) == schema.head_revision()
        schema.check_schema(engine)
        schema.downgrade(url, "base")
        assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
        with pytest.raises(SchemaOutOfDate):
            schema.check_schema(engine)
        schema.upgrade(url, "head")
        schema.check_schema(engine)
        assert "iteration_metrics" in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "url",
    ["sqlite:////nonexistent-dir/ballast/x.db", "postgresql://postgres@127.0.0.1:1/ballast"],
    ids=["sqlite", "postgresql"],
)
def test_unreachable_database_is_unavailable(url):
    engine = create_engine(url)
    try:
        with pytest.raises(Unavailable) as err:
            Repository(engine).authenticate("blt_x")
        assert "BALLAST_DATABASE_URL" in str(err.value)
    finally:
        engine.dispose()


def test_unclaimed_request_is_reaped_only_after_the_stale_window(store: Store):
    rid = enqueue(store, '{"text": "lost"}').request.id
    reap = store.repo.reap_expired_leases
    assert not reap(store.admin, store_pb2.ReapExpiredLeasesRequest(queued_stale_s=60)).requests
    store.clock.advance(61)
    assert not reap(store.admin, store_pb2.ReapExpiredLeasesRequest()).requests  # 0 disables
    again = reap(store.admin, store_pb2.ReapExpiredLeasesRequest(queued_stale_s=60)).requests
    assert [r.id for r in again] == [rid] and again[0].requeues == 1
    assert again[0].state == queue_pb2.REQUEST_STATE_QUEUED
    # Re-sent just now: not due again until another window passes.
    assert not reap(store.admin, store_pb2.ReapExpiredLeasesRequest(queued_stale_s=60)).requests
    with pytest.raises(InvalidArgument, match="queued_stale_s"):
        reap(store.admin, store_pb2.ReapExpiredLeasesRequest(queued_stale_s=-1))


# --- SQLite read/write locking -------------------------------------------------------------------


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run `fn` in a daemon thread; its result (or exception) lands in the returned list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as err:  # surfaced by the caller
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# SQLite only: PostgreSQL's MVCC never makes a reader wait for a writer, so there is nothing to show there.
@pytest.mark.parametrize("empty_database_url", ["sqlite"], indirect=True)
def test_sqlite_reads_run_beside_a_writer_and_writes_queue_behind_it(store: Store):
    repo, a, admin = store.repo, store.a, store.admin
    job = new_job(store)
    rid = enqueue(store, '{"lock": 1}').request.id
    get = store_pb2.GetRequest
    reads: list[Callable[[], Any]] = [
        lambda: repo.authenticate(ADMIN_TOKEN),
        lambda: repo.get_job(a, get(id=job.id)),
        lambda: repo.list_jobs(a, store_pb2.ListJobsRequest()),
        lambda: repo.list_job_events(a, store_pb2.ListJobEventsRequest(job_id=job.id)),  # Watch polls this
        lambda: repo.get_model(a, get(id=job.model_id)),
        lambda: repo.list_models(a, store_pb2.ListModelsRequest()),
        lambda: repo.list_profiles(a, store_pb2.ListProfilesRequest()),
        lambda: repo.list_plans(a, store_pb2.ListPlansRequest()),
        lambda: repo.list_hosts(a, store_pb2.ListHostsRequest()),
        lambda: repo.list_iteration_metrics(a, store_pb2.ListIterationMetricsRequest(job_id=job.id)),
        lambda: repo.list_layer_migrations(a, store_pb2.ListLayerMigrationsRequest(job_id=job.id)),
        lambda: repo.list_checkpoints(a, store_pb2.ListCheckpointsRequest(job_id=job.id)),
        lambda: repo.get_queued_request(a, get(id=rid)),
        lambda: repo.list_requests(a, store_pb2.ListRequestsRequest()),
        lambda: repo.list_workers(a, store_pb2.ListWorkersRequest()),
        lambda: repo.get_tenant(a, get(id=a.tenant_id)),
        lambda: repo.list_tenants(admin, store_pb2.ListTenantsRequest()),
    ]
    writes: list[Callable[[], Any]] = [
        lambda: repo.append_job_event(
            a, store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type="LOCKED"))
        ),
        lambda: move(store, job.id, JS.JOB_STATE_PROFILING),
        lambda: repo.write_iteration_metrics(
            a,
            store_pb2.WriteIterationMetricsRequest(metrics=[job_pb2.IterationMetric(job_id=job.id, iteration=1)]),
        ),
        lambda: enqueue(store, '{"lock": 2}'),
        lambda: claim(store, rid, "w1"),
        lambda: repo.create_tenant(admin, store_pb2.CreateTenantRequest(name="team-c")),
        lambda: repo.create_plan(a, store_pb2.CreatePlanRequest(plan=plan_msg(job.model_id))),
        lambda: repo.record_worker_heartbeat(
            admin, store_pb2.RecordWorkerHeartbeatRequest(heartbeat=queue_pb2.WorkerHeartbeat(name="w1"))
        ),
    ]
    writer = sqlite3.connect(store.engine.url.database, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # a foreign writer holds the lock (e.g. a big metrics batch)
    try:
        for read in reads:
            thread, out = in_thread(read)
            thread.join(10)
            assert not thread.is_alive(), "a read waited for the writer"
            assert not isinstance(out[0], BaseException), out[0]
        queued = [in_thread(write) for write in writes]
        for thread, _ in queued:
            thread.join(0.2)
        assert all(thread.is_alive() for thread, _ in queued), "a write did not wait for the lock"
    finally:
        writer.execute("COMMIT")
        writer.close()
    for thread, out in queued:
        thread.join(30)
        assert not thread.is_alive() and not isinstance(out[0], BaseException), out
    assert {"LOCKED", "STATE_CHANGED"} <= {e.type for e in events(store, job.id)}


# --- bad input: INVALID_ARGUMENT on both backends ------------------------------------------------


def test_out_of_range_input_is_invalid_argument_on_both_backends(store: Store):
    repo, a, admin = store.repo, store.a, store.admin
    job = new_job(store)
    rid = enqueue(store, '{"bad": 1}').request.id
    lease = claim(store, rid, "w1").request.lease_token
    big, long = 2**64 - 1, "k" * 300
    nan, inf = math.nan, math.inf

    def metrics(**kw) -> Callable[[], Any]:
        msg = job_pb2.IterationMetric(**{"job_id": job.id, "iteration": 1, **kw})
        return lambda: repo.write_iteration_metrics(a, store_pb2.WriteIterationMetricsRequest(metrics=[msg]))

    def profile(pr: profile_pb2.Profile) -> Callable[[], Any]:
        return lambda: repo.create_profile(a, store_pb2.CreateProfileRequest(profile=pr))

    def host(h: fleet_pb2.Host) -> Callable[[], Any]:
        return lambda: repo.register_host(admin, store_pb2.RegisterHostRequest(host=h))

    huge_layer = profile_msg(job.model_id)
    huge_layer.layers[1].parameter_count = big
    bad_sample = profile_msg(job.model_id)
    bad_sample.layers[0].samples[1].forward_s = inf
    far_token = base64.urlsafe_b64encode(json.dumps({"o": 2**70}).encode()).decode()
    big_plan = plan_msg(job.model_id, job_id=job.id)
    big_plan.version = 2**31
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("metrics[0].peak_memory_bytes", metrics(peak_memory_bytes=big)),
        ("metrics[0].iteration", metrics(iteration=2**31)),  # INTEGER is 32-bit on PostgreSQL
        ("metrics[0].recorded_at", metrics(recorded_at=timestamp_pb2.Timestamp(seconds=10**12))),
        ("metrics[0].recorded_at", metrics(recorded_at=timestamp_pb2.Timestamp(seconds=1, nanos=-5))),
        ("metrics[0].loss", metrics(loss=nan, has_loss=True)),
        ("metrics[0].iteration_time_s", metrics(iteration_time_s=inf)),
        (
            "checkpoint.layers[0].bytes",
            lambda: repo.create_checkpoint(
                a,
                store_pb2.CreateCheckpointRequest(
                    checkpoint=job_pb2.Checkpoint(
                        job_id=job.id, layers=[job_pb2.LayerCheckpoint(layer_index=0, uri="f", bytes=big)]
                    )
                ),
            ),
        ),
        (
            "migration.bytes",
            lambda: repo.record_layer_migration(
                a,
                store_pb2.RecordLayerMigrationRequest(migration=job_pb2.LayerMigration(job_id=job.id, bytes=big)),
            ),
        ),
        ("profile.layers[1].parameter_count", profile(huge_layer)),
        ("profile.layers[0].samples[1].forward_s", profile(bad_sample)),
        ("profile.device.kind", profile(profile_msg(job.model_id, kind=long))),
        (
            "after_seq",
            lambda: repo.list_job_events(a, store_pb2.ListJobEventsRequest(job_id=job.id, after_seq=big)),
        ),
        ("page.page_token", lambda: repo.list_jobs(a, store_pb2.ListJobsRequest(page=page(1, far_token)))),
        ("lease_seconds", lambda: claim(store, rid, "w2", lease=1e300)),
        ("lease_seconds", lambda: claim(store, rid, "w2", lease=inf)),
        ("lease_seconds", lambda: claim(store, rid, "w2", lease=nan)),
        (
            "lease_seconds",
            lambda: repo.renew_lease(
                admin, store_pb2.RenewLeaseRequest(id=rid, lease_token=lease, lease_seconds=1e300)
            ),
        ),
        ("worker", lambda: claim(store, rid, long)),
        (
            "queued_stale_s",
            lambda: repo.reap_expired_leases(admin, store_pb2.ReapExpiredLeasesRequest(queued_stale_s=1e300)),
        ),
        (
            "queued_stale_s",
            lambda: repo.reap_expired_leases(admin, store_pb2.ReapExpiredLeasesRequest(queued_stale_s=nan)),
        ),
        ("seen_within_s", lambda: repo.list_workers(a, store_pb2.ListWorkersRequest(seen_within_s=1e300))),
        ("seen_within_s", lambda: repo.list_workers(a, store_pb2.ListWorkersRequest(seen_within_s=inf))),
        ("host.name", host(fleet_pb2.Host(name=long))),
        (
            "host.devices[0].spec.kind",
            host(fleet_pb2.Host(name="h1", devices=[fleet_pb2.Device(spec=fleet_pb2.DeviceSpec(kind=long))])),
        ),
        (
            "host.devices[0].spec.memory_bytes",
            host(
                fleet_pb2.Host(
                    name="h1", devices=[fleet_pb2.Device(spec=fleet_pb2.DeviceSpec(kind="cpu", memory_bytes=big))]
                )
            ),
        ),
        ("host.agent_port", host(fleet_pb2.Host(name="h1", agent_port=2**32 - 1))),
        ("kind", lambda: repo.enqueue_request(a, store_pb2.EnqueueRequestRequest(kind=long, payload_json="{}"))),
        ("spec.name", lambda: new_job(store, name=long)),
        (
            "event.type",
            lambda: repo.append_job_event(
                a, store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type=long))
            ),
        ),
        (
            "event.message",
            lambda: repo.append_job_event(
                a, store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type="T", message="a\x00b"))
            ),
        ),
        ("plan.version", lambda: repo.create_plan(a, store_pb2.CreatePlanRequest(plan=big_plan))),
        (
            "heartbeat.name",
            lambda: repo.record_worker_heartbeat(
                admin, store_pb2.RecordWorkerHeartbeatRequest(heartbeat=queue_pb2.WorkerHeartbeat(name=long))
            ),
        ),
    ]
    for field, call in cases:
        with pytest.raises(InvalidArgument) as err:
            call()
        assert err.value.field == field, (field, str(err.value))
        assert err.value.fix, field
    for table in ("iteration_metrics", "checkpoints", "layer_migrations", "profiles", "hosts", "plans", "workers"):
        assert store.count(table) == 0, table
    assert store.count("jobs") == 1 and store.count("queued_requests") == 1 and len(events(store, job.id)) == 1


def test_ids_quoted_in_errors_are_truncated(store: Store):
    huge = "x" * 10_000
    for call in (
        lambda: store.repo.get_job(store.a, store_pb2.GetRequest(id=huge)),
        lambda: store.repo.get_checkpoint(store.a, store_pb2.GetRequest(id=huge)),
        lambda: store.repo.get_tenant(store.a, store_pb2.GetRequest(id=huge)),
    ):
        with pytest.raises(NotFound) as err:
            call()
        assert len(str(err.value)) < 200 and "x" * 64 + "…" in str(err.value)
    with pytest.raises(InvalidArgument) as err:
        store.repo.create_tenant(store.admin, store_pb2.CreateTenantRequest(name=huge))
    assert len(str(err.value)) < 300


# --- queue: a FAILED request releases its dedupe key ----------------------------------------------


def test_failed_request_releases_its_dedupe_key(store: Store):
    payload = '{"retry": 1}'
    first = enqueue(store, payload).request
    assert not enqueue(store, payload).created  # QUEUED dedupes
    token = claim(store, first.id, "w1").request.lease_token
    assert enqueue(store, payload).request.id == first.id  # RUNNING dedupes
    failed = store.repo.complete_request(
        store.admin, store_pb2.CompleteRequestRequest(id=first.id, lease_token=token, error="boom")
    )
    assert failed.state == queue_pb2.REQUEST_STATE_FAILED and failed.dedupe_key == "" and failed.error == "boom"
    again = enqueue(store, payload)
    assert again.created and again.request.id != first.id and again.request.state == queue_pb2.REQUEST_STATE_QUEUED
    assert again.request.dedupe_key == first.dedupe_key
    assert enqueue(store, payload).request.id == again.request.id  # the fresh one dedupes in turn
    done = complete(store, again.request.id, claim(store, again.request.id, "w2").request.lease_token)
    assert done.state == queue_pb2.REQUEST_STATE_SUCCEEDED
    after = enqueue(store, payload)
    assert not after.created and after.request.id == again.request.id  # SUCCEEDED still dedupes
    old = store.repo.get_queued_request(store.a, store_pb2.GetRequest(id=first.id))
    assert old.state == queue_pb2.REQUEST_STATE_FAILED and old.error == "boom"  # history kept


def test_request_failed_by_max_attempts_releases_its_dedupe_key(store: Store):
    payload = '{"retry": 2}'
    first = enqueue(store, payload, max_attempts=1).request
    assert claim(store, first.id, "w1", lease=5).claimed
    store.clock.advance(6)
    out = claim(store, first.id, "w2")
    assert not out.claimed and out.request.state == queue_pb2.REQUEST_STATE_FAILED and not out.request.dedupe_key
    again = enqueue(store, payload, max_attempts=1)
    assert again.created and again.request.id != first.id and again.request.attempts == 0
    assert store.count("queued_requests") == 2


# --- plans: (job_id, version) is unique -----------------------------------------------------------


def test_plan_versions_are_unique_per_job(store: Store):
    repo, a = store.repo, store.a
    job = new_job(store)

    def plan(**kw) -> plan_pb2.Plan:
        pl = plan_msg(job.model_id, **kw)
        return repo.create_plan(a, store_pb2.CreatePlanRequest(plan=pl))

    seven = plan_msg(job.model_id, job_id=job.id)
    seven.version = 7
    assert repo.create_plan(a, store_pb2.CreatePlanRequest(plan=seven)).version == 7
    with pytest.raises(AlreadyExists) as err:
        repo.create_plan(a, store_pb2.CreatePlanRequest(plan=seven))
    assert err.value.field == "plan.version" and err.value.fix
    assert plan(job_id=job.id).version == 8  # version 0: the job's next
    assert [plan().version for _ in range(3)] == [1, 1, 1]  # what-if plans (no job) are unconstrained
    other = new_job(store, name="other")
    seven.job_id = other.id
    assert repo.create_plan(a, store_pb2.CreatePlanRequest(plan=seven)).version == 7  # per job
    assert store.count("plans") == 6 and store.count("plan_layers") == 12
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:  # the database enforces it too
        conn.execute(sa.text(f"UPDATE plans SET version = 7 WHERE job_id = '{job.id}' AND version = 8"))


# --- plans: CreatePlan is idempotent by request_id ------------------------------------------------


def test_create_plan_with_a_request_id_stores_one_plan(store: Store):
    """A re-run search (same queued request id) gets the stored plan back; the key is per tenant."""
    repo, a, b = store.repo, store.a, store.b
    job = new_job(store)
    prof = repo.create_profile(a, store_pb2.CreateProfileRequest(profile=profile_msg(job.model_id)))
    sent = plan_msg(job.model_id, profile_id=prof.id)

    def create(who: Principal, plan: plan_pb2.Plan, key: str = "req-1") -> plan_pb2.Plan:
        return repo.create_plan(who, store_pb2.CreatePlanRequest(plan=plan, request_id=key))

    first = create(a, sent)
    assert create(a, sent) == first
    assert create(store.admin, sent) == first  # the worker acts as the platform; the key is the model tenant's
    assert store.count("plans") == 1 and store.count("plan_layers") == 2 and store.count("plan_candidates") == 1
    assert create(a, sent, key="req-2").id != first.id  # another key, another plan
    other = plan_msg(job.model_id)  # no profile: not the plan stored under req-1
    with pytest.raises(AlreadyExists) as err:
        create(a, other)
    assert err.value.field == "request_id"
    b_job = new_job(store, who=b)
    b_plan = create(b, plan_msg(b_job.model_id))  # b's req-1 is its own key, and says nothing of a's
    assert b_plan.tenant_id == b.tenant_id and b_plan.id != first.id
    with pytest.raises(NotFound):  # and a's stored plan stays invisible to b through the key
        create(b, sent)
    assert store.count("plans") == 3
    plain = [repo.create_plan(a, store_pb2.CreatePlanRequest(plan=sent)) for _ in range(2)]  # no key: no dedup
    assert plain[0].id != plain[1].id
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:  # the database enforces the key
        conn.execute(sa.text(f"UPDATE plans SET request_id = 'req-1' WHERE id = '{plain[0].id}'"))


def test_concurrent_create_plan_with_one_request_id_stores_one_plan(store: Store):
    """Two workers racing to store one request's plan: the loser of the insert gets the winner's plan."""
    job = new_job(store)
    sent = plan_msg(job.model_id)
    barrier = threading.Barrier(4)
    ids: list[str] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            ids.append(store.repo.create_plan(store.admin, store_pb2.CreatePlanRequest(
                plan=sent, request_id="req-race")).id)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(ids)) == 1 and len(ids) == 4
    assert store.count("plans") == 1


def test_migration_0005_adds_and_drops_the_request_key(empty_database_url):
    url = empty_database_url
    schema.upgrade(url)
    engine = create_engine(url)
    repo = Repository(engine, now=FakeClock())
    admin = repo.ensure_admin(ADMIN_TOKEN)
    model = repo.create_model(admin, store_pb2.CreateModelRequest(spec=gpt()))
    keyed = repo.create_plan(admin, store_pb2.CreatePlanRequest(plan=plan_msg(model.id), request_id="req-k"))
    engine.dispose()

    def state() -> tuple[set[str], set[str]]:
        inspector = sa.inspect(engine)
        return ({c["name"] for c in inspector.get_columns("plans")},
                {u["name"] for u in inspector.get_unique_constraints("plans")})

    try:
        schema.downgrade(url, "0004_profile_details")
        columns, uniques = state()
        assert "request_id" not in columns and "uq_plans_tenant_request" not in uniques
        assert "uq_plans_job_version" in uniques
        with engine.connect() as conn:  # plans and their rows survive the rebuild
            assert conn.execute(sa.text("SELECT count(*) FROM plan_layers")).scalar_one() == 2
        engine.dispose()
        schema.upgrade(url)
        schema.check_schema(engine)
        columns, uniques = state()
        assert "request_id" in columns and "uq_plans_tenant_request" in uniques
        assert repo.get_plan(admin, store_pb2.GetRequest(id=keyed.id)).id == keyed.id
        again = repo.create_plan(admin, store_pb2.CreatePlanRequest(plan=plan_msg(model.id), request_id="req-k"))
        assert again.id != keyed.id  # the key was dropped with the column; the plan was kept
    finally:
        engine.dispose()


def test_migration_0003_renumbers_clashing_plans_and_releases_failed_keys(empty_database_url):
    url = empty_database_url
    schema.upgrade(url)
    engine = create_engine(url)
    repo = Repository(engine, now=FakeClock())
    admin = repo.ensure_admin(ADMIN_TOKEN)
    job = repo.create_job(admin, store_pb2.CreateJobRequest(spec=job_spec()))
    first, second = (
        repo.create_plan(admin, store_pb2.CreatePlanRequest(plan=plan_msg(job.model_id, job_id=job.id)))
        for _ in range(2)
    )
    for state in (JS.JOB_STATE_PROFILING, JS.JOB_STATE_PLANNING):
        repo.transition_job(admin, store_pb2.TransitionJobRequest(id=job.id, state=state))
    repo.transition_job(
        admin, store_pb2.TransitionJobRequest(id=job.id, state=JS.JOB_STATE_SCHEDULED, plan_id=second.id)
    )
    rid = repo.enqueue_request(admin, store_pb2.EnqueueRequestRequest(kind="k", payload_json="{}")).request.id
    lease = repo.claim_request(admin, store_pb2.ClaimRequestRequest(id=rid, worker="w", lease_seconds=9))
    repo.complete_request(
        admin, store_pb2.CompleteRequestRequest(id=rid, lease_token=lease.request.lease_token, error="x")
    )

    def scalar(sql: str) -> Any:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql)).scalar_one()

    engine.dispose()
    try:
        schema.downgrade(url, "0002_readonly_role")
        assert scalar(f"SELECT dedupe_key FROM queued_requests WHERE id = '{rid}'") == rid
        with engine.begin() as conn:  # a clash the old schema allowed
            conn.execute(sa.text(f"UPDATE plans SET version = 1 WHERE id = '{second.id}'"))
            conn.execute(sa.text(f"UPDATE jobs SET plan_version = 1 WHERE id = '{job.id}'"))
        engine.dispose()
        schema.upgrade(url)
        assert scalar(f"SELECT version FROM plans WHERE id = '{first.id}'") == 1
        assert scalar(f"SELECT version FROM plans WHERE id = '{second.id}'") == 2
        assert scalar(f"SELECT plan_version FROM jobs WHERE id = '{job.id}'") == 2
        assert scalar(f"SELECT dedupe_key FROM queued_requests WHERE id = '{rid}'") is None
        schema.check_schema(engine)
    finally:
        engine.dispose()


# --- migration 0004: profile details ------------------------------------------------------------


def test_migration_0004_keeps_existing_profiles_and_downgrades_fully(empty_database_url):
    url = empty_database_url
    schema.upgrade(url)
    engine = create_engine(url)
    repo = Repository(engine, now=FakeClock())
    admin = repo.ensure_admin(ADMIN_TOKEN)
    model = repo.create_model(admin, store_pb2.CreateModelRequest(spec=gpt()))
    detailed = repo.create_profile(admin, store_pb2.CreateProfileRequest(profile=detailed_profile_msg(model.id)))
    engine.dispose()

    def columns(table: str) -> set[str]:
        return {c["name"] for c in sa.inspect(engine).get_columns(table)}

    layer_cols = {"note", "measured_as", "batch_input_bytes", "max_micro_batch_size"}
    profile_cols = {"memory_trace", "measured_micro_batch_sizes", "memory_cap_bytes", "profiling_time_s"}
    try:
        schema.downgrade(url, "0003_plan_version_unique")
        assert not layer_cols & columns("profile_layers") and not profile_cols & columns("profiles")
        assert "ix_profiles_cache_lookup" not in {ix["name"] for ix in sa.inspect(engine).get_indexes("profiles")}
        with engine.connect() as conn:  # rows survive the rebuild, foreign keys included
            assert conn.execute(sa.text("SELECT count(*) FROM profile_layers")).scalar_one() == 3
            assert conn.execute(sa.text("SELECT count(*) FROM profile_layer_samples")).scalar_one() == 6
        engine.dispose()

        schema.upgrade(url)
        schema.check_schema(engine)
        assert layer_cols <= columns("profile_layers") and profile_cols <= columns("profiles")
        got = repo.get_profile(admin, store_pb2.GetRequest(id=detailed.id))
        # What 0003 could hold is intact; the details it dropped read back as proto3's empty values.
        assert got.comm == detailed.comm and len(got.layers) == 3
        assert not got.memory_trace and not got.measured_micro_batch_sizes
        assert got.memory_cap_bytes == 0 and got.profiling_time_s == 0.0
        assert all((ly.note, ly.measured_as, ly.batch_input_bytes, ly.max_micro_batch_size) == ("", 0, 0, 0)
                   for ly in got.layers)  # fmt: skip
        bare = profile_pb2.Profile()
        bare.CopyFrom(detailed)
        bare.ClearField("memory_trace")
        bare.ClearField("measured_micro_batch_sizes")
        bare.memory_cap_bytes, bare.profiling_time_s = 0, 0.0
        for ly in bare.layers:
            ly.note, ly.measured_as, ly.batch_input_bytes, ly.max_micro_batch_size = "", 0, 0, 0
        assert got == bare
        again = repo.create_profile(admin, store_pb2.CreateProfileRequest(profile=detailed_profile_msg(model.id)))
        assert repo.get_profile(admin, store_pb2.GetRequest(id=again.id)).memory_trace == detailed.memory_trace
    finally:
        engine.dispose()


def test_models_match_the_migrations(empty_database_url):
    """The ORM and the migrated schema agree (types and server defaults too), so neither drifts."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from services.store.models import Base

    schema.upgrade(empty_database_url)
    engine = create_engine(empty_database_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()
