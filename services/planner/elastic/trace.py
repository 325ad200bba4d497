"""Job traces for the fleet simulator: the CSV format, its validation, and a seeded generator.

Header: name,submit_time_s,model,global_batch_size,iterations,requested_devices,min_devices,max_devices,tenant,
priority. `requested_devices` is what a static scheduler gives the job; [min_devices, max_devices] is the
range an elastic scheduler may resize it within (its global batch never changes); `priority` is any integer,
higher first. A bad trace is refused whole, naming the line and column, so nothing partially simulated is
ever reported as a result.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Collection, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

from services.runtime.errors import InvalidArgument

COLUMNS = ("name", "submit_time_s", "model", "global_batch_size", "iterations", "requested_devices", "min_devices",
           "max_devices", "tenant", "priority")
RENAMED = {"global_batch": "global_batch_size"}  # traces written before 2026-11-29 name the column so
_COUNTS = ("global_batch_size", "iterations", "requested_devices", "min_devices", "max_devices")


class TraceError(InvalidArgument):
    """A trace that cannot be replayed; `line` is 1-based (the header is line 1), `field` the column."""

    def __init__(self, line: int, field: str, message: str, fix: str):
        super().__init__(f"line {line}: {message}", field=field, fix=fix)
        self.line = line


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace, as submitted."""

    name: str
    submit_time_s: float
    model: str
    global_batch_size: int
    iterations: int
    requested_devices: int
    min_devices: int
    max_devices: int
    tenant: str
    priority: int


def parse_trace(text: str, known_models: Collection[str], fleet_devices: int) -> list[TraceJob]:
    """The jobs of a CSV trace, in file order; raises TraceError at the first bad line or field."""
    reader = csv.reader(io.StringIO(text))
    header = [RENAMED.get(h.strip(), h.strip()) for h in next(reader, [])]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise TraceError(1, missing[0], f"header lacks column {missing[0]!r}",
                         f"the header must name every column: {','.join(COLUMNS)}")
    index = {c: header.index(c) for c in COLUMNS}
    jobs: list[TraceJob] = []
    seen: dict[str, int] = {}
    for row in reader:
        line = reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        job = _job(row, index, line, known_models, fleet_devices)
        if job.name in seen:
            raise TraceError(line, "name", f"job name {job.name!r} repeats line {seen[job.name]}",
                             "give every job a unique name")
        seen[job.name] = line
        jobs.append(job)
    if not jobs:
        raise TraceError(1, "name", "the trace has no jobs", "add one row per job under the header")
    return jobs


def _job(row: list[str], index: dict[str, int], line: int, known_models: Collection[str], fleet: int) -> TraceJob:
    def cell(column: str) -> str:
        i = index[column]
        if i >= len(row) or not row[i].strip():
            raise TraceError(line, column, f"{column} is missing", f"give every row a value for {column}")
        return row[i].strip()

    def count(column: str) -> int:
        raw = cell(column)
        try:
            value = int(raw)
        except ValueError:
            raise TraceError(line, column, f"{column} {raw!r} is not an integer", "write a whole number") from None
        if value < 1:
            raise TraceError(line, column, f"{column} is {value}", f"{column} must be at least 1")
        return value

    for column in sorted(COLUMNS, key=index.__getitem__):  # a short row names its first missing column
        cell(column)
    raw_time = cell("submit_time_s")
    try:
        submit = float(raw_time)
    except ValueError:
        raise TraceError(line, "submit_time_s", f"submit_time_s {raw_time!r} is not a number",
                         "write seconds from the trace's start, e.g. 12.5") from None
    if not math.isfinite(submit) or submit < 0:
        raise TraceError(line, "submit_time_s", f"submit_time_s is {raw_time}",
                         "submit times are seconds from the trace's start: finite and >= 0")
    model = cell("model")
    if model not in known_models:
        names = ", ".join(sorted(known_models)[:8])
        raise TraceError(line, "model", f"unknown model {model!r}", f"name a zoo model or example: {names}")
    raw_priority = cell("priority")
    try:
        priority = int(raw_priority)
    except ValueError:
        raise TraceError(line, "priority", f"priority {raw_priority!r} is not an integer",
                         "write a whole number (higher runs first)") from None
    n = {c: count(c) for c in _COUNTS}
    lo, want, hi = n["min_devices"], n["requested_devices"], n["max_devices"]
    if want > fleet:
        raise TraceError(line, "requested_devices", f"requests {want} devices; the fleet has {fleet}",
                         f"request at most {fleet} devices or simulate a larger fleet")
    if hi > fleet:
        raise TraceError(line, "max_devices", f"max_devices {hi} is more than the fleet's {fleet} devices",
                         f"cap max_devices at {fleet}")
    if lo > hi:
        raise TraceError(line, "min_devices", f"min_devices {lo} > max_devices {hi}",
                         "min_devices must not exceed max_devices")
    if not lo <= want <= hi:
        raise TraceError(line, "requested_devices", f"requested_devices {want} outside [{lo}, {hi}]",
                         "request a count between min_devices and max_devices")
    return TraceJob(cell("name"), submit, model, n["global_batch_size"], n["iterations"], want, lo, hi, cell("tenant"),
                    priority)


def write_trace(jobs: Sequence[TraceJob], path: str | Path | None = None) -> str:
    """The CSV text of `jobs` (written to `path` too when given); parse_trace reads it back unchanged."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for job in jobs:
        row = list(astuple(job))
        row[1] = repr(float(job.submit_time_s))
        writer.writerow(row)
    text = out.getvalue()
    if path is not None:
        Path(path).write_text(text)
    return text


def generate_trace(
    jobs: int,
    seed: int,
    models: Sequence[str],
    *,
    fleet_devices: int = 64,
    mean_interarrival_s: float = 120.0,
    median_iterations: float = 2000.0,
    iterations_sigma: float = 1.2,
    global_batches: Sequence[int] = (64, 128, 256),
    tenants: Sequence[str] = ("prod", "research", "vision"),
    priorities: Sequence[int] = (0, 0, 0, 10),
    start_s: float = 0.0,
    max_request: int | None = None,
    sizes: Sequence[int] | None = None,
    median_samples: float | None = None,
) -> list[TraceJob]:
    """A synthetic trace: Poisson arrivals, log-normal (heavy-tailed) iteration counts, and device
    requests drawn from `sizes` (default the powers of two up to `max_request`, itself half the fleet by
    default, so no request alone blocks the whole fleet), small ones likelier (as in production traces), with
    min/max a power-of-two factor below/above (max capped at the fleet). With `median_samples` a job's length
    is drawn in samples (log-normal) and divided by its batch, so large batches run fewer iterations, as in
    traces of jobs training to a target. The same arguments give the same trace."""
    if jobs < 1 or not models or fleet_devices < 1:
        raise InvalidArgument("needs at least one job, one model and one device", field="jobs",
                              fix="pass jobs >= 1, a model name and fleet_devices >= 1")
    if sizes is not None and (not sizes or any(n < 1 or n > fleet_devices for n in sizes)):
        raise InvalidArgument(f"request sizes {list(sizes)} outside 1..{fleet_devices}", field="sizes",
                              fix=f"draw requests between 1 and the fleet's {fleet_devices} devices")
    rng = random.Random(seed)
    top = max_request or max(1, fleet_devices // 2)
    if sizes is None:
        sizes = [1 << i for i in range(fleet_devices.bit_length()) if 1 << i <= min(fleet_devices, top)]
    sizes = sorted(set(sizes))
    weights = [1.0 / (i + 1) for i in range(len(sizes))]
    width = len(str(jobs - 1))
    t = start_s
    out = []
    for i in range(jobs):
        t += rng.expovariate(1.0 / mean_interarrival_s)
        want = rng.choices(sizes, weights)[0]
        lo = max(1, want >> rng.choice((0, 1, 2)))
        hi = min(fleet_devices, want << rng.choice((0, 1, 2, 2)))
        length = rng.lognormvariate(math.log(median_samples or median_iterations), iterations_sigma)
        model, batch = rng.choice(list(models)), rng.choice(list(global_batches))
        iterations = max(1, round(length / batch if median_samples else length))
        out.append(TraceJob(f"job-{i:0{width}d}", round(t, 3), model, batch, iterations, want, lo, hi,
                            rng.choice(list(tenants)), rng.choice(list(priorities))))
    return out
