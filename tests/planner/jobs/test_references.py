"""init_from / resume_from at Submit (planner/jobs/references.py), on every store backend: only the caller's own
jobs, with a kept complete checkpoint; continuing a job keeps its model, global batch, seed and data and counts its
iterations on; starting from weights needs the same architecture. Each refusal names the field and the fix."""

from __future__ import annotations

import pytest

from ballast.v1 import job_pb2, store_pb2
from services.planner.jobs import references
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.store_builders import gpt, job_spec
from tests.store_fixtures import Store, move, new_job

S = job_pb2


def ran(store: Store, iterations=(5, 10), state=S.JOB_STATE_SUCCEEDED, **spec) -> job_pb2.Job:
    """A job of tenant a that ended in `state` with complete checkpoints after `iterations`."""
    job = new_job(store, model=gpt("ref", layers=2), **spec)
    admin = store.as_(store.admin)
    for it in iterations:
        admin.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=job_pb2.Checkpoint(
            job_id=job.id, iteration=it, plan_version=1, complete=True, layers=[job_pb2.LayerCheckpoint(
                layer_index=0, uri=f"/c/{job.id}/iter-{it:08d}/layer-00000.pt")])))
    path = [S.JOB_STATE_PROFILING, S.JOB_STATE_PLANNING, S.JOB_STATE_SCHEDULED, S.JOB_STATE_RUNNING, state]
    for target in path if state == S.JOB_STATE_SUCCEEDED else [state]:
        move(store, job.id, target, who=store.admin)
    return store.as_(store.a).get_job(store_pb2.GetRequest(id=job.id))


def spec_for(source: job_pb2.Job, **fields) -> job_pb2.JobSpec:
    spec = job_pb2.JobSpec()
    spec.CopyFrom(source.spec)
    spec.name = "next"
    for key, value in fields.items():
        setattr(spec, key, value)
    return spec


def refused(store: Store, spec: job_pb2.JobSpec, who=None):
    return lambda: references.check(store.as_(who or store.a), spec)


def test_resume_from_accepts_an_ended_job_of_the_same_run_with_more_iterations(store: Store):
    source = ran(store)
    references.check(store.as_(store.a), spec_for(source, resume_from=source.id, iterations=20))


@pytest.mark.parametrize("change, error, field", [
    ({"iterations": 10}, InvalidArgument, "spec.iterations"),
    ({"global_batch_size": 64}, InvalidArgument, "spec.global_batch_size"),
    ({"seed": 7}, InvalidArgument, "spec.seed"),
])
def test_resume_from_refuses_what_would_not_continue_the_run(store: Store, change, error, field):
    source = ran(store)
    with pytest.raises(error) as info:
        refused(store, spec_for(source, resume_from=source.id, **{"iterations": 20, **change}))()
    assert info.value.field == field and info.value.fix


def test_resume_from_refuses_another_tenants_job_a_running_one_and_one_without_a_checkpoint(store: Store):
    source = ran(store)
    with pytest.raises(NotFound) as info:
        refused(store, spec_for(source, resume_from=source.id, iterations=20), who=store.b)()
    assert info.value.field == "spec.resume_from"
    running = new_job(store, model=gpt("ref", layers=2))
    with pytest.raises(FailedPrecondition, match="JOB_STATE_SUBMITTED"):
        refused(store, spec_for(running, resume_from=running.id, iterations=20))()
    empty = ran(store, iterations=(), state=S.JOB_STATE_CANCELLED)
    with pytest.raises(FailedPrecondition, match="no complete checkpoint"):
        refused(store, spec_for(empty, resume_from=empty.id, iterations=20))()
    other = job_spec("other", model=gpt("other", layers=3))
    other.resume_from, other.iterations = source.id, 20
    with pytest.raises(InvalidArgument) as info:
        refused(store, other)()
    assert info.value.field == "spec.model"


def test_init_from_a_job_needs_its_architecture_and_a_kept_checkpoint(store: Store, tmp_path):
    source = ran(store)
    renamed = spec_for(source, init_from=f"{source.id}:5")
    renamed.model.name, renamed.model.dropout = "fine-tuned", 0.1  # name and dropout may change
    references.check(store.as_(store.a), renamed)
    with pytest.raises(NotFound, match="iteration 7") as info:
        refused(store, spec_for(source, init_from=f"{source.id}:7"))()
    assert "[5, 10]" in info.value.fix
    wider = spec_for(source, init_from=source.id)
    wider.model.transformer.hidden_size *= 2
    with pytest.raises(InvalidArgument, match="architecture"):
        refused(store, wider)()
    assert references.initial_directory(store.as_(store.admin), spec_for(source, init_from=source.id)) == \
        f"/c/{source.id}/iter-00000010"
    with pytest.raises(InvalidArgument, match="model.safetensors") as info:
        refused(store, spec_for(source, init_from=str(tmp_path)))()
    assert info.value.field == "spec.init_from"
    (tmp_path / "model.safetensors").write_bytes(b"x")
    references.check(store.as_(store.a), spec_for(source, init_from=str(tmp_path)))
