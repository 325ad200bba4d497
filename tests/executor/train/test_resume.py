"""Per-layer checkpoints (Varuna §4.5): a run checkpointed under one stage count resumes under another with
the uninterrupted run's losses; files load with weights_only; incomplete checkpoints are refused; SIGTERM stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import model_pb2
from services.executor.train.checkpoint import checkpoint_path
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import train_single
from services.runtime.allocator import STEADY_ALLOCATOR
from services.runtime.ports import free_port
from tests.harness import torch_threads

SPEC = ParseDict({"name": "gpt-small", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 4, "hidden_size": 64, "num_heads": 2, "vocab_size": 128, "seq_length": 32,
    "tie_embeddings": True}}, model_pb2.ModelSpec())
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
DATA = {}
SEED, GLOBAL_BATCH = 5, 4


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_single(SPEC, DATA, SEED, GLOBAL_BATCH, 20, ADAM)
    finally:
        torch.set_num_threads(threads)


def template(**changes) -> WorkerConfig:
    base = WorkerConfig(
        job_id="job-resume", model=MessageToDict(SPEC, preserving_proto_field_name=True), stage_bounds=[[0, 6]],
        num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=2,
        num_micro_batches=2, iterations=20, init_method=f"tcp://127.0.0.1:{free_port()}", optimizer=ADAM,
        seed=SEED, data=DATA, timeout_s=60)
    return replace(base, **changes)


def losses(events: list[list[dict]]) -> list[float]:
    return [e["loss"] for e in events[-1] if e["event"] == "iteration"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "before, after", [([[0, 3], [3, 6]], [[0, 6]]), ([[0, 6]], [[0, 2], [2, 6]])], ids=["2-to-1", "1-to-2"]
)
def test_resume_under_another_stage_count(tmp_path, uninterrupted, before, after):
    first = run_local(plan_configs(template(iterations=10, checkpoint_dir=str(tmp_path), checkpoint_every=10),
                                   before, 1), env=STEADY_ALLOCATOR)
    assert losses(first) == pytest.approx(uninterrupted[:10], rel=1e-5)
    written = [entry for events in first for e in events if e["event"] == "checkpoint" for entry in e["layers"]]
    assert sorted(entry["layer_index"] for entry in written) == list(range(6))  # each layer once, by its owner
    directory = checkpoint_path(tmp_path, 10)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["next_iteration"] == 10
    for entry in written:
        assert manifest["layers"][str(entry["layer_index"])]["sha256"] == entry["sha256"]
        tensors = torch.load(directory / f"layer-{entry['layer_index']:05d}.pt", weights_only=True)
        assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    embed = torch.load(directory / "layer-00000.pt", weights_only=True)
    head = torch.load(directory / "layer-00005.pt", weights_only=True)
    assert {"param/tokens.weight", "state/exp_avg/tokens.weight", "state/step/tokens.weight"} <= set(embed)
    assert "param/lm.weight" not in head and "param/norm.weight" in head  # the tied weight is stored once

    resume = (directory / "manifest.json").resolve().as_uri()  # a path, a file:// URI or the manifest: all work
    second = run_local(plan_configs(template(resume_from=resume), after, 1), env=STEADY_ALLOCATOR)
    assert second[0][0]["start_iteration"] == 10
    assert [e["iteration"] for e in second[-1] if e["event"] == "iteration"] == list(range(11, 21))
    assert losses(second) == pytest.approx(uninterrupted[10:], rel=1e-5)
    assert train_single(SPEC, DATA, SEED, GLOBAL_BATCH, 20, ADAM, resume_from=str(directory)) == pytest.approx(
        uninterrupted[10:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("after, replicas", [([[0, 6]], 2), ([[0, 3], [3, 6]], 1)], ids=["2x2-to-1x2", "2x2-to-2x1"])
def test_a_2x2_run_morphs_to_1x2_or_2x1_with_the_uninterrupted_losses(tmp_path, uninterrupted, after, replicas):
    """Varuna's morph at the same global batch: checkpointed on 2 stages x 2 replicas, resumed on half the
    devices as a shallower or a narrower pipeline; every step's loss is the uninterrupted run's (fp32)."""
    per_replica = GLOBAL_BATCH // 2  # two micro-batches per replica
    first = run_local(plan_configs(template(iterations=10, checkpoint_dir=str(tmp_path), checkpoint_every=10,
                                            micro_batch_size=per_replica // 2), [[0, 3], [3, 6]], 2),
                      env=STEADY_ALLOCATOR)
    assert losses(first) == pytest.approx(uninterrupted[:10], rel=1e-5)
    resumed = run_local(plan_configs(template(resume_from=str(checkpoint_path(tmp_path, 10)),
                                              micro_batch_size=GLOBAL_BATCH // 2 // replicas), after, replicas),
                        env=STEADY_ALLOCATOR)
    assert resumed[0][0]["start_iteration"] == 10 and len(resumed) == len(after) * replicas
    assert losses(resumed) == pytest.approx(uninterrupted[10:], rel=1e-5)


@pytest.mark.slow
def test_incomplete_or_corrupt_checkpoints_are_refused(tmp_path):
    train_single(SPEC, DATA, SEED, GLOBAL_BATCH, 2, ADAM, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    corrupt = checkpoint_path(tmp_path, 1)
    with open(corrupt / "layer-00002.pt", "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\0" * 8)
    with pytest.raises(RuntimeError, match="sha256"):
        train_single(SPEC, DATA, SEED, GLOBAL_BATCH, 4, ADAM, resume_from=str(corrupt))
    incomplete = checkpoint_path(tmp_path, 2)
    (incomplete / "manifest.json").unlink()
    with pytest.raises(RuntimeError, match="manifest.json"):
        train_single(SPEC, DATA, SEED, GLOBAL_BATCH, 4, ADAM, resume_from=str(incomplete))
    (events,) = run_local([template(resume_from=str(incomplete))], env=STEADY_ALLOCATOR, check=False)
    assert events[-1]["event"] == "error"
    assert "manifest.json" in events[-1]["message"] and "never resumed" in events[-1]["message"]


@pytest.mark.slow
def test_sigterm_stops_with_a_stopped_event(tmp_path):
    path = tmp_path / "worker.json"
    path.write_text(template(iterations=100_000).to_json())
    env = {**os.environ, **STEADY_ALLOCATOR, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "services.executor.train.worker", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        events = []
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["event"] == "iteration":
                proc.send_signal(signal.SIGTERM)
                break
        events += [json.loads(line) for line in proc.stdout]
        assert proc.wait(timeout=60) == 143
    finally:
        proc.kill()
    assert events[0]["event"] == "started"
    assert events[-1]["event"] == "stopped" and events[-1]["iteration"] < 100_000


@pytest.mark.slow
def test_a_morph_on_a_token_file_continues_where_the_data_stopped(tmp_path):
    """Token data of 23 windows and a global batch of 4: every 6th iteration or so starts a reshuffled epoch. A 2x2
    run checkpointed after 10 iterations (in the second epoch) resumes as 1x2 and draws the very samples the
    uninterrupted run draws: the same losses, across the epoch boundaries after it; the manifest records the
    position (samples seen, epoch), and a resume with another seed is refused."""
    import numpy as np

    from services.specs.user_inputs import UserInputs

    width = SPEC.transformer.seq_length + 1
    rng = np.random.default_rng(0)
    path = tmp_path / "data" / "train.bin"
    path.parent.mkdir()
    rng.integers(0, SPEC.transformer.vocab_size, 23 * width + 7).astype(np.uint16).tofile(path)
    data = {"tokens": {"path": str(path)}}
    roots = UserInputs.of(data_roots=[str(tmp_path / "data")])
    with_data = {"data": data, "user_inputs": roots}
    with torch_threads(1):
        expected = train_single(SPEC, data, SEED, GLOBAL_BATCH, 20, ADAM, user_inputs=roots)
    first = run_local(plan_configs(template(iterations=10, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10,
                                            micro_batch_size=1, **with_data), [[0, 3], [3, 6]], 2),
                      env=STEADY_ALLOCATOR)
    assert losses(first) == pytest.approx(expected[:10], rel=1e-5)
    directory = checkpoint_path(tmp_path / "ckpt", 10)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert (manifest["samples_seen"], manifest["epoch"], manifest["data"]) == (40, 1, data)
    resumed = run_local(plan_configs(template(resume_from=str(directory), micro_batch_size=1, **with_data),
                                     [[0, 6]], 2), env=STEADY_ALLOCATOR)
    assert losses(resumed) == pytest.approx(expected[10:], rel=1e-5)
    (refused,) = run_local([template(resume_from=str(directory), seed=SEED + 1, micro_batch_size=2, **with_data)],
                           env=STEADY_ALLOCATOR, check=False)
    assert refused[-1]["event"] == "error" and "seed" in refused[-1]["message"]
