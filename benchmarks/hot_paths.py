"""The store's hot calls and the embedded broker's publish, measured alone in one process (issue 22, load).

Why: the load benchmark's tail follows the CPU each call costs on a saturated 2-core machine, and its runs move
with the VM's speed from minute to minute. Measured alone, in-process (no gRPC, TLS or interceptor), these
figures say what a change to one path saves, and are the ones BENCHMARKS.md quotes beside the load runs.
No target: it reports. Run from the repository root: `.venv/bin/python benchmarks/hot_paths.py [--calls 400]`.

Measured, on a fresh SQLite store of its own with an admin and two tenants (tests/store_fixtures.py):
CreateQueuedJob (JobService.Submit's one write), ClaimRequest and CompleteRequest (a worker's lease on the job's
preparation), CreatePlan (a worker's plan for one of those jobs: the load
model's, 2 devices, its alternatives and baselines), TransitionJob (to CANCELLED), ListJobs (a page of 20, with
the specs cached and with none cached, as the read-only store finds new jobs), GetJob, ListJobEvents; and
`send_task` of one request id on the embedded broker (kombu's SQLAlchemy transport over SQLite, WAL), as the
planner's publisher thread sends it.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.config import load_settings  # noqa: E402
from ballast.v1 import common_pb2, job_pb2, plan_pb2, store_pb2  # noqa: E402
from benchmarks.workload import MODEL, spec  # noqa: E402
from services.planner.celery_app import TASK, make_app  # noqa: E402
from services.planner.plans.make import PlanInputs, make_plan  # noqa: E402
from services.profiler.projection import analytical_profile  # noqa: E402
from services.runtime.auth import Principal  # noqa: E402
from services.store.repo.jobs import SPECS  # noqa: E402
from services.store.repository import Repository  # noqa: E402
from tests.store_fixtures import open_store  # noqa: E402


def per_call_ms(calls: int, fn: Callable[[int], object], before: Callable[[], None] | None = None) -> float:
    """CPU milliseconds per call of `fn(i)`, i in range(calls); `before` runs ahead of each call, unmeasured."""
    spent = 0.0
    for i in range(calls):
        if before:
            before()
        start = time.process_time()
        fn(i)
        spent += time.process_time() - start
    return spent * 1e3 / calls


def submit_ms(repo: Repository, who: Principal, calls: int, jobs: list[job_pb2.Job],
              requests: list[str] | None = None) -> float:
    """CPU ms per CreateQueuedJob of the load model (its model already stored, as after a tenant's first job);
    the jobs it made are appended to `jobs`, their requests' ids to `requests`."""

    def submit(i: int) -> None:
        request = store_pb2.CreateQueuedJobRequest(spec=spec(f"hot-{i}"), kind="jobs.prepare")
        made = repo.create_queued_job(who, request)
        if i >= 0:
            jobs.append(made.job)
            if requests is not None:
                requests.append(made.request.id)

    submit(-1)
    return per_call_ms(calls, submit)


def machine_speed(calls: int = 200) -> float:
    """The machine's speed now, as CPU ms per in-process CreateQueuedJob on a scratch store: the load benchmark
    prints it beside its figures, whose tail follows it (BENCHMARKS.md, Load)."""
    with tempfile.TemporaryDirectory(prefix="ballast-speed-") as tmp, \
            open_store(f"sqlite:///{Path(tmp) / 'store.db'}", "local", Path(tmp)) as st:
        return submit_ms(st.repo, st.a, calls, [])


def store_calls(calls: int, root: Path) -> dict[str, float]:
    with open_store(f"sqlite:///{root / 'store.db'}", "local", root) as st:
        repo, who = st.repo, st.a
        page = store_pb2.ListJobsRequest(page=common_pb2.PageRequest(page_size=20))

        jobs: list[job_pb2.Job] = []
        requests: list[str] = []
        out = {"CreateQueuedJob": submit_ms(repo, who, calls, jobs, requests)}
        leases: list[str] = []
        out["ClaimRequest"] = per_call_ms(calls, lambda i: leases.append(repo.claim_request(st.admin, (
            store_pb2.ClaimRequestRequest(id=requests[i], worker="hot", lease_seconds=60))).request.lease_token))
        out["CompleteRequest"] = per_call_ms(calls, lambda i: repo.complete_request(
            st.admin, store_pb2.CompleteRequestRequest(id=requests[i], lease_token=leases[i], result_json="{}")))
        out["GetJob"] = per_call_ms(calls, lambda i: repo.get_job(who, store_pb2.GetRequest(id=jobs[i].id)))
        out["ListJobEvents"] = per_call_ms(calls, lambda i: repo.list_job_events(
            who, store_pb2.ListJobEventsRequest(job_id=jobs[i].id)))
        out["ListJobs (20, specs cached)"] = per_call_ms(calls, lambda i: repo.list_jobs(who, page))
        out["ListJobs (20, no spec cached)"] = per_call_ms(max(calls // 4, 1), lambda i: repo.list_jobs(who, page),
                                                           before=SPECS.clear)
        out["CreatePlan"] = per_call_ms(calls, lambda i: repo.create_plan(who, store_pb2.CreatePlanRequest(
            plan=job_plan(jobs[i]), request_id=f"hot-plan-{i}")))
        out["TransitionJob"] = per_call_ms(calls, lambda i: repo.transition_job(who, store_pb2.TransitionJobRequest(
            id=jobs[i].id, state=job_pb2.JOB_STATE_CANCELLED, event_type="CANCELLED", message="cancelled")))
    return out


@functools.cache
def searched_plan(device_kind: str, global_batch_size: int) -> bytes:
    """The load model's plan on its fleet, searched once (serialized: each caller parses its own copy)."""
    profile = analytical_profile(MODEL, device_kind, "fp32")
    fleet = spec("search").fleet
    inputs = PlanInputs(global_batch_size=global_batch_size, overlap_grad_sync=False)
    return make_plan(profile, fleet, inputs).SerializeToString()


def job_plan(job: job_pb2.Job) -> plan_pb2.Plan:
    """The plan a worker stores for a load job: the job's first version."""
    plan = plan_pb2.Plan.FromString(searched_plan(job.spec.fleet.device.kind, job.spec.global_batch_size))
    plan.model_id, plan.job_id, plan.profile_id, plan.version = job.model_id, job.id, "", 0
    return plan


def broker_publish(calls: int, root: Path) -> float:
    settings = load_settings({}, data_dir=root / "broker")
    app = make_app(settings)
    for i in range(20):  # the queue row, the engine and the connection made once, as in a running planner
        app.send_task(TASK, args=[f"req-warm-{i}"], queue=settings.queue)
    return per_call_ms(calls, lambda i: app.send_task(TASK, args=[f"req-{i:016x}"], queue=settings.queue))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ballast-hot-") as tmp:
        figures = store_calls(args.calls, Path(tmp))
        figures["broker publish (send_task)"] = broker_publish(args.calls, Path(tmp))
    print(f"hot paths: {args.calls} calls each, in one process; {platform.machine()} "
          f"({len(os.sched_getaffinity(0))} cores)")
    for name, ms in figures.items():
        print(f"  {name:32s} {ms:7.3f} ms CPU per call")


if __name__ == "__main__":
    main()
