"""Stage builder and a one-rank worker in this process: boundaries, tied weights, events, stop requests."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import model_pb2
from services.data.batches import batch_for
from services.executor.train.config import WorkerConfig
from services.executor.train.reference import train_single
from services.executor.train.stage import build_stage
from services.executor.train.worker import Stopped, run
from services.runtime.ports import free_port
from services.zoo import build_model

TEXT = {"hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_length": 16, "tie_embeddings": True}
GPT = ParseDict({"name": "g", "family": "MODEL_FAMILY_GPT", "transformer": {**TEXT, "num_layers": 2}},
                model_pb2.ModelSpec())
T5 = ParseDict({"name": "t", "family": "MODEL_FAMILY_T5", "transformer": {
    **TEXT, "num_layers": 2, "num_decoder_layers": 2, "decoder_seq_length": 8}}, model_pb2.ModelSpec())
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.0}
EVENT_KEYS = {
    "started": {"event", "job_id", "rank", "stage", "replica", "world_size", "num_stages", "num_replicas", "layers",
                "parameters", "start_iteration", "iterations", "schedule", "global_batch_size", "plan_version",
                "predicted_iteration_s", "device", "pid", "hybrid"},
    "iteration": {"event", "job_id", "rank", "stage", "replica", "iteration", "plan_version", "iteration_s",
                  "forward_s", "backward_s", "recompute_s", "comm_s", "p2p_s", "allreduce_s", "optimizer_s",
                  "data_s", "overhead_s", "idle_s", "memory_bytes", "heap_peak_bytes",
                  "peak_memory_bytes", "bytes_sent", "bytes_received", "allreduce_bytes", "replica_allreduces",
                  "tied_allreduces", "loss", "has_loss", "samples_per_s", "layers", "swapped_bytes", "active_layers"},
    "checkpoint": {"event", "job_id", "rank", "stage", "replica", "iteration", "plan_version", "dir", "manifest",
                   "layers", "checkpoint_s", "write_s", "background"},
    "done": {"event", "job_id", "rank", "stage", "replica", "iteration", "parameters", "param_sha256", "param_sum",
             "tied_sha256", "layer_sha256"},
}


pytestmark = pytest.mark.usefixtures("one_thread")  # timings and sums as the workers run them


def test_t5_stages_relay_skip_edges_and_track_tied_weights():
    bounds = [[0, 3], [3, 6], [6, 8]]  # enc.embed, enc.block.0-1 | enc.norm, dec.embed, dec.block.0 | dec.block.1, head
    stages = [build_stage(T5, bounds, s, seed=0, micro_batch_size=2) for s in range(3)]
    assert [[b.index for b in s.receives] for s in stages] == [[], [2], [3, 5]]
    assert [[b.index for b in s.sends] for s in stages] == [[2], [3, 5], []]
    assert stages[1].sends[0].shape == (2, 16, 32) and stages[1].sends[1].shape == (2, 8, 32)
    assert stages[0].tied_sets == [(0, 1, 2), (1, 2)]  # shared embedding; decoder relative-bias table
    assert [t.stages for t in stages[1].tied] == [(0, 1, 2), (1, 2)]
    assert stages[2].aliases == {(6, "rel.table.weight"): (5, "rel.table.weight"),
                                 (7, "lm.weight"): (0, "shared.weight")}
    model = build_model(T5, seed=0)
    layers = model.decompose().layers
    for s, (b, e) in zip(stages, bounds, strict=True):
        expected = {id(p): p.numel() for layer in layers[b:e] for p in layer.module.parameters()}
        assert sum(p.numel() for p in s.parameters()) == sum(expected.values())
        assert [layer.index for layer in s.layers] == list(range(b, e))


def test_chained_stages_equal_the_whole_model():
    batch = batch_for(GPT, {}, 0, 0, 0, 2, global_batch_size=2)
    model = build_model(GPT, seed=4)
    loss = model(batch)
    loss.backward()
    first, last = (build_stage(GPT, [[0, 2], [2, 4]], s, seed=4, micro_batch_size=2, checkpoint_layers=[1, 2])
                   for s in range(2))
    (hidden,) = first.forward([], batch)
    received = [hidden.detach().requires_grad_(True)]
    (stage_loss,) = last.forward(received, batch)
    assert torch.equal(stage_loss, loss)
    (grad,) = last.backward([stage_loss], [None], received)  # recomputes on the backward's first use
    assert last.recompute_s > 0 and 0 in last.segments  # (the trainer always calls recompute first)
    first.recompute(0)  # ahead of the gradient, as the schedule does it
    early = first.recompute_s
    assert early > 0 and 0 not in first.segments
    first.backward([hidden], [grad], [])
    assert first.recompute_s == early  # nothing recomputed twice
    assert torch.allclose(last.layers[0].module.mlp[0].weight.grad, model.blocks[1].mlp[0].weight.grad)
    assert torch.allclose(first.layers[1].module.attn.qkv.weight.grad, model.blocks[0].attn.qkv.weight.grad)
    tied = first.layers[0].module.tokens.weight.grad + last.layers[1].module.lm.weight.grad  # summed, Varuna §5.1
    assert torch.allclose(tied, model.embed.tokens.weight.grad, atol=1e-7)


PARTS = ("forward_s", "backward_s", "p2p_s", "allreduce_s", "optimizer_s", "data_s", "overhead_s")


def assert_parts_sum_to_the_iteration(it: dict) -> None:
    """The breakdown of an "iteration" event: disjoint parts, none negative, summing to its wall time."""
    assert all(it[k] >= 0 for k in (*PARTS, "recompute_s")), it
    assert sum(it[k] for k in PARTS) == pytest.approx(it["iteration_s"], rel=1e-9, abs=1e-9)
    assert it["recompute_s"] <= it["backward_s"]
    assert it["comm_s"] == pytest.approx(it["p2p_s"] + it["allreduce_s"], rel=1e-12, abs=1e-15)
    assert it["idle_s"] == it["overhead_s"]


def single_rank(tmp_path, **changes) -> WorkerConfig:
    base = dict(job_id="job-1", model=MessageToDict(GPT, preserving_proto_field_name=True), stage_bounds=[[0, 4]],
                num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=2,
                num_micro_batches=2, iterations=3, init_method=f"tcp://127.0.0.1:{free_port()}", optimizer=ADAM,
                seed=1, checkpoint_dir=str(tmp_path), checkpoint_every=3, timeout_s=30)
    return WorkerConfig(**{**base, **changes})


def test_one_rank_worker_reports_every_event(tmp_path):
    events: list[dict] = []
    run(single_rank(tmp_path), events.append)
    assert not dist.is_initialized()
    assert [e["event"] for e in events] == ["started", "iteration", "iteration", "iteration", "checkpoint", "done"]
    for e in events:
        extra = {"every_layer"} if e["event"] == "checkpoint" else set()  # rank 0 lists every layer
        assert set(e) == EVENT_KEYS[e["event"]] | extra, e["event"]
    reference = train_single(GPT, {}, 1, 4, 3, ADAM)
    losses = [e["loss"] for e in events if e["event"] == "iteration"]
    assert losses == pytest.approx(reference, rel=1e-5)
    assert [e["iteration"] for e in events if e["event"] == "iteration"] == [1, 2, 3]
    for it in (e for e in events if e["event"] == "iteration"):
        assert_parts_sum_to_the_iteration(it)
    assert sorted(entry["layer_index"] for entry in events[4]["layers"]) == [0, 1, 2, 3]
    assert events[4]["manifest"].endswith("iter-00000003/manifest.json")


def test_stop_request_ends_between_iterations(tmp_path):
    events: list[dict] = []
    with pytest.raises(Stopped) as stopped:
        run(single_rank(tmp_path, checkpoint_every=0, iterations=5), events.append,
            should_stop=lambda: len(events) >= 2)
    assert stopped.value.iteration == 1
    assert not dist.is_initialized()
