"""Per-layer measurement on tiny zoo models: times recorded, bytes match what the layers hold."""

from __future__ import annotations

import pytest
import torch
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2
from services.profiler import measure
from services.profiler.measure import iter_layer_args, measure_layer, profile_layers, profile_model
from services.profiler.measure_bytes import adam_bytes_per_param, as_dtype
from services.profiler.measure_timing import robust_median
from services.zoo import build_model, example_input

D, HEADS, VOCAB, SEQ = 32, 4, 64, 16
TEXT = {"hidden_size": D, "num_heads": HEADS, "vocab_size": VOCAB, "seq_length": SEQ, "tie_embeddings": True}
GPT = {"name": "gpt", "family": "MODEL_FAMILY_GPT", "transformer": {**TEXT, "num_layers": 2}}
T5 = {
    "name": "t5",
    "family": "MODEL_FAMILY_T5",
    "transformer": {**TEXT, "num_layers": 1, "num_decoder_layers": 2, "decoder_seq_length": 8},
}


pytestmark = pytest.mark.usefixtures("one_thread")  # timings and sums as the workers run them


def built(raw: dict, batch: int):
    spec = ParseDict(raw, model_pb2.ModelSpec())
    decomposition = build_model(spec, seed=0).decompose()
    return spec, decomposition, example_input(spec, batch)


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def gpt_measurements():
    torch.set_num_threads(1)
    _, decomposition, batch = built(GPT, 2)
    found = [
        (decomposition.layers[i], args, measure_layer(decomposition, i, args))
        for i, args in iter_layer_args(decomposition, batch)
    ]
    return decomposition, found


def test_gpt_layers_times_and_model_bytes(gpt_measurements):
    _, found = gpt_measurements
    assert [m.name for _, _, m in found] == ["embed", "block.0", "block.1", "head"]
    for layer, _, m in found:
        assert m.forward_s > 0 and m.backward_s > 0 and m.recompute_s > 0 and m.no_grad_forward_s > 0
        n_samples = len(m.forward.samples)
        assert n_samples == len(m.backward.samples) == len(m.recompute.samples) == m.repeats
        assert 5 <= n_samples <= measure.MAX_REPEATS
        assert 1 <= m.forward.kept <= n_samples
        n = numel(layer.module)
        assert m.parameter_count == n
        assert (m.parameter_bytes, m.gradient_bytes, m.optimizer_state_bytes) == (4 * n, 4 * n, 8 * n)
        assert m.micro_batch_size == 2 and m.dtype == "float32" and m.device == "cpu"
        assert m.peak_memory_bytes >= m.parameter_bytes + m.boundary_activation_bytes + m.output_bytes


def test_gpt_activation_bytes(gpt_measurements):
    _, found = gpt_measurements
    for layer, args, m in found:
        activations = args[: len(layer.inputs)]
        assert m.boundary_activation_bytes == sum(a.numel() * 4 for a in activations)
        if layer.kind == "block":
            assert m.boundary_activation_bytes == 2 * SEQ * D * 4
            assert m.output_bytes == 2 * SEQ * D * 4
            # attention + MLP save several [b, s, d]-sized tensors (qkv, attention out, 4d MLP hidden, ...)
            assert m.stashed_activation_bytes > 4 * m.boundary_activation_bytes
    embed, head = found[0][2], found[-1][2]
    assert embed.boundary_activation_bytes == 0 and embed.batch_input_bytes == 2 * SEQ * 8  # int64 ids
    assert head.output_bytes == 4  # the summed loss, a scalar
    assert head.stashed_activation_bytes >= 2 * SEQ * VOCAB * 4  # the logits are saved for the loss


def test_tied_weights_are_counted_in_each_layer_and_reported(gpt_measurements):
    _, found = gpt_measurements
    embed, head = found[0][2], found[-1][2]
    assert embed.tied_with == (3,) and head.tied_with == (0,)
    assert embed.shared_parameter_count == head.shared_parameter_count == VOCAB * D
    assert found[1][2].shared_parameter_count == 0


def test_repeats_are_respected_and_bounded(monkeypatch):
    _, decomposition, batch = built(GPT, 1)
    monkeypatch.setattr(measure, "MIN_TIMED_S", 0.0)
    m = measure_layer(decomposition, 1, batch, repeats=7, warmup=2)
    assert len(m.forward.samples) == 7 and m.repeats == 7
    # A tiny layer keeps repeating until the timed forward+backward reach the floor, up to the cap.
    monkeypatch.setattr(measure, "MIN_TIMED_S", 3600.0)
    monkeypatch.setattr(measure, "MAX_REPEATS", 11)
    m = measure_layer(decomposition, 1, batch, repeats=7, warmup=2)
    assert len(m.forward.samples) == len(m.backward.samples) == m.repeats == 11
    with pytest.raises(ValueError):
        measure_layer(decomposition, 1, batch, repeats=3)
    with pytest.raises(ValueError):
        measure_layer(decomposition, 1, batch, warmup=1)


def test_stash_grows_with_the_micro_batch():
    _, decomposition, batch = built(GPT, 4)
    small = measure_layer(decomposition, 1, {k: v[:2] for k, v in batch.items()})
    large = measure_layer(decomposition, 1, batch)
    assert large.micro_batch_size == 4 and small.micro_batch_size == 2
    assert large.boundary_activation_bytes == 2 * small.boundary_activation_bytes
    assert 1.8 * small.stashed_activation_bytes <= large.stashed_activation_bytes <= 2 * small.stashed_activation_bytes


def test_t5_decoder_block_reads_the_encoder_output():
    _, decomposition, batch = built(T5, 2)
    index = next(layer.index for layer in decomposition.layers if layer.kind == "decoder_block")
    layer = decomposition.layers[index]
    m = measure_layer(decomposition, index, batch)
    assert m.extra_inputs == tuple(layer.extra_inputs) and m.extra_inputs
    # its own stream [2, 8, D] plus the encoder output [2, 16, D]
    assert m.boundary_activation_bytes == (2 * 8 * D + 2 * SEQ * D) * 4
    assert m.stashed_activation_bytes > 0 and m.forward_s > 0 and m.backward_s > 0
    assert m.shared_parameter_count > 0  # the relative-position table shared by the decoder stack


def test_mixed_precision_bytes_and_weights_restored():
    _, decomposition, batch = built(GPT, 2)
    module = decomposition.layers[1].module
    before = {k: v.clone() for k, v in module.state_dict().items()}
    m = measure_layer(decomposition, 1, batch, dtype="bf16")
    n = numel(module)
    assert (m.parameter_bytes, m.gradient_bytes, m.optimizer_state_bytes) == (2 * n, 2 * n, 12 * n)
    assert m.boundary_activation_bytes == 2 * SEQ * D * 2 and m.dtype == "bfloat16"
    for k, v in module.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k])


def test_bytes_per_param_formula():
    assert adam_bytes_per_param(torch.float32).total == 16
    assert adam_bytes_per_param(torch.float16).total == 16 and adam_bytes_per_param(torch.bfloat16).param == 2
    assert as_dtype(model_pb2.ModelSpec().dtype) == torch.float32 and as_dtype("DTYPE_BF16") == torch.bfloat16


def test_outlier_filter_drops_spikes():
    s = robust_median([1.0, 1.1, 0.9, 1.05, 100.0])
    assert s.kept == 4 and s.median == pytest.approx(1.025)
    assert robust_median([2.0, 2.0, 2.0, 3.0, 9.0]).kept == 5  # MAD 0: nothing is dropped


def test_profile_layers_protos():
    spec = ParseDict(GPT, model_pb2.ModelSpec())
    profiles = profile_layers(spec, [2, 1], intra_op_threads=1)
    assert torch.get_num_threads() == 1
    assert [p.name for p in profiles] == ["embed", "block.0", "block.1", "head"]
    assert [p.index for p in profiles] == [0, 1, 2, 3]
    assert list(profiles[0].tied_with) == [3] and profiles[1].parameter_bytes == 4 * profiles[1].parameter_count
    for p in profiles:
        assert [s.micro_batch_size for s in p.samples] == [1, 2]
        assert all(s.measured and s.forward_s > 0 for s in p.samples)
    assert profiles[1].samples[1].boundary_activation_bytes == 2 * profiles[1].samples[0].boundary_activation_bytes


def test_profile_model_records_how_it_measured():
    spec = ParseDict({**GPT, "dtype": "DTYPE_BF16"}, model_pb2.ModelSpec())
    profile = profile_model(spec, [1], intra_op_threads=1)
    assert profile.intra_op_threads == 1 and profile.software.startswith("torch ")
    assert profile.dtype == spec.dtype and len(profile.layers) == 4
    assert profile.layers[1].parameter_bytes == 2 * profile.layers[1].parameter_count
    assert profile.non_model_memory_bytes > 0


def test_a_measurement_records_its_spread_without_its_outliers():
    """The spread a profile stores beside each time (issue 45): 1.4826 x MAD of the kept repeats / their median;
    an outlier the filter dropped does not widen it."""
    s = robust_median([1.0, 1.1, 0.9, 1.0, 5.0])
    assert s.median == 1.0 and s.kept == 4
    assert s.spread == pytest.approx(1.4826 * 0.05)
    assert robust_median([2.0, 2.0, 2.0]).spread == 0.0 and robust_median([]).spread == 0.0
    _, decomposition, batch = built(GPT, 1)
    m = measure_layer(decomposition, 1, batch, repeats=7, warmup=2)
    row = m.sample()  # what the profile stores is the measurement's own spread
    assert (row.forward_spread, row.backward_spread) == (m.forward.spread, m.backward.spread)
