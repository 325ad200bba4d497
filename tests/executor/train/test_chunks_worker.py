"""The worker's chunk mode (issue 19): an AssignInstruction whose plan has `offload` becomes chunk-mode
WorkerConfigs, and two real worker processes on gloo train the model with its data in chunks under the device
budget, reporting the stage trainer's events with the swap they did, and the single-process losses."""

from __future__ import annotations

from dataclasses import replace

import pytest
from google.protobuf.json_format import MessageToDict

from ballast.v1 import plan_pb2
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import train_single
from services.executor.train.worker import Stopped, run
from services.executor.workers import stage_stats, worker_config
from services.runtime.allocator import STEADY_ALLOCATOR
from services.runtime.ports import free_port
from services.zoo import build_model
from tests.executor.test_workers import assign_message
from tests.executor.train.test_chunks import ADAM, DATA, SEED, SPEC
from tests.harness import torch_threads

STEPS, CHUNK, BUDGET = 4, 1_100_000, 11_000_000
LAYERS = len(build_model(SPEC, device="meta").decompose().layers)
TEMPLATE = WorkerConfig(
    job_id="job-chunks", model=MessageToDict(SPEC, preserving_proto_field_name=True), stage_bounds=[[0, LAYERS]],
    num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=2, num_micro_batches=1,
    iterations=STEPS, init_method="tcp://127.0.0.1:1", optimizer=ADAM, seed=SEED, data=DATA, timeout_s=60,
    chunk_bytes=CHUNK, device_budget_bytes=BUDGET)


def test_two_chunk_mode_workers_train_like_one_process(tmp_path):
    with torch_threads(1):
        expected = train_single(SPEC, DATA, SEED, 4, STEPS, ADAM)
    # A repartition is refused while training goes on.
    template = TEMPLATE
    plan = {"command": "plan", "version": 3, "not_before": 1, "stage_bounds": [[0, 2], [2, LAYERS]]}
    events = run_local(plan_configs(template, [[0, LAYERS]], 2), env=STEADY_ALLOCATOR, timeout_s=120,
                       commands={1: [plan]})
    for rank, rank_events in enumerate(events):
        rejected = [e for e in rank_events if e["event"] == "command_rejected"]
        assert [(e["version"], "chunk offload takes no plan commands" in e["message"]) for e in rejected] == (
            [(3, True)] if rank == 1 else [])
        kept = [e for e in rank_events if e["event"] != "command_rejected"]
        assert [e["event"] for e in kept] == ["started"] + ["iteration"] * STEPS + ["done"], rank_events
        started, iterations = kept[0], kept[1:-1]
        assert [started[k] for k in ("rank", "replica", "num_replicas", "num_stages")] == [rank, rank, 2, 1]
        assert started["layers"] == list(range(LAYERS)) and started["global_batch_size"] == 4
        assert started["offload"]["chunk_bytes"] == CHUNK and started["offload"]["model_bytes"] > BUDGET
        assert started["warnings"] == []
        assert [e["loss"] for e in iterations] == pytest.approx(expected, rel=1e-5, abs=0)
        for it in iterations:  # every rank holds the global loss, and really swapped
            assert it["has_loss"] and it["swap_in_bytes"] > 0 and it["swap_out_bytes"] > 0 and it["swap_s"] > 0
            assert it["swapped_bytes"] == it["swap_out_bytes"] and it["gathered_bytes"] > 0
            assert it["device_budget_peak_bytes"] <= BUDGET and it["peak_memory_bytes"] > 0
            assert it["recompute_s"] == it["p2p_s"] == 0 and it["comm_s"] == it["allreduce_s"] > 0
            parts = it["forward_s"] + it["backward_s"] + it["allreduce_s"] + it["optimizer_s"] + it["overhead_s"]
            assert parts == pytest.approx(it["iteration_s"], rel=1e-9)
            assert min(it["forward_s"], it["backward_s"], it["optimizer_s"], it["overhead_s"]) >= 0


def test_a_stop_ends_chunk_mode_at_an_iteration_boundary():
    config = replace(TEMPLATE, init_method=f"tcp://127.0.0.1:{free_port()}")
    events: list[dict] = []
    with torch_threads(1), pytest.raises(Stopped) as stopped:
        run(config, events.append, should_stop=lambda: bool(events))
    assert stopped.value.iteration == 1 and not stopped.value.drained
    assert [e["event"] for e in events] == ["started", "iteration"]


def test_chunk_mode_refuses_a_stage_short_of_the_model_before_the_rendezvous():
    config = replace(TEMPLATE, stage_bounds=[[0, LAYERS - 1]])  # nobody listens on the rendezvous: it never gets there
    with torch_threads(1), pytest.raises(ValueError, match=r"stage_bounds: chunk offload's one stage holds every"):
        run(config, lambda e: None)


@pytest.mark.parametrize("change,field", [
    ({"chunk_bytes": -1}, "chunk_bytes"),
    ({"device_budget_bytes": True}, "device_budget_bytes"),
    ({"chunk_bytes": 0}, "device_budget_bytes"),  # a budget without chunks means nothing
    ({"stage_bounds": [[0, 2], [2, LAYERS]], "world_size": 2}, "stage_bounds"),
    ({"layer_toggles": [[1, 0, 0]]}, "layer_toggles"),
    ({"checkpoint_layers": [1]}, "checkpoint_layers"),
    ({"zero2_layers": [1]}, "zero2_layers"),
])
def test_worker_config_validates_the_chunk_fields(change, field):
    TEMPLATE.validate()
    replace(TEMPLATE, chunk_bytes=0, device_budget_bytes=0, resume_from="/ckpt").validate()  # not chunk mode
    with pytest.raises(ValueError, match=rf"^WorkerConfig\.{field}:"):
        replace(TEMPLATE, **change).validate()


def test_an_offload_plan_becomes_chunk_mode_worker_configs():
    message = assign_message("job-o", ranks=2)
    assert worker_config(message.assign, message.assign.workers[0], "job-o").chunk_bytes == 0
    message.assign.plan.offload.CopyFrom(plan_pb2.ChunkOffload(chunk_bytes=CHUNK, device_budget_bytes=BUDGET))
    configs = [worker_config(message.assign, w, "job-o") for w in message.assign.workers]
    assert [(c.chunk_bytes, c.device_budget_bytes, c.replica_index) for c in configs] == [
        (CHUNK, BUDGET, 0), (CHUNK, BUDGET, 1)]
    WorkerConfig.from_json(configs[1].to_json())  # valid as the worker reads it
    stats = stage_stats({"swap_in_bytes": 5, "swap_out_bytes": 7, "swap_s": 0.25}, "job-o")
    assert (stats.swap_in_bytes, stats.swap_out_bytes, stats.swap_s) == (5, 7, 0.25)
    assert stage_stats({}, "job-o").swap_s == 0
