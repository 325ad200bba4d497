"""The job lifecycle, as written on `enum JobState` in protos/ballast/v1/job.proto.

Pure data and one check, so the store, the job service and tests agree on one table.
"""

from __future__ import annotations

from ballast.v1 import job_pb2
from services.runtime.errors import FailedPrecondition, InvalidArgument

SUBMITTED = "JOB_STATE_SUBMITTED"
PROFILING = "JOB_STATE_PROFILING"
PLANNING = "JOB_STATE_PLANNING"
SCHEDULED = "JOB_STATE_SCHEDULED"
QUEUED = "JOB_STATE_QUEUED"
RUNNING = "JOB_STATE_RUNNING"
REPARTITIONING = "JOB_STATE_REPARTITIONING"
MORPHING = "JOB_STATE_MORPHING"
CANCELLING = "JOB_STATE_CANCELLING"
SUCCEEDED = "JOB_STATE_SUCCEEDED"
FAILED = "JOB_STATE_FAILED"
CANCELLED = "JOB_STATE_CANCELLED"

TERMINAL: frozenset[str] = frozenset({SUCCEEDED, FAILED, CANCELLED})

_FORWARD: dict[str, set[str]] = {
    SUBMITTED: {PROFILING, CANCELLED},
    PROFILING: {PLANNING},
    PLANNING: {SCHEDULED},
    SCHEDULED: {RUNNING, QUEUED},
    # waiting for devices: admitted, re-planned for the devices free, or cancelled at once (nothing runs)
    QUEUED: {RUNNING, PLANNING, CANCELLED},
    RUNNING: {SUCCEEDED, REPARTITIONING, MORPHING, QUEUED},  # QUEUED: preempted, to resume later
    REPARTITIONING: {RUNNING},
    MORPHING: {RUNNING, QUEUED},  # QUEUED: survivors stopped, to resume re-planned from its checkpoint
    CANCELLING: {CANCELLED},
}

# Every non-terminal state may also be cancelled (via CANCELLING) or fail.
ALLOWED: dict[str, set[str]] = {
    state: targets | {FAILED} | ({CANCELLING} if state != CANCELLING else set())
    for state, targets in _FORWARD.items()
} | {state: set() for state in TERMINAL}


def state_name(state: str | int) -> str:
    """Accept a proto enum number or name; return the name."""
    if isinstance(state, int):
        try:
            return job_pb2.JobState.Name(state)
        except ValueError:
            raise InvalidArgument(f"unknown job state {state}", field="state") from None
    return state


def check_transition(current: str | int, target: str | int) -> None:
    """Raise FailedPrecondition unless `current -> target` is an allowed transition."""
    current, target = state_name(current), state_name(target)
    if target not in ALLOWED:
        raise InvalidArgument(
            f"unknown or unspecified target state {target!r}",
            field="state",
            fix="pass one of " + ", ".join(sorted(ALLOWED)),
        )
    if current in TERMINAL:
        raise FailedPrecondition(
            f"job is {current}, a terminal state; it cannot move to {target}",
            field="state",
            fix="submit a new job",
        )
    allowed = ALLOWED.get(current, set())
    if target not in allowed:
        raise FailedPrecondition(
            f"cannot move a job from {current} to {target}",
            field="state",
            fix="allowed from here: " + ", ".join(sorted(allowed)),
        )
