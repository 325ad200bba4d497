"""A job that starts from another's weights (JobSpec.init_from) or continues another (JobSpec.resume_from): checked at
Submit, as the caller (only the caller's own jobs are found), before anything is stored; resolved to a checkpoint
directory when the job is first assigned.

Continuing a job keeps what its checkpoint's state depends on: the model, the global batch, the seed and the data
(so the data order and the position in it carry on), and counts iterations on from the checkpoint's. Starting from
weights needs only the same architecture: the name, dropout and precision may change."""

from __future__ import annotations

from pathlib import Path

from google.protobuf.json_format import MessageToDict

from ballast.v1 import job_pb2, model_pb2, store_pb2
from services.planner.jobs.retention import checkpoint_directory
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from services.runtime.store_api import Store, every_page
from services.specs.model import JOB_REF

TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED)
EXPORTED = ("model.safetensors", "manifest.json")  # an export, or a checkpoint directory


def referenced(store: Store, job_id: str, field: str) -> job_pb2.Job:
    try:
        return store.get_job(store_pb2.GetRequest(id=job_id))
    except NotFound:
        raise NotFound(f"job {job_id} not found", field=field, fix="name a job of yours (`ballast jobs`)") from None


def kept_checkpoint(store: Store, job: job_pb2.Job, iteration: int, field: str) -> job_pb2.Checkpoint:
    """The job's complete checkpoint at `iteration` (0: its newest) whose files are kept."""
    rows = [c for page in every_page(store.list_checkpoints, store_pb2.ListCheckpointsRequest(
        job_id=job.id, complete_only=True)) for c in page.checkpoints if not c.HasField("deleted_at")]
    if not rows:
        raise FailedPrecondition(f"job {job.id} has no complete checkpoint", field=field,
                                 fix="name a job that ran (jobs checkpoint after their last iteration)")
    if not iteration:
        return max(rows, key=lambda c: c.iteration)
    for c in rows:
        if c.iteration == iteration:
            return c
    raise NotFound(f"job {job.id} keeps no complete checkpoint at iteration {iteration}", field=field,
                   fix=f"one of {sorted(c.iteration for c in rows)}, or the job alone for its newest")


def architecture(spec: model_pb2.ModelSpec) -> bytes:
    """What weights depend on: the spec without its name, dropout and precision."""
    plain = model_pb2.ModelSpec()
    plain.CopyFrom(spec)
    plain.ClearField("name")
    plain.dropout = 0.0
    plain.ClearField("dtype")
    return plain.SerializeToString(deterministic=True)


def check(store: Store, spec: job_pb2.JobSpec) -> None:
    """Refuse a reference that cannot be honoured (NOT_FOUND, FAILED_PRECONDITION or INVALID_ARGUMENT, naming the
    field and the fix); a malformed one is left to the spec's own validation."""
    if spec.resume_from and JOB_REF.match(spec.resume_from):
        _check_resume(store, spec)
    if not spec.init_from:
        return
    match = JOB_REF.match(spec.init_from)
    if match is None:
        folder = Path(spec.init_from)
        if folder.is_absolute() and not any((folder / name).is_file() for name in EXPORTED):
            raise InvalidArgument(f"{spec.init_from} holds no exported weights (model.safetensors) and no checkpoint "
                                  "(manifest.json)", field="spec.init_from",
                                  fix="give the directory `ballast export` wrote (the safetensors format)")
        return
    field = "spec.init_from"
    source = referenced(store, match.group(1), field)
    kept_checkpoint(store, source, int(match.group(2) or 0), field)
    if architecture(source.spec.model) != architecture(spec.model):
        raise InvalidArgument(f"job {source.id} trained another model architecture than this job's", field=field,
                              fix="start from a job of the same model (its name, dropout and dtype may differ)")


def _check_resume(store: Store, spec: job_pb2.JobSpec) -> None:
    field = "spec.resume_from"
    source = referenced(store, spec.resume_from, field)
    if source.state not in TERMINAL:
        raise FailedPrecondition(f"job {source.id} is {job_pb2.JobState.Name(source.state)}", field=field,
                                 fix="continue a job once it has ended (`ballast cancel` it first to stop it now)")
    checkpoint = kept_checkpoint(store, source, 0, field)
    for name, theirs, ours in (
            ("model", source.spec.model.SerializeToString(deterministic=True),
             spec.model.SerializeToString(deterministic=True)),
            ("global_batch_size", source.spec.global_batch_size, spec.global_batch_size),
            ("seed", source.spec.seed, spec.seed),
            ("data", MessageToDict(source.spec.data), MessageToDict(spec.data))):
        if theirs != ours:
            raise InvalidArgument(f"job {source.id} trained with another {name}", field=f"spec.{name}",
                                  fix=f"continue it with its own {name} (or start from its weights: init_from)")
    if spec.iterations <= checkpoint.iteration:
        raise InvalidArgument(f"job {source.id}'s checkpoint is at iteration {checkpoint.iteration}",
                              field="spec.iterations", fix=f"more than {checkpoint.iteration}: iterations counts on "
                                                           "from the job's")


def initial_directory(store: Store, spec: job_pb2.JobSpec) -> str:
    """JobSpec.init_from as the workers load it: a job's checkpoint directory, or the directory given."""
    match = JOB_REF.match(spec.init_from)
    if match is None:
        return spec.init_from
    source = referenced(store, match.group(1), "spec.init_from")
    directory = checkpoint_directory(kept_checkpoint(store, source, int(match.group(2) or 0), "spec.init_from"))
    if directory is None:
        raise FailedPrecondition(f"job {source.id}'s checkpoint has no single directory", field="spec.init_from",
                                 fix="start from another of its checkpoints")
    return str(directory)
