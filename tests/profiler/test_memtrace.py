"""Warm-up iteration memory trace: non-model bytes per operator, bounded timeline, model untouched."""

from __future__ import annotations

import pytest
import torch
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2
from services.profiler.memtrace import LiveTensorTracker, TracePoint, _Recorder, trace_iteration
from services.zoo import build_model, example_input

GPT = {
    "name": "gpt",
    "family": "MODEL_FAMILY_GPT",
    "transformer": {"hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_length": 16, "num_layers": 2}
    | {"tie_embeddings": True},
}


pytestmark = pytest.mark.usefixtures("one_thread")  # timings and sums as the workers run them


@pytest.fixture(scope="module")
def gpt():
    spec = ParseDict(GPT, model_pb2.ModelSpec())
    model = build_model(spec, seed=0)
    return model, model.decompose(), example_input(spec, 2)


def test_trace_of_a_tiny_gpt_iteration(gpt):
    model, decomposition, batch = gpt
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace = trace_iteration(decomposition, batch)
    assert trace.timeline and trace.ops == len(trace.timeline) and trace.stride == 1
    assert all(trace.peak_non_model_bytes >= p.non_model_bytes for p in trace.timeline)
    assert trace.peak in trace.timeline
    assert {p.phase for p in trace.timeline} == {"forward", "backward", "step"}
    backward = [p for p in trace.timeline if p.phase == "backward"]
    assert max(p.non_model_bytes for p in backward) > 0
    assert {p.layer for p in backward} >= {layer.name for layer in decomposition.layers}
    assert [p.op_index for p in trace.timeline] == sorted(p.op_index for p in trace.timeline)
    # activations of a [2, 16, 32] stream through two blocks outweigh one activation
    assert trace.peak_non_model_bytes > 2 * 16 * 32 * 4
    params = sum(p.numel() for p in model.parameters())
    assert trace.model_bytes >= 16 * params  # fp32 params + grads + Adam moments
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())


def test_timeline_is_bounded_and_keeps_the_peak(gpt):
    _, decomposition, batch = gpt
    full = trace_iteration(decomposition, batch)
    small = trace_iteration(decomposition, batch, max_points=16)
    assert len(small.timeline) <= 16 and small.stride > 1 and small.ops == full.ops
    assert small.peak_non_model_bytes == full.peak_non_model_bytes
    assert max(p.non_model_bytes for p in small.timeline) == small.peak_non_model_bytes


def test_recorder_max_pools_pairs():
    recorder = _Recorder(max_points=4)
    for i, b in enumerate([5, 1, 2, 9, 3, 3, 7, 0, 4, 1]):
        recorder.add(TracePoint(i, "op", "layer", "forward", b))
    recorder.flush()
    trace = recorder.trace
    assert len(trace.timeline) <= 4 and trace.peak_non_model_bytes == 9 and trace.ops == 10
    assert max(p.non_model_bytes for p in trace.timeline) == 9


def test_live_tensor_tracker_follows_storages():
    with LiveTensorTracker() as tracker:
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:]
        b = a * 2
        del a
        assert tracker.live_bytes() == 8000  # the view keeps a's storage alive
        del view
        assert tracker.live_bytes() == 4000
        del b
    assert tracker.live_bytes() == 0 and tracker.peak_bytes == 8000


def test_model_with_gradients_is_refused(gpt):
    model, decomposition, batch = gpt
    p = next(model.parameters())
    p.grad = torch.zeros_like(p)
    try:
        with pytest.raises(ValueError, match="without gradients"):
            trace_iteration(decomposition, batch)
    finally:
        p.grad = None
