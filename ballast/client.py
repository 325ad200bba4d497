"""Client SDK: authenticated channels with retries, and typed stubs for every Ballast service.

Calls that fail with UNAVAILABLE (a service restarting, the database down) are retried with
exponential backoff by gRPC's own retry policy; a unary call throttled by a tenant's rate limit waits the
delay the server advises and is tried again, a bounded number of times (ballast/throttle.py). Services calling
services pass `deadline_source` so a downstream call never outlives the incoming call's deadline.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ballast import exported, sdk, trace
from ballast.config import Settings, load_settings
from ballast.errors import CallFailed, ClientError, InvalidInput, PlanSearchFailed, SearchTimeout
from ballast.throttle import ThrottleRetry
from ballast.transport import PLAINTEXT, ClientTransport, client_transport
from ballast.v1 import (
    common_pb2,
    executor_pb2_grpc,
    fleet_pb2,
    job_pb2,
    model_pb2,
    plan_pb2,
    profile_pb2,
    queue_pb2,
    services_pb2,
    services_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)

TokenSource = str | Callable[[], str]
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 30.0

RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.5s",
                    "maxBackoff": "5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


class _CallInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer token and the current trace id, and caps the timeout by the propagated deadline."""

    def __init__(self, token: TokenSource, default_timeout: float | None, deadline_source: Callable[[], float | None],
                 metadata: tuple[tuple[str, str], ...] = ()):
        self.token = token
        self.default_timeout = default_timeout
        self.deadline_source = deadline_source
        self.metadata = metadata

    def _details(self, details: grpc.ClientCallDetails, streaming: bool) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or []), *self.metadata]
        token = self.token() if callable(self.token) else self.token
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        if trace.current() and not any(key == trace.HEADER for key, _ in metadata):
            metadata.append((trace.HEADER, trace.current()))  # the call this one serves, in every service's log
        timeout = details.timeout
        if timeout is None and not streaming:
            timeout = self.default_timeout
        remaining = self.deadline_source()
        if remaining is not None:
            remaining = max(remaining, 0.001)  # an expired deadline must fail fast, never mean "no deadline"
            timeout = remaining if timeout is None else min(timeout, remaining)
        return _Details(details.method, timeout, metadata, details.credentials, details.wait_for_ready,
                        getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details, False), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details, True), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details, False), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details, True), request_iterator)


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: object
    wait_for_ready: bool | None
    compression: object


def open_channel(
    address: str,
    token: TokenSource = "",
    *,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    deadline_source: Callable[[], float | None] = lambda: None,
    transport: ClientTransport = PLAINTEXT,
    metadata: tuple[tuple[str, str], ...] = (),
    retries: bool = True,
) -> grpc.Channel:
    """A channel with auth, retries and limits: TLS when `transport` has a CA (`client_transport(settings)`),
    else plaintext, which a TLS server refuses. `metadata` goes out with every call. Without `retries` an
    UNAVAILABLE answer comes back at once (for a caller with somewhere else to go)."""
    options = channel_options(retries)
    credentials = transport.credentials()
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, credentials, options=options)
    # The throttle retry is outermost, so each attempt gets a fresh token and the deadline left
    return grpc.intercept_channel(channel, ThrottleRetry(), _CallInterceptor(token, timeout, deadline_source, metadata))


def channel_options(retries: bool = True) -> list[tuple[str, object]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.enable_retries", int(retries)),
        *([("grpc.service_config", RETRY_SERVICE_CONFIG)] if retries else []),
    ]


def open_aio_channel(address: str, transport: ClientTransport = PLAINTEXT) -> grpc.aio.Channel:
    """A grpc.aio channel with open_channel's limits, for a caller that holds long streams on an event loop (an
    executor agent's Connect; the emulator holds a thousand of them on one loop). Call it on that loop; the
    caller adds the bearer token to its calls (`bearer`)."""
    credentials = transport.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=channel_options())
    return grpc.aio.secure_channel(address, credentials, options=channel_options())


def bearer(token: TokenSource) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` ("" : none)."""
    token = token() if callable(token) else token
    return (("authorization", f"Bearer {token}"),) if token else ()


def pages(list_call: Callable[[Any], Any], request: Any) -> Iterator[Any]:
    """Every reply of a paged List call, in order (the request's page token is advanced in place)."""
    while True:
        reply = list_call(request)
        yield reply
        if not reply.next_page_token:
            return
        request.page.page_token = reply.next_page_token


class Client:
    """Stubs for the services at the given addresses (any may be omitted); `Client.of(settings)` for the
    configured ones with their transport security."""

    def __init__(self, *, store: str = "", planner: str = "", profiler: str = "", token: TokenSource = "",
                 deadline_source: Callable[[], float | None] = lambda: None, transport: ClientTransport = PLAINTEXT):
        self._channels: list[grpc.Channel] = []

        def channel(address: str) -> grpc.Channel | None:
            if not address:
                return None
            ch = open_channel(address, token, deadline_source=deadline_source, transport=transport)
            self._channels.append(ch)
            return ch

        store_ch, planner_ch, profiler_ch = channel(store), channel(planner), channel(profiler)
        self.store = store_pb2_grpc.StoreServiceStub(store_ch) if store_ch else None
        self.planner = services_pb2_grpc.PlannerServiceStub(planner_ch) if planner_ch else None
        self.jobs = services_pb2_grpc.JobServiceStub(planner_ch) if planner_ch else None
        self.fleet = services_pb2_grpc.FleetServiceStub(planner_ch) if planner_ch else None
        self.executor_control = executor_pb2_grpc.ExecutorControlStub(planner_ch) if planner_ch else None
        self.profiler = services_pb2_grpc.ProfilerServiceStub(profiler_ch) if profiler_ch else None

    @classmethod
    def of(cls, settings: Settings, services: tuple[str, ...] = ("store", "planner", "profiler"),
           token: TokenSource | None = None) -> Client:
        """A client of the configured `services`, TLS-verified with the configured CA (or plaintext)."""
        return cls(**{name: settings.address(name) for name in services},
                   token=settings.resolved_token() if token is None else token, transport=client_transport(settings))

    def iteration_metrics(self, job_id: str, **filters: int) -> list[job_pb2.IterationMetric]:
        """Every iteration metric of a job (all pages), by (iteration, stage, replica)."""
        request = store_pb2.ListIterationMetricsRequest(job_id=job_id, page=common_pb2.PageRequest(page_size=1000),
                                                        **filters)
        return [m for reply in pages(self.store.ListIterationMetrics, request) for m in reply.metrics]

    def evaluations(self, job_id: str) -> list[job_pb2.Evaluation]:
        """A job's validation losses (JobSpec.eval_every), by iteration (all pages)."""
        request = store_pb2.ListEvaluationsRequest(job_id=job_id, page=common_pb2.PageRequest(page_size=1000))
        return [e for reply in pages(self.store.ListEvaluations, request) for e in reply.evaluations]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- The SDK's typed calls (docs/sdk.md), kept together here. Arguments are checked before anything is sent
    # (InvalidInput names the parameter and the fix); a refused call raises CallFailed (field and fix as the
    # server gave them), which is also a grpc.RpcError.

    _SERVICES = {"store": "StoreService", "planner": "PlannerService", "jobs": "JobService",
                 "fleet": "FleetService", "profiler": "ProfilerService"}

    @classmethod
    def from_env(cls, **overrides: Any) -> Client:
        """A client of every service as the CLI finds them: BALLAST_* variables, the config file, the data dir's
        admin token unless BALLAST_TOKEN is set; `overrides` are Settings fields, e.g. data_dir="./state"."""
        return cls.of(load_settings(**overrides))

    def _call(self, stub: str, method: str, request: Any, **kwargs: Any) -> Any:
        service = getattr(self, stub)
        if service is None:
            address = "planner" if stub in ("jobs", "fleet") else stub
            raise ClientError(f"this client has no {address} address", field=address,
                              fix=f"use Client.from_env(), or Client({address}='host:port', ...)")
        try:
            return getattr(service, method)(request, **kwargs)
        except CallFailed:
            raise
        except grpc.RpcError as exc:
            raise CallFailed.of(f"{self._SERVICES[stub]}.{method}", exc) from None

    def submit(self, model: model_pb2.ModelSpec | job_pb2.JobSpec | str | os.PathLike[str], *, batch: int = 8,
               iterations: int = 20, fleet: fleet_pb2.Fleet | None = None, name: str = "", seed: int = 0,
               memory: int | str = 0, engine: str | None = None, schedule: str | None = None, stages: int = 0,
               online: bool = False, toggles: Iterable[job_pb2.LayerToggle] = (), priority: str = "",
               min_devices: int | None = None, max_devices: int | None = None, micro_batches: int = 0,
               checkpoint_every: int = 0, elastic: bool = False) -> job_pb2.Job:
        """Submit a training job (`ballast submit`): a model spec (or its YAML path) and the options, or a whole
        JobSpec as is. Returns the stored job (SUBMITTED); `watch(job.id)` follows it."""
        spec = model if isinstance(model, job_pb2.JobSpec) else sdk.job_spec(
            model, batch=batch, iterations=iterations, fleet=fleet, name=name, seed=seed, memory=memory,
            engine=engine, schedule=schedule, stages=stages, online=online, toggles=toggles, priority=priority,
            min_devices=min_devices, max_devices=max_devices, micro_batches=micro_batches,
            checkpoint_every=checkpoint_every, elastic=elastic)
        return self._call("jobs", "Submit", services_pb2.SubmitJobRequest(spec=spec))

    def job(self, job_id: str) -> job_pb2.Job:
        """A job as it is now (state, plan, iteration, message)."""
        return self._call("jobs", "Get", store_pb2.GetRequest(id=job_id))

    def cancel(self, job_id: str, reason: str = "") -> job_pb2.Job:
        """Cancel a job: at once if nothing runs it yet, else CANCELLING until its workers are gone."""
        return self._call("jobs", "Cancel", services_pb2.CancelJobRequest(job_id=job_id, reason=reason))

    def export(self, job_id: str, out: str | os.PathLike[str], *, iteration: int = 0,
               format: str = "safetensors") -> exported.Export:  # noqa: A002 - the CLI's flag
        """Write a job's trained weights into the new or empty directory `out` (`ballast export`): its newest complete
        checkpoint (or the one at `iteration`), consolidated into one state dict under the model's own names, as
        model.safetensors, model.pt (`format="torch"`) or, for a Hugging Face model, a save_pretrained directory
        (`format="hf"`); ballast.json beside it says which job and iteration. Each file is checked against its
        SHA-256 before it takes its name."""
        if not job_id:
            raise InvalidInput("required", field="job_id", fix="pass the id submit() returned (job.id)")
        folder = exported.target(out)
        stream = self._call("jobs", "Export", services_pb2.ExportRequest(job_id=job_id, iteration=iteration,
                                                                         format=format))
        try:
            return exported.receive(stream, folder)
        except grpc.RpcError as exc:
            raise CallFailed.of("JobService.Export", exc) from None
        finally:
            stream.cancel()

    def watch(self, job_id: str, *, after: int = 0, until: str | int | None = None,
              timeout: float | None = None) -> Iterator[job_pb2.JobEvent]:
        """A job's events, replayed after seq `after`, then live; the iterator ends when the job does (SUCCEEDED,
        FAILED, CANCELLED) or reaches `until` ('scheduled', 'queued', 'running', …). Closing it early stops
        the stream."""
        if not job_id:
            raise InvalidInput("required", field="job_id", fix="pass the id submit() returned (job.id)")
        target = sdk.job_state(until)
        stream = self._call("jobs", "Watch", services_pb2.WatchJobRequest(job_id=job_id, after_seq=after),
                            timeout=timeout)
        return self._events(stream, target)

    @staticmethod
    def _events(stream: Any, target: int | None) -> Iterator[job_pb2.JobEvent]:
        try:
            for event in stream:
                yield event
                if sdk.reached(event.state, target):
                    return
        except grpc.RpcError as exc:
            raise CallFailed.of("JobService.Watch", exc) from None
        finally:
            stream.cancel()

    def wait(self, job_id: str, *, until: str | int | None = None, timeout: float | None = None) -> job_pb2.Job:
        """Follow a job until it ends (or reaches `until`) and return it as it is then."""
        for _ in self.watch(job_id, until=until, timeout=timeout):
            pass
        return self.job(job_id)

    def inspect(self, model: model_pb2.ModelSpec | str | os.PathLike[str],
                data: job_pb2.DataSpec | None = None) -> services_pb2.Inspection:
        """Check a model (and the data it would train on) against Ballast's rules and list the layers it is cut into
        (`ballast inspect`); nothing is stored. A user's factory or Hugging Face model is built and dry-run, the
        data's files read, by the profiler in a worker process; a rule broken comes back as INVALID_ARGUMENT naming
        the rule and the fix."""
        return self._call("profiler", "Inspect", services_pb2.InspectRequest(model=sdk.model_spec(model), data=data))

    def profile(self, model: model_pb2.ModelSpec | str | os.PathLike[str], *, device: str = sdk.LOCAL_DEVICE,
                micro_batch_sizes: Sequence[int] = (), max_micro_batch: int = 0, time_budget_s: float = 0.0,
                project_to: str = "", dtype: str | None = None, refresh: bool = False,
                on_progress: Callable[[services_pb2.ProfileProgress], None] | None = None) -> profile_pb2.Profile:
        """Profile a model layer by layer on the profiler's host (`ballast profile`); cached by model signature,
        device, precision and software unless `refresh`. `on_progress` gets every progress update."""
        request = sdk.profile_request(sdk.model_spec(model), device=device, micro_batch_sizes=micro_batch_sizes,
                                      max_micro_batch=max_micro_batch, time_budget_s=time_budget_s,
                                      project_to=project_to, dtype=sdk.choice(sdk.DTYPES, dtype, "dtype"),
                                      refresh=refresh)
        return self.profile_stream(request, on_progress).profile

    def profile_stream(self, request: services_pb2.ProfileRequest,
                       on_progress: Callable[[services_pb2.ProfileProgress], None] | None = None,
                       ) -> services_pb2.ProfileProgress:
        """Send a ProfileRequest and follow its progress; returns the last update, which carries the profile."""
        final = None
        try:
            for update in self._call("profiler", "ProfileStream", request):
                if on_progress is not None:
                    on_progress(update)
                final = update
        except grpc.RpcError as exc:
            raise CallFailed.of("ProfilerService.ProfileStream", exc) from None
        if final is None or not final.HasField("profile"):
            raise ClientError("the profiler's stream ended without a profile", fix="retry; the profiler's log says why")
        return final

    def profiles(self, model: str = "", *, device_kind: str = "") -> list[profile_pb2.Profile]:
        """Stored profiles you may read, of every model or of one (`mdl-…` id or name), optionally one device."""
        model_ids = [model]
        if model and not model.startswith("mdl-"):
            found = pages(lambda r: self._call("store", "ListModels", r), store_pb2.ListModelsRequest(name=model))
            model_ids = [m.id for page in found for m in page.models]
        return [p for model_id in model_ids
                for page in pages(lambda r: self._call("store", "ListProfiles", r),
                                  store_pb2.ListProfilesRequest(model_id=model_id, device_kind=device_kind))
                for p in page.profiles]

    def plan(self, model: model_pb2.ModelSpec | str | os.PathLike[str], fleet: fleet_pb2.Fleet, *, batch: int = 0,
             memory: int | str = 0, engine: str | None = None, schedule: str | None = None, profile: str = "auto",
             micro_batch_sizes: Sequence[int] = (1, 2, 4, 8), dtype: str | None = None, what_if: bool = False,
             timeout: float = 600.0,
             on_progress: Callable[[services_pb2.ProfileProgress], None] | None = None) -> plan_pb2.Plan:
        """Profile the model for the fleet's device (`profile`: auto = measured on cpu, else analytical; or
        measured, projected, analytical), queue the plan search and return the stored plan (`ballast plan`);
        `what_if` searches the full space synchronously and stores nothing."""
        if not isinstance(fleet, fleet_pb2.Fleet):
            raise InvalidInput(f"expected a Fleet, got {type(fleet).__name__}", field="fleet",
                                   fix="load a fleet file with services.specs.fleet.load_fleet(path)")
        spec = sdk.model_spec(model)
        kind = sdk.profile_kind(profile, fleet.device.kind)
        precision = sdk.choice(sdk.DTYPES, dtype, "dtype") or spec.dtype
        request = sdk.plan_profile_request(spec, micro_batch_sizes, kind, fleet.device.kind, precision)
        priced = self.profile_stream(request, on_progress).profile
        search = services_pb2.PlanRequest(profile_id=priced.id, fleet=fleet, global_batch_size=batch,
                                          memory_budget_bytes=sdk.memory_bytes(memory),
                                          engine=sdk.choice(sdk.ENGINES, engine, "engine"),
                                          schedule=sdk.choice(sdk.SCHEDULES, schedule, "schedule"))
        if what_if:
            return self._call("planner", "WhatIf", search, timeout=timeout)
        done = self.wait_plan(self._call("planner", "Plan", search), timeout=timeout)
        return self.explain(done.plan_id)

    def wait_plan(self, op: services_pb2.PlanOperation, *, timeout: float = 600.0, poll_s: float = 0.3,
                  on_update: Callable[[services_pb2.PlanOperation], None] | None = None,
                  ) -> services_pb2.PlanOperation:
        """Poll a queued plan search until it ends: its operation once SUCCEEDED, PlanSearchFailed if it failed,
        SearchTimeout past `timeout` (the search goes on)."""
        deadline = time.monotonic() + timeout
        while op.request.state not in (queue_pb2.REQUEST_STATE_SUCCEEDED, queue_pb2.REQUEST_STATE_FAILED):
            if time.monotonic() > deadline:
                state = queue_pb2.RequestState.Name(op.request.state).removeprefix("REQUEST_STATE_").lower()
                raise SearchTimeout(f"request {op.request.id} still {state} after {timeout:.0f} s; the search goes "
                                    "on", fix="poll it later with wait_plan or GetPlanOperation")
            time.sleep(poll_s)
            op = self._call("planner", "GetPlanOperation", store_pb2.GetRequest(id=op.request.id))
            if on_update is not None:
                on_update(op)
        if op.request.state == queue_pb2.REQUEST_STATE_FAILED:
            raise PlanSearchFailed(op.request.id, op.request.error)
        return op

    def explain(self, plan_id: str) -> plan_pb2.Plan:
        """A stored plan (`ballast explain`): stages, per-layer strategies, prediction, alternatives and
        baselines, and its `explanation` in words."""
        return self._call("planner", "GetPlan", store_pb2.GetRequest(id=plan_id))

    def queue(self) -> list[services_pb2.QueueEntry]:
        """The shared fleet's queue in admission order (`ballast queue`): another tenant's entries show their
        position, tenant, class and size but no job id."""
        return list(self._call("fleet", "ListQueue", services_pb2.ListQueueRequest()).entries)

    def fleet_view(self) -> services_pb2.GetFleetResponse:
        """Every device, who leases it since when and its use over the last hour, and the policy in force
        (`ballast fleet`). `client.fleet` itself is the FleetService stub."""
        return self._call("fleet", "GetFleet", services_pb2.GetFleetRequest())

    def sql(self, query: str, *, limit: int = 0, timeout: float = 0.0) -> sdk.SqlResult:
        """One read-only SQL statement (`ballast sql`; platform admin): at most `limit` rows (0: 1000, at most
        10,000) within `timeout` seconds (0: 10). docs/sql.md lists the tables."""
        if not isinstance(query, str) or not query.strip():
            raise InvalidInput("no SQL statement given", field="query", fix='e.g. "SELECT id, state FROM jobs"')
        # The call waits as long as the query may run (the channel's default deadline is shorter than its cap).
        reply = self._call("store", "Query", store_pb2.QueryRequest(sql=query, row_limit=limit, timeout_s=timeout),
                           timeout=(timeout or 10.0) + 10.0 if 0 < (timeout or 10.0) <= 300 else None)
        return sdk.SqlResult.of(reply)
