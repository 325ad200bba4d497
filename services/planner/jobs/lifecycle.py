"""JobService logic over the store: submit, read, watch, cancel. No grpc imports."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from ballast.v1 import fleet_pb2, job_pb2, services_pb2, store_pb2
from services.planner.jobs import references
from services.planner.jobs.prepare import KIND as PREPARE
from services.planner.queue import durable
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.runtime.store_api import Store, every_page
from services.specs.ranges import check_bounds

TERMINAL = {job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED}
CANCEL_ATTEMPTS = 5  # a job a worker keeps moving (profiling, planning, queued) settles within a few reads


class HostsView:
    """The registered executor hosts, read from the store at most every `ttl_s`: Submit checks a job's fleet
    against them on every call, and a store round trip each time was a third of its store traffic. Only a
    refusal is decided on a fresh read (`fresh`), so a stale view can delay a refusal, never cause one."""

    def __init__(self, store: Store, ttl_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.store, self.ttl_s, self.clock = store, ttl_s, clock
        self._hosts: list[fleet_pb2.Host] = []
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def get(self, fresh: bool = False) -> list[fleet_pb2.Host]:
        with self._lock:
            if not fresh and self._read_at is not None and self.clock() - self._read_at < self.ttl_s:
                return self._hosts
        read_at = self.clock()
        hosts = [h for page in every_page(self.store.list_hosts, store_pb2.ListHostsRequest()) for h in page.hosts]
        with self._lock:
            if self._read_at is None or read_at >= self._read_at:
                self._hosts, self._read_at = hosts, read_at
        return hosts


def submit(store: Store, request: services_pb2.SubmitJobRequest, send: durable.Send,
           hosts: HostsView | None = None, check_inputs: Callable[[job_pb2.JobSpec], None] | None = None
           ) -> job_pb2.Job:
    """Store the job, its model, its SUBMITTED event and the request that prepares it (profile and plan,
    services/planner/jobs/prepare.py) in one store transaction (validated there), as the caller, then hand the
    request to `send` (the planner's broker publisher, which does not wait for the broker). A job whose
    preparation could not be handed over is failed with the reason rather than left waiting for nothing.
    `check_inputs` (jobs/inputs_check.py) refuses a user's model or data that breaks a rule before anything is
    stored."""
    if not request.HasField("spec"):
        raise InvalidArgument("required", field="spec", fix="send a JobSpec with model, global_batch_size, iterations")
    check_bounds(request.spec, "spec")  # before any store call: the store checks them again with the rest
    if check_inputs is not None and request.spec.HasField("model"):
        check_inputs(request.spec)
    references.check(store, request.spec)
    if request.spec.HasField("fleet"):
        view = hosts or HostsView(store, ttl_s=0.0)
        try:
            check_offered(request.spec, view.get())
        except FailedPrecondition:
            check_offered(request.spec, view.get(fresh=True))
    stored = store.create_queued_job(store_pb2.CreateQueuedJobRequest(spec=request.spec, kind=PREPARE))
    job = stored.job
    try:
        send(stored.request.id)
    except Exception as exc:
        store.transition_job(store_pb2.TransitionJobRequest(
            id=job.id, state=job_pb2.JOB_STATE_FAILED, expected_state=job_pb2.JOB_STATE_SUBMITTED,
            message=f"could not queue the job's preparation: {exc}", event_type="FAILED"))
        raise
    return job


def check_offered(spec: job_pb2.JobSpec, hosts: list[fleet_pb2.Host]) -> None:
    """Refuse a job whose fleet (spec.fleet) no registered executor could ever offer: a device kind none has,
    or more devices of it than all of them together (down to spec.min_devices for a job that may re-plan).
    With no executor registered yet nothing is known, so the job waits for one instead."""
    devices = [d for h in hosts for d in h.devices]
    if not devices:
        return
    fleet = spec.fleet
    kind, asked = fleet.device.kind, fleet.nodes * fleet.devices_per_node
    need = min(asked, spec.min_devices) if spec.min_devices else asked
    counts: dict[str, int] = {}
    for d in devices:
        counts[d.spec.kind] = counts.get(d.spec.kind, 0) + 1
    if counts.get(kind, 0) >= need:
        return
    has = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    raise FailedPrecondition(
        f"asks for {need} {kind} device(s); the registered executors offer {has}", field="spec.fleet",
        fix="leave spec.fleet unset to plan for the executors at hand, or plan for a fleet not at hand without "
            "running it (`ballast plan --fleet FILE`)")


def watch(store: Store, job_id: str, after_seq: int,
          active: Callable[[], bool], poll_s: float = 0.5) -> Iterator[job_pb2.JobEvent]:
    """Replay events after `after_seq`, then follow new ones until the job is terminal and drained."""
    if not job_id:
        raise InvalidArgument("required", field="job_id")
    seq = after_seq
    while active():
        page = store.list_job_events(store_pb2.ListJobEventsRequest(job_id=job_id, after_seq=seq))
        for event in page.events:
            seq = event.seq
            yield event
        if page.next_page_token:
            continue
        # The terminal transition commits with its event, so a drain after seeing it misses nothing.
        if store.get_job(store_pb2.GetRequest(id=job_id)).state in TERMINAL:
            while True:
                page = store.list_job_events(store_pb2.ListJobEventsRequest(job_id=job_id, after_seq=seq))
                for event in page.events:
                    seq = event.seq
                    yield event
                if not page.events:
                    return
        time.sleep(poll_s)


def cancel(store: Store, request: services_pb2.CancelJobRequest, attempts: int = CANCEL_ATTEMPTS) -> job_pb2.Job:
    """A job nobody runs (submitted, or queued for devices) is cancelled at once; a running one goes to
    CANCELLING for its executors. The move is a compare-and-set on the state just read: when a worker or
    the scheduler moved the job in between, the job is read again and the cancel decided again."""
    for attempt in range(attempts):
        job = store.get_job(store_pb2.GetRequest(id=request.job_id))
        if job.state in TERMINAL:
            raise FailedPrecondition(
                f"job is already {job_pb2.JobState.Name(job.state)}", field="job_id", fix="nothing to cancel"
            )
        nothing_runs = job.state in (job_pb2.JOB_STATE_SUBMITTED, job_pb2.JOB_STATE_QUEUED)
        target = job_pb2.JOB_STATE_CANCELLED if nothing_runs else job_pb2.JOB_STATE_CANCELLING
        try:
            return store.transition_job(store_pb2.TransitionJobRequest(
                id=job.id, state=target, expected_state=job.state, message=request.reason or "cancelled by user",
                event_type="CANCEL_REQUESTED"))
        except FailedPrecondition as exc:
            if exc.field != "expected_state" or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
