"""Dynamic workloads (layer toggles) and activation swap: a toggled layer is the identity while inactive, in the
workers and in the single-process reference alike; the swap pool round-trips saved tensors through host buffers."""

from __future__ import annotations

import pytest
import torch
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import model_pb2
from services.data.batches import batch_for
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import train_single
from services.executor.train.stage import build_stage
from services.executor.train.swap import SwapPool
from services.runtime.allocator import STEADY_ALLOCATOR

SPEC = ParseDict({"name": "gpt-dynamic", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 6, "hidden_size": 64, "num_heads": 2, "vocab_size": 128, "seq_length": 32,
    "tie_embeddings": True}}, model_pb2.ModelSpec())  # embed, block.0-5, head: 8 layers
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
DATA = {}
SEED, STEPS, MICRO, NUM_MICRO = 7, 20, 2, 2
TOGGLES = [[3, 0, 0], [3, 8, 1]]  # block.2 is the identity in iterations 0-7, computes from 8 on


def single(toggles: list[list[int]] | None) -> list[float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_single(SPEC, DATA, SEED, MICRO * NUM_MICRO, STEPS, ADAM, layer_toggles=toggles)
    finally:
        torch.set_num_threads(threads)


def test_toggled_layer_matches_the_reference_and_migrates_without_optimizer_state():
    bounds = [[0, 3], [3, 8]]
    template = WorkerConfig(
        job_id="job-dynamic", model=MessageToDict(SPEC, preserving_proto_field_name=True), stage_bounds=bounds,
        num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=MICRO,
        num_micro_batches=NUM_MICRO, iterations=STEPS, init_method="", optimizer=ADAM, seed=SEED, data=DATA,
        timeout_s=60, layer_toggles=TOGGLES)
    # block.2 moves to stage 0 at step 5 while inactive (its parameters have no Adam state yet), then, with
    # swap on, back at step 12 once it has state.
    commands = [
        {"command": "plan", "version": 1, "not_before": 5, "stage_bounds": [[0, 4], [4, 8]],
         "checkpoint_layers": [], "swap_layers": [3]},
        {"command": "plan", "version": 2, "not_before": 12, "stage_bounds": bounds, "checkpoint_layers": [],
         "swap_layers": [3]},
    ]
    events = run_local(plan_configs(template, bounds, 1), env=STEADY_ALLOCATOR, timeout_s=120,
                       commands={0: commands, 1: commands})
    first, last = ([e for e in rank if e["event"] == "iteration"] for rank in events)
    assert [it["active_layers"] for it in first[:5]] == [[0, 1, 2]] * 5
    assert [it["active_layers"] for it in first[5:8]] == [[0, 1, 2]] * 3  # holds 3, but it is inactive
    assert [it["layers"] for it in first[5:8]] == [[0, 1, 2, 3]] * 3
    assert [it["active_layers"] for it in first[8:12]] == [[0, 1, 2, 3]] * 4
    assert [it["active_layers"] for it in last[12:]] == [[3, 4, 5, 6, 7]] * 8
    assert [it["swapped_bytes"] > 0 for it in first[5:12]] == [False] * 3 + [True] * 4  # swaps only when active
    (there,) = [e for e in events[0] if e["event"] == "migration"]
    (back,) = [e for e in events[1] if e["event"] == "migration"]
    assert there["layer_index"] == back["layer_index"] == 3
    assert back["bytes"] > 2 * there["bytes"]  # parameters only, then parameters + exp_avg + exp_avg_sq
    losses = [it["loss"] for it in last]
    reference = single(TOGGLES)
    assert losses == pytest.approx(reference, rel=1e-5)
    plain = single(None)
    assert abs(reference[0] - plain[0]) > 1e-4  # the toggle is real: the early losses differ


def test_only_shape_preserving_layers_can_be_toggled():
    with pytest.raises(ValueError, match=r"WorkerConfig\.layer_toggles: layer 0 \(embed\)"):
        build_stage(SPEC, [[0, 8]], 0, seed=0, micro_batch_size=2, layer_toggles=[[0, 3, 0]])
    with pytest.raises(ValueError, match=r"WorkerConfig\.layer_toggles: layer 7 \(head\)"):
        build_stage(SPEC, [[0, 8]], 0, seed=0, micro_batch_size=2, layer_toggles=[[7, 0, 0]])
    with pytest.raises(ValueError, match=r"WorkerConfig\.layer_toggles: 9 is not a layer"):
        build_stage(SPEC, [[0, 8]], 0, seed=0, micro_batch_size=2, layer_toggles=[[9, 0, 0]])
    with pytest.raises(ValueError, match=r"WorkerConfig\.layer_toggles"):
        WorkerConfig(job_id="j", model={}, stage_bounds=[[0, 8]], num_replicas=1, stage_index=0, replica_index=0,
                     rank=0, world_size=1, micro_batch_size=1, num_micro_batches=1, iterations=1, init_method="x",
                     layer_toggles=[[1, 0, 2]]).validate()
    stage = build_stage(SPEC, [[0, 8]], 0, seed=0, micro_batch_size=2, layer_toggles=TOGGLES)
    stage.set_iteration(7)
    assert stage.active_layers == [0, 1, 2, 4, 5, 6, 7]
    stage.set_iteration(8)
    assert stage.active_layers == list(range(8))


@pytest.mark.usefixtures("one_thread")
def test_swapped_stage_gives_the_same_gradients_and_reuses_host_buffers():
    batch = batch_for(SPEC, DATA, 0, 0, 0, 2, global_batch_size=2)
    plain = build_stage(SPEC, [[0, 8]], 0, seed=4, micro_batch_size=2)
    swapped = build_stage(SPEC, [[0, 8]], 0, seed=4, micro_batch_size=2, swap_layers=[1, 2, 3],
                          checkpoint_layers=[3])
    assert swapped.swap_layers == {1, 2}  # checkpoint wins for layer 3
    pool = swapped.swap
    assert pool is not None
    (loss,) = plain.forward([], batch)
    plain.backward([loss], [None], [])
    for _ in range(2):
        for p in swapped.parameters():
            p.grad = None
        (swapped_loss,) = swapped.forward([], batch, micro_batch=0)
        packed = pool.swapped_bytes
        assert packed > 2 * 2 * 32 * 64 * 4 and pool.outstanding > 0
        buffers = pool.host_bytes
        pool.prefetch(0)
        swapped.backward([swapped_loss], [None], [])
        assert pool.outstanding == 0
        pool.finish(0)
        assert torch.equal(swapped_loss, loss)
        for p, q in zip(plain.parameters(), swapped.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        assert pool.take_bytes() == packed and pool.swapped_bytes == 0
    assert pool.host_bytes == buffers  # the second iteration reused the first one's host buffers


def test_swap_pool_round_trip_keeps_layout_and_skips_leaves():
    pool = SwapPool("cpu")
    x = torch.randn(4, 6).t()  # non-contiguous but dense: the restored tensor keeps its strides
    weight = torch.nn.Parameter(torch.randn(3))
    assert pool.pack(0, weight) is weight  # leaves that require grad are held elsewhere anyway
    handle = pool.pack(0, x)
    assert isinstance(handle, tuple) and pool.swapped_bytes == x.numel() * 4
    x_copy = x.clone()
    x.zero_()  # the pool holds its own copy
    restored = pool.unpack(handle)
    assert torch.equal(restored, x_copy) and restored.stride() == x.stride()
    with pytest.raises(RuntimeError, match="already released"):
        pool.unpack(handle)
    again = pool.pack(1, torch.randn(6, 4))  # same dtype and size: the released buffer is reused
    assert pool.host_bytes == 24 * 4
    pool.clear()
    assert pool.outstanding == 0 and again is not None
