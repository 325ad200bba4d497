"""JobService.Export's logic (planner/jobs/export.py) on every store backend, and the client's end (exported.py):
the caller's own job only, the newest kept complete checkpoint unless an iteration is named, the checkpoint marked
exported (so retention keeps it) before it is read, every file streamed in pieces that the client reassembles and
checks against its SHA-256."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ballast import exported
from ballast.errors import ClientError, InvalidInput
from ballast.v1 import job_pb2, services_pb2, store_pb2
from services.executor.train import checkpoint as ckpt
from services.executor.train import weights
from services.executor.train.reference import train_single
from services.planner.jobs import export
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from services.specs.user_inputs import NO_USER_INPUTS
from tests.executor.train.test_hybrid import ADAM, SPEC
from tests.store_fixtures import Store, new_job

ITERATIONS = 2


def checkpointed(store: Store, root) -> job_pb2.Job:
    """A job of tenant a with a complete checkpoint after each of its 2 iterations, recorded as the services do."""
    job = new_job(store, model=SPEC)
    train_single(SPEC, {}, 0, 4, ITERATIONS, ADAM, checkpoint_dir=str(root / job.id), checkpoint_every=1)
    admin = store.as_(store.admin)
    for iteration in range(1, ITERATIONS + 1):
        folder = ckpt.checkpoint_path(root / job.id, iteration)
        manifest = ckpt.read_manifest(folder)
        admin.create_checkpoint(store_pb2.CreateCheckpointRequest(checkpoint=job_pb2.Checkpoint(
            job_id=job.id, iteration=iteration, plan_version=1, complete=True, layers=[
                job_pb2.LayerCheckpoint(layer_index=int(i), uri=(folder / e["file"]).as_uri(), bytes=e["bytes"],
                                        sha256=e["sha256"]) for i, e in manifest["layers"].items()])))
    return job


def run(store: Store, root, who, **request) -> list[services_pb2.ExportChunk]:
    return list(export.export(store.as_(who), store.as_(store.admin), services_pb2.ExportRequest(**request), root,
                              NO_USER_INPUTS))


def test_export_streams_the_newest_checkpoint_of_the_callers_own_job(store: Store, tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    job = checkpointed(store, root)
    monkeypatch.setattr(export, "PIECE", 4096)  # several pieces per file
    pieces = run(store, root, store.a, job_id=job.id)
    assert {p.iteration for p in pieces} == {ITERATIONS} and len(pieces) > 2
    done = exported.receive(pieces, tmp_path / "out")
    assert set(done.files) == {weights.WEIGHTS, weights.META} and done.iteration == ITERATIONS
    expected, _ = weights.checkpoint_weights(ckpt.checkpoint_path(root / job.id, ITERATIONS), SPEC, NO_USER_INPUTS)
    state = load_file(str(tmp_path / "out" / weights.WEIGHTS))
    assert sorted(state) == sorted(expected) and all(torch.equal(state[k], expected[k]) for k in state)
    rows = store.as_(store.a).list_checkpoints(store_pb2.ListCheckpointsRequest(job_id=job.id)).checkpoints
    assert [c.iteration for c in rows if c.HasField("exported_at")] == [ITERATIONS]
    # an older one by its iteration, as a torch state dict
    older = exported.receive(run(store, root, store.a, job_id=job.id, iteration=1, format="torch"),
                             tmp_path / "older")
    assert older.iteration == 1 and weights.TORCH_WEIGHTS in older.files


def test_export_refuses_another_tenants_job_a_missing_iteration_and_a_bad_format(store: Store, tmp_path):
    root = tmp_path / "checkpoints"
    job = checkpointed(store, root)
    with pytest.raises(NotFound):
        run(store, root, store.b, job_id=job.id)
    with pytest.raises(NotFound, match="iteration 7") as info:
        run(store, root, store.a, job_id=job.id, iteration=7)
    assert info.value.field == "iteration" and "[1, 2]" in info.value.fix
    with pytest.raises(InvalidArgument) as bad:
        run(store, root, store.a, job_id=job.id, format="onnx")
    assert bad.value.field == "format"
    with pytest.raises(InvalidArgument, match="save_pretrained"):
        run(store, root, store.a, job_id=job.id, format="hf")
    fresh = new_job(store, model=SPEC)
    with pytest.raises(FailedPrecondition, match="no complete checkpoint"):
        run(store, root, store.a, job_id=fresh.id)
    rows = store.as_(store.a).list_checkpoints(store_pb2.ListCheckpointsRequest(job_id=job.id)).checkpoints
    assert not [c for c in rows if c.HasField("exported_at")]  # a refusal marks nothing
    # the worker's own refusal comes back whole, naming its field (a checkpoint file gone from disk)
    ckpt.checkpoint_path(root / job.id, ITERATIONS).joinpath("manifest.json").unlink()
    with pytest.raises(FailedPrecondition, match="manifest.json"):
        run(store, root, store.a, job_id=job.id)


def test_the_client_refuses_a_non_empty_directory_and_a_piece_that_does_not_match(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(InvalidInput) as info:
        exported.target(tmp_path / "full")
    assert info.value.field == "out"
    bad = [services_pb2.ExportChunk(file="model.safetensors", data=b"abc", size=3, sha256="0" * 64)]
    with pytest.raises(ClientError, match="sha256"):
        exported.receive(bad, tmp_path / "bad")
    assert list((tmp_path / "bad").iterdir()) == []  # nothing half-written keeps its name
    with pytest.raises(ClientError, match="named"):
        exported.receive([services_pb2.ExportChunk(file="../x")], tmp_path / "bad")
