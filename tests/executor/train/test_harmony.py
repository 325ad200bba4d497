"""Harmony (issue 19): the wrap-around schedule, its search, and the executor that runs it under a device budget.

The equality tests train a zoo GPT (untied, no dropout) whose parameters do not fit the device budget, compare
every iteration's loss with the in-memory reference (`train_single`), prove data moved (bytes each way > 0, the
budget's high-water mark below the model's size) and hold the bytes each device moved against the schedule's
predicted traffic, exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import model_pb2
from services.data.batches import batch_for
from services.executor.train.harmony import measure_layers, train_harmony
from services.executor.train.reference import train_single
from services.memory.harmony_schedule import (
    BACKWARD,
    FORWARD,
    FORWARD_BACKWARD,
    HarmonyLayer,
    HarmonySchedule,
    host_bytes,
    traffic,
)
from services.memory.pool import BudgetExceeded
from services.planner.sim.harmony_search import Machine, balanced_packs, estimate, search
from services.runtime.errors import InvalidArgument
from services.zoo import build_model
from tests.harness import torch_threads

SPEC = ParseDict({"name": "gpt-chain", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 8, "hidden_size": 128, "num_heads": 2, "vocab_size": 128, "seq_length": 8,
    "tie_embeddings": False}}, model_pb2.ModelSpec())
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
SGD = {"name": "sgd", "learning_rate": 0.05}
DATA = {}
SEED, STEPS, GLOBAL_BATCH_SIZE = 11, 3, 4
BUDGET = 4_500_000  # the model's parameters are 6.5 MB; with Adam's states and gradients training needs 4x that
MB = 2**20


def layers(optimizer: str = "adam") -> list[HarmonyLayer]:
    with torch_threads(1):
        model = build_model(SPEC, seed=SEED)
        sample = batch_for(SPEC, DATA, SEED, 0, 0, 1, global_batch_size=GLOBAL_BATCH_SIZE)
        return measure_layers(model.decompose(), sample, optimizer)


def config(schedule: HarmonySchedule, store: Path, optimizer: dict = ADAM, budget: int | None = BUDGET,
           prefetch: bool = True) -> dict:
    return {"model": MessageToDict(SPEC, preserving_proto_field_name=True), "seed": SEED,
            "global_batch_size": GLOBAL_BATCH_SIZE,
            "iterations": STEPS, "optimizer": optimizer, "device_budget": budget, "store_dir": str(store),
            "prefetch": prefetch,
            "schedule": {"forward_micro_batch": schedule.forward_micro_batch,
                         "forward_packs": [list(p) for p in schedule.forward_packs],
                         "backward_micro_batch": schedule.backward_micro_batch,
                         "backward_packs": [list(p) for p in schedule.backward_packs],
                         "devices": schedule.devices}}


def reference(optimizer: dict = ADAM) -> list[float]:
    with torch_threads(1):
        return train_single(SPEC, DATA, SEED, GLOBAL_BATCH_SIZE, STEPS, optimizer)


# -- the schedule (pure) ----------------------------------------------------------------------------------------
def test_tasks_follow_pf_plus_reversed_pb():
    s = HarmonySchedule(2, ((0, 3), (3, 4)), 1, ((0, 2), (2, 4), (4, 7)), devices=2)
    tasks = s.tasks()
    assert [(t.kind, t.span, t.device, t.micro_batch) for t in tasks] == [
        (FORWARD, (0, 3), 0, 2), (FORWARD, (3, 4), 1, 2), (FORWARD_BACKWARD, (4, 7), 0, 2),
        (BACKWARD, (2, 4), 1, 1), (BACKWARD, (0, 2), 0, 1)]
    assert tasks[0].stash == (2,) and tasks[1].stash == ()  # backward pack [2, 4) starts inside forward pack 0
    assert [t.reads_stash for t in tasks] == [False, False, False, True, False]  # pack 0 rebuilds from the batch
    assert [t.source for t in tasks] == [None, 0, 1, 2, 3]


@pytest.mark.parametrize(("schedule", "message"), [
    (HarmonySchedule(3, ((0, 4),), 1, ((0, 4), (4, 7)), 1), "forward_micro_batch 3 must divide"),
    (HarmonySchedule(2, ((0, 3),), 1, ((0, 2), (2, 4), (4, 7)), 1), "forward_packs must end at layer 4"),
    (HarmonySchedule(2, ((0, 4),), 1, ((0, 2), (3, 7)), 1), "backward_packs must tile"),
    (HarmonySchedule(2, (), 1, (), 1), "backward_packs is empty"),
])
def test_a_schedule_that_does_not_tile_or_divide_is_refused(schedule: HarmonySchedule, message: str):
    with pytest.raises(ValueError, match=message):
        schedule.check(7, 4)


def test_weight_traffic_is_harmony_pp_three_w_less_the_jit_pack():
    """§3: with input-batch grouping and jit-update the wrap-around pipeline moves 3|W| of weights per iteration;
    jit-compute brings the last pack once for its forward and backward, so it saves that pack's |W| once."""
    weights = [100, 200, 300, 400, 500]
    only_weights = [HarmonyLayer(w, 0, 0, 0, 0.0, 0.0).bytes() for w in weights]
    s = HarmonySchedule(2, ((0, 2), (2, 3)), 2, ((0, 1), (1, 3), (3, 5)), devices=3)
    moved = traffic(s, only_weights, 8).total
    assert moved["to_device"] + moved["to_host"] == 3 * sum(weights) - (400 + 500)
    assert moved["peer"] == 0


def test_traffic_counts_stashes_states_and_peer_sends_per_device():
    layer = [HarmonyLayer(10, 20, 3, 0, 0.0, 0.0).bytes() for _ in range(4)]
    s = HarmonySchedule(1, ((0, 2),), 1, ((0, 1), (1, 2), (2, 4)), devices=2)  # F[0,2) d0, FB[2,4) d1, B d0, B d1
    t = traffic(s, layer, 4)
    # d0: forward weights 20 + B[1,2) weights/states 10+20 + its stash 3*4; stash out of layer 1's input 12
    assert t.to_device == (20 + 30 + 12, 20 + 40 + 10 + 20)
    assert t.to_host == (12 + 30, 60 + 30)
    # d0 sends pack outputs (layer 2's input) to d1 and B[1,2)'s input gradient to d1; d1 sends FB's input grad
    assert t.peer == (12 + 12, 12)


# -- the search (Algorithms 1 and 2) ------------------------------------------------------------------------------
def test_balanced_packs_split_time_evenly_and_grow_when_memory_says_so():
    times = [1.0] * 8
    assert balanced_packs(times, 0, 8, lambda a, b: b - a, capacity=8) == ((0, 8),)
    assert balanced_packs(times, 0, 8, lambda a, b: b - a, capacity=3) == ((0, 3), (3, 6), (6, 8))
    assert balanced_packs([1, 1, 1, 5], 0, 4, lambda a, b: b - a, capacity=3) == ((0, 3), (3, 4))
    assert balanced_packs(times, 0, 8, lambda a, b: 10 * (b - a), capacity=5) is None


def test_search_picks_a_feasible_schedule_and_more_devices_are_faster():
    costs = [HarmonyLayer(4 * MB, 8 * MB, 64 * 1024, 512 * 1024, 1e-3, 2e-3) for _ in range(12)]
    one = search(costs, 16, Machine(1, 40 * MB, 10e9, 50e9))
    four = search(costs, 16, Machine(4, 40 * MB, 10e9, 50e9))
    assert one is not None and four is not None and four.explored > 1
    assert max(four.peak_bytes) <= 40 * MB and max(one.peak_bytes) <= 40 * MB
    assert four.iteration_s < one.iteration_s
    assert four.iteration_s == estimate(four.schedule, costs, 16, Machine(4, 40 * MB, 10e9, 50e9), four.prefetch)
    assert search(costs, 16, Machine(4, 4 * MB, 10e9, 50e9)) is None  # one layer's weights fill the device


# -- the executor --------------------------------------------------------------------------------------------------
def test_harmony_on_one_device_equals_training_in_memory_and_moves_what_the_schedule_says(tmp_path: Path):
    costs = layers()
    choice = search(costs, GLOBAL_BATCH_SIZE, Machine(1, BUDGET, 5e9, 5e9))
    assert choice is not None
    with torch_threads(1):
        run = train_harmony(config(choice.schedule, tmp_path, prefetch=choice.prefetch), 0, tmp_path)
    assert run.losses == pytest.approx(reference(), rel=1e-5, abs=0)
    assert run.device_peak <= BUDGET < run.model_bytes
    assert run.device_peak <= choice.peak_bytes[0]  # the search's memory model is not optimistic
    predicted = traffic(choice.schedule, [c.bytes() for c in costs], GLOBAL_BATCH_SIZE)
    stored = sum(f.stat().st_size for f in tmp_path.iterdir() if f.suffix != ".json")
    assert stored == host_bytes(choice.schedule, [c.bytes() for c in costs],
                                GLOBAL_BATCH_SIZE)  # what the planner checks
    for step in run.steps:
        assert step.traffic["to_device"] == predicted.to_device[0] > 0
        assert step.traffic["to_host"] == predicted.to_host[0] > 0


def test_harmony_with_sgd_and_no_prefetch_equals_training_in_memory(tmp_path: Path):
    schedule = HarmonySchedule(2, ((0, 4), (4, 8)), 1, ((0, 2), (2, 4), (4, 6), (6, 8), (8, 10)), devices=1)
    cfg = config(schedule, tmp_path, SGD, prefetch=False)
    with torch_threads(1):
        run = train_harmony(cfg, 0, tmp_path)
    assert run.losses == pytest.approx(reference(SGD), rel=1e-5, abs=0)


def test_wrap_around_pipeline_on_two_gloo_ranks_equals_training_in_memory(tmp_path: Path):
    costs = layers()
    choice = search(costs, GLOBAL_BATCH_SIZE, Machine(2, BUDGET, 5e9, 5e9))
    assert choice is not None and len(choice.schedule.tasks()) >= 4
    (tmp_path / "config.json").write_text(json.dumps(config(choice.schedule, tmp_path, prefetch=choice.prefetch)))
    procs = [subprocess.Popen([sys.executable, "-m", "services.executor.train.harmony", "--config",
                               str(tmp_path / "config.json"), "--rank", str(r), "--world", "2",
                               "--init", f"file://{tmp_path / 'rendezvous'}", "--out", str(tmp_path / f"{r}.json")])
             for r in range(2)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    expected = reference()
    predicted = traffic(choice.schedule, [c.bytes() for c in costs], GLOBAL_BATCH_SIZE)
    for r in range(2):
        result = json.loads((tmp_path / f"{r}.json").read_text())
        assert result["losses"] == pytest.approx(expected, rel=1e-5, abs=0)
        assert result["device_peak"] <= BUDGET < result["model_bytes"]
        for moved in result["traffic"]:
            assert (moved["to_device"], moved["to_host"], moved["peer"]) == (
                predicted.to_device[r], predicted.to_host[r], predicted.peer[r])
        assert result["traffic"][0]["peer"] > 0  # activations and their gradients went device to device


def test_a_budget_below_one_pack_fails_loudly(tmp_path: Path):
    schedule = HarmonySchedule(4, ((0, 9),), 4, ((0, 9), (9, 10)), devices=1)
    with torch_threads(1), pytest.raises(BudgetExceeded, match="device budget"):
        train_harmony(config(schedule, tmp_path), 0, tmp_path)


@pytest.mark.parametrize(("change", "field"), [
    ({"transformer": {"tie_embeddings": True}}, "model.transformer.tie_embeddings"),
    ({"dropout": 0.1}, "model.dropout"),
])
def test_models_the_schedule_cannot_replay_are_refused_by_field(tmp_path: Path, change: dict, field: str):
    spec = model_pb2.ModelSpec()
    spec.CopyFrom(SPEC)
    ParseDict(change, spec)
    cfg = config(HarmonySchedule(4, ((0, 9),), 4, ((0, 9), (9, 10)), 1), tmp_path)
    cfg["model"] = MessageToDict(spec, preserving_proto_field_name=True)
    with torch_threads(1), pytest.raises(InvalidArgument) as err:
        train_harmony(cfg, 0, tmp_path)
    assert err.value.field == field


def test_measured_layers_see_the_activations_autograd_keeps():
    costs = layers()
    assert costs[0].input_per_sample == 0 and all(c.input_per_sample == 8 * 128 * 4 for c in costs[1:])
    assert all(c.saved_per_sample > c.input_per_sample for c in costs[1:-1])  # a block keeps far more than its input
    assert sum(c.weights for c in costs) == 4 * sum(p.numel() for p in build_model(SPEC, device="meta").parameters())
