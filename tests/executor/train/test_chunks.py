"""PatrickStar chunks (issue 19): model data in fixed-size chunks under an enforced device budget.

The equality tests train a zoo GPT whose parameters (12.8 MB) do not fit the device budget and compare every
iteration's loss with the in-memory reference (`train_single`), and prove data moved: bytes each way > 0,
evictions > 0, and the budget's high-water mark below the model's size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from google.protobuf.json_format import MessageToDict, ParseDict
from torch import nn

from ballast.v1 import model_pb2
from services.executor.train.chunks import ChunkManager
from services.executor.train.offload import tensor_map, train_chunked
from services.executor.train.reference import train_single
from services.memory.chunk_layout import plan_chunks
from services.memory.chunk_policy import TensorState, Trace
from services.memory.pool import BudgetExceeded, MemoryPool
from services.planner.sim.chunks import ChunkModel, ChunkOptions, ChunkSim, simulate_chunks
from services.zoo import build_model
from tests.harness import torch_threads

SPEC = ParseDict({"name": "gpt-wide", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 4, "hidden_size": 256, "num_heads": 2, "vocab_size": 128, "seq_length": 8,
    "tie_embeddings": True}}, model_pb2.ModelSpec())
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
SGD = {"name": "sgd", "learning_rate": 0.05, "weight_decay": 0.01}
DATA = {}
SEED, STEPS = 11, 4
MODEL_BYTES = 12_777_472  # the parameters of SPEC, fp32
CHUNK = 1_310_720  # 327,680 elements: holds the largest tensor (fc1, 262,144)
BUDGET = 8_000_000  # about 5/8 of the model, activations included


def reference(optimizer: dict, global_batch_size: int = 2) -> list[float]:
    with torch_threads(1):
        return train_single(SPEC, DATA, SEED, global_batch_size, STEPS, optimizer)


def test_layout_packs_parameters_in_order_and_pads_communication_groups():
    layout = plan_chunks([6, 3, 2, 9, 1], chunk_numel=10, world=2)
    assert [(s.chunk, s.offset) for s in layout.slots] == [(0, 0), (0, 6), (1, 0), (2, 0), (2, 9)]
    assert layout.num_chunks == 4  # three used, padded to whole groups of two
    assert list(layout.group(3)) == [2, 3] and layout.owner(3) == 1 and layout.local_chunks(0) == [0, 2]


def test_layout_refuses_a_parameter_larger_than_a_chunk():
    with pytest.raises(ValueError, match="raise chunk_bytes to at least 11 elements"):
        plan_chunks([4, 11], chunk_numel=10)


def test_pool_asks_for_eviction_before_it_refuses():
    pool, asked = MemoryPool("device", 100), []

    def evict(need: int) -> None:
        asked.append(need)
        pool.release("chunk", 40)

    pool.reserve("chunk", 80)
    pool.on_pressure = evict
    pool.reserve("activation", 50)  # 130 > 100: the manager frees 40, then it fits
    assert asked == [30] and pool.used == 90 and pool.peak == 90 and pool.peak_non_model == 50
    with pytest.raises(BudgetExceeded, match=r"device budget 0.0 MiB exceeded placing .* of activation"):
        pool.reserve("activation", 60)  # the manager frees 40 again; still 110 > 100
    assert pool.used == 50  # nothing half-placed


def test_belady_evicts_the_chunk_needed_last():
    params = [nn.Parameter(torch.full((10,), float(i))) for i in range(3)]  # one 40-byte chunk each
    device = MemoryPool("device", 80)
    manager = ChunkManager(params, 40, device, MemoryPool("host", None))
    for p in params[:2]:
        manager.access([p])
        manager.release([p], TensorState.HOLD_AFTER_FWD)
    manager.policy.trace = Trace.of([0, 1, 2, 0, 1])  # chunk 0 is needed again before chunk 1
    manager.access([params[2]])
    assert [c.where for c in manager.policy.chunks] == ["device", "host", "device"]
    assert torch.equal(params[0].detach(), torch.zeros(10)) and manager.policy.traffic.evictions == 1
    manager.release([params[2]], TensorState.HOLD_AFTER_FWD)
    manager.access([params[1]])  # the payload comes back intact
    assert torch.equal(params[1].detach(), torch.ones(10))


def test_warm_up_evicts_in_chunk_list_order():
    params = [nn.Parameter(torch.zeros(10)) for _ in range(3)]
    manager = ChunkManager(params, 40, MemoryPool("device", 80), MemoryPool("host", None))
    for p in params:
        manager.access([p])
        manager.release([p], TensorState.HOLD_AFTER_FWD)
    assert [c.where for c in manager.policy.chunks] == ["host", "device", "device"]


def test_a_computing_chunk_is_never_evicted():
    params = [nn.Parameter(torch.zeros(10)) for _ in range(3)]
    manager = ChunkManager(params, 40, MemoryPool("device", 80), MemoryPool("host", None))
    manager.access(params[:2])  # both COMPUTE: nothing may leave for the third
    with pytest.raises(BudgetExceeded, match="nothing more can be evicted"):
        manager.access([params[2]])


@pytest.mark.parametrize("optimizer", [ADAM, SGD], ids=["adam", "sgd"])
def test_chunked_training_under_a_budget_equals_training_in_memory(optimizer):
    expected = reference(optimizer)
    with torch_threads(1):
        run = train_chunked(SPEC, DATA, SEED, 2, STEPS, optimizer, device_budget=BUDGET, chunk_bytes=CHUNK)
    assert run.model_bytes == MODEL_BYTES
    assert run.losses == pytest.approx(expected, rel=1e-5, abs=0)
    assert run.device_peak <= BUDGET < run.model_bytes  # never more than ~5/8 of the model was resident
    for moved in run.traffic:  # every iteration swapped chunks out and back in
        assert moved.to_device > 0 and moved.to_host > 0 and moved.evictions > 0
    assert run.optimizer_chunks_on_device == 0  # no margin left beside the parameter chunks
    steady = run.traffic[1:]
    assert max(t.evictions for t in steady) <= run.traffic[0].evictions  # Belady after the warm-up


def test_micro_batches_accumulate_before_gradients_take_the_parameter_slots():
    expected = reference(ADAM, global_batch_size=4)
    with torch_threads(1):
        run = train_chunked(SPEC, DATA, SEED, 4, STEPS, ADAM, device_budget=None, chunk_bytes=CHUNK,
                            micro_batches=2)
    assert run.losses == pytest.approx(expected, rel=1e-5, abs=0)
    assert run.non_model_peak >= MODEL_BYTES  # the first micro-batch's gradients are held for the second


def test_optimizer_states_move_into_the_margin_when_they_fit():
    with torch_threads(1):
        run = train_chunked(SPEC, DATA, SEED, 2, STEPS, ADAM, device_budget=80_000_000, chunk_bytes=CHUNK)
    assert run.optimizer_chunks_on_device == run.chunks  # everything fits: all states go to the device
    assert [t.to_device + t.to_host for t in run.traffic[2:]] == [0] * (STEPS - 2)  # nothing moves any more


def test_a_budget_below_one_layer_fails_loudly():
    with torch_threads(1), pytest.raises(BudgetExceeded, match="raise the device budget"):
        train_chunked(SPEC, DATA, SEED, 2, 1, ADAM, device_budget=3_000_000, chunk_bytes=CHUNK)


def test_data_parallel_chunks_on_two_gloo_ranks_equal_training_in_memory(tmp_path: Path):
    expected = reference(ADAM, global_batch_size=4)
    config = {"model": MessageToDict(SPEC, preserving_proto_field_name=True), "seed": SEED, "global_batch_size": 4,
              "iterations": STEPS, "optimizer": ADAM, "device_budget": 11_000_000, "chunk_bytes": 1_100_000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    procs = [subprocess.Popen([sys.executable, "-m", "services.executor.train.offload", "--config",
                               str(tmp_path / "config.json"), "--rank", str(r), "--world", "2",
                               "--init", f"file://{tmp_path / 'rendezvous'}", "--out", str(tmp_path / f"{r}.json")])
             for r in range(2)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["losses"] == pytest.approx(expected, rel=1e-5, abs=0)
        assert result["device_peak"] <= 11_000_000 < result["model_bytes"]
        # the host holds this rank's local half of the chunks, in four lists (parameters, master, momentum, variance)
        assert result["host_peak"] <= result["chunks"] // 2 * 4 * 1_100_000 < 4 * result["model_bytes"]
        sim = simulated(result["activation_bytes"], ChunkOptions(1_100_000, 11_000_000, world=2), STEPS,
                        rank=result["rank"])
        for moved, predicted in zip(result["traffic"], sim.traffic, strict=True):
            assert moved["gathered"] > 0 and moved["reduced"] > 0
            for key in ("to_device", "to_host", "gathered", "reduced"):
                assert within(moved[key], getattr(predicted, key)), (key, moved, predicted)


def simulated(run_activations: list, options: ChunkOptions, iterations: int, rank: int = 0) -> ChunkSim:
    tensors, layers = tensor_map(build_model(SPEC, device="meta"))
    model = ChunkModel(tuple(tensors), tuple(map(tuple, layers)), tuple(a[1] for a in run_activations),
                       tuple(a[0] for a in run_activations))
    return simulate_chunks(model, options, iterations=iterations, rank=rank)


def within(measured: int, predicted: int, tolerance: float = 0.10) -> bool:
    return abs(predicted - measured) <= tolerance * measured


@pytest.mark.parametrize("micro_batches,budget", [(1, BUDGET), (2, 24_000_000)], ids=["one", "two-micro-batches"])
def test_simulator_predicts_the_swap_bytes_the_runtime_moves(micro_batches, budget):
    with torch_threads(1):
        run = train_chunked(SPEC, DATA, SEED, 2 * micro_batches, STEPS, ADAM, device_budget=budget,
                            chunk_bytes=CHUNK, micro_batches=micro_batches)
    sim = simulated(run.activation_bytes, ChunkOptions(CHUNK, budget, micro_batches=micro_batches), STEPS)
    assert sim.feasible, sim.reason
    for measured, predicted in zip(run.traffic, sim.traffic, strict=True):
        assert measured.to_device > 0
        assert within(measured.to_device, predicted.to_device) and within(measured.to_host, predicted.to_host)
    assert within(run.device_peak, sim.device_peak, 0.05)


def test_simulator_refuses_what_the_runtime_refuses():
    sim = simulated([(192, 192)] + [(262_528, 262_528)] * 4 + [(41_220, 41_220)], ChunkOptions(CHUNK, 3_000_000), 1)
    assert not sim.feasible and "raise the device budget" in sim.reason
