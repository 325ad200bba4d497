"""docs/sql.md: every cookbook block runs as `ballast sql` runs it (read-only; on PostgreSQL as the read-only
login) on SQLite and on PostgreSQL, against rows whose answers are known (tests/sql_cookbook_rows.py), and every
table and column of the schema has its line in the reference.

Blocks are found by their markers, `<!-- sql-cookbook: NAME BACKENDS -->` right before a ```sql fence: a block
that goes missing, or a new one without an answer here, fails.
"""

from __future__ import annotations

import re

import pytest

from services.store import schema
from services.store.db import create_engine
from services.store.models import Base
from services.store.sql import readonly_url, run_readonly_query
from tests.conftest import fresh_database
from tests.harness import ROOT
from tests.sql_cookbook_rows import seed

DOC = ROOT / "docs" / "sql.md"
MARKER = "<!-- sql-cookbook:"
BLOCK = re.compile(r"<!-- sql-cookbook: (?P<name>[\w-]+) (?P<backends>[\w,]+) -->\n```sql\n(?P<sql>.*?)```", re.S)
BACKENDS = ("sqlite", "postgresql")

# The answers, worked out from the rows' docstrings in tests/sql_cookbook_rows.py.
EXPECTED: dict[str, list[list[object]]] = {
    # model, layout -> runs, predicted s, measured s, mean signed error %
    "estimator-error": [["gpt", "1x2", 1, 0.6, 0.5, 20.0], ["gpt", "2x1", 2, 0.85, 0.9, -5.0],
                        ["t5", "1x1", 1, 1.5, 2.0, -25.0]],
    # job -> worker-iterations, forward / backward / p2p / allreduce / optimizer / overhead % (job-4 has no parts)
    "time-shares": [["job-1", 8, 33.3, 38.9, 8.3, 11.1, 4.4, 3.9], ["job-2", 4, 30.0, 50.0, 0.0, 10.0, 6.0, 4.0]],
    # job -> migrations, plan versions, MiB, transfer s, first iteration
    "migrations-per-job": [["job-1", 2, 1, 6, 0.3, 2], ["job-2", 1, 1, 1, 0.05, 7]],
    # tenant, kind -> ended leases, device-hours (job-2's live lease is left out)
    "device-hours-by-kind": [["research", "h100", 2, 4.0], ["prod", "h100", 4, 2.0], ["research", "cpu", 1, 1.5]],
    # tenant, class -> admissions, mean and max wait s
    "queue-wait-by-tenant": [["prod", "high", 1, 4.0, 4.0], ["research", "low", 1, 12.0, 12.0],
                             ["research", "normal", 3, 40.0, 90.0]],
    # n -> device kind, dtype, how, profiling s, ms per step at micro-batch 1
    "profiles-over-time": [[1, "cpu", "DTYPE_FP32", "measured", 12.5, 11.0],
                           [2, "cpu", "DTYPE_FP32", "measured", 10.0, 10.0],
                           [3, "A100-80GB", "DTYPE_FP32", "projected", 0.0, 1.1]],
    "slowest-layers": [[1, "block.0", "block", 10.0], [0, "embed", "embedding", 6.0]],
    # job, version -> engine, samples/s, best fitting baseline, its samples/s, speedup, candidates out of memory
    "plans-vs-baselines": [["job-1", 1, "PLAN_ENGINE_GALVATRON", 20.0, "GPipe", 16.0, 1.25, 1],
                           ["job-1", 2, "PLAN_ENGINE_VPIPE", 25.0, "GPipe", 12.5, 2.0, 0],
                           ["job-4", 1, "PLAN_ENGINE_VARUNA", 8.0, "Megatron TP", 5.0, 1.6, 1]],
    "morph-recovery": [["job-1", "host_lost", "2x2 -> 2x1", 3, 12.5], ["job-1", "grow", "2x1 -> 2x2", 0, 4.0],
                       ["job-2", "straggler", "1x2 -> 1x1", 0, None]],
    # host class -> versions, latest, iterations, worst error before, best after
    "calibrations-per-class": [["cpu/2c/2w", 3, 3, 220, 0.4, 0.05], ["h100/32c/8w", 1, 1, 200, 0.2, 0.125]],
    # who, role -> calls, not OK, mean ms
    "audit-per-tenant": [["admin", "TENANT_ROLE_ADMIN", 1, 0, 10.0], ["dash", "TENANT_ROLE_VIEWER", 1, 1, 1.0],
                         ["research", "TENANT_ROLE_MEMBER", 3, 1, 3.0],
                         ["unauthenticated", "TENANT_ROLE_UNSPECIFIED", 1, 1, 0.5]],
    # job -> complete checkpoints, last iteration, MiB
    "checkpoints-per-job": [["job-1", 2, 20, 12], ["job-4", 1, 5, 16]],
    "degraded-hosts": [["gpu-b", 2, 1, "yes"], ["cpu-a", 1, 1, "no"]],
    "jobs-by-state": [["prod", "JOB_STATE_QUEUED", 1], ["prod", "JOB_STATE_SUCCEEDED", 1],
                      ["research", "JOB_STATE_FAILED", 1], ["research", "JOB_STATE_RUNNING", 1],
                      ["research", "JOB_STATE_SUCCEEDED", 1]],
    # kind, state -> requests, most attempts, requeues
    "queued-requests": [["jobs.calibrate", "REQUEST_STATE_QUEUED", 1, 0, 0],
                        ["jobs.prepare", "REQUEST_STATE_FAILED", 1, 3, 0],
                        ["jobs.prepare", "REQUEST_STATE_SUCCEEDED", 3, 2, 1],
                        ["planner.plan", "REQUEST_STATE_SUCCEEDED", 1, 1, 0]],
}


def cookbook() -> list[tuple[str, set[str], str]]:
    """(name, backends, sql) for every marked block of docs/sql.md."""
    text = DOC.read_text(encoding="utf-8")
    return [(m["name"], set(m["backends"].split(",")), m["sql"]) for m in BLOCK.finditer(text)]


def test_every_marker_is_a_block_and_every_answer_has_one_per_backend() -> None:
    blocks = cookbook()
    assert DOC.read_text(encoding="utf-8").count(MARKER) == len(blocks), "a marker not right before a ```sql fence"
    assert {name for name, _, _ in blocks} == set(EXPECTED), "a block without an answer here, or an answer without one"
    assert len(EXPECTED) >= 12
    for name in EXPECTED:
        covered = sorted(b for n, backends, _ in blocks if n == name for b in backends)
        assert covered == sorted(BACKENDS), f"{name}: one block per backend, got {covered}"


def _same(got: list[object], want: list[object]) -> bool:
    """Cell by cell; numbers compare by value (PostgreSQL sums come back as floats, SQLite's as ints)."""
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (g, w))
        if not (g == pytest.approx(w, abs=1e-9) if numbers else g == w):
            return False
    return True


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_cookbook_answers_on_each_backend(backend: str, tmp_path) -> None:
    with fresh_database(backend, tmp_path) as url:
        schema.upgrade(url)
        engine = create_engine(url)
        query = create_engine(readonly_url(url)) if backend == "postgresql" else engine  # what `ballast sql` uses
        try:
            seed(engine)
            ran = set()
            for name, backends, sql in cookbook():
                if backend not in backends:
                    continue
                want = EXPECTED.get(name)
                assert want is not None, f"docs/sql.md block {name!r} has no expected answer in this test"
                rows = run_readonly_query(query, sql).rows
                assert len(rows) == len(want) and all(map(_same, rows, want)), f"{name} on {backend}: {rows}"
                ran.add(name)
            assert ran == set(EXPECTED)
        finally:
            query.dispose()
            engine.dispose()


def documented_columns() -> dict[str, set[str]]:
    """Table -> the columns with a `| `name` |` row under its `#### table` heading in docs/sql.md."""
    found: dict[str, set[str]] = {}
    table = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            heading = re.fullmatch(r"#### (\w+)", line)
            table = heading[1] if heading else None
            if table:
                found[table] = set()
        elif table and (row := re.match(r"\| `(\w+)` \|", line)):
            found[table].add(row[1])
    return found


def test_every_table_and_column_is_documented() -> None:
    documented = documented_columns()
    missing = {t.name: sorted({c.name for c in t.columns} - documented.get(t.name, set()))
               for t in Base.metadata.sorted_tables}
    missing = {table: columns for table, columns in missing.items() if columns}
    assert not missing, f"add a line to docs/sql.md for each (table: columns): {missing}"
    gone = {t: sorted(cols - {c.name for c in Base.metadata.tables[t].columns}) if t in Base.metadata.tables
            else "no such table" for t, cols in documented.items()}
    assert not {t: c for t, c in gone.items() if c}, f"docs/sql.md names what the schema does not have: {gone}"


def test_the_readme_links_the_reference() -> None:
    assert "docs/sql.md" in (ROOT / "README.md").read_text(encoding="utf-8")
