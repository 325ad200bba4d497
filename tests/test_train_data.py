"""Training data: deterministic samples whatever the split, a learnable synthetic task, token-file windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2
from services.executor.train.data import batch_for, sample_range
from services.executor.train.reference import train_single

SYNTHETIC = {"kind": "synthetic"}


def gpt(**transformer) -> model_pb2.ModelSpec:
    cfg = {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 64, "seq_length": 16} | transformer
    return ParseDict({"name": "g", "family": "MODEL_FAMILY_GPT", "transformer": cfg}, model_pb2.ModelSpec())


BERT = ParseDict({"name": "b", "family": "MODEL_FAMILY_BERT", "transformer": {
    "num_layers": 1, "hidden_size": 16, "num_heads": 2, "vocab_size": 32, "seq_length": 8}}, model_pb2.ModelSpec())


pytestmark = pytest.mark.usefixtures("one_thread")  # timings and sums as the workers run them


@pytest.mark.parametrize("spec", [gpt(), BERT], ids=["gpt", "bert"])
def test_any_split_draws_the_same_samples(spec):
    whole = batch_for(spec, SYNTHETIC, 5, 3, 0, 8, global_batch=8)
    parts = [batch_for(spec, SYNTHETIC, 5, 3, b, b + 2, global_batch=8) for b in range(0, 8, 2)]
    for key, value in whole.items():
        assert torch.equal(value, torch.cat([p[key] for p in parts])), key
    again = batch_for(spec, SYNTHETIC, 5, 3, 0, 8, global_batch=8)
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    other = batch_for(spec, SYNTHETIC, 5, 4, 0, 8, global_batch=8)
    assert not torch.equal(whole["input_ids"], other["input_ids"])


def test_sample_order_is_replica_then_micro_batch():
    # 2 replicas x 3 micro-batches of 2: replica 1's micro-batch 0 starts after replica 0's six samples.
    assert sample_range(0, 0, 2, 3) == (0, 2)
    assert sample_range(0, 2, 2, 3) == (4, 6)
    assert sample_range(1, 0, 2, 3) == (6, 8)
    assert sample_range(1, 2, 2, 3) == (10, 12)


def test_synthetic_gpt_sequences_follow_their_rule():
    b = batch_for(gpt(), SYNTHETIC, 0, 0, 0, 4, global_batch=4)
    ids, labels = b["input_ids"], b["labels"]
    assert ids.shape == labels.shape == (4, 16) and ids.dtype == torch.long
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    steps = (ids[:, 1:] - ids[:, :-1]) % 64
    assert torch.equal(steps, steps[:, :1].expand_as(steps))  # one constant step per sequence
    assert int(ids.max()) < 64


def test_synthetic_task_is_learnable():
    spec = gpt()
    losses = train_single(spec, SYNTHETIC, 0, 8, 30, {"name": "adam", "learning_rate": 3e-3})
    assert abs(losses[0] - math.log(64)) < 0.3
    assert np.mean(losses[-5:]) < 0.75 * losses[0]


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_token_file_windows(tmp_path, dtype):
    seq, vocab = 16, 64
    tokens = (np.arange(5 * (seq + 1) + 3) % vocab).astype(dtype)  # five whole windows and a ragged tail
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    data = {"kind": "tokens", "path": str(path), "dtype": dtype}
    b = batch_for(gpt(), data, 0, 1, 0, 4, global_batch=4)  # global samples 4..7 -> windows 4, 0, 1, 2
    rows = [torch.from_numpy(tokens[w * (seq + 1) : (w + 1) * (seq + 1)].astype(np.int64)) for w in (4, 0, 1, 2)]
    assert torch.equal(b["input_ids"], torch.stack([r[:-1] for r in rows]))
    assert torch.equal(b["labels"], torch.stack([r[1:] for r in rows]))


def test_token_file_errors(tmp_path):
    path = tmp_path / "tokens.bin"
    (np.arange(40) + 100).astype(np.uint16).tofile(path)
    data = {"kind": "tokens", "path": str(path)}
    with pytest.raises(ValueError, match="vocab_size"):
        batch_for(gpt(), data, 0, 0, 0, 1, global_batch=1)
    with pytest.raises(ValueError, match="GPT"):
        batch_for(BERT, data, 0, 0, 0, 1, global_batch=1)
    with pytest.raises(ValueError, match="global batch"):
        batch_for(gpt(), SYNTHETIC, 0, 0, 3, 5, global_batch=4)
