"""Deterministic samples: sample k of iteration i is a pure function of (seed, i * global_batch + k).

Whoever draws a sample (any stage, replica or micro-batch split, or the single-process reference) gets the
same tensors, so the global batch of an iteration is the same multiset of samples under every plan. Order
inside an iteration: replica r, micro-batch j takes samples [r * nm * m + j * m, ... + m) (`sample_range`).

Sources (`data` dict of the WorkerConfig):
- {"kind": "synthetic"}: for next-token models (GPT, a Hugging Face causal LM) a learnable task, each sequence an
  arithmetic progression
  t_k = (a + k * d) mod vocab from a random start a and a step d in [1, 4]: after two tokens the rest is
  predictable, so next-token loss falls far below log(vocab). Other families fall back to the zoo's
  `example_input` drawn per sample from a generator seeded by (seed, global sample index).
- {"kind": "tokens", "path": ..., "dtype": "uint16" | "int32"}: a flat token file (nanoGPT-style, read via
  numpy memmap) cut into non-overlapping windows of seq_length + 1; global sample n takes window
  n mod (number of windows). Next-token models only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ballast.v1 import model_pb2
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import causal_lm_shape, example_input

MAX_STEP = 4
_MASK = (1 << 64) - 1


def mix(*values: int) -> int:
    """splitmix64 over the values: a well-spread 63-bit seed from small integers."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h >> 1


def dropout_seed(seed: int, iteration: int, micro_batch: int) -> int:
    """RNG seed of one micro-batch (global index replica * nm + j): every stage replays the same stream, and
    activation recompute replays it (recompute.py keeps each checkpointed run's RNG state)."""
    return mix(seed, iteration, micro_batch)


def sample_range(replica: int, micro_batch: int, micro_batch_size: int, num_micro_batches: int) -> tuple[int, int]:
    """[begin, end) sample indices within the iteration for (replica, micro-batch)."""
    begin = replica * num_micro_batches * micro_batch_size + micro_batch * micro_batch_size
    return begin, begin + micro_batch_size


def batch_for(
    spec: model_pb2.ModelSpec,
    data: dict[str, Any],
    seed: int,
    iteration: int,
    sample_begin: int,
    sample_end: int,
    *,
    global_batch: int,
    user_inputs: UserInputs = NO_USER_INPUTS,
) -> dict[str, Tensor]:
    """Samples [sample_begin, sample_end) of 0-based iteration `iteration`, keyed as the zoo layers read them."""
    if not 0 <= sample_begin < sample_end <= global_batch:
        raise ValueError(f"samples [{sample_begin}, {sample_end}) outside the global batch of {global_batch}")
    first = iteration * global_batch + sample_begin
    indices = range(first, first + sample_end - sample_begin)
    kind = data.get("kind")
    text = causal_lm_shape(spec, user_inputs)  # (vocab, seq_length) of a next-token model
    if kind == "tokens":
        if text is None:
            raise ValueError("data.kind 'tokens' supports next-token models only (GPT, a Hugging Face causal LM); "
                             "use 'synthetic' for other families")
        return _token_windows(data, *text, indices)
    if kind != "synthetic":
        raise ValueError(f"data.kind {kind!r}: use 'synthetic' or 'tokens'")
    if text is not None:
        return _progressions(*text, seed, indices)
    parts = [example_input(spec, 1, generator=torch.Generator().manual_seed(mix(seed, n)), user_inputs=user_inputs)
             for n in indices]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _progressions(vocab: int, s: int, seed: int, indices: range) -> dict[str, Tensor]:
    h = np.array([mix(seed, n) for n in indices], dtype=np.uint64)
    start = (h % np.uint64(vocab)).astype(np.int64)
    step = ((h >> np.uint64(32)) % np.uint64(MAX_STEP)).astype(np.int64) + 1
    tokens = (start[:, None] + step[:, None] * np.arange(s + 1)[None, :]) % vocab
    t = torch.from_numpy(tokens)
    return {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


def _token_windows(data: dict[str, Any], vocab: int, seq_length: int, indices: range) -> dict[str, Tensor]:
    dtype = data.get("dtype", "uint16")
    if dtype not in ("uint16", "int32"):
        raise ValueError(f"data.dtype {dtype!r}: token files hold 'uint16' or 'int32' tokens")
    tokens = np.memmap(data["path"], dtype=np.dtype(dtype), mode="r")
    width = seq_length + 1
    windows = len(tokens) // width
    if windows < 1:
        raise ValueError(f"data.path {data['path']}: {len(tokens)} tokens, need at least seq_length + 1 = {width}")
    rows = np.stack([np.asarray(tokens[(n % windows) * width : (n % windows + 1) * width]) for n in indices])
    t = torch.from_numpy(rows.astype(np.int64))
    if int(t.max()) >= vocab or int(t.min()) < 0:
        raise ValueError(f"data.path {data['path']}: token ids outside [0, vocab_size={vocab})")
    return {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}
