"""A host class the online fleet forms with no calibration is calibrated by a short known workload before user
jobs are planned on it (services/planner/jobs/arrival.py). The unit tests drive `Arrival` on a real store
(SQLite, PostgreSQL, remote) with our own clock and job moves; the slow test runs it on a real plane."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from ballast.v1 import fleet_pb2, job_pb2, plan_pb2, services_pb2, store_pb2
from services.planner.jobs.arrival import GIVE_UP_S, NAME, SETTLE_S, WORKLOAD_ITERATIONS, Arrival, Gate, workload
from services.planner.plans.calibrate import CORES_LABEL
from services.planner.plans.make import CALIBRATED
from tests.store_fixtures import Store, claim, complete

S = job_pb2.JobState
MIN_ITERATIONS = 20


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def host(i: int, kind: str = "cpu", cores: int = 2) -> fleet_pb2.Host:
    return fleet_pb2.Host(id=f"hst-{i}", name=f"h{i}", address="127.0.0.1", state=fleet_pb2.HOST_STATE_ONLINE,
                          labels={CORES_LABEL: str(cores)},
                          devices=[fleet_pb2.Device(index=0, spec=fleet_pb2.DeviceSpec(kind=kind))])


class Harness:
    """An Arrival on the store's platform view; submitted workload jobs and calibration requests recorded."""

    def __init__(self, store: Store):
        self.store, self.platform, self.clock = store, store.as_(store.admin), Clock()
        self.submitted: list[job_pb2.JobSpec] = []
        self.fits: list[tuple[str, list[str]]] = []
        self.requests: list[str] = []
        self.arrival = Arrival(self.platform, self.submit, self.calibrate, MIN_ITERATIONS, clock=self.clock)

    def submit(self, spec: job_pb2.JobSpec) -> job_pb2.Job:
        self.submitted.append(spec)
        return self.platform.create_queued_job(store_pb2.CreateQueuedJobRequest(spec=spec, kind="jobs.prepare")).job

    def calibrate(self, job_id: str, runs):
        self.fits.append((job_id, list(runs)))
        request = self.platform.enqueue_request(store_pb2.EnqueueRequestRequest(
            kind="jobs.calibrate", payload_json=json.dumps({"job_id": job_id, "runs": list(runs)}))).request
        self.requests.append(request.id)
        return request

    def end(self, job_id: str, state: int) -> None:
        steps = (S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING, S.JOB_STATE_SCHEDULED, S.JOB_STATE_RUNNING)
        for step in (*steps, state) if state == S.JOB_STATE_SUCCEEDED else (state,):
            self.platform.transition_job(store_pb2.TransitionJobRequest(id=job_id, state=step, message="moved"))

    def later(self, seconds: float) -> None:
        self.clock.t += seconds


def test_the_workload_fits_a_fixed_cost_and_a_scale_on_every_class_size() -> None:
    for devices in (1, 2, 8):
        jobs = workload("cpu/2c/2w", devices)
        assert len(jobs) == 2 and all(j.name.startswith(NAME + " cpu/2c/2w ") for j in jobs)
        assert all(j.min_devices == j.max_devices == devices and j.iterations == WORKLOAD_ITERATIONS for j in jobs)
        # micro-batches 8x apart: per-micro-batch predictions far enough apart to fit a line, not a ratio
        sizes = sorted(j.global_batch_size // j.micro_batches for j in jobs)
        assert sizes[1] == 8 * sizes[0]
    assert [j.pipeline_stages for j in workload("k", 2)] == [1, 2]


def test_a_new_class_waits_for_its_hosts_to_settle_then_runs_the_workload_once(store: Store) -> None:
    h = Harness(store)
    gate = h.arrival.update([host(1)], ["job-user"])
    assert "cpu/2c/1w is new" in gate.reason and h.submitted == []
    h.later(SETTLE_S - 1)
    gate = h.arrival.update([host(1), host(2)], ["job-user"])  # a second agent joins: the class is judged again
    assert "cpu/2c/2w is new" in gate.reason and h.submitted == []
    h.later(SETTLE_S + 0.1)
    gate = h.arrival.update([host(1), host(2)], ["job-user"])
    assert len(h.submitted) == 2 and all(s.min_devices == 2 for s in h.submitted)
    assert "cpu/2c/2w is calibrating on arrival" in gate.reason
    assert gate.workload and gate.replan == ()
    again = h.arrival.update([host(1), host(2)], ["job-user", *gate.workload])
    assert len(h.submitted) == 2 and again.workload == gate.workload  # submitted once


def test_held_jobs_are_planned_again_once_the_fit_over_every_run_is_done(store: Store) -> None:
    h = Harness(store)
    h.arrival.update([host(1), host(2)], [])
    h.later(SETTLE_S + 0.1)
    gate = h.arrival.update([host(1), host(2)], ["job-user"])
    first, second = sorted(gate.workload)
    h.end(first, S.JOB_STATE_SUCCEEDED)
    assert h.arrival.update([host(1), host(2)], ["job-user"]).reason  # one still runs
    h.end(second, S.JOB_STATE_SUCCEEDED)
    gate = h.arrival.update([host(1), host(2)], ["job-user", "job-late"])
    assert gate.reason and len(h.fits) == 1 and sorted(h.fits[0][1]) == [first, second]
    claimed = claim(store, h.requests[0], "worker-1")  # a worker runs the fit
    assert h.arrival.update([host(1), host(2)], ["job-user", "job-late"]).reason
    complete(store, claimed.request.id, claimed.request.lease_token)
    done = h.arrival.update([host(1), host(2)], ["job-user", "job-late"])
    assert done.reason == "" and done.replan == ("job-late", "job-user") and done.key == "cpu/2c/2w"
    assert h.arrival.update([host(1), host(2)], ["job-user"]) == type(done)()  # never judged again
    assert len(h.fits) == 1


def test_a_calibrated_class_mixed_or_unmeasured_fleet_is_not_held(store: Store) -> None:
    h = Harness(store)
    h.platform.record_calibration(store_pb2.RecordCalibrationRequest(calibration=plan_pb2.Calibration(
        host_class="cpu/2c/2w", device_kind="cpu", cores=2, colocated=2, forward_scale=1.0, backward_scale=1.0,
        allreduce_scale=1.0, update_scale=1.0, memory_scale=1.0, iterations=MIN_ITERATIONS, job_ids=["job-x"])))
    assert h.arrival.update([host(1), host(2)], ["job-user"]).reason == ""
    assert h.arrival.update([host(1), host(2, kind="h100")], ["job-user"]).reason == ""
    assert h.arrival.update([host(3, kind="h100")], ["job-user"]).reason == ""
    assert h.submitted == []


def test_failed_or_slow_workloads_are_given_up_and_the_jobs_go_on(store: Store) -> None:
    h = Harness(store)
    h.arrival.update([host(1)], [])
    h.later(SETTLE_S + 0.1)
    gate = h.arrival.update([host(1)], ["job-user"])
    for job_id in gate.workload:
        h.end(job_id, S.JOB_STATE_FAILED)
    done = h.arrival.update([host(1)], ["job-user"])
    assert done.reason == "" and done.replan == () and h.fits == []  # no fit: its plan stands, it just goes on

    slow = Harness(store)
    slow.arrival.update([host(4, cores=4)], [])
    slow.later(SETTLE_S + 0.1)
    assert slow.arrival.update([host(4, cores=4)], ["job-user"]).reason
    slow.later(GIVE_UP_S)
    assert slow.arrival.update([host(4, cores=4)], ["job-user"]) == Gate(key="cpu/4c/1w")


def test_a_restarted_planner_adopts_the_workload_already_submitted(store: Store) -> None:
    h = Harness(store)
    h.arrival.update([host(1), host(2)], [])
    h.later(SETTLE_S + 0.1)
    first = h.arrival.update([host(1), host(2)], [])
    restarted = Harness(store)
    restarted.arrival.update([host(1), host(2)], [])
    restarted.later(SETTLE_S + 0.1)
    assert restarted.arrival.update([host(1), host(2)], []).workload == first.workload
    assert restarted.submitted == []


@pytest.mark.timeout(600)  # two measured profiles, a calibrating workload and the job: minutes under load
@pytest.mark.slow
def test_the_first_user_job_on_a_new_class_is_planned_with_its_arrival_calibration(tmp_path: Path) -> None:
    from services.specs.model import load_model_spec
    from tests.harness import ROOT, executor_plane, job_story, wait_for

    with executor_plane(tmp_path, f"arrival-{uuid.uuid4().hex[:8]}", calibrate_on_arrival=True) as plane:
        client = plane.client()
        spec = job_pb2.JobSpec(name="user", model=load_model_spec(ROOT / "examples" / "gpt-tiny.yaml"),
                               global_batch_size=16, iterations=25, seed=1,
                               optimizer=job_pb2.OptimizerSpec(name="adam", learning_rate=1e-3))
        job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec))
        ended = wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job.id))).state in (
            S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED) and j, timeout=420,
            story=lambda: job_story(client, job.id, plane.settings.data_dir))
        story = job_story(client, job.id, plane.settings.data_dir)
        assert ended.state == S.JOB_STATE_SUCCEEDED, story
        events = client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job.id)).events
        held = [e for e in events if e.type == "QUEUED" and e.attributes.get("reason") == "calibrating"]
        assert held and "cpu/2c/2w is calibrating on arrival" in held[0].message, story
        assert any(e.type == "REPLANNING" and "calibrated on arrival" in e.message for e in events), story
        plan = client.planner.GetPlan(store_pb2.GetRequest(id=ended.plan_id))
        assert plan.version == 2 and CALIBRATED in plan.explanation, plan.explanation
        workload_jobs = [j for j in client.jobs.List(store_pb2.ListJobsRequest()).jobs
                         if j.spec.name.startswith(NAME)]
        assert len(workload_jobs) == 2 and all(j.state == S.JOB_STATE_SUCCEEDED for j in workload_jobs)
        stages = sorted(len(client.planner.GetPlan(store_pb2.GetRequest(id=j.plan_id)).stages)
                        for j in workload_jobs)
        assert stages == [1, 2]
        cals = client.store.ListCalibrations(store_pb2.ListCalibrationsRequest(host_class="cpu/2c/2w")).calibrations
        first = min(cals, key=lambda c: c.version)
        assert sorted(first.job_ids) == sorted(j.id for j in workload_jobs)
        assert first.id in plan.explanation and first.iterations >= MIN_ITERATIONS
