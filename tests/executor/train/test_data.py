"""Training data: deterministic samples whatever the split, a learnable synthetic task, token-file windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2
from services.data.batches import batch_for
from services.executor.train.data import sample_range
from services.executor.train.reference import train_single
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.specs.user_inputs import UserInputs

SYNTHETIC = {}


def gpt(**transformer) -> model_pb2.ModelSpec:
    cfg = {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 64, "seq_length": 16} | transformer
    return ParseDict({"name": "g", "family": "MODEL_FAMILY_GPT", "transformer": cfg}, model_pb2.ModelSpec())


BERT = ParseDict({"name": "b", "family": "MODEL_FAMILY_BERT", "transformer": {
    "num_layers": 1, "hidden_size": 16, "num_heads": 2, "vocab_size": 32, "seq_length": 8}}, model_pb2.ModelSpec())


pytestmark = pytest.mark.usefixtures("one_thread")  # timings and sums as the workers run them


@pytest.mark.parametrize("spec", [gpt(), BERT], ids=["gpt", "bert"])
def test_any_split_draws_the_same_samples(spec):
    whole = batch_for(spec, SYNTHETIC, 5, 3, 0, 8, global_batch_size=8)
    parts = [batch_for(spec, SYNTHETIC, 5, 3, b, b + 2, global_batch_size=8) for b in range(0, 8, 2)]
    for key, value in whole.items():
        assert torch.equal(value, torch.cat([p[key] for p in parts])), key
    again = batch_for(spec, SYNTHETIC, 5, 3, 0, 8, global_batch_size=8)
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    other = batch_for(spec, SYNTHETIC, 5, 4, 0, 8, global_batch_size=8)
    assert not torch.equal(whole["input_ids"], other["input_ids"])


def test_sample_order_is_replica_then_micro_batch():
    # 2 replicas x 3 micro-batches of 2: replica 1's micro-batch 0 starts after replica 0's six samples.
    assert sample_range(0, 0, 2, 3) == (0, 2)
    assert sample_range(0, 2, 2, 3) == (4, 6)
    assert sample_range(1, 0, 2, 3) == (6, 8)
    assert sample_range(1, 2, 2, 3) == (10, 12)


def test_synthetic_gpt_sequences_follow_their_rule():
    b = batch_for(gpt(), SYNTHETIC, 0, 0, 0, 4, global_batch_size=4)
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


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_are_drawn_once_per_epoch_in_a_reshuffled_order(tmp_path, dtype):
    seq, vocab = 16, 64
    tokens = (np.arange(5 * (seq + 1) + 3) % vocab).astype(dtype)  # five whole windows and a ragged tail
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    data = {"tokens": {"path": str(path), "dtype": f"TOKEN_DTYPE_{dtype.upper()}"}}
    roots = UserInputs.of(data_roots=[str(tmp_path)])
    windows = [tokens[w * (seq + 1):(w + 1) * (seq + 1)].astype(np.int64) for w in range(5)]
    epochs = [batch_for(gpt(), data, 3, e, 0, 5, global_batch_size=5, user_inputs=roots) for e in range(3)]
    for b in epochs:  # each epoch (5 samples = one iteration here) is every window once
        got = sorted(tuple(row) for row in torch.cat([b["input_ids"], b["labels"][:, -1:]], 1).tolist())
        assert got == sorted(tuple(w) for w in windows)
        assert torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])
    orders = [tuple(b["input_ids"][:, 0].tolist()) for b in epochs]
    assert len(set(orders)) > 1  # reshuffled from the seed ...
    again = batch_for(gpt(), data, 3, 1, 1, 3, global_batch_size=5, user_inputs=roots)
    assert torch.equal(again["input_ids"], epochs[1]["input_ids"][1:3])  # ... and the same whoever draws it


def test_token_data_is_read_under_the_data_roots_and_checked_against_the_vocabulary(tmp_path):
    path = tmp_path / "tokens.bin"
    (np.arange(40) + 100).astype(np.uint16).tofile(path)
    data = {"tokens": {"path": str(path)}}
    roots = UserInputs.of(data_roots=[str(tmp_path)])
    with pytest.raises(ValueError, match="token id 1[0-3][0-9] is not below the model's vocabulary of 64"):
        batch_for(gpt(), data, 0, 0, 0, 1, global_batch_size=1, user_inputs=roots)
    with pytest.raises(InvalidArgument, match="BALLAST_DATA_ROOTS is empty"):
        batch_for(gpt(vocab_size=256), data, 0, 0, 0, 1, global_batch_size=1)
    with pytest.raises(FailedPrecondition, match="next-token and masked-token models only"):
        batch_for(BERT, data, 0, 0, 0, 1, global_batch_size=1, user_inputs=roots)
    with pytest.raises(ValueError, match="global batch"):
        batch_for(gpt(), SYNTHETIC, 0, 0, 3, 5, global_batch_size=4)
