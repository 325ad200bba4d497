"""The live-heap peak sampler (heap.py) and the heap_peak_bytes it puts in a one-rank worker's iteration events."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import model_pb2
from services.executor.train import heap
from services.executor.train.config import WorkerConfig
from services.executor.train.worker import run
from services.runtime.ports import free_port

pytestmark = [pytest.mark.skipif(heap.live_bytes() is None, reason="needs glibc's mallinfo2"),
              pytest.mark.usefixtures("one_thread")]
SIZE = 64 << 20
SLACK = 16 << 20  # what other threads of this process may allocate or free meanwhile
GPT = ParseDict({"name": "g", "family": "MODEL_FAMILY_GPT", "transformer": {
    "hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_length": 16, "num_layers": 2}}, model_pb2.ModelSpec())


@pytest.fixture
def sampler():
    heap.stop()
    yield heap.start()
    heap.stop()  # the thread must not outlive the test: it costs CPU


def sampled(s: heap.Sampler, reads: int = 2) -> None:
    """Wait (however slowly the machine runs) until the thread has read the heap `reads` more times."""
    target, deadline = s.samples + reads, time.monotonic() + 120  # a hang guard, not a timing check
    while s.samples < target:
        assert time.monotonic() < deadline, "the sampler thread stopped reading"
        time.sleep(0.001)


def test_the_peak_outlives_a_freed_allocation_and_resets(sampler):
    assert heap.start() is sampler  # one per process
    before = heap.live_bytes()
    block = bytearray(SIZE)
    assert heap.live_bytes() >= before + SIZE - SLACK  # counted whether glibc served it from the arena or mmap
    sampled(sampler)
    del block
    assert heap.live_bytes() < before + SIZE - SLACK
    assert heap.take_peak() >= before + SIZE - SLACK
    assert heap.take_peak() < before + SIZE - SLACK  # reset to the heap in use at the previous call
    block = bytearray(SIZE)
    sampled(sampler)
    del block
    assert heap.take_peak() >= before + SIZE - SLACK


def test_nothing_is_reported_without_a_sampler():
    heap.stop()
    assert heap.take_peak() == 0


def test_iteration_events_carry_the_heap_peak_when_asked(monkeypatch):
    config = WorkerConfig(
        job_id="job-heap", model=MessageToDict(GPT, preserving_proto_field_name=True), stage_bounds=[[0, 4]],
        num_replicas=1, stage_index=0, replica_index=0, rank=0, world_size=1, micro_batch_size=2,
        num_micro_batches=2, iterations=2, init_method=f"tcp://127.0.0.1:{free_port()}",
        optimizer={"name": "adam", "learning_rate": 1e-3}, seed=1, timeout_s=30)
    heap.stop()
    events: list[dict] = []
    try:
        run(config, events.append)  # BALLAST_HEAP_PEAK unset: no sampler, 0
        monkeypatch.setenv(heap.ENV, "1")
        run(config, events.append)
    finally:
        heap.stop()
    assert not dist.is_initialized()
    peaks = [e["heap_peak_bytes"] for e in events if e["event"] == "iteration"]
    assert peaks[:2] == [0, 0]
    assert len(peaks) == 4 and all(p > 0 for p in peaks[2:])
