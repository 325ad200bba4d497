"""Weights out (`ballast export`, JobService.Export): one of a job's complete checkpoints, consolidated by the export
worker (a process of its own: a user's model code never runs in the planner) into the caller's format, streamed
back in 1 MiB pieces with each file's size and SHA-256, because the caller's machine is not an executor.

Only the caller's own jobs: the job is read as the caller (another tenant's job is NOT_FOUND). The checkpoint is
marked exported before its files are read, so retention keeps it from then on (and never deletes it mid-read)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from ballast.v1 import job_pb2, model_pb2, services_pb2, store_pb2
from services.planner.jobs.retention import checkpoint_directory
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable, from_code
from services.runtime.store_api import Store, every_page
from services.specs.user_inputs import UserInputs

PIECE = 1 << 20
FORMATS = ("safetensors", "torch", "hf")
WORKER = (sys.executable, "-m", "services.executor.train.export")
TIMEOUT_S = 1800.0


def chosen(checkpoints: list[job_pb2.Checkpoint], iteration: int, job_id: str) -> job_pb2.Checkpoint:
    """The complete, kept checkpoint at `iteration` (0: the newest)."""
    kept = sorted((c for c in checkpoints if c.complete and not c.HasField("deleted_at")),
                  key=lambda c: c.iteration, reverse=True)
    if not kept:
        raise FailedPrecondition(f"job {job_id} has no complete checkpoint to export", field="job_id",
                                 fix="a job checkpoints after its last iteration (and every --checkpoint-every); "
                                     "export it once it has run")
    if not iteration:
        return kept[0]
    for c in kept:
        if c.iteration == iteration:
            return c
    raise NotFound(f"job {job_id} keeps no complete checkpoint at iteration {iteration}", field="iteration",
                   fix=f"one of {sorted(c.iteration for c in kept)}, or 0 for the newest")


def export(caller: Store, platform: Store, request: services_pb2.ExportRequest, root: Path,
           user_inputs: UserInputs, command: tuple[str, ...] = WORKER) -> Iterator[services_pb2.ExportChunk]:
    """Stream the export of `request.job_id`'s checkpoint; every check happens before the first piece."""
    fmt = request.format or "safetensors"
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown format {fmt!r}", field="format", fix=f"one of {', '.join(FORMATS)}")
    job = caller.get_job(store_pb2.GetRequest(id=request.job_id))  # NOT_FOUND unless the caller's
    if fmt == "hf" and job.spec.model.family != model_pb2.MODEL_FAMILY_HF:
        raise InvalidArgument("the hf format is a Hugging Face model's save_pretrained directory; this job's model "
                              "is not one", field="format", fix="export it as safetensors or torch")
    rows = [c for page in every_page(caller.list_checkpoints, store_pb2.ListCheckpointsRequest(
        job_id=job.id, complete_only=True)) for c in page.checkpoints]
    checkpoint = chosen(rows, request.iteration, job.id)
    directory = checkpoint_directory(checkpoint)
    if directory is None or directory.resolve().parent != (root / job.id).resolve():
        raise FailedPrecondition(f"checkpoint {checkpoint.id} does not lie in the job's checkpoint directory",
                                 field="iteration", fix="export another checkpoint of the job")
    platform.update_checkpoints(store_pb2.UpdateCheckpointsRequest(job_id=job.id, exported_ids=[checkpoint.id]))
    out = Path(tempfile.mkdtemp(prefix=f"export-{job.id}-"))
    try:
        files = run_worker(command, {"checkpoint": str(directory), "spec": MessageToDict(job.spec.model),
                                     "format": fmt, "out": str(out / "weights"), "user_inputs": user_inputs.to_json(),
                                     "meta": {"job_id": job.id, "checkpoint_id": checkpoint.id}})
        yield from pieces(out / "weights", files, checkpoint)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_worker(command: tuple[str, ...], job: dict) -> list[dict]:
    """The export worker's files, or its error raised as the code it named."""
    try:
        done = subprocess.run(list(command), input=json.dumps(job), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"the export took longer than {TIMEOUT_S:.0f} s", fix="retry") from exc
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    answer = json.loads(lines[-1]) if lines else {}
    if "error" in answer:
        e = answer["error"]
        raise from_code(e.get("code", ""), e.get("message", "export failed"), field=e.get("field") or None,
                        fix=e.get("fix") or None)
    if done.returncode != 0 or "files" not in answer:
        raise Unavailable(f"the export worker died (exit status {done.returncode}): {done.stderr[-500:]}",
                          fix="retry; see the planner's log")
    return answer["files"]


def pieces(folder: Path, files: list[dict], checkpoint: job_pb2.Checkpoint) -> Iterator[services_pb2.ExportChunk]:
    for entry in files:
        with open(folder / entry["name"], "rb") as f:
            offset, first = 0, True
            while True:
                data = f.read(PIECE)
                if not data and not first:
                    break
                chunk = services_pb2.ExportChunk(file=entry["name"], offset=offset, data=data,
                                                 checkpoint_id=checkpoint.id, iteration=checkpoint.iteration)
                if first:
                    chunk.size, chunk.sha256 = entry["bytes"], entry["sha256"]
                yield chunk
                offset += len(data)
                first = False
