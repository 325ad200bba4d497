"""ProfilerService logic, without grpc: resolve the model, answer from the cache, or run a profiling
worker subprocess and store its result.

Measuring runs in a child process (`python -m services.profiler.worker`, JSON lines on stdout, never
pickle) so an out-of-memory kill or a crash in a kernel cannot take the service down, and a profile
is stored only once it is complete: nothing half-done reaches the database. A user's code (an allow-listed
factory, a Hugging Face model through transformers) is imported only there too: its check at Submit (`inspect`)
and its analytical profile run in such a process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.message import Message

from ballast.v1 import common_pb2, job_pb2, model_pb2, profile_pb2, services_pb2, store_pb2
from services.profiler import projection
from services.profiler.bounded import check_budget
from services.profiler.versions import code_version, software
from services.runtime.allocator import STEADY_ALLOCATOR
from services.runtime.auth import Principal, hash_token
from services.runtime.context import caller_token
from services.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
    from_code,
)
from services.runtime.lru import BytesLRU
from services.runtime.store_api import Store, every_page
from services.specs import catalog
from services.specs.data import data_fingerprint, validate_data_spec
from services.specs.model import model_signature, validate_model_spec
from services.specs.ranges import check_bounds
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs

log = logging.getLogger("ballast.profiler")

LOCAL_DEVICES = ("", "cpu")
WORKER_COMMAND = (sys.executable, "-m", "services.profiler.worker")
USER_FAMILIES = (model_pb2.MODEL_FAMILY_CUSTOM, model_pb2.MODEL_FAMILY_HF)  # their code runs in a worker process
INSPECTIONS_KEPT = 1024  # inspections a profiler keeps, by signature and code version (at most 8 MiB of them)
T = TypeVar("T", bound=Message)
LOOKUPS_KEPT = 4096  # stored models and analytical profiles a profiler remembers per caller (at most 64 MiB)


def resolve_model(store: Store, request: services_pb2.ProfileRequest,
                  user_inputs: UserInputs = NO_USER_INPUTS) -> model_pb2.Model:
    """The stored model: by id, or the inline spec matched by signature (any name), or stored now."""
    if request.model_id:
        return store.get_model(store_pb2.GetRequest(id=request.model_id))
    if request.HasField("model"):
        validate_model_spec(request.model, user_inputs, prefix="model")  # bad specs fail before anything is stored
        known = store.list_models(store_pb2.ListModelsRequest(signature=model_signature(request.model)))
        if known.models:
            return known.models[0]
        return store.create_model(store_pb2.CreateModelRequest(spec=request.model))
    raise InvalidArgument("required", field="model_id", fix="pass a stored model id or the model spec inline")


def local_device(kind: str) -> str:
    """Profiles are measured on this host's device; other devices are reached by projection."""
    if kind.lower() in LOCAL_DEVICES:
        return "cpu"
    catalog.device(kind)  # unknown names: INVALID_ARGUMENT naming "device"
    raise FailedPrecondition(
        f"this profiler measures on cpu, not {kind}", field="device_kind",
        fix=f"profile on cpu with project_to={kind!r}, or run the profiler on a host with that device",
    )


def cached(store: Store, model: model_pb2.Model, device: str, dtype: int,
           user_inputs: UserInputs = NO_USER_INPUTS) -> profile_pb2.Profile | None:
    """The newest measured profile of the same model, device, precision and software. By model id, not only
    signature: a platform caller (a worker preparing a job) sees every tenant's profiles and must get the
    job's own (a tenant stores each signature once, so for tenants the two keys agree)."""
    request = store_pb2.ListProfilesRequest(model_id=model.id, model_signature=model.signature,
                                            device_kind=device, dtype=dtype,
                                            software=software(model.spec, user_inputs), projected=False)
    newest = None
    for reply in every_page(store.list_profiles, request):
        newest = reply.profiles[-1] if reply.profiles else newest
    return newest


class Runner:
    """Profiles one model at a time (profiling owns the CPU; a second request waits its turn)."""

    def __init__(self, store: Store, user_inputs: UserInputs = NO_USER_INPUTS,
                 worker_command: tuple[str, ...] = WORKER_COMMAND):
        self._store = store
        self._user_inputs = user_inputs
        self._worker_command = worker_command
        self._turn = threading.Semaphore(1)
        self._inspections = BytesLRU(INSPECTIONS_KEPT, 8 << 20)
        # Stored models and analytical profiles are never changed or deleted, so a caller who read one reads the
        # same again: a worker preparing jobs of one model asked the store twice per job (GetModel, ListProfiles)
        self._lookups = BytesLRU(LOOKUPS_KEPT, 64 << 20)
        self._lock = threading.Lock()
        self._checks: dict[str, list] = {}  # model key -> [its lock, callers holding or waiting]

    def turn(self) -> threading.Semaphore:
        """Held while measuring: profiling and calibration own the host's cores."""
        return self._turn

    def stream(self, request: services_pb2.ProfileRequest,
               active: Callable[[], bool] = lambda: True) -> Iterator[services_pb2.ProfileProgress]:
        check_budget(request.time_budget_s)  # before the cache or a worker: a bad budget is the whole answer
        check_bounds(request)
        if request.analytical:
            yield self.analytical(request)
            return
        device = local_device(request.device_kind)
        target = catalog.device(request.project_to) if request.project_to else None
        model = resolve_model(self._store, request, self._user_inputs)
        dtype = request.dtype or model.spec.dtype or common_pb2.DTYPE_FP32
        hit = None if request.refresh else cached(self._store, model, device, dtype, self._user_inputs)
        if hit is not None and request.options.calibrate and not hit.comm.fits:
            hit = None  # calibrated links were asked for and that profile has none: measure again
        if hit is not None:
            yield from self._finish(hit, target, cached_hit=True)
            return
        yield services_pb2.ProfileProgress(phase="queued", message="waiting for the profiler")
        with self.turn():
            measured = None
            for update in run_worker(request, model.spec, device, self._user_inputs, active, self._worker_command):
                if update.HasField("profile"):
                    measured = update.profile
                else:
                    yield update
            if measured is None:
                raise Unavailable("the profiling worker stopped without a result", fix="retry")
        measured.model_id, measured.model_signature = model.id, model.signature
        yield services_pb2.ProfileProgress(phase="storing", fraction=1.0)
        stored = self._store.create_profile(store_pb2.CreateProfileRequest(profile=measured))
        yield from self._finish(stored, target, cached_hit=False)

    def _finish(self, profile: profile_pb2.Profile, target, *, cached_hit: bool):
        message = f"profile {profile.id}" + (" (cached)" if cached_hit else "")
        if target is not None:
            projected = projection.project(profile, target.kind)
            profile = self._store.create_profile(store_pb2.CreateProfileRequest(profile=projected))
            message += f"; projected to {target.kind} as {profile.id}"
        yield services_pb2.ProfileProgress(phase="done", fraction=1.0, profile=profile, cached=cached_hit,
                                           message=message)

    def analytical(self, request: services_pb2.ProfileRequest) -> services_pb2.ProfileProgress:
        """An analytical profile for any catalog device (nothing measured, so no turn on the CPU), stored
        once per model signature, device, precision and formula (its software string) and reused after."""
        if not request.device_kind:
            raise InvalidArgument("required with analytical", field="device_kind", fix="name a catalog device")
        if request.project_to:
            raise InvalidArgument("an analytical profile is computed for device_kind directly", field="project_to",
                                  fix="leave project_to empty and set device_kind")
        kind = catalog.device(request.device_kind).kind
        model = self._model(request)
        sizes = analytical_sizes(request)
        code = code_version(model.spec, self._user_inputs)  # an edited model file is priced again
        formula = projection.analytical_software() + (f"; {code}" if code else "")
        dtype = request.dtype or model.spec.dtype or catalog.device(kind).default_dtype
        lookup = store_pb2.ListProfilesRequest(model_id=model.id, model_signature=model.signature, device_kind=kind,
                                               dtype=dtype, software=formula, projected=True)
        key = self._caller_key("analytical", lookup.SerializeToString(deterministic=True), *sizes)
        hit = remembered = None if request.refresh else self._remembered(key, profile_pb2.Profile)
        for reply in () if request.refresh or hit is not None else every_page(self._store.list_profiles, lookup):
            hit = next((p for p in reversed(reply.profiles) if not p.source_profile_id and p.layers
                        and [smp.micro_batch_size for smp in p.layers[0].samples] == sizes), hit)
        if hit is not None:
            if remembered is None:  # found in the store: kept for next time (a remembered one is kept already)
                self._lookups.put(key, hit.SerializeToString())
            return services_pb2.ProfileProgress(phase="done", fraction=1.0, profile=hit, cached=True,
                                                message=f"analytical profile {hit.id} (cached)")
        if model.spec.family in USER_FAMILIES:  # a user's code: priced in a worker process
            asked = services_pb2.ProfileRequest(device_kind=kind, dtype=dtype,
                                                options=services_pb2.ProfileOptions(micro_batch_sizes=sizes))
            _, profile = worker_result(asked, model.spec, "analytical", self._user_inputs, self._worker_command)
            profile.model_id, profile.model_signature = model.id, model.signature
        else:
            profile = projection.analytical_profile(model.spec, kind, dtype, sizes, model_id=model.id,
                                                    model_signature=model.signature)
        profile.software = formula
        stored = self._store.create_profile(store_pb2.CreateProfileRequest(profile=profile))
        self._lookups.put(key, stored.SerializeToString())
        return services_pb2.ProfileProgress(phase="done", fraction=1.0, profile=stored,
                                            message=f"analytical profile {stored.id} for {kind}")

    @staticmethod
    def _caller_key(*parts: object) -> tuple[object, ...]:
        """A lookup's key for this caller: what one token may read, another may not (tenant isolation)."""
        return (hash_token(caller_token()), *parts)

    def _remembered(self, key: tuple[object, ...], kind: type[T]) -> T | None:
        found = self._lookups.get(key)
        return None if found is None else kind.FromString(found)

    def _model(self, request: services_pb2.ProfileRequest) -> model_pb2.Model:
        """resolve_model, remembered by id for this caller (a stored model never changes)."""
        if not request.model_id:
            return resolve_model(self._store, request, self._user_inputs)
        key = self._caller_key("model", request.model_id)
        model = self._remembered(key, model_pb2.Model)
        if model is None:
            model = resolve_model(self._store, request, self._user_inputs)
            self._lookups.put(key, model.SerializeToString())
        return model

    def inspect(self, request: services_pb2.InspectRequest) -> services_pb2.Inspection:
        """The model checked against Ballast's rules with its layers (zoo.contract), and its data against the model
        (data.check), built, dry-run and read in a worker process; kept by signature, code version and the data's
        files (their sizes and times), so a resubmitted job is answered at once and a changed file is read again."""
        if not request.HasField("model"):
            raise InvalidArgument("required", field="model", fix="send the ModelSpec to check")
        spec = request.model
        validate_model_spec(spec, self._user_inputs)  # the cheap rules first, with no process started
        validate_data_spec(request.data, self._user_inputs)
        key = f"{model_signature(spec)}|{software(spec, self._user_inputs)}|{data_fingerprint(request.data)}"
        with self._checking(key):  # one worker per model however many Submits of it arrive at once
            known = self._inspections.get(key)
            if known is not None:
                return services_pb2.Inspection.FromString(known)
            _, inspection = worker_result(services_pb2.ProfileRequest(), spec, "inspect", self._user_inputs,
                                          self._worker_command, data=request.data)
            inspection.model.code_version = code_version(spec, self._user_inputs)
            self._inspections.put(key, inspection.SerializeToString())
            return inspection

    @contextlib.contextmanager
    def _checking(self, key: str) -> Iterator[None]:
        with self._lock:
            held = self._checks.setdefault(key, [threading.Lock(), 0])
            held[1] += 1
        try:
            with held[0]:
                yield
        finally:
            with self._lock:
                held[1] -= 1
                if not held[1]:
                    self._checks.pop(key, None)

    def profile(self, request: services_pb2.ProfileRequest) -> profile_pb2.Profile:
        final = None
        for update in self.stream(request):
            final = update
        return final.profile

    def project(self, request: services_pb2.ProjectProfileRequest) -> profile_pb2.Profile:
        check_bounds(request)
        source = self._store.get_profile(store_pb2.GetRequest(id=request.profile_id))
        if not request.HasField("device") or not request.device.kind:
            raise InvalidArgument("required", field="device.kind", fix="name a catalog device, e.g. A100-80GB")
        target = request.device if request.device.peak_flops else request.device.kind
        return self._store.create_profile(
            store_pb2.CreateProfileRequest(profile=projection.project(source, target)))

    def get_profile(self, request: store_pb2.GetRequest) -> profile_pb2.Profile:
        return self._store.get_profile(request)

    def calibrate(self, request: services_pb2.CalibrateRequest, caller: Principal) -> profile_pb2.CommCalibration:
        """Link calibration on this host, in its own process group, taking the profiler's turn: an operator's
        measurement of the fleet's host (platform admin), never a tenant's (a job's profile calibrates its
        links itself, through Profile)."""
        if not caller.admin:
            raise PermissionDenied("link calibration measures this host for the whole fleet: platform admin only",
                                   field="token", fix="ask the platform operator, or profile with "
                                   "options.calibrate for your model")
        # Imported on first use: calibration imports torch, which the server process otherwise never needs.
        from services.profiler import calibrate as cal

        check_calibrate(request)
        kwargs = {"group_sizes": tuple(request.group_sizes) or (2,), "backend": request.backend or None}
        if request.sizes_bytes:
            kwargs["sizes_bytes"] = tuple(request.sizes_bytes)
        with self.turn():
            try:
                return cal.to_proto(cal.calibrate(**kwargs))
            except ValueError as exc:
                raise InvalidArgument(str(exc), field="group_sizes") from None
            except cal.CalibrationError as exc:  # a rank failed or timed out: this host cannot run it now
                raise FailedPrecondition(str(exc), field="group_sizes",
                                         fix="the profiler log has each rank's output; retry with fewer ranks"
                                         ) from None


MAX_CALIBRATE_RANKS = 16  # every rank of a link calibration is a process on this host
MAX_CALIBRATE_BYTES = 1 << 30  # per-rank buffer: each rank allocates it
MAX_CALIBRATE_SIZES = 32
BACKENDS = ("gloo", "nccl")


def check_calibrate(request: services_pb2.CalibrateRequest) -> None:
    """Refuse a link calibration this host cannot run before any process starts: every rank is a local
    process and allocates each buffer size, so counts and sizes are bounded."""
    if request.backend and request.backend not in BACKENDS:
        raise InvalidArgument(f"unknown backend {request.backend[:40]!r}", field="backend",
                              fix="gloo, nccl, or empty for the host's default")
    if any(not 2 <= g <= MAX_CALIBRATE_RANKS for g in request.group_sizes):
        raise InvalidArgument(f"group sizes must be 2..{MAX_CALIBRATE_RANKS} ranks on this host",
                              field="group_sizes", fix=f"use sizes between 2 and {MAX_CALIBRATE_RANKS}")
    if len(request.sizes_bytes) > MAX_CALIBRATE_SIZES or any(
            not 4 <= s <= MAX_CALIBRATE_BYTES for s in request.sizes_bytes):
        raise InvalidArgument(f"at most {MAX_CALIBRATE_SIZES} sizes, each 4 B .. {MAX_CALIBRATE_BYTES >> 20} MiB",
                              field="sizes_bytes", fix="measure fewer or smaller buffers")


def analytical_sizes(request: services_pb2.ProfileRequest) -> list[int]:
    """Micro-batch sizes of an analytical profile: those asked for, else powers of two up to the sweep cap
    (max_micro_batch_size, default 8; the cost model extends the rows linearly beyond them)."""
    if request.options.micro_batch_sizes:
        return sorted(set(request.options.micro_batch_sizes))
    top = request.max_micro_batch_size or 8
    return [1 << i for i in range(top.bit_length()) if 1 << i <= top]


def list_device_kinds() -> services_pb2.ListDeviceKindsResponse:
    return services_pb2.ListDeviceKindsResponse(devices=[catalog.to_proto(e) for e in catalog.DEVICES.values()])


def worker_result(request: services_pb2.ProfileRequest, spec: model_pb2.ModelSpec, mode: str,
                  user_inputs: UserInputs, command: tuple[str, ...] = WORKER_COMMAND,
                  data: job_pb2.DataSpec | None = None) -> tuple[str, Message]:
    """A worker job that answers with one message ("inspect", "analytical"): (its key, the message)."""
    for key, message in worker_messages(request, spec, "cpu", user_inputs, lambda: True, command, mode, data):
        if key != "progress":
            return key, message
    raise Unavailable("the profiler's worker process ended without an answer", fix="retry")


def run_worker(request: services_pb2.ProfileRequest, spec: model_pb2.ModelSpec, device: str,
               user_inputs: UserInputs, active: Callable[[], bool],
               command: tuple[str, ...] = WORKER_COMMAND) -> Iterator[services_pb2.ProfileProgress]:
    """Run the profiling worker; yields its progress and finally a ProfileProgress carrying the profile."""
    for key, message in worker_messages(request, spec, device, user_inputs, active, command, "profile"):
        yield message if key == "progress" else services_pb2.ProfileProgress(profile=message)


RESULTS = {"progress": services_pb2.ProfileProgress, "profile": profile_pb2.Profile,
           "inspection": services_pb2.Inspection}


def worker_messages(request: services_pb2.ProfileRequest, spec: model_pb2.ModelSpec, device: str,
                    user_inputs: UserInputs, active: Callable[[], bool], command: tuple[str, ...],
                    mode: str, data: job_pb2.DataSpec | None = None) -> Iterator[tuple[str, Message]]:
    """Run one worker job; yields (key, message) for its progress and its result, raises its error."""
    job = {"mode": mode, "request": MessageToDict(request), "spec": MessageToDict(spec), "device": device,
           "user_inputs": user_inputs.to_json(), "data": MessageToDict(data or job_pb2.DataSpec())}
    stderr = tempfile.TemporaryFile()  # a file, not a pipe: a chatty worker must never block on it
    env = {**STEADY_ALLOCATOR, **os.environ}
    proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, env=env,
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    error: dict | None = None
    try:
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        for line in proc.stdout:
            if not active():
                proc.kill()
                raise Unavailable("profiling cancelled by the caller")
            message = json.loads(line)
            if "error" in message:
                error = message["error"]
            for key, kind in RESULTS.items():
                if key in message:
                    yield key, ParseDict(message[key], kind())
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.seek(0)
        tail = stderr.read()[-2000:].decode(errors="replace")
        stderr.close()
    if error:
        raise from_code(error.get("code", ""), error.get("message", "profiling failed"),
                        field=error.get("field") or None, fix=error.get("fix") or None)
    if code != 0:
        log.error("profiling worker died", extra={"exit": code, "stderr": tail})
        raise Unavailable(f"the profiling worker died (exit status {code}); nothing was stored",
                          fix="see the profiler log; a negative status is the signal that killed it")
