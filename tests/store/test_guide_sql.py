"""The SQL in the guides (docs/user-guide.md: where an iteration's time went, fidelity, morphs, calibrations;
docs/operator-guide.md: the shared fleet, the audit log), run
as `ballast sql` runs it (read-only) on SQLite and on PostgreSQL against a database `schema.upgrade` made, with
rows whose answers are known.

The blocks are found by their markers, `<!-- guide-sql: NAME BACKENDS -->` right before a ```sql fence, so
an edit to a guide is what gets tested, and a block that goes missing fails here.
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
    AuditRecord,
    Calibration,
    Device,
    DeviceLease,
    Host,
    IterationMetric,
    Job,
    JobEvent,
    JobMorph,
    Model,
    Plan,
    Tenant,
)
from services.store.sql import readonly_url, run_readonly_query
from tests.conftest import fresh_database
from tests.harness import ROOT

GUIDES = ("docs/user-guide.md", "docs/operator-guide.md")
BLOCK = re.compile(r"<!-- guide-sql: (?P<name>[\w-]+) (?P<backends>[\w,]+) -->\n```sql\n(?P<sql>.*?)```", re.S)
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
# model, stages, replicas, micro-batches, host class -> runs, calibrated runs, steady iterations, predicted /
# measured s, error %, predicted / measured peak MiB, memory error % (see _fidelity_metrics)
FIDELITY = [["bert", 2, 1, 2, "cpu/0c/2w", 1, 0, 2, 0.26, 0.325, -20.0, None, None, None],
            ["gpt", 1, 1, 8, "h100/0c/1w", 1, 0, 1, 0.4, 0.5, -20.0, 40960.0, 51200.0, -20.0],
            ["gpt", 1, 2, 4, "cpu/8c/2w", 2, 1, 5, 1.0, 0.9, 11.1, 1024.0, 896.0, 14.3],
            ["gpt", 3, 1, 6, "cpu/8c/3w", 1, 0, 2, 2.0, 2.3, -13.0, 512.0, 640.0, -20.0]]
# who, method, result -> calls (see _audit; the store's record of the admin's own writes is left out)
AUDIT = [["dash", "Submit", "PERMISSION_DENIED", 1], ["research", "Cancel", "NOT_FOUND", 1],
         ["research", "Submit", "OK", 2], ["unauthenticated", "Cancel", "UNAUTHENTICATED", 1]]
EXPECTED = {"audit-by-tenant": AUDIT, "device-hours": DEVICE_HOURS, "queue-wait": QUEUE_WAIT,
            "queue-wait-from-events": QUEUE_WAIT,
            "morphs": MORPHS, "calibrations": CALIBRATIONS, "iteration-breakdown": BREAKDOWN, "fidelity": FIDELITY}


def guide_blocks() -> list[tuple[str, set[str], str]]:
    """(name, backends, sql) for every marked block of the guides."""
    text = "\n".join((ROOT / guide).read_text(encoding="utf-8") for guide in GUIDES)
    return [(m["name"], set(m["backends"].split(",")), m["sql"]) for m in BLOCK.finditer(text)]


def test_every_query_has_a_block_for_each_backend() -> None:
    blocks = guide_blocks()
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
        insert(Model, *({"id": f"m-{n}", "tenant_id": "t-research", "name": name, "family": "MODEL_FAMILY_GPT",
                          "signature": str(n) * 64, "spec": {}, "created_at": now - 30 * DAY}
                         for n, name in ((1, "gpt"), (2, "bert"))))
        # gpu-a: 4 h100 and no core count; cpu-a and cpu-b: two agents on one machine (10.0.0.5), 3 cpu devices
        insert(Host, *({"id": f"h-{n}", "name": name, "address": address, "state": "HOST_STATE_ONLINE",
                        "supported_parallelism": [], "labels": labels, "registered_at": now - 30 * DAY,
                        "changed_at": now - 30 * DAY}
                       for n, name, address, labels in ((1, "gpu-a", "", {}),
                                                        (2, "cpu-a", "10.0.0.5", {"cpu_cores": "16"}),
                                                        (3, "cpu-b", "10.0.0.5", {"cpu_cores": "8"}))))
        insert(Device, *({"host_id": host, "device_index": i, "kind": kind, "memory_bytes": 80 << 30,
                          "peak_flops": 1e15, "spec": {}}
                         for host, kind, count in (("h-1", "h100", 4), ("h-2", "cpu", 2), ("h-3", "cpu", 1))
                         for i in range(count)))
        jobs = {"job-a": ("high", "t-prod"), "job-b": ("high", "t-prod"), "job-c": ("normal", "t-research"),
                "job-d": ("normal", "t-research"), "job-e": ("low", "t-research"), "job-f": ("normal", "t-research"),
                "job-g": ("normal", "t-research"), "job-h": ("normal", "t-research")}
        insert(Job, *({"id": job_id, "tenant_id": tenant, "model_id": "m-2" if job_id == "job-f" else "m-1",
                       "state": "JOB_STATE_RUNNING", "spec": {}, "created_at": now - 20 * DAY, "updated_at": now,
                       "priority_class": cls}
                      for job_id, (cls, tenant) in jobs.items()))
        insert(DeviceLease, *_leases(now))
        insert(Plan, *_plans(now - 20 * DAY))
        insert(JobEvent, *_events(now - 2 * DAY))
        insert(JobMorph, *_morphs(now - DAY))
        insert(Calibration, *_calibrations(now - DAY))
        insert(IterationMetric, *_metrics(now - HOUR))
        insert(IterationMetric, *_fidelity_metrics(now - 2 * HOUR))
        insert(AuditRecord, *_audit(now - HOUR))


def _audit(t0: datetime) -> Iterator[dict]:
    """research submits twice and cancels an unknown job; a viewer's submit and an unknown token's cancel are
    refused; the store records the admin creating a tenant."""
    for n, (server, who, role, method, code) in enumerate([
        ("store", "admin", "ADMIN", "CreateTenant", "OK"), ("planner", "research", "MEMBER", "Submit", "OK"),
        ("planner", "research", "MEMBER", "Submit", "OK"), ("planner", "research", "MEMBER", "Cancel", "NOT_FOUND"),
        ("planner", "dash", "VIEWER", "Submit", "PERMISSION_DENIED"), ("planner", "", "", "Cancel", "UNAUTHENTICATED"),
    ]):
        yield {"uid": f"u{n}", "at": t0 + timedelta(seconds=n), "tenant_id": f"t-{who}" if who else "",
               "tenant_name": who, "role": f"TENANT_ROLE_{role or 'UNSPECIFIED'}", "service": "ballast.v1.JobService",
               "method": method, "target": "", "code": code, "message": "", "duration_ms": 1.0, "peer": "",
               "server": server}


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


def _plans(t0: datetime) -> Iterator[dict]:
    """The plans the fidelity runs trained under; job-h's was priced with a calibration."""
    for job, model, version, kind, per_node, micro_batches in [
        ("job-d", "m-1", 1, "h100", 4, 8), ("job-f", "m-2", 1, "cpu", 2, 2),
        ("job-g", "m-1", 1, "cpu", 2, 4), ("job-g", "m-1", 2, "cpu", 2, 6), ("job-h", "m-1", 1, "cpu", 2, 4),
    ]:
        calibrated = "Calibrated from earlier runs: cal-1 (version 1 for cpu/8c/2w)" if job == "job-h" else ""
        yield {"id": f"pln-{job}-{version}", "tenant_id": "t-research", "model_id": model, "job_id": job,
               "engine": "PLAN_ENGINE_GALVATRON", "version": version, "global_batch_size": 8, "micro_batch_size": 1,
               "num_micro_batches": micro_batches, "schedule": "SCHEDULE_1F1B", "pipeline_degree": 1,
               "iteration_time_s": 1.0, "throughput_samples_per_s": 8.0, "peak_memory_bytes": 1 << 30,
               "out_of_memory": False, "memory_budget_bytes": 8 << 30,
               "fleet": {"device": {"kind": kind}, "devices_per_node": per_node}, "stages": [], "prediction": {},
               "explanation": f"Predicted 1 s per iteration.\n{calibrated}", "created_at": t0}


def _fidelity_metrics(t0: datetime) -> Iterator[dict]:
    """Runs whose first 3 iterations (per plan version) take 5 s, left out as warm-up. Without a breakdown, so
    the breakdown's answer stays job-c's. Slowest rank per steady iteration, mean over them:
    job-g v1 (1 stage x 2): 1.2, 1.0, 1.1 -> 1.1 s (predicted 1.0); job-h v1 (1 x 2, calibrated): 0.7 s (1.0);
    job-g v2 after a morph (3 x 1, from iteration 6): 2.2, 2.4 -> 2.3 s (2.0); job-d (h100, 1 x 1): 0.5 s
    (0.4); job-f (bert, 2 x 1, no peak predicted, no lease): 0.35, 0.3 -> 0.325 s (0.26). job-h's two steady
    iterations are one window row per rank (13 to 14), which the SQL weights as the two iterations it covers.
    Steady peaks, predicted -> measured MiB: job-g v1 1024 -> 1280, job-h 1024 -> 512; job-g v2 512 each -> 600,
    640, 680; job-d 40960 -> 51200 (the warm-up's 4096 MiB are left out too)."""
    runs = {  # (job, version) -> predicted s, first iteration, {steady iteration: [(stage, replica, s)]}, peaks
        ("job-g", 1): (1.0, 0, {3: [(0, 0, 1.0), (0, 1, 1.2)], 4: [(0, 0, 1.0), (0, 1, 1.0)],
                                5: [(0, 0, 1.1), (0, 1, 0.8)]}, {0: (1024, 1280)}),
        ("job-h", 1): (1.0, 10, {13: [(0, 0, 0.7), (0, 1, 0.7)], 14: [(0, 0, 0.7), (0, 1, 0.7)]}, {0: (1024, 512)}),
        ("job-g", 2): (2.0, 6, {9: [(0, 0, 2.0), (1, 0, 2.2), (2, 0, 2.1)], 10: [(0, 0, 2.0), (1, 0, 2.0),
                                                                                 (2, 0, 2.4)]},
                       {0: (512, 600), 1: (512, 640), 2: (512, 680)}),
        ("job-d", 1): (0.4, 0, {3: [(0, 0, 0.5)]}, {0: (40960, 51200)}),
        ("job-f", 1): (0.26, 0, {3: [(0, 0, 0.3), (1, 0, 0.35)], 4: [(0, 0, 0.3), (1, 0, 0.25)]}, {}),
    }
    windows = {("job-h", 1): (13, 14)}  # job-h's steady iterations arrived as one window per rank (the same times)
    for (job, version), (predicted, first, steady, peaks) in runs.items():
        ranks = steady[min(steady)]
        warmup = {first + i: [(stage, replica, 5.0) for stage, replica, _ in ranks] for i in range(3)}
        start, end = windows.get((job, version), (None, None))
        for iteration, rows in {**warmup, **steady}.items():
            if start is not None and start <= iteration < end:
                continue  # inside the window its last iteration's row stands for
            span = ({"first_iteration": start, "iterations": end - start + 1} if iteration == end
                    else {"first_iteration": iteration, "iterations": 1})  # every row names them: one executemany
            for stage, replica, seconds in rows:
                predicted_peak, peak = peaks.get(stage, (None, 256))
                # the largest peak in one steady iteration, smaller ones elsewhere; the warm-up's are left out
                peak_mib = peak if iteration == max(steady) and replica == 0 else min(peak, 256)
                peak_mib = 4096 if iteration in warmup else peak_mib
                yield {"job_id": job, "plan_version": version, "iteration": iteration, "stage_index": stage, **span,
                       "replica_index": replica, "iteration_time_s": seconds, "predicted_iteration_time_s": predicted,
                       "forward_s": 0.0, "backward_s": 0.0, "comm_s": 0.0, "idle_s": 0.0, "loss": None,
                       "throughput_samples_per_s": 8.0, "recorded_at": t0, "peak_memory_bytes": peak_mib << 20,
                       "predicted_peak_memory_bytes": None if predicted_peak is None else predicted_peak << 20}


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
    before it (nothing). prod: a live lease older than the window (7 d = 168 h) + 0.25 h closed. job-g and job-h
    leased cpu devices of the machine 10.0.0.5 before the window (nothing)."""
    for n, (job, tenant, host, device, start, end) in enumerate([
        ("job-c", "t-research", "h-1", 0, now - 3 * HOUR, now - HOUR),
        ("job-c", "t-research", "h-1", 1, now - 0.5 * HOUR, None),
        ("job-d", "t-research", "h-1", 2, now - 8 * DAY, now - 6 * DAY),
        ("job-d", "t-research", "h-1", 2, now - 12 * DAY, now - 10 * DAY),
        ("job-a", "t-prod", "h-1", 3, now - 9 * DAY, None),
        ("job-b", "t-prod", "h-1", 1, now - 2 * HOUR, now - 1.75 * HOUR),
        *(("job-g", "t-research", host, device, now - 9 * DAY, now - 8 * DAY)
          for host, device in (("h-2", 0), ("h-2", 1), ("h-3", 0))),
        *(("job-h", "t-research", host, 0, now - 14 * DAY, now - 13 * DAY) for host in ("h-2", "h-3")),
    ]):
        yield {"id": f"lse-{n}", "job_id": job, "tenant_id": tenant, "host_id": host, "device_index": device,
               "device_kind": "h100" if host == "h-1" else "cpu", "started_at": start, "ended_at": end,
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
def test_the_guides_sql_answers_on_each_backend(backend: str, tmp_path) -> None:
    with fresh_database(backend, tmp_path) as url:
        schema.upgrade(url)
        engine = create_engine(url)
        query = create_engine(readonly_url(url)) if backend == "postgresql" else engine  # what `ballast sql` uses
        try:
            _seed(engine, datetime.now(UTC))
            ran = set()
            for name, backends, sql in guide_blocks():
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
