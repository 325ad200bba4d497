"""The job state machine matches the comment on `enum JobState` in job.proto."""

from __future__ import annotations

import pytest

from ballast.v1 import job_pb2
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.store import job_states as js

ALL = [name for name in job_pb2.JobState.keys() if name != "JOB_STATE_UNSPECIFIED"]
NON_TERMINAL = [s for s in ALL if s not in js.TERMINAL]


def test_every_state_is_covered():
    assert set(js.ALLOWED) == set(ALL)
    assert js.TERMINAL == {js.SUCCEEDED, js.FAILED, js.CANCELLED}


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (js.SUBMITTED, js.PROFILING),
        (js.PROFILING, js.PLANNING),
        (js.PLANNING, js.SCHEDULED),
        (js.SCHEDULED, js.RUNNING),
        (js.RUNNING, js.SUCCEEDED),
        (js.RUNNING, js.REPARTITIONING),
        (js.REPARTITIONING, js.RUNNING),
        (js.RUNNING, js.MORPHING),
        (js.MORPHING, js.RUNNING),
        (js.MORPHING, js.QUEUED),
        (js.CANCELLING, js.CANCELLED),
        (js.SUBMITTED, js.CANCELLED),
    ],
)
def test_documented_transitions(current, target):
    js.check_transition(current, target)


def test_cancel_and_fail_from_any_non_terminal_state():
    for state in NON_TERMINAL:
        js.check_transition(state, js.FAILED)
        if state != js.CANCELLING:
            js.check_transition(state, js.CANCELLING)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (js.SUBMITTED, js.RUNNING),
        (js.PROFILING, js.CANCELLED),
        (js.RUNNING, js.PLANNING),
        (js.REPARTITIONING, js.MORPHING),
        (js.SCHEDULED, js.SUCCEEDED),
        (js.RUNNING, js.RUNNING),
        (js.CANCELLING, js.RUNNING),
    ],
)
def test_illegal_transitions_are_refused(current, target):
    with pytest.raises(FailedPrecondition) as err:
        js.check_transition(current, target)
    assert err.value.field == "state" and err.value.fix


def test_terminal_states_are_final():
    for state in js.TERMINAL:
        assert js.ALLOWED[state] == set()
        for target in ALL:
            with pytest.raises(FailedPrecondition):
                js.check_transition(state, target)


def test_accepts_enum_numbers_and_rejects_unknown_targets():
    js.check_transition(job_pb2.JOB_STATE_SUBMITTED, job_pb2.JOB_STATE_PROFILING)
    for bad in (job_pb2.JOB_STATE_UNSPECIFIED, "JOB_STATE_BOGUS", 99):
        with pytest.raises(InvalidArgument):
            js.check_transition(js.SUBMITTED, bad)
