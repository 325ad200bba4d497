"""The SQL in README.md (where an iteration's time went, the shared fleet, morphs), run as `ballast sql` runs
it (read-only) on SQLite and on PostgreSQL against a database `schema.upgrade` made, with rows whose answers
are known.

The blocks are found by their markers, `<!-- readme-sql: NAME BACKENDS -->` right before a ```sql fence, so
an edit to the README is what gets tested, and a block that goes missing fails here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from services.store import schema
from services.store.db import create_engine
from services.store.models import (
    Calibration,
    Device,
    DeviceLease,
    Host,
    IterationMetric,
    Job,
    JobEvent,
    JobMorph,
    Model,
    Tenant,
)
from services.store.sql import readonly_url, run_readonly_query
from tests.conftest import fresh_database
from tests.harness import ROOT

BLOCK = re.compile(r"<!-- readme-sql: (?P<name>[\w-]+) (?P<backends>[\w,]+) -->\n```sql\n(?P<sql>.*?)```", re.S)
BACKENDS = ("sqlite", "postgresql")
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)

# tenant -> device-hours over the last 7 days (see _leases)
DEVICE_HOURS = [["prod", 168.25], ["research", 26.5]]
# priority class -> admissions, mean wait in seconds (see _events)
QUEUE_WAIT = [["high", 2, 5.0], ["normal", 3, 60.0]]
# cause -> morphs, iterations trained again, mean recovery in seconds (see _morphs)
MORPHS = [["host_lost", 1, 4, 9.5], ["worker_lost", 2, 3, 4.0]]
# host class -> latest version, its iterations, error before and after (see _calibrations)
CALIBRATIONS = [["cpu/16c/2w", 2, 120, 0.35, 0.05], ["h100/32c/8w", 1, 200, 0.2, 0.125]]
# job, plan version, stage -> measured / predicted iteration s, compute / predicted compute s, recompute, p2p,
# allreduce, optimizer, overhead s, peak / predicted peak MiB (see _metrics; the row without a breakdown is out)
BREAKDOWN = [["job-c", 1, 0, 1.0, 0.8, 0.65, 0.5, 0.1, 0.15, 0.1, 0.03, 0.07, 3072, 2560],
             ["job-c", 1, 1, 1.0, 0.8, 0.8, 0.7, 0.0, 0.05, 0.1, 0.03, 0.02, 4096, 3584]]
EXPECTED = {"device-hours": DEVICE_HOURS, "queue-wait": QUEUE_WAIT, "queue-wait-from-events": QUEUE_WAIT,
            "morphs": MORPHS, "calibrations": CALIBRATIONS, "iteration-breakdown": BREAKDOWN}


def readme_blocks() -> list[tuple[str, set[str], str]]:
    """(name, backends, sql) for every marked block of README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [(m["name"], set(m["backends"].split(",")), m["sql"]) for m in BLOCK.finditer(text)]


def test_every_query_has_a_block_for_each_backend() -> None:
    blocks = readme_blocks()
    assert {name for name, _, _ in blocks} == set(EXPECTED)
    for name in EXPECTED:
        covered = [b for n, backends, _ in blocks if n == name for b in backends]
        assert sorted(covered) == sorted(BACKENDS), f"{name}: one block per backend, got {covered}"


def _seed(engine: sa.Engine, now: datetime) -> None:
    with engine.begin() as conn:
        def insert(model, *rows: dict) -> None:
            conn.execute(sa.insert(model.__table__), list(rows))

        insert(Tenant, *({"id": f"t-{name}", "name": name, "admin": name == "admin", "token_hash": name.ljust(64, "x"),
                          "created_at": now - 30 * DAY} for name in ("admin", "research", "prod", "idle")))
        insert(Model, {"id": "m-1", "tenant_id": "t-research", "name": "gpt", "family": "MODEL_FAMILY_GPT",
                       "signature": "s" * 64, "spec": {}, "created_at": now - 30 * DAY})
        insert(Host, {"id": "h-1", "name": "gpu-a", "state": "HOST_STATE_ONLINE", "supported_parallelism": [],
                      "labels": {}, "registered_at": now - 30 * DAY})
        insert(Device, *({"host_id": "h-1", "device_index": i, "kind": "h100", "memory_bytes": 80 << 30,
                          "peak_flops": 1e15, "spec": {}} for i in range(4)))
        jobs = {"job-a": ("high", "t-prod"), "job-b": ("high", "t-prod"), "job-c": ("normal", "t-research"),
                "job-d": ("normal", "t-research"), "job-e": ("low", "t-research")}
        insert(Job, *({"id": job_id, "tenant_id": tenant, "model_id": "m-1", "state": "JOB_STATE_RUNNING", "spec": {},
                       "created_at": now - 20 * DAY, "updated_at": now, "priority_class": cls}
                      for job_id, (cls, tenant) in jobs.items()))
        insert(DeviceLease, *_leases(now))
        insert(JobEvent, *_events(now - 2 * DAY))
        insert(JobMorph, *_morphs(now - DAY))
        insert(Calibration, *_calibrations(now - DAY))
        insert(IterationMetric, *_metrics(now - HOUR))


def _calibrations(t0: datetime) -> Iterator[dict]:
    """cpu/16c/2w fitted twice (the second on more iterations, closer), h100/32c/8w once."""
    for n, (host_class, version, iterations, before, after) in enumerate([
        ("cpu/16c/2w", 1, 40, 0.4, 0.1), ("h100/32c/8w", 1, 200, 0.2, 0.125), ("cpu/16c/2w", 2, 120, 0.35, 0.05),
    ]):
        kind, cores, workers = host_class.split("/")
        yield {"id": f"cal-{n}", "host_class": host_class, "device_kind": kind, "cores": int(cores[:-1]),
               "colocated": int(workers[:-1]), "version": version, "forward_scale": 1.2, "forward_fixed_s": 0.0,
               "backward_scale": 1.1, "backward_fixed_s": 0.0, "allreduce_scale": 1.0, "update_scale": 1.0,
               "iteration_fixed_s": 0.01, "memory_scale": 1.0, "memory_fixed_bytes": 0, "iterations": iterations,
               "residual": after, "residual_before": before, "job_ids": ["job-c"], "notes": "",
               "fitted_at": t0 + timedelta(hours=n)}


def _metrics(t0: datetime) -> Iterator[dict]:
    """job-c, 2 stages x 2 replicas x 2 iterations whose parts sum to 1 s; stage 0's replicas wait on p2p for
    0.2 and 0.1 s (the rest is overhead); one older row without a breakdown."""
    stages = {0: dict(forward_s=0.25, backward_s=0.4, recompute_s=0.1, allreduce_s=0.1, optimizer_s=0.03,
                      predicted_stage_compute_s=0.5, peak_memory_bytes=3 << 30, predicted_peak_memory_bytes=2560 << 20),
              1: dict(forward_s=0.3, backward_s=0.5, recompute_s=0.0, allreduce_s=0.1, optimizer_s=0.03,
                      predicted_stage_compute_s=0.7, peak_memory_bytes=4 << 30, predicted_peak_memory_bytes=3584 << 20)}
    waits = {(0, 0): (0.2, 0.02), (0, 1): (0.1, 0.12), (1, 0): (0.05, 0.02), (1, 1): (0.05, 0.02)}
    base = {"job_id": "job-c", "plan_version": 1, "iteration_time_s": 1.0, "predicted_iteration_time_s": 0.8,
            "idle_s": 0.0, "loss": None, "throughput_samples_per_s": 8.0, "recorded_at": t0}
    for (stage, replica), (p2p, overhead) in waits.items():
        for iteration in (0, 1):
            yield {**base, **stages[stage], "iteration": iteration, "stage_index": stage, "replica_index": replica,
                   "p2p_s": p2p, "comm_s": p2p + 0.1, "overhead_s": overhead}
    unmeasured = dict.fromkeys([*stages[0], "p2p_s", "overhead_s"])
    yield {**base, **unmeasured, "iteration": 2, "stage_index": 0, "replica_index": 0, "forward_s": 0.5,
           "backward_s": 0.5, "comm_s": 0.0, "peak_memory_bytes": 1 << 30}


def _morphs(t0: datetime) -> Iterator[dict]:
    """worker_lost twice (1 and 2 iterations again, recovered in 3 and 5 s), host_lost once (4, 9.5 s)."""
    s = timedelta(seconds=1)
    for n, (job, cause, failed, checkpoint, recovery) in enumerate([
        ("job-c", "worker_lost", 11, 10, 3.0), ("job-c", "worker_lost", 22, 20, 5.0),
        ("job-d", "host_lost", 14, 10, 9.5),
    ]):
        detected = t0 + 100 * n * s
        yield {"id": f"mph-{n}", "job_id": job, "tenant_id": "t-research", "cause": cause, "detail": "",
               "from_stages": 1, "from_replicas": 2, "from_plan_version": 1, "to_stages": 1, "to_replicas": 2,
               "to_plan_version": 1, "failed_iteration": failed, "checkpoint_iteration": checkpoint,
               "lost_iterations": failed - checkpoint, "detected_at": detected, "resumed_at": detected + s,
               "first_iteration_at": detected + recovery * s, "recovery_s": recovery, "created_at": detected}


def _leases(now: datetime) -> Iterator[dict]:
    """research: 2 h closed + 0.5 h live + 24 h of a lease that began before the window; one lease ended
    before it (nothing). prod: a live lease older than the window (7 d = 168 h) + 0.25 h closed."""
    for n, (job, tenant, device, start, end) in enumerate([
        ("job-c", "t-research", 0, now - 3 * HOUR, now - HOUR),
        ("job-c", "t-research", 1, now - 0.5 * HOUR, None),
        ("job-d", "t-research", 2, now - 8 * DAY, now - 6 * DAY),
        ("job-d", "t-research", 2, now - 12 * DAY, now - 10 * DAY),
        ("job-a", "t-prod", 3, now - 9 * DAY, None),
        ("job-b", "t-prod", 1, now - 2 * HOUR, now - 1.75 * HOUR),
    ]):
        yield {"id": f"lse-{n}", "job_id": job, "tenant_id": tenant, "host_id": "h-1", "device_index": device,
               "device_kind": "h100", "started_at": start, "ended_at": end,
               "end_reason": "LEASE_END_REASON_FINISHED" if end else None}


def _events(t0: datetime) -> Iterator[dict]:
    """high: job-a queued 10 s, job-b admitted at once (0 s); normal: job-c queued 30 s, then preempted and
    resumed after 60 s, job-d queued 90 s; low: job-e still queued (no admission, so no row)."""
    s = timedelta(seconds=1)
    timeline = {
        "job-a": [("QUEUED", "QUEUED", 0, {}), ("ADMITTED", "QUEUED", 10, {"waited_s": "10.000"}),
                  ("ASSIGNED", "RUNNING", 10, {})],
        "job-b": [("ADMITTED", "SCHEDULED", 40, {"waited_s": "0.000"}), ("ASSIGNED", "RUNNING", 40, {})],
        "job-c": [("QUEUED", "QUEUED", 0, {}), ("ADMITTED", "QUEUED", 30, {"waited_s": "30.000"}),
                  ("ASSIGNED", "RUNNING", 30, {}), ("PREEMPTING", "RUNNING", 90, {"for_job": "job-a"}),
                  ("PREEMPTED", "QUEUED", 100, {"for_job": "job-a", "checkpoint_iteration": "7"}),
                  ("RESUMED", "QUEUED", 160, {"waited_s": "60.000", "start_iteration": "7"}),
                  ("ASSIGNED", "RUNNING", 160, {})],
        "job-d": [("QUEUED", "QUEUED", 5, {}), ("ADMITTED", "QUEUED", 95, {"waited_s": "90.000"}),
                  ("ASSIGNED", "RUNNING", 95, {})],
        "job-e": [("QUEUED", "QUEUED", 0, {})],
    }
    for job_id, events in timeline.items():
        first = [("SUBMITTED", "SUBMITTED", -60, {}), ("STATE_CHANGED", "SCHEDULED", -20, {})]
        for seq, (kind, state, at, attributes) in enumerate(first + events, start=1):
            yield {"job_id": job_id, "seq": seq, "type": kind, "state": f"JOB_STATE_{state}", "message": "",
                   "attributes": {"priority_class": "", **attributes}, "created_at": t0 + at * s}


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_readme_sql_answers_on_each_backend(backend: str, tmp_path) -> None:
    with fresh_database(backend, tmp_path) as url:
        schema.upgrade(url)
        engine = create_engine(url)
        query = create_engine(readonly_url(url)) if backend == "postgresql" else engine  # what `ballast sql` uses
        try:
            _seed(engine, datetime.now(UTC))
            ran = set()
            for name, backends, sql in readme_blocks():
                if backend not in backends:
                    continue
                result = run_readonly_query(query, sql)
                expected = EXPECTED[name]
                assert len(result.rows) == len(expected), (name, result.rows)
                for got, want in zip(result.rows, expected, strict=True):
                    assert got[:-1] == want[:-1], (name, result.rows)
                    # a live lease grows while the test runs: allow a minute of it
                    assert got[-1] == pytest.approx(want[-1], abs=0.02), (name, result.rows)
                ran.add(name)
            assert ran == set(EXPECTED)
        finally:
            query.dispose()
            engine.dispose()
