"""Structured logs: a call's trace id travels from the planner to the store and is on both services' lines,
with the job it concerns; the text format is one readable line; a worker's request is its own trace."""

from __future__ import annotations

import io
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ballast import trace
from ballast.v1 import services_pb2, store_pb2
from services.runtime import logs
from tests.harness import Plane, make_settings, start_plane
from tests.store_builders import gpt, job_spec


@pytest.fixture(autouse=True)
def untraced() -> Iterator[None]:
    """Each test starts outside any trace, whatever ran in this thread before."""
    token = trace.set_current("")
    yield
    trace.reset(token)


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter("test"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture(scope="module")
def plane() -> Iterator[Plane]:
    with tempfile.TemporaryDirectory() as data:
        plane = start_plane(make_settings(Path(data), sweep_interval_s=60.0), send=lambda request_id: None)
        try:
            yield plane
        finally:
            plane.stop()


def lines(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


def test_a_trace_id_follows_a_call_into_the_store(plane: Plane, captured: io.StringIO) -> None:
    token = trace.set_current("trace-abc-123")
    try:
        with plane.client() as client:
            job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec("traced", model=gpt())))
            client.jobs.Get(store_pb2.GetRequest(id=job.id))
    finally:
        trace.reset(token)
    rpcs = [e for e in lines(captured) if e.get("msg") == "rpc" and e.get("trace_id") == "trace-abc-123"]
    methods = {e["method"].rsplit("/", 1)[1] for e in rpcs}
    assert {"Submit", "CreateQueuedJob", "Get", "GetJob"} <= methods, methods  # the planner's and the store's lines
    assert [e["job_id"] for e in rpcs if e["method"].endswith("/Get")] == [job.id]
    untraced = [e for e in lines(captured) if e.get("msg") == "rpc" and not e.get("trace_id")]
    assert not untraced, untraced  # a call without one gets a fresh trace id


def test_a_call_without_a_trace_gets_its_own(plane: Plane, captured: io.StringIO) -> None:
    with plane.client() as client:
        client.profiler.ListDeviceKinds(services_pb2.ListDeviceKindsRequest())
        client.profiler.ListDeviceKinds(services_pb2.ListDeviceKindsRequest())
    ids = [e["trace_id"] for e in lines(captured) if e.get("msg") == "rpc" and e["method"].endswith("ListDeviceKinds")]
    assert len(ids) == 2 and ids[0] != ids[1] and all(trace.valid(i) for i in ids)


def test_the_text_format_is_one_line_with_the_ids() -> None:
    record = logging.LogRecord("ballast.x", logging.INFO, __file__, 1, "assigned", (), None)
    record.rank = 3
    with logs.bound(job_id="job-1", plan_id="pln-2"):
        line = logs.TextFormatter("planner").format(record)
    assert line.endswith("info    planner ballast.x: assigned job_id=job-1 plan_id=pln-2 rank=3"), line
    with pytest.raises(ValueError, match="BALLAST_LOG_FORMAT"):
        logs.configure_logging("planner", fmt="xml")


def test_header_values_are_checked() -> None:
    assert trace.valid("req-1234") and not trace.valid("") and not trace.valid("a b") and not trace.valid("x" * 65)
