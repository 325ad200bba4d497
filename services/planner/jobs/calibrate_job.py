"""After a job succeeds, recalibrate its host class from it and the runs the class's last calibration used.

The scheduler queues one "jobs.calibrate" request per SUCCEEDED job; a Celery worker runs `calibrate_after`:
it rebuilds the job's run (the plan version it trained longest under, its metrics under that version, its
profile), adds up to MAX_RUNS - 1 earlier runs named by the host class's latest calibration (so each version's
provenance is its job ids), fits (plans/calibrate.py) and stores a new version with the error before and
after. A run too short to calibrate from is skipped with a reason, never an error: the job already succeeded.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ballast.v1 import plan_pb2, store_pb2
from services.planner.jobs.arrival import is_workload
from services.planner.plans.calibrate import (
    Run,
    calibrate,
    error_of,
    from_proto,
    host_class,
    run_spread,
    to_proto,
)
from services.planner.queue import durable
from services.runtime.errors import NotFound
from services.runtime.store_api import Store, every_page

KIND = "jobs.calibrate"
MAX_RUNS = 8  # runs one calibration is fitted on: the newest, so a changed host is followed within a few jobs


def run_of(store: Store, job_id: str) -> Run | None:
    """The job's longest-trained plan version with its metrics and profile; None without metrics."""
    request = store_pb2.ListIterationMetricsRequest(job_id=job_id)
    metrics = [m for page in every_page(store.list_iteration_metrics, request) for m in page.metrics]
    if not metrics:
        return None
    version = Counter(m.plan_version for m in metrics).most_common(1)[0][0]
    plans = [p for page in every_page(store.list_plans, store_pb2.ListPlansRequest(job_id=job_id))
             for p in page.plans if p.version == version]
    if not plans:
        return None
    profile = store.get_profile(store_pb2.GetRequest(id=plans[0].profile_id))
    return Run(job_id, profile, plans[0], [m for m in metrics if m.plan_version == version])


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
    if run.plan.HasField("offload"):  # its time is mostly chunk traffic, which the fit does not model
        return {"job_id": job_id, "calibrated": False,
                "why": "chunk offload: the calibration's model of a run does not price chunk moves"}
    if run.plan.HasField("harmony"):  # its time is swaps and a wrap-around pipeline the fit does not model
        return {"job_id": job_id, "calibrated": False,
                "why": "Harmony's swap schedule: the calibration's model of a run does not price its swaps"}
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
    for earlier in named or (latest.job_ids if latest is not None else []):
        if earlier != job_id and len(runs) < MAX_RUNS and (other := run_of(store, earlier)) is not None:
            runs.append(other)
    cal, before, after = calibrate(runs, cls)
    if cal.iterations == 0:
        return {"job_id": job_id, "calibrated": False, "why": "too few steady iterations"}
    if latest is not None and (kept := error_of(from_proto(latest), runs)) <= after:
        # a fit pulled off by a noisy run never replaces a better one: on the very same runs, the one in force wins
        return {"job_id": job_id, "calibrated": False,
                "why": f"the new fit ({after:.1%} error on {len(runs)} run(s)) is no better than version "
                       f"{latest.version} on the same runs ({kept:.1%})"}
    stored = store.record_calibration(store_pb2.RecordCalibrationRequest(calibration=to_proto(
        cal, cls, [r.job_id for r in runs], before, after, run_spread(runs))))
    return {"job_id": job_id, "calibrated": True, "calibration_id": stored.id, "version": stored.version}

