"""`ballast sql`: read-only enforced by the database on SQLite and PostgreSQL.

Every write attempt must fail with ReadOnlyViolation AND leave the data exactly as it was; the data
check is what proves the database (not a parser) stopped it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from services.runtime import context
from services.runtime.errors import Cancelled, FailedPrecondition, InvalidArgument, ResourceExhausted
from services.store import schema
from services.store.db import create_engine, normalize_url
from services.store.models import IterationMetric, Job, Model, Tenant
from services.store.sql import (
    MAX_TIMEOUT_S,
    QueryResult,
    QueryTimeout,
    ReadOnlyViolation,
    json_safe,
    readonly_url,
    run_readonly_query,
    single_statement,
)

# Narrow the database fixture to one backend for backend-specific tests (no skips to explain).
POSTGRES_ONLY = pytest.mark.parametrize(
    "database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
POSTGRES_EMPTY = pytest.mark.parametrize(
    "empty_database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)

NOW = datetime(2026, 5, 10, 12, 30, tzinfo=UTC)
JOB_IDS = ["job-1", "job-2", "job-3"]


@dataclass
class Store:
    url: str
    engine: sa.Engine
    sql: sa.Engine  # what `ballast sql` queries through: the read-only login on PostgreSQL
    sql: sa.Engine  # what `ballast sql` queries through: the read-only login on PostgreSQL

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name


def _seed(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.insert(Tenant.__table__).values(
                id="t-1", name="acme", admin=True, token_hash="h" * 64, created_at=NOW
            )
        )
        conn.execute(
            sa.insert(Model.__table__).values(
                id="m-1",
                tenant_id="t-1",
                name="gpt-tiny",
                family="MODEL_FAMILY_GPT",
                signature="s" * 64,
                parameter_count=1234,
                spec={"layers": 2, "name": "gpt-tiny"},
                created_at=NOW,
            )
        )
        for index, job_id in enumerate(JOB_IDS):
            conn.execute(
                sa.insert(Job.__table__).values(
                    id=job_id,
                    tenant_id="t-1",
                    model_id="m-1",
                    name=f"run-{index}",
                    state="JOB_STATE_RUNNING",
                    spec={"steps": index, "tags": ["a", "b"]},
                    created_at=NOW,
                    updated_at=NOW,
                )
            )
        conn.execute(
            sa.insert(IterationMetric.__table__).values(
                job_id="job-1",
                iteration=1,
                stage_index=0,
                replica_index=0,
                plan_version=1,
                iteration_time_s=1.5,
                forward_s=0.5,
                backward_s=0.75,
                comm_s=0.1,
                idle_s=0.15,
                peak_memory_bytes=2**33,
                loss=2.25,
                throughput_samples_per_s=64.0,
                predicted_iteration_time_s=1.4,
                recorded_at=NOW,
            )
        )


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    engine = create_engine(database_url)
    _seed(engine)
    is_pg = engine.dialect.name == "postgresql"
    query = create_engine(readonly_url(database_url)) if is_pg else engine
    try:
        yield Store(url=database_url, engine=engine, sql=query)
    finally:
        query.dispose()
        engine.dispose()


def _snapshot(engine: sa.Engine) -> dict:
    """Everything a write attempt could have changed: row contents and the set of tables."""
    with engine.connect() as conn:
        return {
            "tables": sorted(sa.inspect(conn).get_table_names()),
            "tenants": conn.execute(sa.text("SELECT id, name FROM tenants ORDER BY id")).all(),
            "jobs": conn.execute(sa.text("SELECT id, name, state, message FROM jobs ORDER BY id")).all(),
            "metrics": conn.execute(sa.text("SELECT id, loss FROM iteration_metrics ORDER BY id")).all(),
        }


# --- reads ---------------------------------------------------------------------------------------


def test_select_returns_columns_and_rows(store: Store) -> None:
    result = run_readonly_query(store.sql, "SELECT id, name, state FROM jobs ORDER BY id")
    assert result == QueryResult(
        columns=["id", "name", "state"],
        rows=[[job_id, f"run-{i}", "JOB_STATE_RUNNING"] for i, job_id in enumerate(JOB_IDS)],
        truncated=False,
    )


def test_empty_result_still_names_columns(store: Store) -> None:
    result = run_readonly_query(store.sql, "SELECT id, name FROM jobs WHERE id = 'nope'")
    assert result == QueryResult(columns=["id", "name"], rows=[], truncated=False)


def test_trailing_semicolon_comments_and_quoted_semicolons_are_one_statement(store: Store) -> None:
    sql = "-- leading\nSELECT ';' AS s, 'it''s; fine' AS t /* ; */ FROM jobs WHERE id = 'job-1'; -- done"
    result = run_readonly_query(store.sql, sql)
    assert result.columns == ["s", "t"]
    assert result.rows == [[";", "it's; fine"]]


def test_values_are_json_safe(store: Store) -> None:
    result = run_readonly_query(
        store.sql,
        "SELECT j.id, j.spec, j.created_at, m.parameter_count, im.loss, im.peak_memory_bytes "
        "FROM jobs j JOIN models m ON m.id = j.model_id JOIN iteration_metrics im ON im.job_id = j.id",
    )
    json.dumps(result.rows, allow_nan=False)
    [row] = result.rows
    assert row[0] == "job-1"
    assert row[3:] == [1234, 2.25, 2**33]
    assert datetime.fromisoformat(row[2]).replace(tzinfo=UTC) == NOW
    # PostgreSQL returns JSONB as a dict; SQLite returns the JSON text. Both are JSON-safe as they are.
    spec = row[1] if store.dialect == "postgresql" else json.loads(row[1])
    assert spec == {"steps": 0, "tags": ["a", "b"]}


@POSTGRES_ONLY
def test_postgres_native_types_are_json_safe(store: Store) -> None:
    result = run_readonly_query(
        store.sql,
        "SELECT 1.25::numeric AS n, '\\xdead'::bytea AS b, now() AS t, 'NaN'::float8 AS nan, "
        "ARRAY[1, 2] AS a, '1 day'::interval AS d, gen_random_uuid() AS u, '{\"k\": [1]}'::jsonb AS j, "
        "'50%' AS pct",
    )
    json.dumps(result.rows, allow_nan=False)
    n, b, t, nan, a, d, u, j, pct = result.rows[0]
    assert (n, b, nan, a, d, j, pct) == (1.25, "dead", "NaN", [1, 2], 86400.0, {"k": [1]}, "50%")
    assert datetime.fromisoformat(t).tzinfo is not None
    uuid.UUID(u)


@SQLITE_ONLY
def test_sqlite_blobs_are_hex(store: Store) -> None:
    assert run_readonly_query(store.sql, "SELECT x'dead' AS b").rows == [["dead"]]


def test_json_safe_conversions() -> None:
    value = {
        "when": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        "amount": Decimal("1.5"),
        "raw": b"\x00\xff",
        "nested": [(1, Decimal("NaN")), {"inf": float("inf")}],
    }
    assert json_safe(value) == {
        "when": "2026-01-02T03:04:05+00:00",
        "amount": 1.5,
        "raw": "00ff",
        "nested": [[1, "NaN"], {"inf": "Infinity"}],
    }


# --- row limit -------------------------------------------------------------------------------------

COUNT_TO_20000 = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 20000) SELECT x FROM c"
)


def test_row_limit_truncates(store: Store) -> None:
    result = run_readonly_query(store.sql, "SELECT id FROM jobs ORDER BY id", row_limit=2)
    assert result.rows == [["job-1"], ["job-2"]]
    assert result.truncated
    exact = run_readonly_query(store.sql, "SELECT id FROM jobs ORDER BY id", row_limit=3)
    assert len(exact.rows) == 3 and not exact.truncated


def test_row_limit_default_and_cap(store: Store) -> None:
    default = run_readonly_query(store.sql, COUNT_TO_20000, row_limit=0)
    assert len(default.rows) == 1000 and default.truncated
    capped = run_readonly_query(store.sql, COUNT_TO_20000, row_limit=50_000)
    assert len(capped.rows) == 10_000 and capped.truncated
    assert capped.rows[-1] == [10_000]


def test_negative_arguments_are_rejected(store: Store) -> None:
    with pytest.raises(InvalidArgument) as err:
        run_readonly_query(store.sql, "SELECT 1", row_limit=-1)
    assert err.value.field == "row_limit"
    with pytest.raises(InvalidArgument) as err:
        run_readonly_query(store.sql, "SELECT 1", timeout_s=-1)
    assert err.value.field == "timeout_s"


@pytest.mark.parametrize("timeout_s", [1e9, float("inf"), float("nan"), MAX_TIMEOUT_S + 1])
def test_a_timeout_past_the_cap_is_refused_before_anything_runs(store: Store, timeout_s: float) -> None:
    with pytest.raises(InvalidArgument) as err:
        run_readonly_query(store.sql, COUNT_TO_1E9, timeout_s=timeout_s)
    assert err.value.field == "timeout_s" and "300" in err.value.message and err.value.fix


def test_a_query_stops_when_its_caller_goes_away(store: Store) -> None:
    """The RPC's cancellation (context.on_cancel, fired by grpc when the caller cancels, expires or disconnects)
    stops the query on both databases, though its own timeout is the full 300 s."""
    cancellation = context.Cancellation()
    outcome: list[BaseException] = []

    def call() -> None:
        context.set_call(None, None, cancellation=cancellation)
        try:
            run_readonly_query(store.sql, COUNT_TO_1E9, timeout_s=MAX_TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive()  # running
    cancellation.fire()
    thread.join(60)
    assert not thread.is_alive() and len(outcome) == 1
    assert isinstance(outcome[0], Cancelled), outcome
    assert run_readonly_query(store.sql, "SELECT count(*) AS n FROM jobs").rows == [[3]]


def test_the_calls_deadline_bounds_the_query(store: Store) -> None:
    context.set_call(None, time.monotonic() + 0.5)
    try:
        with pytest.raises(QueryTimeout):
            run_readonly_query(store.sql, COUNT_TO_1E9, timeout_s=MAX_TIMEOUT_S)
    finally:
        context.set_call(None, None)


@SQLITE_ONLY
@pytest.mark.parametrize("sql", [
    "SELECT fts3_tokenizer('simple')",
    "SELECT fts3_tokenizer('evil', x'4141414141414141')",
    "SELECT hex(fts3_tokenizer('porter'))",
    "SELECT load_extension('/tmp/x.so')",
    "SELECT sqlite_log(1, 'x')",
    "SELECT id FROM jobs WHERE rtreenode(2, x'00') IS NOT NULL",
])
def test_sqlite_functions_that_take_or_expose_pointers_are_refused(store: Store, sql: str) -> None:
    before = _snapshot(store.engine)
    with pytest.raises(ReadOnlyViolation) as err:
        run_readonly_query(store.sql, sql)
    name = next(f for f in ("fts3_tokenizer", "load_extension", "sqlite_log", "rtreenode") if f in sql)
    assert f"the function {name}()" in err.value.message and err.value.fix
    assert _snapshot(store.engine) == before


@SQLITE_ONLY
def test_sqlite_core_functions_stay_allowed(store: Store) -> None:
    sql = ("SELECT count(*), max(loss), round(avg(iteration_time_s), 2), json_extract('{\"a\": 2}', '$.a'), "
           "strftime('%Y', recorded_at), coalesce(NULL, 1), sqrt(4.0), group_concat(stage_index) "
           "FROM iteration_metrics")
    assert run_readonly_query(store.sql, sql).rows == [[1, 2.25, 1.5, 2, "2026", 1, 2.0, "0"]]


# --- writes are refused by the database ---------------------------------------------------------------

WRITES = [
    "DELETE FROM jobs",
    "WITH d AS (DELETE FROM jobs RETURNING *) SELECT * FROM d",
    "INSERT INTO tenants (id, name, admin, token_hash, created_at) "
    "VALUES ('t-9', 'evil', false, 'x', '2026-01-01')",
    "UPDATE jobs SET state = 'JOB_STATE_FAILED'",
    "DROP TABLE jobs",
    "CREATE TABLE x (id integer)",
    "ALTER TABLE jobs ADD COLUMN y integer",
    "CREATE INDEX ix_evil ON jobs (name)",
    "with d as (update jobs set message = 'pwned' returning id) select count(*) from d",
]


@pytest.mark.parametrize("sql", WRITES)
def test_writes_are_refused_and_change_nothing(store: Store, sql: str) -> None:
    before = _snapshot(store.engine)
    with pytest.raises(ReadOnlyViolation) as err:
        run_readonly_query(store.sql, sql)
    assert str(err.value).startswith("read-only:")
    assert err.value.code == "PERMISSION_DENIED"
    assert _snapshot(store.engine) == before


@SQLITE_ONLY
def test_sqlite_cte_write_error_quotes_sqlite(store: Store) -> None:
    """SQLite cannot even parse DML inside WITH: say it was refused as a write, in SQLite's own words."""
    with pytest.raises(ReadOnlyViolation) as err:
        run_readonly_query(store.sql, "WITH d AS (DELETE FROM jobs RETURNING *) SELECT * FROM d")
    message = str(err.value)
    assert "`ballast sql` is read-only" in message
    assert 'near "DELETE": syntax error' in message


@SQLITE_ONLY
def test_sqlite_attach_and_pragma_writes_are_refused(store: Store, tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    for sql in (f"ATTACH DATABASE '{other}' AS o", "PRAGMA user_version = 7", "VACUUM"):
        with pytest.raises(ReadOnlyViolation):
            run_readonly_query(store.sql, sql)
    assert not other.exists()
    assert run_readonly_query(store.sql, "PRAGMA user_version").rows == [[0]]
    # Introspection stays available.
    info = run_readonly_query(store.sql, "SELECT name FROM pragma_table_info('jobs') ORDER BY cid")
    assert ["id"] in info.rows
    assert run_readonly_query(store.sql, "PRAGMA table_info(jobs)").rows


@POSTGRES_ONLY
def test_postgres_writes_outside_tables_are_refused(store: Store) -> None:
    before = _snapshot(store.engine)
    for sql in ("TRUNCATE jobs CASCADE", "SELECT set_config('transaction_read_only', 'off', false)"):
        with pytest.raises((ReadOnlyViolation, InvalidArgument)):
            run_readonly_query(store.sql, sql)
    assert _snapshot(store.engine) == before


@POSTGRES_ONLY
def test_postgres_autocommit_engine_is_still_read_only(store: Store) -> None:
    """SET TRANSACTION would be a silent no-op outside a transaction; the guard must not depend on it."""
    engine = sa.create_engine(readonly_url(store.url), isolation_level="AUTOCOMMIT")
    try:
        before = _snapshot(store.engine)
        with pytest.raises(ReadOnlyViolation):
            run_readonly_query(engine, "DELETE FROM jobs")
        assert _snapshot(store.engine) == before
        assert run_readonly_query(engine, "SELECT current_setting('transaction_read_only') AS ro").rows == [
            ["on"]
        ]
    finally:
        engine.dispose()


def _sequence_state(engine: sa.Engine) -> tuple[str, tuple]:
    with engine.connect() as conn:
        name = conn.execute(sa.text("SELECT pg_get_serial_sequence('iteration_metrics', 'id')")).scalar_one()
        assert name, "iteration_metrics.id should be backed by a sequence"
        state = conn.execute(sa.text(f"SELECT last_value, is_called FROM {name}")).one()
    return name, tuple(state)


@POSTGRES_ONLY
@pytest.mark.parametrize("call", ["setval('{seq}', 42)", "nextval('{seq}')", "setval('{seq}', 1, false)"])
def test_postgres_sequences_cannot_be_moved(store: Store, call: str) -> None:
    sequence, before = _sequence_state(store.engine)
    with pytest.raises(ReadOnlyViolation) as err:
        run_readonly_query(store.sql, "SELECT " + call.format(seq=sequence))
    assert str(err.value).startswith("read-only:")
    assert _sequence_state(store.engine) == (sequence, before)


# --- statements, timeouts, bad SQL ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "sql", ["SELECT 1; DELETE FROM jobs", "SELECT 1; SELECT 2", "DELETE FROM jobs; SELECT 1;"]
)
def test_multiple_statements_are_rejected_before_anything_runs(store: Store, sql: str) -> None:
    before = _snapshot(store.engine)
    with pytest.raises(InvalidArgument) as err:
        run_readonly_query(store.sql, sql)
    assert err.value.field == "sql"
    assert _snapshot(store.engine) == before


@pytest.mark.parametrize("sql", ["", "   ", "-- only a comment", ";;"])
def test_empty_sql_is_rejected(store: Store, sql: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        run_readonly_query(store.sql, sql)
    assert err.value.field == "sql"


@pytest.mark.parametrize(
    ("sql", "dialect", "count"),
    [
        ("SELECT $$a;b$$ AS s", "postgresql", 1),
        ("SELECT $tag$ ; $notend$ ; $tag$", "postgresql", 1),
        ("SELECT E'it\\'s; ok'", "postgresql", 1),
        ("SELECT 1 /* outer /* inner; */ still comment; */", "postgresql", 1),
        ('SELECT "a;b" FROM t', "postgresql", 1),
        ("SELECT [a;b] FROM t", "sqlite", 1),
        ("SELECT `a;b` FROM t", "sqlite", 1),
        ("SELECT 1 /* c */ ; SELECT 2", "sqlite", 2),
        ("SELECT a$b FROM t; SELECT 2", "postgresql", 2),
    ],
)
def test_statement_splitting(sql: str, dialect: str, count: int) -> None:
    if count == 1:
        assert single_statement(sql, dialect=dialect) == sql.strip().rstrip(";").strip()
    else:
        with pytest.raises(InvalidArgument):
            single_statement(sql, dialect=dialect)


COUNT_TO_1E9 = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) "
    "SELECT count(*) FROM c"
)
SLOW = {"sqlite": [COUNT_TO_1E9], "postgresql": ["SELECT pg_sleep(5)", COUNT_TO_1E9]}


def test_slow_queries_time_out(store: Store) -> None:
    for sql in SLOW[store.dialect]:
        started = time.monotonic()
        with pytest.raises(QueryTimeout) as err:
            run_readonly_query(store.sql, sql, timeout_s=0.5)
        assert err.value.code == "DEADLINE_EXCEEDED"
        assert time.monotonic() - started < 4, sql
    # The engine is still usable afterwards.
    assert run_readonly_query(store.sql, "SELECT count(*) AS n FROM jobs").rows == [[3]]


@pytest.mark.parametrize("sql", ["SELEC 1", "SELECT * FROM no_such_table", "SELECT no_such_column FROM jobs"])
def test_bad_sql_is_invalid_argument(store: Store, sql: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        run_readonly_query(store.sql, sql)
    assert err.value.field == "sql"
    assert not isinstance(err.value, ReadOnlyViolation)


def test_store_keeps_working_after_queries(store: Store) -> None:
    """The read-only session never leaks into the store's own (writable) connections."""
    for sql in ("SELECT 1", "DELETE FROM jobs", "SELEC 1"):
        try:
            run_readonly_query(store.sql, sql)
        except (ReadOnlyViolation, InvalidArgument):
            pass
    with store.engine.begin() as conn:
        conn.execute(sa.update(Job.__table__).where(Job.__table__.c.id == "job-1").values(message="written"))
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT message FROM jobs WHERE id = 'job-1'")).scalar_one() == "written"


# --- the migration -----------------------------------------------------------------------------------


def _pg_scalar(engine: sa.Engine, sql: str):
    with engine.connect() as conn:
        return conn.execute(sa.text(sql)).scalar()


def test_downgrade_to_base_and_upgrade_again(store: Store) -> None:
    schema.downgrade(store.url, "0001_initial")
    if store.dialect == "postgresql":
        assert _pg_scalar(store.engine, "SELECT 1 FROM pg_roles WHERE rolname = 'ballast_readonly'") == 1
        assert not _pg_scalar(
            store.engine, "SELECT has_table_privilege('ballast_readonly', 'jobs', 'SELECT')"
        )
        assert not _pg_scalar(
            store.engine,
            "SELECT count(*) FROM pg_default_acl WHERE defaclacl::text LIKE '%ballast_readonly%'",
        )
    schema.downgrade(store.url, "base")
    store.engine.dispose()
    schema.upgrade(store.url)
    assert schema.current_revision(store.url) == schema.head_revision()
    _seed(store.engine)
    assert run_readonly_query(store.sql, "SELECT count(*) AS n FROM jobs").rows == [[3]]


@POSTGRES_ONLY
def test_postgres_role_and_grants(store: Store) -> None:
    engine = store.engine
    # LOGIN without a password: only trust/peer authentication lets it in until an operator sets one.
    assert _pg_scalar(engine, "SELECT rolcanlogin FROM pg_roles WHERE rolname = 'ballast_readonly'") is True
    assert _pg_scalar(engine, "SELECT has_table_privilege('ballast_readonly', 'jobs', 'SELECT')")
    for privilege in ("INSERT", "UPDATE", "DELETE", "TRUNCATE"):
        assert not _pg_scalar(
            engine, f"SELECT has_table_privilege('ballast_readonly', 'jobs', '{privilege}')"
        )
    # Tables created later by the same user are readable through the default privileges.
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE later_table (id integer)"))
    assert _pg_scalar(engine, "SELECT has_table_privilege('ballast_readonly', 'later_table', 'SELECT')")
    assert run_readonly_query(store.sql, "SELECT current_user AS u").rows == [["ballast_readonly"]]


@POSTGRES_ONLY
def test_postgres_privileged_login_is_refused(store: Store) -> None:
    """A superuser (or the tables' owner) could switch back from any role: never run as one."""
    before = _snapshot(store.engine)
    with pytest.raises(FailedPrecondition, match="refuses to run as") as info:
        run_readonly_query(store.engine, "SELECT 1")
    assert "BALLAST_SQL_DATABASE_URL" in str(info.value)
    assert _snapshot(store.engine) == before


ESCAPE_MARKER = Path("/tmp/ballast_sql_escape")
ESCAPES = [
    "SELECT set_config('role', 'postgres', true), current_user",
    "SELECT set_config('role', 'postgres', true), "
    "query_to_xml('select pg_read_file(''/etc/hostname'')', true, false, '')",
    "SELECT pg_read_file('/etc/hostname')",
    "DO $$BEGIN RESET ROLE; EXECUTE 'COPY (SELECT 1) TO PROGRAM ''touch " + str(ESCAPE_MARKER) + "'''; END$$",
    "DO $$BEGIN EXECUTE 'DELETE FROM jobs'; END$$",
    "COPY (SELECT 1) TO PROGRAM 'touch " + str(ESCAPE_MARKER) + "'",
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
    "SELECT lo_import('/etc/hostname')",
]


@POSTGRES_ONLY
@pytest.mark.parametrize("statement", ESCAPES)
def test_postgres_escape_attempts_fail_and_change_nothing(store: Store, statement: str) -> None:
    """The review's exploits against a privileged login; as the read-only login each one fails."""
    ESCAPE_MARKER.unlink(missing_ok=True)
    before = _snapshot(store.engine)
    with pytest.raises((ReadOnlyViolation, InvalidArgument)):
        run_readonly_query(store.sql, statement)
    assert not ESCAPE_MARKER.exists()
    assert _snapshot(store.engine) == before


def test_huge_values_are_refused_not_materialized(store: Store) -> None:
    huge = "SELECT randomblob(1000000000)" if store.dialect == "sqlite" else "SELECT repeat('x', 100000000)"
    with pytest.raises((ResourceExhausted, InvalidArgument)):
        run_readonly_query(store.sql, huge)
    assert run_readonly_query(store.sql, "SELECT 1").rows == [[1]]


@POSTGRES_EMPTY
def test_postgres_non_superuser_service_account(empty_database_url: str) -> None:
    """A service account that is not a superuser migrates; queries go through the read-only login, and the
    owner account itself is refused (it could write)."""
    admin = create_engine(empty_database_url)
    account = f"ballast_svc_{uuid.uuid4().hex[:8]}"
    database = empty_database_url.rsplit("/", 1)[1]
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # The role is cluster-wide and usually exists already (created by another database's migration).
        conn.execute(
            sa.text(
                "DO $$ BEGIN CREATE ROLE ballast_readonly NOLOGIN; "
                "EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
            )
        )
        conn.execute(sa.text(f"CREATE ROLE {account} LOGIN CREATEROLE"))
        conn.execute(sa.text(f'ALTER DATABASE "{database}" OWNER TO {account}'))
        conn.execute(sa.text(f"GRANT ALL ON SCHEMA public TO {account}"))
        if conn.dialect.server_version_info >= (16,):
            # From PostgreSQL 16 only holders of ADMIN OPTION may grant a role someone else created.
            conn.execute(sa.text(f"GRANT ballast_readonly TO {account} WITH ADMIN OPTION"))
    url = sa.make_url(normalize_url(empty_database_url)).set(username=account)
    url_text = url.render_as_string(hide_password=False)
    try:
        schema.upgrade(url_text)
        service = create_engine(url_text)
        readonly = create_engine(readonly_url(url_text))
        try:
            _seed(service)
            assert run_readonly_query(readonly, "SELECT count(*) AS n FROM jobs").rows == [[3]]
            with pytest.raises(ReadOnlyViolation):
                run_readonly_query(readonly, "DELETE FROM jobs")
            with pytest.raises(FailedPrecondition, match="owner"):
                run_readonly_query(service, "SELECT 1")
            assert _pg_scalar(service, "SELECT count(*) FROM jobs") == 3
        finally:
            readonly.dispose()
            service.dispose()
    finally:
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text(f"REASSIGN OWNED BY {account} TO CURRENT_USER"))
            conn.execute(sa.text(f"DROP OWNED BY {account}"))
            conn.execute(sa.text(f"DROP ROLE {account}"))
        admin.dispose()
