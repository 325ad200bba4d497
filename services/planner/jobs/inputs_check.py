"""A user's model and a job's data are checked at Submit, before anything is stored: an allow-listed factory or a
Hugging Face model is built and dry-run, the data's files read against the model, by the profiler in a worker
process (ProfilerService.Inspect: zoo.contract, data.check), so a model or data that breaks a rule is refused
with the rule and the fix, not on a worker at iteration 0. A zoo model on synthetic samples needs no check beyond
the store's validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ballast.v1 import job_pb2, model_pb2, services_pb2
from services.runtime.errors import BallastError, from_code
from services.runtime.remote import call

USER_FAMILIES = (model_pb2.MODEL_FAMILY_CUSTOM, model_pb2.MODEL_FAMILY_HF)
INSPECT_TIMEOUT_S = 25.0  # a first check imports torch (and transformers) in a fresh process: seconds


class InputsCheck:
    """Calls the profiler's Inspect for a user's model or a job's data; the stub is made on first use (`connect`)."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._stub: Any = None

    def __call__(self, spec: job_pb2.JobSpec) -> None:
        if spec.model.family not in USER_FAMILIES and not spec.HasField("data"):
            return
        if self._stub is None:
            self._stub = self._connect()
        try:
            call(self._stub.Inspect, services_pb2.InspectRequest(model=spec.model, data=spec.data),
                 timeout=INSPECT_TIMEOUT_S)
        except BallastError as exc:  # a model's field is the ModelSpec's; the caller sent a JobSpec
            field = exc.field or ""
            if field.startswith("spec.") and not field.startswith("spec.data"):
                field = f"spec.model.{field.removeprefix('spec.')}"
            raise from_code(exc.code, exc.message, field=field or None, fix=exc.fix or None) from None
