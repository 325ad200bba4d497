"""A short seeded fuzz of every RPC the store, planner and profiler serve (benchmarks/fuzz.py runs >= 300 cases
each): hostile requests from the descriptors get clean statuses only -- no INTERNAL, UNKNOWN or hang -- and an
INVALID_ARGUMENT names its field. Real servers on loopback ports."""

from __future__ import annotations

import grpc
import pytest

from ballast.client import open_channel
from ballast.transport import client_transport
from ballast.v1 import job_pb2, model_pb2
from tests.fuzzing import BASES, MALFORMED, Method, call, cases, inconsistencies, methods
from tests.harness import make_settings, start_plane

CASES = 8


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = start_plane(make_settings(tmp_path_factory.mktemp("fuzz")))
    yield plane
    plane.stop()


def test_every_rpc_answers_hostile_requests_with_a_clean_status(plane):
    findings, seen = [], set()
    for name, server in plane.servers.items():
        channel = open_channel(plane.settings.address(name), plane.token, timeout=None,
                               transport=client_transport(plane.settings))
        for method in methods(set(server.services)):
            seen.add(method.path)
            verdicts = [call(channel, method, request, n) for n, request in enumerate(cases(method, CASES, seed=7))]
            findings += [v for v in verdicts if not v.clean]
        channel.close()
    assert not findings, "\n".join(f"{v.method} case {v.case}: {v.why}: {v.detail[:200]}" for v in findings)
    served = {m.path for m in methods() if not m.service.endswith("ExecutorControl")}
    assert seen == served  # every RPC in the protos but the agents' own was fuzzed
    assert not any(inconsistencies(plane.settings.database_url).values())  # nothing half-written


def test_cases_are_the_same_for_a_seed_and_start_with_the_empty_request():
    method = next(m for m in methods({"ballast.v1.JobService"}) if m.name == "Submit")
    def wire(case) -> bytes:
        return case if isinstance(case, bytes) else case.SerializeToString()

    first, again = list(cases(method, 20, seed=3)), list(cases(method, 20, seed=3))
    assert [wire(c) for c in first] == [wire(c) for c in again]
    assert first[0].ByteSize() == 0 and first[1:1 + len(MALFORMED)] == MALFORMED
    assert any(not isinstance(c, bytes) and c.ByteSize() > 0 for c in first[1:])
    assert [wire(c) for c in cases(method, 20, seed=4)] != [wire(c) for c in first]
    assert set(BASES) >= {model_pb2.ModelSpec.DESCRIPTOR.full_name, job_pb2.JobSpec.DESCRIPTOR.full_name}


def test_an_internal_error_or_a_nameless_invalid_argument_is_a_finding(plane):
    """The verdict itself: an RPC path no server has is UNIMPLEMENTED, which is not clean."""
    channel = open_channel(plane.settings.address("store"), plane.token, timeout=None,
                           transport=client_transport(plane.settings))
    ghost = Method("ballast.v1.StoreService", "NoSuchCall", job_pb2.JobSpec, job_pb2.JobSpec, False)
    verdict = call(channel, ghost, job_pb2.JobSpec(), 0)
    channel.close()
    assert not verdict.clean and verdict.code == grpc.StatusCode.UNIMPLEMENTED
