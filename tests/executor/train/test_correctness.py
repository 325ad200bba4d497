"""Acceptance test of the pipeline x data-parallel runtime (Harmony §5.4): a 2-stage x 2-replica run on real
gloo process groups reproduces the single-process losses step for step, and really was distributed."""

from __future__ import annotations

import pytest
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import model_pb2
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import train_single
from services.runtime.allocator import STEADY_ALLOCATOR
from services.zoo import build_model
from tests.harness import torch_threads

SPEC = ParseDict({"name": "gpt-small", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 4, "hidden_size": 64, "num_heads": 2, "vocab_size": 128, "seq_length": 32,
    "tie_embeddings": True}}, model_pb2.ModelSpec())
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
DATA = {}
SEED, STEPS, MICRO, NUM_MICRO, REPLICAS = 11, 20, 2, 2, 2
BOUNDS = [[0, 3], [3, 6]]  # embed, block.0, block.1 | block.2, block.3, head (tied to the embedding)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    with torch_threads(1):
        return train_single(SPEC, DATA, SEED, MICRO * NUM_MICRO * REPLICAS, STEPS, ADAM)


def expected_parameters(begin: int, end: int) -> int:
    layers = build_model(SPEC, device="meta").decompose().layers[begin:end]
    return sum({id(p): p.numel() for layer in layers for p in layer.module.parameters()}.values())


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("checkpointed", [[], [1, 2, 4]], ids=["no-recompute", "recompute"])
def test_pipeline_x_data_parallel_matches_single_process(reference, schedule, checkpointed):
    template = WorkerConfig(
        job_id="job-acceptance", model=MessageToDict(SPEC, preserving_proto_field_name=True), stage_bounds=BOUNDS,
        num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=MICRO,
        num_micro_batches=NUM_MICRO, iterations=STEPS, init_method="", schedule=schedule,
        checkpoint_layers=checkpointed, optimizer=ADAM, seed=SEED, data=DATA, timeout_s=60)
    events = run_local(plan_configs(template, BOUNDS, REPLICAS), env=STEADY_ALLOCATOR, timeout_s=120)
    assert len(events) == 4
    by_rank = {}
    for rank, rank_events in enumerate(events):
        kinds = [e["event"] for e in rank_events]
        assert kinds == ["started"] + ["iteration"] * STEPS + ["done"], kinds
        by_rank[rank] = rank_events
    activation_bytes = NUM_MICRO * MICRO * 32 * 64 * 4  # one fp32 [m, seq, hidden] tensor per micro-batch
    for rank, rank_events in by_rank.items():
        stage, replica = divmod(rank, REPLICAS)
        started, iterations, done = rank_events[0], rank_events[1:-1], rank_events[-1]
        assert (started["stage"], started["replica"]) == (stage, replica)
        begin, end = BOUNDS[stage]
        assert started["layers"] == list(range(begin, end))  # this rank holds its stage's layers only
        assert started["parameters"] == done["parameters"] == expected_parameters(begin, end)
        for it in iterations:
            assert it["bytes_sent"] == activation_bytes  # activations forward from stage 0, gradients back from 1
            assert it["replica_allreduces"] == 1 and it["tied_allreduces"] == 1
            assert it["has_loss"] == (stage == 1)
            assert it["iteration_s"] > 0 and it["peak_memory_bytes"] > 0
        # The last stage skips the recompute of a micro-batch whose backward follows at once: all of them under
        # 1F1B, the newest under GPipe (as the simulator prices it).
        last_skips_all = stage == len(BOUNDS) - 1 and schedule == "1f1b"
        if any(begin <= i < end for i in checkpointed) and not last_skips_all:
            assert sum(it["recompute_s"] for it in iterations) > 0
        else:
            assert all(it["recompute_s"] == 0 for it in iterations)
    for replica in range(REPLICAS):
        losses = [e["loss"] for e in by_rank[REPLICAS + replica][1:-1]]
        assert losses == pytest.approx(reference, rel=1e-5)  # every last-stage replica reports the global loss
    assert reference[-1] < reference[0] - 0.5
    for stage in range(2):  # replicas stayed bit-identical: gradients were summed in the replica group
        hashes = {by_rank[stage * REPLICAS + r][-1]["param_sha256"] for r in range(REPLICAS)}
        assert len(hashes) == 1
    assert by_rank[0][-1]["param_sha256"] != by_rank[REPLICAS][-1]["param_sha256"]
    # the tied embedding's two copies (stage 0's embedding, stage 1's LM head) stayed identical (Varuna §5.1)
    assert by_rank[0][-1]["tied_sha256"] == by_rank[REPLICAS][-1]["tied_sha256"]


T5 = ParseDict({"name": "t5-tiny", "family": "MODEL_FAMILY_T5", "transformer": {
    "num_layers": 2, "num_decoder_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_length": 16,
    "decoder_seq_length": 8, "tie_embeddings": True}}, model_pb2.ModelSpec())


@pytest.mark.slow
def test_t5_relays_the_encoder_output_through_a_middle_stage():
    # enc.embed, enc.block.0-1, enc.norm | dec.embed, dec.block.0 | dec.block.1, head: stage 1 receives the
    # encoder output and relays it on to stage 2; the shared embedding spans all three stages.
    bounds = [[0, 4], [4, 6], [6, 8]]
    template = WorkerConfig(
        job_id="job-t5", model=MessageToDict(T5, preserving_proto_field_name=True), stage_bounds=bounds,
        num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=2,
        num_micro_batches=2, iterations=5, init_method="", optimizer=ADAM, seed=SEED, data=DATA, timeout_s=60)
    events = run_local(plan_configs(template, bounds, 1), env=STEADY_ALLOCATOR, timeout_s=120)
    reference = train_single(T5, DATA, SEED, 4, 5, ADAM)
    assert [e["loss"] for e in events[2] if e["event"] == "iteration"] == pytest.approx(reference, rel=1e-5)
    middle = [e for e in events[1] if e["event"] == "iteration"][0]
    assert middle["bytes_sent"] == 2 * (2 * 16 * 32 + 2 * 8 * 32) * 4 + 2 * 2 * 16 * 32 * 4  # relay + grads back
    assert middle["tied_allreduces"] == 2  # shared embedding (stages 0-2), decoder bias table (stages 1-2)
    assert len({rank_events[-1]["tied_sha256"] for rank_events in events[1:]}) == 1
