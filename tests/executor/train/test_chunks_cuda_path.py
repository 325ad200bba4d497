"""The chunk manager's CUDA path (issue 19), the parts a CPU can check: the budget arithmetic, that the CPU keeps
its synchronous unpinned moves, and the CUDA move's order of operations driven through a recording stand-in for
the copy streams (a real GPU run is benchmarks/memory_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from services.executor.train import chunks
from services.executor.train.chunks import MIB, ChunkManager, CopyStreams, pool_budget
from services.executor.train.offload import train_chunked
from services.memory.chunk_policy import TensorState
from services.memory.pool import MemoryPool
from tests.executor.train.test_chunks import ADAM, BUDGET, CHUNK, DATA, SEED, SPEC, STEPS, reference
from tests.harness import torch_threads


class RecordingStreams:
    """CopyStreams' interface, copying synchronously and recording each copy: (into a device buffer, blocking,
    the target's and the source's storage bytes at the time)."""

    def __init__(self, device_buffers: dict[int, Tensor] | None = None) -> None:
        self.device_buffers = device_buffers if device_buffers is not None else {}
        self.log: list[tuple[bool, bool, int, int]] = []

    def copy(self, target: Tensor, source: Tensor, *, blocking: bool) -> None:
        into_device = any(target is t for t in self.device_buffers.values())
        self.log.append((into_device, blocking, target.untyped_storage().nbytes(), source.untyped_storage().nbytes()))
        target.copy_(source)

    def take_seconds(self) -> float:
        return 0.25 * len(self.log)


def test_the_pool_gets_the_budget_less_the_runtime_the_transients_and_the_rounding():
    # 1 GiB, a 65 MiB runtime, 32 MiB chunks: two chunks of transients, 33 MiB of rounding (32 chunks fit, + 1)
    assert pool_budget(1024 * MIB, 65 * MIB, 32 * MIB) == (1024 - 65 - 64 - 33) * MIB
    assert pool_budget(1024 * MIB, 0, 8 * MIB) == (1024 - 16 - 129) * MIB  # more chunks fit: more rounding
    with pytest.raises(ValueError, match="leaves nothing for the chunks"):
        pool_budget(100 * MIB, 65 * MIB, 16 * MIB)


def test_the_cpu_keeps_synchronous_unpinned_moves():
    assert CopyStreams.for_device(torch.device("cpu")) is None
    params = [nn.Parameter(torch.full((10,), float(i))) for i in range(3)]
    manager = ChunkManager(params, 40, MemoryPool("device", 80), MemoryPool("host", None))
    assert manager.streams is None
    assert not any(h.is_pinned() for h in manager.host.values())
    manager.access([params[0]])
    key = manager.policy.chunks[0].key
    assert manager.host[key].untyped_storage().nbytes() == 0  # the CPU frees the side it left, as before
    assert manager.device[key].untyped_storage().nbytes() == 40
    assert manager.take_swap_s() > 0 and manager.seconds["move"] == 0


def test_chunks_are_built_one_device_buffer_at_a_time_on_the_named_device():
    params = [nn.Parameter(torch.arange(6.0) + 10 * i) for i in range(4)]
    manager = ChunkManager(params, 48, MemoryPool("device", None), MemoryPool("host", None), device="cpu")
    assert manager.layout.num_chunks == 2
    assert all(manager.device[c.key].untyped_storage().nbytes() == 0 for c in manager.policy.chunks)
    for i, p in enumerate(params):  # each parameter is a view of its chunk, the payload on the host
        slot = manager.layout.slots[i]
        assert p.untyped_storage().data_ptr() == manager.device[slot.chunk].untyped_storage().data_ptr()
        host = manager.host[manager.policy.chunks[slot.chunk].key]
        assert torch.equal(host[slot.offset:slot.offset + slot.numel], torch.arange(6.0) + 10 * i)
    master = manager.policy.os[0]["master"]
    assert torch.equal(manager.host[master.key], manager.host[manager.policy.chunks[0].key])


def test_the_cuda_move_allocates_before_copying_in_and_frees_only_after_a_blocking_copy_out():
    params = [nn.Parameter(torch.full((10,), float(i))) for i in range(3)]
    manager = ChunkManager(params, 40, MemoryPool("device", 80), MemoryPool("host", None))
    manager.streams = streams = RecordingStreams(manager.device)
    for p in params[:2]:
        manager.access([p])
        manager.release([p], TensorState.HOLD_AFTER_FWD)
    manager.access([params[2]])  # evicts chunk 0
    assert streams.log == [
        (True, False, 40, 40),  # in: the device block exists before the copy fills it; the host is kept
        (True, False, 40, 40),
        (False, True, 40, 40),  # out: blocking, the device block still there while the copy reads it
        (True, False, 40, 40),
    ]
    first = manager.policy.chunks[0]
    assert first.where == "host" and manager.device[first.key].untyped_storage().nbytes() == 0  # freed after
    assert manager.host[first.key].untyped_storage().nbytes() == 40  # pinned host buffers are never resized
    manager.release([params[2]], TensorState.HOLD_AFTER_FWD)
    manager.access([params[0]])  # the payload comes back intact
    assert torch.equal(params[0].detach(), torch.zeros(10))
    assert manager.take_swap_s() == pytest.approx(0.25 * 6)  # the copies' own seconds count as the moves'


def test_training_through_the_cuda_moves_equals_training_in_memory(monkeypatch: pytest.MonkeyPatch):
    pinned: list[bool] = []

    def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
        pinned.append(pin)
        return torch.zeros(numel, dtype=dtype)  # no pinned allocator on a CPU-only build

    monkeypatch.setattr(chunks, "_host_buffer", host_buffer)
    monkeypatch.setattr(CopyStreams, "for_device", classmethod(lambda cls, device: RecordingStreams()))
    expected = reference(ADAM)
    with torch_threads(1):
        run = train_chunked(SPEC, DATA, SEED, 2, STEPS, ADAM, device_budget=BUDGET, chunk_bytes=CHUNK)
    assert pinned and all(pinned)  # a device with copy streams gets pinned host buffers
    assert run.losses == pytest.approx(expected, rel=1e-5, abs=0)
    assert run.device_peak <= BUDGET and run.pool_budget == BUDGET  # no CUDA reserve off a non-CUDA device
    assert all(t.to_device > 0 and t.to_host > 0 for t in run.traffic)


def test_a_closed_trainer_frees_its_device_buffers_and_is_collected():
    import gc
    import weakref

    from services.executor.train.offload import ChunkedTrainer

    with torch_threads(1):
        trainer = ChunkedTrainer(SPEC, DATA, SEED, 2, ADAM, device_budget=80_000_000, chunk_bytes=CHUNK)
        trainer.step(0)
    resident = [t for t in trainer.manager.device.values() if t.untyped_storage().nbytes()]
    assert resident  # the optimizer states moved into the margin after the warm-up
    trainer.close()
    assert all(t.untyped_storage().nbytes() == 0 for t in resident)
    ref = weakref.ref(trainer.manager)
    del trainer
    gc.collect()
    assert ref() is None  # the grad hooks autograd held are gone, so nothing keeps the chunks alive



def test_chunks_compute_in_bf16_on_a_gpu_and_in_fp32_on_the_cpu():
    """Mixed precision is the GPU's: a bf16 model keeps bf16 chunks there (fp32 master and states beside them);
    on the CPU every model trains in fp32; fp16 is refused until loss scaling exists."""
    from ballast.v1 import common_pb2, model_pb2
    from services.executor.train.offload import compute_dtype

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    bf16, fp16, fp32 = (model_pb2.ModelSpec(dtype=d) for d in (common_pb2.DTYPE_BF16, common_pb2.DTYPE_FP16,
                                                               common_pb2.DTYPE_FP32))
    assert compute_dtype(bf16, cuda) == torch.bfloat16
    assert compute_dtype(fp32, cuda) == compute_dtype(model_pb2.ModelSpec(), cuda) == torch.float32
    assert compute_dtype(bf16, cpu) == compute_dtype(fp16, cpu) == torch.float32
    with pytest.raises(ValueError, match="ModelSpec.dtype DTYPE_FP16: .* use DTYPE_BF16"):
        compute_dtype(fp16, cuda)
