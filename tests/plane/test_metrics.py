"""Prometheus metrics, scraped over HTTPS from real servers: RPC latency by method and status on every
server, the store's jobs by state and its transaction latency, and (on a plane that trains) the iteration-time
histogram, per-job iteration gauges that go away with the job, the fleet's devices, the workers' task
durations and an executor agent's endpoint."""

from __future__ import annotations

import ssl
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ballast.tls import SCRAPER, Identity, ensure_ca, issue, scraper_identity, tls_files
from ballast.v1 import job_pb2, model_pb2, services_pb2, store_pb2
from services.planner.jobs.gauges import FleetGauges
from services.runtime.metrics_http import metrics_url
from tests.harness import AGENT_PORTS, Plane, executor_plane, free_port, job_story, make_settings, start_plane, wait_for
from tests.store_builders import gpt, job_spec

S = job_pb2.JobState
PORTS = ("store", "profiler", "planner")


def scrape(plane: Plane, port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from one endpoint, verified with the plane's CA, presenting the
    scraper's certificate (the endpoints serve no one else)."""
    context = ssl.create_default_context(cafile=str(tls_files(plane.settings).ca))
    scraper = scraper_identity(plane.settings)
    context.load_cert_chain(str(scraper.cert), str(scraper.key))
    with urllib.request.urlopen(metrics_url(plane.settings, port), context=context, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def plane() -> Iterator[Plane]:
    with tempfile.TemporaryDirectory() as data:
        ports = {f"{name}_metrics_port": free_port() for name in PORTS}
        plane = start_plane(make_settings(Path(data), sweep_interval_s=60.0, **ports), send=lambda request_id: None)
        try:
            yield plane
        finally:
            plane.stop()


def test_rpc_latency_by_method_and_status_and_jobs_by_state(plane: Plane) -> None:
    s = plane.settings
    before = scrape(plane, s.planner_metrics_port)
    jobs_before = value(scrape(plane, s.store_metrics_port), "ballast_jobs", state="submitted")
    with plane.client() as client:
        for n in range(2):
            client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec(f"metered-{n}", model=gpt())))
        with pytest.raises(grpc.RpcError):
            client.jobs.Cancel(services_pb2.CancelJobRequest(job_id="job-0000000000000000"))
        client.profiler.ListDeviceKinds(services_pb2.ListDeviceKindsRequest())
    after = scrape(plane, s.planner_metrics_port)
    count = "ballast_rpc_duration_seconds_count"
    submit = dict(server="planner", method="Submit", code="OK")
    assert value(after, count, **submit) - value(before, count, **submit) == 2
    missing = dict(server="planner", method="Cancel", code="NOT_FOUND")
    assert value(after, count, **missing) - value(before, count, **missing) == 1
    assert value(after, "ballast_rpc_duration_seconds_sum", **submit) > 0
    profiler = scrape(plane, s.profiler_metrics_port)
    assert value(profiler, count, server="profiler", method="ListDeviceKinds", code="OK") >= 1
    store = scrape(plane, s.store_metrics_port)
    assert value(store, "ballast_jobs", state="submitted") - jobs_before == 2
    assert value(store, "ballast_store_transaction_duration_seconds_count", kind="write") > 0
    assert value(store, count, server="store", method="CreateQueuedJob", code="OK") >= 2


def test_a_scrape_without_a_certificate_of_the_planes_ca_gets_nothing(plane: Plane, tmp_path: Path) -> None:
    """Hardening 2, item 8: the planner's gauges name tenants, so its metrics are for the operator's scraper."""
    url = metrics_url(plane.settings, plane.settings.planner_metrics_port)
    anonymous = ssl.create_default_context(cafile=str(tls_files(plane.settings).ca))
    stranger = ssl.create_default_context(cafile=str(tls_files(plane.settings).ca))
    other_ca = ensure_ca(tmp_path / "other-ca")
    outsider = Identity(tmp_path / "outsider.crt", tmp_path / "outsider.key")
    issue(other_ca, outsider, SCRAPER, [SCRAPER], server=False, client=True)
    stranger.load_cert_chain(str(outsider.cert), str(outsider.key))
    for context in (anonymous, stranger):
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            with urllib.request.urlopen(url, context=context, timeout=10) as reply:
                reply.read()
    assert any(name.startswith("ballast_") for name, _ in scrape(plane, plane.settings.planner_metrics_port))


def test_an_unauthenticated_plaintext_planner_names_no_tenant() -> None:
    waiting = [SimpleNamespace(tenant_id=t, job_id=j, submitted_at=0.0) for t, j in (("t1", "a"), ("t2", "b"))]
    snap = SimpleNamespace(queue=waiting, tenant_names={"t1": "alpha", "t2": "beta"}, classes={}, now=5.0,
                           free=[], running=[])

    def lines(name_tenants: bool) -> dict:
        families = FleetGauges(lambda: snap, name_tenants=name_tenants).collect()
        return {tuple(s.labels.values()): s.value for f in families if f.name == "ballast_queue_jobs"
                for s in f.samples}
    assert lines(True) == {("alpha", ""): 1, ("beta", ""): 1}
    assert lines(False) == {("-", ""): 2}


def test_endpoints_are_tls_only(plane: Plane) -> None:
    """A plaintext scrape of a TLS endpoint gets no metrics."""
    url = metrics_url(plane.settings, plane.settings.store_metrics_port).replace("https://", "http://")
    with pytest.raises(Exception):  # noqa: B017,PT011 - the server drops the connection or answers garbage
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert b"ballast_jobs" not in reply.read()
            raise AssertionError("plaintext answered")


@pytest.mark.slow
def test_a_training_run_moves_the_iteration_metrics(tmp_path) -> None:
    ports = {f"{name}_metrics_port": free_port() for name in (*PORTS, "worker")}
    ports["executor_metrics_port"] = free_port(block=AGENT_PORTS)  # agent i serves metrics on this + i
    model = model_pb2.ModelSpec(name="metered-gpt", family=model_pb2.MODEL_FAMILY_GPT,
                                transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=32, num_heads=2,
                                                                        vocab_size=128, seq_length=16))
    with executor_plane(tmp_path, f"metrics-{uuid.uuid4().hex[:8]}", agents=1, **ports) as plane:
        s = plane.settings
        client = plane.client()
        job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_pb2.JobSpec(
            name="metered", model=model, global_batch_size=4, iterations=100000, seed=3)))
        measured = ("ballast_job_iteration_seconds", tuple(sorted({"job_id": job.id, "source": "measured"}.items())))
        wait_for(lambda: measured in scrape(plane, s.planner_metrics_port), timeout=240,
                 what="the job's measured iteration time", story=lambda: job_story(client, job.id, s.data_dir))
        predicted = (measured[0], tuple(sorted({"job_id": job.id, "source": "predicted"}.items())))
        assert scrape(plane, s.planner_metrics_port)[predicted] > 0
        wait_for(lambda: value(scrape(plane, s.planner_metrics_port), "ballast_devices", kind="cpu",
                               state="leased") >= 1, timeout=30, what="the job's device shown leased")
        client.jobs.Cancel(services_pb2.CancelJobRequest(job_id=job.id, reason="measured enough"))
        wait_for(lambda: client.jobs.Get(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_CANCELLED,
                 timeout=60, what="the job to end", story=lambda: job_story(client, job.id, s.data_dir))
        planner = wait_for(lambda: (p := scrape(plane, s.planner_metrics_port)) and measured not in p and p,
                           timeout=30, what="the finished job's gauge to go")
        assert value(planner, "ballast_iteration_duration_seconds_count") >= 1
        wait_for(lambda: value(scrape(plane, s.planner_metrics_port), "ballast_devices", kind="cpu",
                               state="idle") >= 1, timeout=30, what="the device shown idle again")
        store = scrape(plane, s.store_metrics_port)
        assert value(store, "ballast_jobs", state="cancelled") == 1
        worker = scrape(plane, s.worker_metrics_port)
        assert value(worker, "ballast_task_duration_seconds_count", kind="jobs.prepare", outcome="succeeded") >= 1
        assert value(worker, "ballast_plan_memo_total", outcome="miss") >= 1  # the job's search ran on the worker
        agent = scrape(plane, s.executor_metrics_port)
        assert any(name.startswith("process_") or name.startswith("python_") for name, _ in agent)
