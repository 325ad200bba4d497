"""The schema itself: migrations up and down (data kept), the ORM matching them, and an unusable database.

These run against the Repository and the engine directly, on SQLite and PostgreSQL: the remote
backend would add nothing, since migrations never travel over the wire.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from ballast.v1 import profile_pb2, store_pb2
from services.runtime.errors import SchemaOutOfDate, Unavailable
from services.store import schema
from services.store.db import create_engine
from services.store.repository import Repository
from tests.store_builders import detailed_profile_msg, gpt, job_spec, plan_msg
from tests.store_fixtures import ADMIN_TOKEN, JS, FakeClock


def test_schema_upgrade_downgrade_and_check(empty_database_url):
    url = empty_database_url
    engine = create_engine(url)
    try:
        assert schema.current_revision(url) is None
        with pytest.raises(SchemaOutOfDate) as err:
            schema.check_schema(engine)
        assert "ballast db upgrade" in str(err.value) and err.value.current is None
        with pytest.raises(SchemaOutOfDate):  # an un-migrated database answers the same from the repository
            Repository(engine).principal_for_token("blt_x")

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
            Repository(engine).principal_for_token("blt_x")
        assert "BALLAST_DATABASE_URL" in str(err.value)
    finally:
        engine.dispose()

def test_profile_cache_lookup_index_exists(empty_database_url):
    schema.upgrade(empty_database_url)
    engine = create_engine(empty_database_url)
    try:
        indexes = {ix["name"]: ix["column_names"] for ix in sa.inspect(engine).get_indexes("profiles")}
    finally:
        engine.dispose()
    assert indexes["ix_profiles_cache_lookup"] == ["tenant_id", "model_signature", "device_kind", "dtype"]


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


def stored_detailed_profile(url: str):
    """A database at head holding one detailed profile: (engine, repo, admin, the profile as stored)."""
    schema.upgrade(url)
    engine = create_engine(url)
    repo = Repository(engine, now=FakeClock())
    admin = repo.ensure_admin(ADMIN_TOKEN)
    model = repo.create_model(admin, store_pb2.CreateModelRequest(spec=gpt()))
    stored = repo.create_profile(admin, store_pb2.CreateProfileRequest(profile=detailed_profile_msg(model.id)))
    engine.dispose()
    return engine, repo, admin, stored


def test_migration_0004_keeps_existing_profiles_and_downgrades_fully(empty_database_url):
    url = empty_database_url
    engine, repo, admin, detailed = stored_detailed_profile(url)

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
            ly.tensor_parallel = ly.sequence_parallel = 0  # 0013's and 0027's columns, dropped with all above 0003
            for sample in ly.samples:  # 0020's columns too
                sample.forward_spread = sample.backward_spread = 0.0
        bare.composition_factor, bare.host_noise, bare.noisy, bare.measure_passes = 0.0, 0.0, False, 0
        assert got == bare
        request = store_pb2.CreateProfileRequest(profile=detailed_profile_msg(detailed.model_id))
        again = repo.create_profile(admin, request)
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


def test_migration_0027_adds_and_drops_sequence_parallel(empty_database_url):
    """Profile and plan layers stored before 0027 (or through a downgrade) read sequence_parallel 0 / false."""
    url = empty_database_url
    engine, repo, admin, stored = stored_detailed_profile(url)
    assert [ly.sequence_parallel for ly in stored.layers] == [0, 2, 0]
    try:
        schema.downgrade(url, "0026_metric_windows")
        for table in ("profile_layers", "plan_layers"):
            assert "sequence_parallel" not in {c["name"] for c in sa.inspect(engine).get_columns(table)}
        engine.dispose()
        schema.upgrade(url)
        schema.check_schema(engine)
        got = repo.get_profile(admin, store_pb2.GetRequest(id=stored.id))
        assert [ly.tensor_parallel for ly in got.layers] == [0, 4, 0] and not any(ly.sequence_parallel
                                                                                  for ly in got.layers)
    finally:
        engine.dispose()


def test_migration_0013_adds_and_drops_tensor_parallel(empty_database_url):
    """Profile layers stored before 0013 (or through a downgrade) read tensor_parallel 0: no TP offered."""
    url = empty_database_url
    engine, repo, admin, stored = stored_detailed_profile(url)
    assert [ly.tensor_parallel for ly in stored.layers] == [0, 4, 0]
    try:
        schema.downgrade(url, "0012_plan_layer_dp_sharding")
        assert "tensor_parallel" not in {c["name"] for c in sa.inspect(engine).get_columns("profile_layers")}
        engine.dispose()
        schema.upgrade(url)
        schema.check_schema(engine)
        got = repo.get_profile(admin, store_pb2.GetRequest(id=stored.id))
        assert len(got.layers) == 3 and not any(ly.tensor_parallel for ly in got.layers)
    finally:
        engine.dispose()


def test_migration_0016_versions_models_and_downgrades_only_without_second_versions(empty_database_url):
    """Rows stored before 0016 are version 1; a name's second version blocks the downgrade (it would clash)."""
    url = empty_database_url
    schema.upgrade(url, "0015_harmony_swap")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO tenants (id, name, admin, role, token_hash, created_at) VALUES "
                                 "('t-1', 'a', false, 'TENANT_ROLE_MEMBER', :hash, :now)"),
                         {"hash": "x" * 64, "now": datetime(2026, 1, 1, tzinfo=UTC)})
            conn.execute(sa.text("INSERT INTO models (id, tenant_id, name, family, signature, parameter_count, spec, "
                                 "created_at) VALUES ('m-1', 't-1', 'net', 'F', :sig, 0, '{}', :now)"),
                         {"sig": "a" * 64, "now": datetime(2026, 1, 1, tzinfo=UTC)})
        engine.dispose()
        schema.upgrade(url)
        schema.check_schema(engine)

        def rows() -> list[tuple]:
            with engine.connect() as conn:
                return [tuple(r) for r in conn.execute(sa.text("SELECT id, version FROM models ORDER BY id"))]

        assert rows() == [("m-1", 1)]
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO models (id, tenant_id, name, version, family, signature, "
                                 "parameter_count, spec, created_at) VALUES ('m-2', 't-1', 'net', 2, 'F', :sig, 0, "
                                 "'{}', :now)"), {"sig": "b" * 64, "now": datetime(2026, 1, 2, tzinfo=UTC)})
        engine.dispose()
        with pytest.raises(RuntimeError, match="1 model rows are second or later versions"):
            schema.downgrade(url, "0015_harmony_swap")
        assert rows() == [("m-1", 1), ("m-2", 2)]  # nothing changed
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM models WHERE id = 'm-2'"))
        engine.dispose()
        schema.downgrade(url, "0015_harmony_swap")
        assert "version" not in {c["name"] for c in sa.inspect(engine).get_columns("models")}
    finally:
        engine.dispose()
