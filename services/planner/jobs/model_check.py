"""A user's model is checked at Submit, before anything is stored: an allow-listed factory or a Hugging Face
model is built and dry-run by the profiler in a worker process (ProfilerService.Inspect, zoo.contract), so a
model that breaks a rule is refused with the rule and the fix, not on a worker at iteration 0. Zoo models need
no check beyond the store's validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ballast.v1 import model_pb2, services_pb2
from services.runtime.errors import BallastError, from_code
from services.runtime.remote import call

USER_FAMILIES = (model_pb2.MODEL_FAMILY_CUSTOM, model_pb2.MODEL_FAMILY_HF)
INSPECT_TIMEOUT_S = 25.0  # a first check imports torch (and transformers) in a fresh process: seconds


class ModelCheck:
    """Calls the profiler's Inspect for user models; the profiler stub is made on first use (`connect`)."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._stub: Any = None

    def __call__(self, model: model_pb2.ModelSpec) -> None:
        if model.family not in USER_FAMILIES:
            return
        if self._stub is None:
            self._stub = self._connect()
        try:
            call(self._stub.Inspect, services_pb2.InspectModelRequest(model=model), timeout=INSPECT_TIMEOUT_S)
        except BallastError as exc:  # its field is the ModelSpec's; the caller sent a JobSpec
            field = exc.field or ""
            field = f"spec.model.{field.removeprefix('spec.')}" if field.startswith("spec.") else field
            raise from_code(exc.code, exc.message, field=field or None, fix=exc.fix or None) from None
