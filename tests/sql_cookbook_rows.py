"""Rows for the SQL cookbook test (docs/sql.md): a small history whose answers are worked out by hand.

Every timestamp is fixed (T0 plus an offset), so no answer depends on when the test runs. Each function's
docstring says what its rows add up to; tests/store/test_sql_cookbook.py holds the answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from services.store.models import (
    AuditRecord,
    Calibration,
    Checkpoint,
    CheckpointLayer,
    Device,
    DeviceLease,
    Host,
    HostDegradation,
    IterationMetric,
    Job,
    JobEvent,
    JobMorph,
    LayerMigration,
    Model,
    Plan,
    PlanCandidate,
    Profile,
    ProfileLayer,
    ProfileLayerSample,
    QueuedRequest,
    Tenant,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
S, HOUR, DAY = timedelta(seconds=1), timedelta(hours=1), timedelta(days=1)
MiB = 1 << 20
# job -> tenant, model, state, priority class
JOBS = {"job-1": ("t-research", "m-gpt", "SUCCEEDED", "normal"), "job-2": ("t-research", "m-gpt", "RUNNING", "normal"),
        "job-3": ("t-research", "m-bert", "FAILED", "low"), "job-4": ("t-prod", "m-t5", "SUCCEEDED", "high"),
        "job-5": ("t-prod", "m-t5", "QUEUED", "high")}


def seed(engine: sa.Engine) -> None:
    """Insert the whole history, parents first."""
    with engine.begin() as conn:
        for model, rows in [(Tenant, _tenants()), (Model, _models()), (Host, _hosts()), (Device, _devices()),
                            (Job, _jobs()), (Profile, _profiles()), (ProfileLayer, _profile_layers()),
                            (ProfileLayerSample, _samples()), (Plan, _plans()), (PlanCandidate, _candidates()),
                            (JobEvent, _events()), (IterationMetric, _metrics()), (LayerMigration, _migrations()),
                            (DeviceLease, _leases()), (JobMorph, _morphs()), (Calibration, _calibrations()),
                            (Checkpoint, _checkpoints()), (CheckpointLayer, _checkpoint_layers()),
                            (HostDegradation, _degradations()), (AuditRecord, _audit()),
                            (QueuedRequest, _requests())]:
            conn.execute(sa.insert(model.__table__), list(rows))


def _tenants() -> Iterator[dict]:
    for name, role in (("admin", "ADMIN"), ("research", "MEMBER"), ("prod", "MEMBER"), ("dash", "VIEWER")):
        yield {"id": f"t-{name}", "name": name, "admin": role == "ADMIN", "role": f"TENANT_ROLE_{role}",
               "token_hash": name.ljust(64, "x"), "created_at": T0 - 30 * DAY}


def _models() -> Iterator[dict]:
    for n, (name, tenant, family) in enumerate((("gpt", "t-research", "GPT"), ("bert", "t-research", "BERT"),
                                                ("t5", "t-prod", "T5"))):
        yield {"id": f"m-{name}", "tenant_id": tenant, "name": name, "family": f"MODEL_FAMILY_{family}",
               "signature": str(n) * 64, "parameter_count": 1000, "spec": {}, "created_at": T0 - 20 * DAY}


def _hosts() -> Iterator[dict]:
    """gpu-b is degraded now; cpu-a was lost."""
    for id_, name, state, degraded in (("h-1", "gpu-a", "ONLINE", None), ("h-2", "gpu-b", "ONLINE", T0 + 6 * HOUR),
                                       ("h-3", "cpu-a", "LOST", None)):
        yield {"id": id_, "name": name, "address": f"10.0.0.{id_[-1]}", "state": f"HOST_STATE_{state}",
               "supported_parallelism": [], "labels": {"cpu_cores": "32"}, "registered_at": T0 - 30 * DAY,
               "degraded_reason": "straggler: 40% slower than its peers" if degraded else None,
               "degraded_at": degraded, "changed_at": degraded or T0 - 30 * DAY}


def _devices() -> Iterator[dict]:
    for host, kind, count in (("h-1", "h100", 4), ("h-2", "h100", 4), ("h-3", "cpu", 2)):
        for i in range(count):
            yield {"host_id": host, "device_index": i, "kind": kind, "memory_bytes": 80 << 30, "peak_flops": 1e15,
                   "spec": {}}


def _jobs() -> Iterator[dict]:
    for job_id, (tenant, model, state, cls) in JOBS.items():
        yield {"id": job_id, "tenant_id": tenant, "model_id": model, "state": f"JOB_STATE_{state}", "spec": {},
               "created_at": T0, "updated_at": T0 + DAY, "priority_class": cls}


# profile -> model, device kind, projected, profiling seconds, created, {layer: {micro-batch: (forward, backward)}}
PROFILES = {
    "prf-1": ("m-gpt", "cpu", False, 12.5, T0, {0: {1: (0.001, 0.002)}, 1: {1: (0.002, 0.004)},
                                                2: {1: (0.001, 0.001)}}),
    "prf-2": ("m-gpt", "cpu", False, 10.0, T0 + DAY, {0: {1: (0.001, 0.002), 2: (0.002, 0.004)},
                                                      1: {1: (0.002, 0.003), 2: (0.004, 0.006)},
                                                      2: {1: (0.001, 0.001), 2: (0.001, 0.002)}}),
    "prf-3": ("m-gpt", "A100-80GB", True, 0.0, T0 + 2 * DAY, {0: {1: (0.0001, 0.0002)}, 1: {1: (0.0002, 0.0004)},
                                                              2: {1: (0.0001, 0.0001)}}),
    "prf-4": ("m-bert", "cpu", False, 7.0, T0, {0: {1: (0.5, 0.5)}}),
}
LAYERS = {0: ("embed", "embedding"), 1: ("block.0", "block"), 2: ("head", "head")}


def _profiles() -> Iterator[dict]:
    """gpt on cpu twice (11 then 10 ms per step at micro-batch 1), then projected to A100 (1.1 ms); bert once."""
    for id_, (model, kind, projected, seconds, created, _) in PROFILES.items():
        yield {"id": id_, "tenant_id": "t-research", "model_id": model, "model_signature": "0" * 64,
               "device_kind": kind, "dtype": "DTYPE_FP32", "projected": projected,
               "source_profile_id": "prf-2" if projected else None, "device": {}, "comm": {},
               "profiling_time_s": seconds, "created_at": created}


def _profile_layers() -> Iterator[dict]:
    for id_, (*_, layers) in PROFILES.items():
        for index in layers:
            name, kind = LAYERS[index]
            yield {"profile_id": id_, "layer_index": index, "name": name, "kind": kind, "parameter_count": 100,
                   "parameter_bytes": 400, "gradient_bytes": 400, "optimizer_state_bytes": 800, "extra_inputs": [],
                   "tied_with": [], "measured_as": index}


def _samples() -> Iterator[dict]:
    for id_, (*_, layers) in PROFILES.items():
        for index, sizes in layers.items():
            for size, (forward, backward) in sizes.items():
                yield {"profile_id": id_, "layer_index": index, "micro_batch_size": size, "measured": True,
                       "forward_s": forward, "backward_s": backward, "recompute_s": forward,
                       "boundary_activation_bytes": 0, "stashed_activation_bytes": 0, "output_bytes": 0,
                       "peak_memory_bytes": 0}


# plan -> job, version, engine, samples/s, [(candidate name, engine, samples/s, out of memory)]
PLANS = {
    "pln-1": ("job-1", 1, "GALVATRON", 20.0, [("runner-up", "GALVATRON", 18.0, False), ("DDP", "BASELINE", 10.0, False),
                                              ("GPipe", "BASELINE", 16.0, False), ("ZeRO-3", "BASELINE", 0.0, True)]),
    "pln-2": ("job-1", 2, "VPIPE", 25.0, [("DDP", "BASELINE", 10.0, False), ("GPipe", "BASELINE", 12.5, False)]),
    "pln-3": ("job-4", 1, "VARUNA", 8.0, [("DDP", "BASELINE", 0.0, True), ("Megatron TP", "BASELINE", 5.0, False)]),
    "pln-4": ("job-2", 1, "GALVATRON", 40.0, []),
}


def _plans() -> Iterator[dict]:
    for id_, (job, version, engine, throughput, _) in PLANS.items():
        tenant, model, *_ = JOBS[job]
        yield {"id": id_, "tenant_id": tenant, "model_id": model, "job_id": job, "engine": f"PLAN_ENGINE_{engine}",
               "version": version, "global_batch_size": 8, "micro_batch_size": 1, "num_micro_batches": 8,
               "schedule": "SCHEDULE_1F1B", "pipeline_degree": 1, "iteration_time_s": 8 / throughput,
               "throughput_samples_per_s": throughput, "peak_memory_bytes": MiB, "out_of_memory": False,
               "memory_budget_bytes": 8 << 30, "fleet": {}, "stages": [], "prediction": {},
               "created_at": T0 + version * HOUR}


def _candidates() -> Iterator[dict]:
    for id_, (*_, candidates) in PLANS.items():
        for position, (name, engine, throughput, oom) in enumerate(candidates):
            yield {"plan_id": id_, "position": position, "name": name, "engine": f"PLAN_ENGINE_{engine}",
                   "global_batch_size": 8, "iteration_time_s": 8 / throughput if throughput else 0.0,
                   "throughput_samples_per_s": throughput, "peak_memory_bytes": MiB, "out_of_memory": oom}


def _events() -> Iterator[dict]:
    """Waits (waited_s): research normal 30 and 90 (job-1, preempted once) and 0 (job-2); research low 12
    (job-3); prod high 4 (job-4); job-5 still queued."""
    timeline = {
        "job-1": [("QUEUED", "QUEUED", {}), ("ADMITTED", "QUEUED", {"waited_s": "30.000"}),
                  ("ASSIGNED", "RUNNING", {}), ("PREEMPTED", "QUEUED", {"for_job": "job-4"}),
                  ("RESUMED", "QUEUED", {"waited_s": "90.000"}), ("SUCCEEDED", "SUCCEEDED", {})],
        "job-2": [("ADMITTED", "SCHEDULED", {"waited_s": "0.000"}), ("ASSIGNED", "RUNNING", {})],
        "job-3": [("ADMITTED", "QUEUED", {"waited_s": "12.000"}), ("FAILED", "FAILED", {})],
        "job-4": [("ADMITTED", "QUEUED", {"waited_s": "4.000"}), ("SUCCEEDED", "SUCCEEDED", {})],
        "job-5": [("QUEUED", "QUEUED", {})],
    }
    for job_id, events in timeline.items():
        for seq, (kind, state, attributes) in enumerate([("SUBMITTED", "SUBMITTED", {}), *events], start=1):
            yield {"job_id": job_id, "seq": seq, "type": kind, "state": f"JOB_STATE_{state}", "message": "",
                   "attributes": {"priority_class": JOBS[job_id][3], **attributes}, "created_at": T0 + seq * S}


# (job, plan version) -> stages, replicas, iterations, measured s, predicted s, breakdown (forward, backward, p2p,
# allreduce, optimizer, overhead) or None for rows recorded before migration 0009
RUNS = {
    ("job-1", 1): (2, 1, (0, 1), 1.0, 0.9, (0.3, 0.4, 0.1, 0.1, 0.05, 0.05)),
    ("job-1", 2): (2, 1, (2, 3), 0.8, 0.8, (0.3, 0.3, 0.05, 0.1, 0.03, 0.02)),
    ("job-2", 1): (1, 2, (0, 1), 0.5, 0.6, (0.15, 0.25, 0.0, 0.05, 0.03, 0.02)),
    ("job-4", 1): (1, 1, (0, 1), 2.0, 1.5, None),
}


def _metrics() -> Iterator[dict]:
    """job-1 (gpt, 2x1) runs twice: 1.0 s against 0.9 predicted, then 0.8 against 0.8; job-2 (gpt, 1x2) 0.5
    against 0.6; job-4 (t5, 1x1) 2.0 against 1.5, recorded without a breakdown."""
    for (job, version), (stages, replicas, iterations, measured, predicted, parts) in RUNS.items():
        forward, backward, p2p, allreduce, optimizer, overhead = parts or (measured / 2, measured / 2, *[None] * 4)
        for iteration in iterations:
            for stage in range(stages):
                for replica in range(replicas):
                    yield {"job_id": job, "plan_version": version, "iteration": iteration, "stage_index": stage,
                           "replica_index": replica, "iteration_time_s": measured,
                           "predicted_iteration_time_s": predicted, "forward_s": forward, "backward_s": backward,
                           "comm_s": (p2p or 0.0) + (allreduce or 0.0), "idle_s": overhead or 0.0,
                           "peak_memory_bytes": MiB, "loss": 2.0 if stage == stages - 1 else None,
                           "throughput_samples_per_s": 8 / measured, "recorded_at": T0 + HOUR,
                           "recompute_s": 0.0 if parts else None, "p2p_s": p2p, "allreduce_s": allreduce,
                           "optimizer_s": optimizer, "overhead_s": overhead}


def _migrations() -> Iterator[dict]:
    """job-1: layers 3 (4 MiB, 0.2 s) and 4 (2 MiB, 0.1 s) to stage 1 at iteration 2; job-2: layer 1 (1 MiB)."""
    for n, (job, layer, source, target, size, seconds, iteration, version) in enumerate([
        ("job-1", 3, 0, 1, 4 * MiB, 0.2, 2, 2), ("job-1", 4, 0, 1, 2 * MiB, 0.1, 2, 2),
        ("job-2", 1, 1, 0, MiB, 0.05, 7, 3),
    ]):
        yield {"id": f"mig-{n}", "job_id": job, "layer_index": layer, "from_stage": source, "to_stage": target,
               "bytes": size, "duration_s": seconds, "iteration": iteration, "plan_version": version,
               "created_at": T0 + HOUR}


def _leases() -> Iterator[dict]:
    """Ended: research 2 x 2 h on h100 and 1.5 h on cpu; prod 4 x 0.5 h on h100. job-2's lease is still live."""
    for n, (job, host, device, start, hours, reason) in enumerate([
        ("job-1", "h-1", 0, T0 + HOUR, 2.0, "FINISHED"), ("job-1", "h-1", 1, T0 + HOUR, 2.0, "FINISHED"),
        ("job-3", "h-3", 0, T0, 1.5, "FAILED"),
        *(("job-4", "h-2", i, T0 + 5 * HOUR, 0.5, "FINISHED") for i in range(4)),
        ("job-2", "h-1", 2, T0 + 10 * HOUR, None, None),
    ]):
        yield {"id": f"lse-{n}", "job_id": job, "tenant_id": JOBS[job][0], "host_id": host, "device_index": device,
               "device_kind": "cpu" if host == "h-3" else "h100", "started_at": start,
               "ended_at": None if hours is None else start + hours * HOUR,
               "end_reason": reason and f"LEASE_END_REASON_{reason}"}


def _morphs() -> Iterator[dict]:
    """job-1 lost a host (2x2 -> 2x1, 3 iterations again, 12.5 s) and grew back (4 s); job-2's straggler morph
    has not trained its first iteration yet (no recovery time)."""
    for n, (job, cause, before, after, lost, recovery) in enumerate([
        ("job-1", "host_lost", (2, 2), (2, 1), 3, 12.5), ("job-1", "grow", (2, 1), (2, 2), 0, 4.0),
        ("job-2", "straggler", (1, 2), (1, 1), 0, None),
    ]):
        detected = T0 + (n + 2) * HOUR
        yield {"id": f"mph-{n}", "job_id": job, "tenant_id": "t-research", "cause": cause, "detail": "",
               "from_stages": before[0], "from_replicas": before[1], "from_plan_version": n + 1,
               "to_stages": after[0], "to_replicas": after[1], "to_plan_version": n + 2, "failed_iteration": 10 + lost,
               "checkpoint_iteration": 10, "lost_iterations": lost, "detected_at": detected,
               "resumed_at": detected + S, "first_iteration_at": None if recovery is None else detected + recovery * S,
               "recovery_s": recovery, "created_at": detected}


def _calibrations() -> Iterator[dict]:
    """cpu/2c/2w fitted three times (220 iterations in all; worst before 0.4, best after 0.05); h100 once."""
    for n, (host_class, version, iterations, before, after) in enumerate([
        ("cpu/2c/2w", 1, 40, 0.4, 0.1), ("h100/32c/8w", 1, 200, 0.2, 0.125), ("cpu/2c/2w", 2, 120, 0.35, 0.05),
        ("cpu/2c/2w", 3, 60, 0.3, 0.08),
    ]):
        kind, cores, workers = host_class.split("/")
        yield {"id": f"cal-{n}", "host_class": host_class, "device_kind": kind, "cores": int(cores[:-1]),
               "colocated": int(workers[:-1]), "version": version, "forward_scale": 1.2, "forward_fixed_s": 0.0,
               "backward_scale": 1.1, "backward_fixed_s": 0.0, "allreduce_scale": 1.0, "update_scale": 1.0,
               "iteration_fixed_s": 0.01, "memory_scale": 1.0, "memory_fixed_bytes": 0, "iterations": iterations,
               "residual": after, "residual_before": before, "job_ids": ["job-1"], "notes": "",
               "fitted_at": T0 + n * HOUR}


# checkpoint -> job, iteration, complete, layers, MiB per layer
CHECKPOINTS = {"ckpt-1": ("job-1", 10, True, 3, 2), "ckpt-2": ("job-1", 20, True, 3, 2),
               "ckpt-3": ("job-1", 30, False, 1, 2), "ckpt-4": ("job-4", 5, True, 2, 8)}


def _checkpoints() -> Iterator[dict]:
    """Complete: job-1 at 10 and 20 (6 MiB each; the one at 30 never completed), job-4 at 5 (16 MiB)."""
    for id_, (job, iteration, complete, _, _) in CHECKPOINTS.items():
        yield {"id": id_, "job_id": job, "iteration": iteration, "plan_version": 1, "complete": complete,
               "created_at": T0 + iteration * S}


def _checkpoint_layers() -> Iterator[dict]:
    for id_, (_, _, _, layers, mib) in CHECKPOINTS.items():
        for index in range(layers):
            yield {"checkpoint_id": id_, "layer_index": index, "uri": f"file:///ckpt/{id_}/{index}.pt",
                   "bytes": mib * MiB, "sha256": ""}


def _degradations() -> Iterator[dict]:
    """gpu-b marked twice (the first cleared, the second in force); cpu-a once, cleared."""
    for n, (host, marked, cleared) in enumerate([("h-2", T0 + HOUR, T0 + 2 * HOUR), ("h-2", T0 + 6 * HOUR, None),
                                                 ("h-3", T0, T0 + HOUR)]):
        yield {"id": f"deg-{n}", "host_id": host, "job_id": "job-2", "reason": "straggler",
               "evidence": {"slowdown": 0.4}, "marked_at": marked, "cleared_at": cleared,
               "cleared_reason": "replaced the GPU" if cleared else None, "cleared_by": "t-admin" if cleared else None}


def _audit() -> Iterator[dict]:
    """research: two submits (2 and 4 ms) and a cancel of an unknown job (3 ms); a viewer's refused submit; an
    unknown token's cancel; the admin creating a tenant (10 ms)."""
    for n, (who, role, method, code, ms) in enumerate([
        ("research", "MEMBER", "Submit", "OK", 2.0), ("research", "MEMBER", "Submit", "OK", 4.0),
        ("research", "MEMBER", "Cancel", "NOT_FOUND", 3.0), ("dash", "VIEWER", "Submit", "PERMISSION_DENIED", 1.0),
        ("", "UNSPECIFIED", "Cancel", "UNAUTHENTICATED", 0.5), ("admin", "ADMIN", "CreateTenant", "OK", 10.0),
    ]):
        yield {"uid": f"u{n}", "at": T0 + n * S, "tenant_id": f"t-{who}" if who else "", "tenant_name": who,
               "role": f"TENANT_ROLE_{role}", "service": "ballast.v1.JobService", "method": method, "target": "",
               "code": code, "message": "", "duration_ms": ms, "peer": "", "server": "planner"}


def _requests() -> Iterator[dict]:
    """jobs.prepare: 3 succeeded (one on its second attempt, after a requeue), 1 failed after 3 attempts;
    planner.plan: 1 succeeded; jobs.calibrate: 1 waiting."""
    for n, (kind, state, attempts, requeues) in enumerate([
        ("jobs.prepare", "SUCCEEDED", 1, 0), ("jobs.prepare", "SUCCEEDED", 1, 0), ("jobs.prepare", "SUCCEEDED", 2, 1),
        ("jobs.prepare", "FAILED", 3, 0), ("planner.plan", "SUCCEEDED", 1, 0), ("jobs.calibrate", "QUEUED", 0, 0),
    ]):
        yield {"id": f"req-{n}", "tenant_id": "t-research", "kind": kind, "payload_json": "{}", "dedupe_key": None,
               "state": f"REQUEST_STATE_{state}", "attempts": attempts, "max_attempts": 3, "requeues": requeues,
               "created_at": T0 + n * S, "updated_at": T0 + n * S}
