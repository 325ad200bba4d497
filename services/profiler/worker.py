"""Profiling worker process: `python -m services.profiler.worker`, one profile per process.

The profiler service spawns this so that an out-of-memory kill or a crash inside a kernel takes down
only this process, and nothing half-done is stored. Protocol, JSON only (never pickle):

* stdin: one JSON object {"mode": "profile" | "inspect" | "analytical", "request": ProfileRequest,
  "spec": ModelSpec, "user_inputs": {"factories": [...], "path": [...]}, "device": "cpu"}, messages as
  `MessageToDict` writes them. "profile" (the default) measures; "inspect" checks a user's model against the
  rules (zoo.contract); "analytical" prices it from FLOP and byte counts for request.device_kind at the
  request's micro-batch sizes: user code (a factory, transformers) runs here, never in the service.
* stdout: JSON lines, {"progress": ProfileProgress} while measuring, then exactly one of {"profile": Profile}
  or {"inspection": Inspection} (exit 0), or {"error": {"code": "INVALID_ARGUMENT" | ..., "message",
  "field", "fix"}} (exit 1).
  Codes are BallastError codes; any other exception is INTERNAL, named by its type.
* stderr: logs. Anything else that writes to sys.stdout while profiling is diverted there, so stdout
  carries nothing but the protocol.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

from google.protobuf.json_format import MessageToDict, ParseDict, ParseError
from google.protobuf.message import Message

from ballast.v1 import job_pb2, model_pb2, services_pb2
from services.runtime.errors import BallastError, InvalidArgument
from services.specs.user_inputs import UserInputs

log = logging.getLogger("ballast.profiler.worker")
MODES = ("profile", "inspect", "analytical")


def _emit(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message, separators=(",", ":")) + "\n")
    out.flush()


def parse_job(text: str) -> dict[str, Any]:
    """The job object with `request` and `spec` parsed; InvalidArgument naming what is wrong."""
    try:
        job = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"not JSON: {exc}", field="stdin", fix="write one JSON object") from exc
    if not isinstance(job, dict):
        raise InvalidArgument("expected a JSON object", field="stdin", fix='{"request": ..., "spec": ...}')
    parsed: dict[str, Any] = {}
    for key, message in (("request", services_pb2.ProfileRequest()), ("spec", model_pb2.ModelSpec()),
                         ("data", job_pb2.DataSpec())):
        try:
            parsed[key] = ParseDict(job.get(key) or {}, message)
        except ParseError as exc:
            fix = f"pass a {type(message).__name__} as MessageToDict writes it"
            raise InvalidArgument(str(exc), field=key, fix=fix) from exc
    try:
        parsed["user_inputs"] = UserInputs.from_json(job.get("user_inputs") or {})
    except ValueError as exc:
        raise InvalidArgument(str(exc), field="user_inputs", fix='{"factories": [...], "path": [...]}') from exc
    parsed["device"] = str(job.get("device") or "cpu")
    parsed["mode"] = job.get("mode") or "profile"
    if parsed["mode"] not in MODES:
        raise InvalidArgument(f"unknown mode {parsed['mode']!r}", field="mode", fix=f"one of {list(MODES)}")
    return parsed


def answer(job: dict[str, Any], out: TextIO) -> tuple[str, Message]:
    """The job's result message, under its key in the protocol."""
    if job["mode"] == "inspect":
        from services.data.check import inspect_data  # imports torch: after stdout is diverted
        from services.zoo.contract import inspect_model

        model = inspect_model(job["spec"], job["user_inputs"])
        return "inspection", services_pb2.Inspection(model=model, data=inspect_data(job["spec"], job["data"],
                                                                                     job["user_inputs"]))
    if job["mode"] == "analytical":
        from services.profiler import projection

        request = job["request"]
        return "profile", projection.analytical_profile(job["spec"], request.device_kind, request.dtype or None,
                                                        sorted(request.options.micro_batch_sizes),
                                                        user_inputs=job["user_inputs"])
    from services.profiler import driver

    return "profile", driver.profile(job["spec"], job["request"], device=job["device"],
                                     user_inputs=job["user_inputs"],
                                     progress=lambda p: _emit(out, {"progress": MessageToDict(p)}))


def run(stdin: TextIO, out: TextIO) -> int:
    """Read the job, run it, write the result; returns the exit status."""
    try:
        job = parse_job(stdin.read())
        key, result = answer(job, out)
    except BallastError as exc:
        log.info("profiling refused: %s", exc)
        # its parts, so the RPC's answer names the field and the fix as an in-process error would
        _emit(out, {"error": {"code": exc.code, "message": exc.message, "field": exc.field, "fix": exc.fix}})
        return 1
    except Exception as exc:
        log.exception("profiling failed")
        _emit(out, {"error": {"code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}"}})
        return 1
    _emit(out, {key: MessageToDict(result)})
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints (libraries, warnings) must not corrupt the protocol
    try:
        return run(sys.stdin, out)
    finally:
        sys.stdout = out


if __name__ == "__main__":
    raise SystemExit(main())
