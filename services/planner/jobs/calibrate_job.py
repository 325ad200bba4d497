"""After a job succeeds, recalibrate its host class from it and the runs the class's last calibration used.

The scheduler queues one "jobs.calibrate" request per SUCCEEDED job; a Celery worker runs `calibrate_after`:
it rebuilds the job's run (the plan version it trained longest under, its metrics under that version, its
profile), adds up to MAX_RUNS - 1 earlier runs named by the host class's latest calibration (so each version's
provenance is its job ids), fits (plans/calibrate.py) and stores a new version with the error before and
after. A run too short to calibrate from is skipped with a reason, never an error: the job already succeeded.
A Harmony or chunk offload run fits only its estimator's scale (measured over estimated iteration time, the median
over the class's runs of that kind); a pipeline run fits the stage model; each version carries the other parts.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace
from typing import Any

from ballast.v1 import plan_pb2, store_pb2
from ballast.windows import weight
from services.planner.cost.calibration import Calibration, HostClass
from services.planner.jobs.arrival import is_workload
from services.planner.plans.calibrate import (
    WARMUP,
    Run,
    calibrate,
    error_of,
    from_proto,
    host_class,
    offload_error,
    offload_kind,
    offload_ratios,
    run_spread,
    steady_iteration_times,
    to_proto,
)
from services.planner.queue import durable
from services.runtime.errors import NotFound
from services.runtime.store_api import Store, every_page

KIND = "jobs.calibrate"
MAX_RUNS = 8  # runs one calibration is fitted on: the newest, so a changed host is followed within a few jobs
# An offload estimator's scale outside these is a broken measurement. Wider than the stage fit's: on a small model
# the estimators miss fixed costs per task (gloo messages, Python), and Harmony measured a steady 5.8x its estimate
# on the 8-block test chain here (benchmarks/offload_fidelity.py).
OFFLOAD_SCALE_BOUNDS = (0.1, 10.0)


def run_of(store: Store, job_id: str) -> Run | None:
    """The job's longest-trained plan version with its metrics and profile; None without metrics."""
    request = store_pb2.ListIterationMetricsRequest(job_id=job_id)
    metrics = [m for page in every_page(store.list_iteration_metrics, request) for m in page.metrics]
    if not metrics:
        return None
    trained: Counter[int] = Counter()  # iterations per plan version (a row may be a window of them)
    for m in metrics:
        trained[m.plan_version] += weight(m)
    version = trained.most_common(1)[0][0]
    plans = [p for page in every_page(store.list_plans, store_pb2.ListPlansRequest(job_id=job_id))
             for p in page.plans if p.version == version]
    if not plans:
        return None
    profile = store.get_profile(store_pb2.GetRequest(id=plans[0].profile_id))
    return Run(job_id, profile, plans[0], [m for m in metrics if m.plan_version == version])


def _offload(store: Store, job_id: str, runs: list[Run], kind: str, cls: HostClass,
             latest: plan_pb2.Calibration | None) -> dict[str, Any]:
    """Fit the class's Harmony or chunk offload scale (the median of measured over estimated iteration time of its
    runs of that kind) into a new version that keeps the rest of the one in force."""
    pairs = offload_ratios(runs)
    if not pairs:
        return {"job_id": job_id, "calibrated": False,
                "why": "too few steady iterations, or a plan that recorded no estimate of its own"}
    scale = statistics.median(m / e for e, m in pairs)
    if not OFFLOAD_SCALE_BOUNDS[0] <= scale <= OFFLOAD_SCALE_BOUNDS[1]:
        return {"job_id": job_id, "calibrated": False,
                "why": f"{kind} measured {scale:.2f}x its estimate: a broken measurement, not a slower host"}
    base = from_proto(latest) if latest is not None else Calibration(host_class=cls.key)
    before, after = offload_error(pairs, 1.0), offload_error(pairs, scale)
    held = base.offload(kind == "harmony")
    if latest is not None and held != 1.0 and (kept := offload_error(pairs, held)) <= after:
        return {"job_id": job_id, "calibrated": False,
                "why": f"the new {kind} scale ({after:.1%} error on {len(pairs)} run(s)) is no better than version "
                       f"{latest.version}'s on the same runs ({kept:.1%})"}
    cal = replace(base, **{f"{kind}_scale": scale})
    if latest is None:  # the stage fit has no run yet: the class is known by these runs alone
        steady = sum(len(steady_iteration_times(r.metrics, r.plan.version, WARMUP)) for r in runs)
        cal = replace(cal, iterations=steady)
    out = to_proto(cal, cls, provenance([r.job_id for r in runs], latest),
                   latest.residual_before if latest else 0.0, latest.residual if latest else 0.0,
                   latest.run_spread if latest else run_spread(runs))
    out.notes = (f"{kind} scale x{scale:.2f} from {len(pairs)} run(s): its iteration time error {before:.1%} -> "
                 f"{after:.1%}" + (f"; the rest as version {latest.version}" if latest else ""))
    stored = store.record_calibration(store_pb2.RecordCalibrationRequest(calibration=out))
    return {"job_id": job_id, "calibrated": True, "calibration_id": stored.id, "version": stored.version,
            "kind": kind, "scale": scale}


def _devices(plan: plan_pb2.Plan) -> int:
    return sum(max(int(s.devices), 1) for s in plan.stages)


def calibrate_after(payload: dict[str, Any], task: durable.Task) -> dict[str, Any]:
    """Fit and store the host class's next calibration from this job's run and the latest one's runs."""
    store, job_id = task.store, str(payload.get("job_id", ""))
    named = [str(j) for j in payload.get("runs", [])]  # a calibration on arrival: exactly its workload's runs
    job = store.get_job(store_pb2.GetRequest(id=job_id))
    if is_workload(job) and not named:
        return {"job_id": job_id, "calibrated": False,
                "why": "a run of a calibration on arrival: fitted with the rest of its workload"}
    spec = job.spec
    if spec.layer_toggles or spec.online_repartition:  # its layers were switched or moved: not the plan it measured
        return {"job_id": job_id, "calibrated": False,
                "why": "layers switched on or off, or migrated live: the run does not measure its plan"}
    run = run_of(store, job_id)
    if run is None:
        return {"job_id": job_id, "calibrated": False, "why": "no metrics under a stored plan"}
    if any(x.tp > 1 or x.sdp > 1 for x in run.plan.layers):  # the fit prices a run as pipeline x (ZeRO-)DP
        return {"job_id": job_id, "calibrated": False,
                "why": "TP or SDP layers: the calibration's model of a run does not price them yet"}
    hosts = {lease.device.host_id for page in every_page(store.list_leases,
                                                         store_pb2.ListLeasesRequest(job_id=job_id))
             for lease in page.leases}
    found = [store.get_host(store_pb2.GetRequest(id=h)) for h in sorted(hosts)]
    cls = host_class(run.plan.fleet, found, _devices(run.plan))
    runs, latest = [run], None
    try:
        latest = store.get_calibration(store_pb2.GetCalibrationRequest(host_class=cls.key))
    except NotFound:
        pass
    kind = offload_kind(run.plan)
    for earlier in named or (latest.job_ids if latest is not None else []):
        if earlier != job_id and len(runs) < MAX_RUNS and (other := run_of(store, earlier)) is not None \
                and offload_kind(other.plan) == kind:  # each estimator is fitted on runs of its own kind
            runs.append(other)
    if kind:
        return _offload(store, job_id, runs, kind, cls, latest)
    cal, before, after = calibrate(runs, cls)
    if cal.iterations == 0:
        return {"job_id": job_id, "calibrated": False, "why": "too few steady iterations"}
    if latest is not None and (kept := error_of(from_proto(latest), runs)) <= after:
        # a fit pulled off by a noisy run never replaces a better one: on the very same runs, the one in force wins
        return {"job_id": job_id, "calibrated": False,
                "why": f"the new fit ({after:.1%} error on {len(runs)} run(s)) is no better than version "
                       f"{latest.version} on the same runs ({kept:.1%})"}
    if latest is not None:  # the offload estimators' scales are fitted on other runs: carried as they are
        cal = replace(cal, harmony_scale=latest.harmony_scale, chunks_scale=latest.chunks_scale)
    stored = store.record_calibration(store_pb2.RecordCalibrationRequest(calibration=to_proto(
        cal, cls, provenance([r.job_id for r in runs], latest), before, after, run_spread(runs))))
    return {"job_id": job_id, "calibrated": True, "calibration_id": stored.id, "version": stored.version}


def provenance(fitted: list[str], latest: plan_pb2.Calibration | None) -> list[str]:
    """The runs a new version names: those it was fitted on, then the rest of the latest's (the runs behind the
    parts it carries over), at most 2 x MAX_RUNS; each kind's fit reads its own MAX_RUNS newest of them."""
    return list(dict.fromkeys([*fitted, *(latest.job_ids if latest is not None else [])]))[:2 * MAX_RUNS]

