"""What the SDK (`ballast.Client`'s typed methods) and the CLI share: option vocabularies, spec and request
builders, job states, SQL results. Pure: protos and values in, protos and values out, no calls.

The CLI turns flags into these arguments; the SDK takes them from Python. Errors name the parameter and the
fix (`InvalidInput`), before anything is sent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from ballast.errors import InvalidInput
from ballast.specfile import read_data_spec, read_model_spec
from ballast.v1 import common_pb2, fleet_pb2, job_pb2, model_pb2, plan_pb2, services_pb2, store_pb2

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
ENGINES = {"galvatron": plan_pb2.PLAN_ENGINE_GALVATRON, "varuna": plan_pb2.PLAN_ENGINE_VARUNA,
           "harmony": plan_pb2.PLAN_ENGINE_HARMONY, "patrickstar": plan_pb2.PLAN_ENGINE_PATRICKSTAR}
SCHEDULES = {"gpipe": plan_pb2.SCHEDULE_GPIPE, "1f1b": plan_pb2.SCHEDULE_1F1B, "varuna": plan_pb2.SCHEDULE_VARUNA}
DTYPES = {"fp32": common_pb2.DTYPE_FP32, "fp16": common_pb2.DTYPE_FP16, "bf16": common_pb2.DTYPE_BF16}
TOKEN_DTYPES = {"uint16": job_pb2.TOKEN_DTYPE_UINT16, "uint32": job_pb2.TOKEN_DTYPE_UINT32}
PROFILE_KINDS = ("auto", "measured", "projected", "analytical")
LOCAL_DEVICE = "cpu"  # the device this host measures
# `ballast profile`'s defaults, shared so that `ballast plan` and `Client.plan` profile as it would
REPEATS = 5  # timed repeats per measurement
THREADS = 1  # intra-op threads while measuring

S = job_pb2.JobState
STATES = {name.removeprefix("JOB_STATE_").lower(): value for name, value in S.items() if value}
# A job admitted at once goes SCHEDULED -> RUNNING; one that waits for devices passes through QUEUED (and goes
# back to it when preempted), so following `until="queued"` stops once the job is queued or already past it.
ORDER = [S.JOB_STATE_SUBMITTED, S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING, S.JOB_STATE_SCHEDULED,
         S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING, S.JOB_STATE_SUCCEEDED]
BAD_END = (S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
ENDED = (S.JOB_STATE_SUCCEEDED, *BAD_END)


def parse_bytes(text: str) -> int:
    """'16GiB' -> 16 * 2**30, '16GB' -> 16 * 10**9, '123' -> 123 (units as written, never guessed)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"cannot read {text!r} as bytes (e.g. 16GiB, 16GB, 800MiB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def memory_bytes(value: int | str, field: str = "memory") -> int:
    """Bytes from an int or a size with its unit ('16GiB'); InvalidInput naming `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidInput(f"expected bytes or a size such as '16GiB', got {value!r}", field=field)
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError as exc:
            raise InvalidInput(str(exc), field=field) from None  # the message shows how to write it
    if value < 0:
        raise InvalidInput(f"must not be negative, got {value}", field=field, fix="0 means the device's memory")
    return value


def choice(table: dict[str, int], value: str | None, field: str) -> int:
    """The enum a name stands for (None or '' is 0: let the planner choose); InvalidInput lists the names."""
    if not value:
        return 0
    if value.lower() not in table:
        raise InvalidInput(f"unknown {field} {value!r}", field=field, fix=f"use one of {', '.join(sorted(table))}")
    return table[value.lower()]


def model_spec(model: model_pb2.ModelSpec | str | os.PathLike[str]) -> model_pb2.ModelSpec:
    """A ModelSpec as given, or read from a YAML (or JSON) file: field names as in the proto, enums by name.
    The control plane validates it; this only reads it."""
    if isinstance(model, model_pb2.ModelSpec):
        return model
    if not isinstance(model, str | os.PathLike):
        raise InvalidInput(f"expected a ModelSpec or the path of a spec file, got {type(model).__name__}",
                           field="model")
    return read_model_spec(model)


def device_range_problem(low: int | None, high: int | None, *, flags: bool = False) -> str | None:
    """Why a device range cannot be, or None. Names the options as flags (`--min-devices 2`, the CLI's) or as
    keyword arguments (`min_devices=2`, the SDK's)."""
    def opt(name: str, value: int | str) -> str:
        return f"--{name.replace('_', '-')} {value}" if flags else f"{name}={value}"

    def bare(name: str) -> str:
        return f"--{name.replace('_', '-')}" if flags else name

    if low is None and high is None:
        return None
    if high is None:
        return (f"{opt('min_devices', low)} needs {bare('max_devices')} too: give both (e.g. {opt('min_devices', low)} "
                f"{opt('max_devices', low)} for exactly {low}), or neither to run on the devices the plan needs")
    if low is None:
        return (f"{opt('max_devices', high)} needs {bare('min_devices')} too: give both (e.g. {opt('min_devices', 1)} "
                f"{opt('max_devices', high)} for any count up to {high}), or neither to run on the devices the plan "
                "needs")
    if low > high:
        return (f"{opt('min_devices', low)} is above {opt('max_devices', high)}: the range must have "
                f"{bare('min_devices')} <= {bare('max_devices')}, e.g. {opt('min_devices', high)} "
                f"{opt('max_devices', low)}")
    return None


def _count(value: int, field: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidInput(f"must be a whole number >= {least}, got {value!r}", field=field)
    return value


def job_spec(model: model_pb2.ModelSpec | str | os.PathLike[str], *, batch: int = 8, iterations: int = 20,
             fleet: fleet_pb2.Fleet | None = None, name: str = "", seed: int = 0, memory: int | str = 0,
             engine: str | None = None, schedule: str | None = None, stages: int = 0, online: bool = False,
             toggles: Iterable[job_pb2.LayerToggle] = (), priority: str = "", min_devices: int | None = None,
             max_devices: int | None = None, micro_batches: int = 0, checkpoint_every: int = 0,
             elastic: bool = False, data: job_pb2.DataSpec | str | os.PathLike[str] | None = None,
             eval_every: int = 0, eval_batches: int = 0, keep_checkpoints: int = 0, init_from: str = "",
             resume_from: str = "", raw_metrics: bool = False) -> job_pb2.JobSpec:
    """The JobSpec `ballast submit` sends, from values (see its flags); InvalidInput before anything is sent.
    `data` is a DataSpec or the path of its YAML (docs/data.md); `token_data` makes one for a token file."""
    problem = device_range_problem(min_devices, max_devices)
    if problem:
        raise InvalidInput(problem, field="max_devices" if max_devices is None else "min_devices")
    if elastic and min_devices is None:
        raise InvalidInput("an elastic job is resized within its device range: give min_devices and max_devices",
                           field="min_devices", fix="e.g. elastic=True, min_devices=1, max_devices=4")
    for field, value, least in (("batch", batch, 1), ("iterations", iterations, 1), ("stages", stages, 0),
                                ("micro_batches", micro_batches, 0), ("checkpoint_every", checkpoint_every, 0),
                                ("min_devices", min_devices or 1, 1), ("max_devices", max_devices or 1, 1),
                                ("eval_every", eval_every, 0), ("eval_batches", eval_batches, 0),
                                ("keep_checkpoints", keep_checkpoints, 0)):
        _count(value, field, least)
    spec = model_spec(model)
    job = job_pb2.JobSpec(name=name or spec.name, model=spec, global_batch_size=batch, iterations=iterations,
                          seed=seed, memory_budget_bytes=memory_bytes(memory),
                          engine=choice(ENGINES, engine, "engine"), schedule=choice(SCHEDULES, schedule, "schedule"),
                          online_repartition=online, layer_toggles=list(toggles), pipeline_stages=stages,
                          priority_class=priority, min_devices=min_devices or 0, max_devices=max_devices or 0,
                          micro_batches=micro_batches, checkpoint_every=checkpoint_every, elastic=elastic,
                          eval_every=eval_every, eval_batches=eval_batches, keep_checkpoints=keep_checkpoints,
                          init_from=weights_source(init_from), resume_from=resume_from, raw_metrics=raw_metrics)
    if fleet is not None:
        job.fleet.CopyFrom(fleet)
    if data is not None:
        job.data.CopyFrom(data_spec(data))
    return job


def weights_source(init_from: str | os.PathLike[str]) -> str:
    """`init_from` as the services read it: a job reference as given ("job-…", "job-…:ITERATION"), a local
    directory of weights made absolute (the services read it at that path, not from the caller's directory)."""
    text = os.fspath(init_from)
    if not text or text.startswith("job-"):
        return text
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() else text


def data_spec(data: job_pb2.DataSpec | str | os.PathLike[str]) -> job_pb2.DataSpec:
    """A DataSpec as given, or read from its YAML file (tokens:, hf_dataset: or factory:); relative paths in the
    file are taken from the file's directory and made absolute (the services read them there)."""
    if isinstance(data, job_pb2.DataSpec):
        return data
    return read_data_spec(data)


def token_data(path: str | os.PathLike[str], validation: str | os.PathLike[str] | None = None,
               dtype: str = "uint16") -> job_pb2.DataSpec:
    """Data from a flat file of token ids (and one held out for evaluation), paths made absolute."""
    if dtype.lower() not in TOKEN_DTYPES:
        raise InvalidInput(f"unknown token dtype {dtype!r}", field="dtype", fix=f"one of {', '.join(TOKEN_DTYPES)}")
    return job_pb2.DataSpec(tokens=job_pb2.TokenFile(
        path=str(Path(path).expanduser().resolve()), dtype=TOKEN_DTYPES[dtype.lower()],
        validation_path=str(Path(validation).expanduser().resolve()) if validation else ""))


def job_state(until: str | int | None) -> int | None:
    """A state to stop at: 'scheduled', 'JOB_STATE_SCHEDULED' or the enum value; None: the end."""
    if until is None or until == "":
        return None
    if isinstance(until, int) and until in STATES.values():
        return until
    text = str(until).lower().removeprefix("job_state_")
    if text not in STATES:
        raise InvalidInput(f"unknown job state {until!r}", field="until", fix=f"use one of {', '.join(STATES)}")
    return STATES[text]


def reached(state: int, target: int | None) -> bool:
    """True once a job in `state` is done, or at or past `target` on the way to SUCCEEDED."""
    if state in ENDED:
        return True
    return target is not None and state in ORDER and target in ORDER and ORDER.index(state) >= ORDER.index(target)


def profile_request(spec: model_pb2.ModelSpec, *, device: str = LOCAL_DEVICE, project_to: str = "",
                    refresh: bool = False, dtype: int = 0, max_micro_batch: int = 0, memory_cap_bytes: int = 0,
                    repeats: int = REPEATS, stride: int = 0, threads: int = THREADS,
                    micro_batch_sizes: Sequence[int] = (), calibrate: bool = False,
                    time_budget_s: float = 0.0) -> services_pb2.ProfileRequest:
    """The ProfileRequest `ballast profile` sends for these values (its defaults)."""
    return services_pb2.ProfileRequest(
        model=spec, device_kind=device, project_to=project_to, refresh=refresh, dtype=dtype,
        max_micro_batch_size=max_micro_batch, memory_cap_bytes=memory_cap_bytes, time_budget_s=time_budget_s,
        options=services_pb2.ProfileOptions(repeats=repeats, stride=stride, intra_op_threads=threads,
                                            micro_batch_sizes=micro_batch_sizes, calibrate=calibrate),
    )


def profile_kind(choice_: str, device_kind: str) -> str:
    """auto: measured when the fleet's device is this host's (cpu), else analytical."""
    if choice_ not in PROFILE_KINDS:
        raise InvalidInput(f"unknown profile kind {choice_!r}", field="profile",
                           fix=f"use one of {', '.join(PROFILE_KINDS)}")
    if choice_ != "auto":
        return choice_
    return "measured" if device_kind == LOCAL_DEVICE else "analytical"


def plan_profile_request(spec: model_pb2.ModelSpec, micro_batch_sizes: Sequence[int], kind: str, device_kind: str,
                         dtype: int) -> services_pb2.ProfileRequest:
    """The profile a plan for `device_kind` is priced on, of the chosen kind."""
    if kind == "measured" and device_kind != LOCAL_DEVICE:
        raise InvalidInput(f"this host measures {LOCAL_DEVICE}, not {device_kind}", field="profile",
                           fix="use profile='analytical' or 'projected', or plan where that device is")
    request = profile_request(spec, micro_batch_sizes=micro_batch_sizes, dtype=dtype)
    if kind == "analytical":
        request.analytical, request.device_kind = True, device_kind
    elif kind == "projected":
        request.project_to = device_kind
    return request


def plain(value: Any) -> Any:
    """Numbers travel as doubles in a ListValue: integral ones become ints again."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass(frozen=True)
class SqlResult:
    """A read-only query's answer: column names, rows of plain Python values, and whether the row limit cut it."""

    columns: list[str]
    rows: list[list[Any]]
    truncated: bool

    def dicts(self) -> list[dict[str, Any]]:
        """One dict per row, by column name."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    @classmethod
    def of(cls, reply: store_pb2.QueryResponse) -> SqlResult:
        return cls(list(reply.columns), [[plain(v) for v in MessageToDict(r)] for r in reply.rows], reply.truncated)
