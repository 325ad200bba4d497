"""Checkpoints written in the background (issue 16, Varuna §4.5): the boundary copies the tensors, a thread
writes them while training goes on, rank 0 vouches for the whole checkpoint once every layer is on disk."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import replace

import pytest
import torch
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import model_pb2
from services.executor.train import checkpoint as ckpt
from services.executor.train.background import BackgroundWriter
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import train_single
from services.runtime.allocator import STEADY_ALLOCATOR
from services.runtime.ports import free_port

SPEC = ParseDict({"name": "gpt-small", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 64, "seq_length": 16}}, model_pb2.ModelSpec())
ADAM = {"name": "adam", "learning_rate": 3e-3}
DATA = {}
SEED, GLOBAL_BATCH, ITERATIONS = 3, 4, 6
BOUNDS = [[0, 2], [2, 4]]


def template(**changes) -> WorkerConfig:
    base = WorkerConfig(
        job_id="job-bg", model=MessageToDict(SPEC, preserving_proto_field_name=True), stage_bounds=[[0, 4]],
        num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=2,
        num_micro_batches=2, iterations=ITERATIONS, init_method=f"tcp://127.0.0.1:{free_port()}", optimizer=ADAM,
        seed=SEED, data=DATA, timeout_s=60)
    return replace(base, **changes)


def layer_hashes(directory) -> dict[str, str]:
    manifest = json.loads((directory / ckpt.MANIFEST).read_text())
    assert manifest["complete"] is True
    for entry in manifest["layers"].values():  # the manifest's hash is the file's
        assert hashlib.sha256((directory / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]
    return {i: entry["sha256"] for i, entry in manifest["layers"].items()}


@pytest.mark.slow
def test_background_checkpoints_hold_the_boundary_state_and_resume_exactly(tmp_path):
    """Written while later steps change the parameters, each checkpoint still holds its boundary's state: its
    files are byte-identical to a synchronous write, and resuming from it gives the uninterrupted losses."""
    runs = {}
    for background in (True, False):
        root = tmp_path / ("bg" if background else "sync")
        config = template(checkpoint_dir=str(root), checkpoint_every=2, checkpoint_background=background)
        runs[background] = (root, run_local(plan_configs(config, BOUNDS, 1), env=STEADY_ALLOCATOR))
    (bg_root, bg_events), (sync_root, _) = runs[True], runs[False]
    for done in (2, 4, 6):
        assert layer_hashes(ckpt.checkpoint_path(bg_root, done)) == layer_hashes(ckpt.checkpoint_path(sync_root, done))
    vouched = [e for e in bg_events[0] if e["event"] == "checkpoint"]
    assert [e["iteration"] for e in vouched] == [2, 4, 6]
    assert all(e["background"] and e["manifest"] and len(e["every_layer"]) == 4 for e in vouched)
    assert all(e["write_s"] >= 0 and e["checkpoint_s"] >= 0 for e in vouched)
    peer = [e for e in bg_events[1] if e["event"] == "checkpoint"]
    assert [e["iteration"] for e in peer] == [2, 4, 6] and all("every_layer" not in e for e in peer)
    assert [e["event"] for e in bg_events[0]][-1] == "done"  # the last write finished before "done"
    for rank_events in bg_events:  # iteration k + 1 is reported only once checkpoint k is complete
        order = [(e["event"], e["iteration"]) for e in rank_events if e["event"] in ("iteration", "checkpoint")]
        for done in (2, 4):
            assert order.index(("checkpoint", done)) < order.index(("iteration", done + 1)), order

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        uninterrupted = train_single(SPEC, DATA, SEED, GLOBAL_BATCH, ITERATIONS, ADAM)
    finally:
        torch.set_num_threads(threads)
    resumed = run_local([template(resume_from=str(ckpt.checkpoint_path(bg_root, 2)))], env=STEADY_ALLOCATOR)
    got = [e["loss"] for e in resumed[0] if e["event"] == "iteration"]
    assert got == pytest.approx(uninterrupted[2:], rel=1e-5)


def test_clear_stale_leaves_no_sidecar_or_manifest_to_vouch_for_a_new_write(tmp_path):
    for name in ("layer-00000.json", "layer-00001.json", ckpt.MANIFEST):
        (tmp_path / name).write_text("{}")
    (tmp_path / "layer-00000.pt").write_bytes(b"old")
    ckpt.clear_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer-00000.pt"]
    with pytest.raises(TimeoutError, match=r"layers \[0, 1\] were not written"):
        ckpt.await_layers(tmp_path, 2, lambda: False, timeout_s=0.05)


def test_await_layers_returns_when_every_sidecar_exists_or_false_when_cancelled(tmp_path):
    (tmp_path / "layer-00000.json").write_text("{}")
    assert ckpt.await_layers(tmp_path, 2, lambda: True, timeout_s=60) is False
    (tmp_path / "layer-00001.json").write_text("{}")
    assert ckpt.await_layers(tmp_path, 2, lambda: False, timeout_s=60) is True


def test_the_writer_raises_a_failed_write_at_the_next_wait_and_refuses_two_in_flight():
    writer, gate = BackgroundWriter(), threading.Event()
    writer.start(gate.wait)
    with pytest.raises(RuntimeError, match="still in flight"):
        writer.start(lambda: None)
    gate.set()
    writer.wait()

    def fail() -> None:
        raise OSError("disk full")

    writer.start(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.wait()  # reported once


def test_abandon_cancels_a_rank_0_wait_for_peers_that_are_gone(tmp_path):
    writer, outcome = BackgroundWriter(), []
    writer.start(lambda: outcome.append(ckpt.await_layers(tmp_path, 1, writer.cancelled, timeout_s=60)))
    writer.abandon(timeout_s=10)
    assert outcome == [False] and not writer.busy


def test_within_its_grace_rank_0_still_completes_a_checkpoint_whose_peer_wrote_its_layers(tmp_path):
    """A peer killed after writing its part: the checkpoint in flight completes, so less is trained again."""
    writer, outcome = BackgroundWriter(), []
    writer.start(lambda: outcome.append(ckpt.await_layers(tmp_path, 1, writer.cancelled, timeout_s=60)))
    late = threading.Timer(0.1, (tmp_path / "layer-00000.json").write_text, args=("{}",))
    late.start()
    writer.abandon(timeout_s=30, grace_s=20)
    late.join()
    assert outcome == [True]


def test_snapshot_copies_are_not_changed_by_the_next_step():
    layer = torch.nn.Linear(2, 2)
    graph_layer = type("L", (), {"index": 0, "name": "fc", "module": layer})()
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    snap = ckpt.snapshot([graph_layer], {}, optimizer)
    before = snap[0][1]["param/weight"].clone()
    layer.weight.grad = torch.ones_like(layer.weight)
    optimizer.step()
    assert torch.equal(snap[0][1]["param/weight"], before) and not torch.equal(layer.weight.detach(), before)


def test_a_checkpoint_naming_the_global_batch_the_old_way_is_checked_the_same():
    """Manifests written before the global batch had one name say `global_batch`; a resume still checks it."""
    ckpt.check_position({"global_batch": 8, "seed": 1}, {}, 8, 1)
    with pytest.raises(ValueError, match="global_batch_size 8"):
        ckpt.check_position({"global_batch": 8, "seed": 1}, {}, 16, 1)
