"""The batches a job's layers read: samples [begin, end) of an iteration's global batch (training) or of one of the
validation batches (evaluation), from the job's data opened once per process.

Training sample k of iteration i is the job's global sample n = i * global_batch_size + k, taken in `order`'s
reshuffled epochs of the data; without data, the model's synthetic samples (for next-token models a learnable
task, each sequence an arithmetic progression t_j = (a + j * d) mod vocab from a random start a and a step d in
[1, 4]; for other models the zoo's `example_input`, seeded by (seed, n)). Validation batch b's sample k is
validation sample (b * global_batch_size + k) mod N, in order, so every evaluation sees the same samples; without a
validation set, held-out synthetic samples of a stream of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf.json_format import ParseDict
from torch import Tensor

from ballast.v1 import job_pb2, model_pb2
from services.data.order import mix, train_index
from services.data.sources import Source, TextShape, fields, open_sources, text_shape
from services.runtime.errors import FailedPrecondition
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import causal_lm_shape, example_input

MAX_STEP = 4
HELD_OUT = 0xE7A1  # the synthetic validation stream's seed salt


@dataclass(eq=False)
class JobData:
    """A job's data as one process reads it: the model's shape and the opened sources (None: synthetic)."""

    spec: model_pb2.ModelSpec
    shape: TextShape | None
    train: Source | None
    validation: Source | None
    user_inputs: UserInputs

    @property
    def train_samples(self) -> int:
        """Samples in one epoch (0: synthetic, which has no end)."""
        return len(self.train) if self.train is not None else 0

    def epoch(self, sample: int) -> int:
        """The epoch a job's global training sample falls in (0 for synthetic data)."""
        return sample // self.train_samples if self.train_samples else 0

    def train_batch(self, seed: int, first: int, count: int) -> dict[str, Tensor]:
        if self.train is None:
            return self._synthetic(seed, range(first, first + count))
        picks = [(n, train_index(n, len(self.train), seed)[1]) for n in range(first, first + count)]
        return self._stack(self.train, seed, picks)

    def validation_batch(self, seed: int, first: int, count: int) -> dict[str, Tensor]:
        if self.validation is None:
            return self._synthetic(mix(seed, HELD_OUT), range(first, first + count))
        size = len(self.validation)
        return self._stack(self.validation, seed, [(n, n % size) for n in range(first, first + count)])

    def _stack(self, source: Source, seed: int, picks: list[tuple[int, int]]) -> dict[str, Tensor]:
        """(global sample, index) pairs as one batch; a masked-token sample's mask is drawn per global sample."""
        if self.shape is None:
            parts = [source.sample(i) for _, i in picks]
        else:
            parts = [fields(source.sample(i), self.shape, seed, n) for n, i in picks]
            largest = max(int(p["labels"].max()) for p in parts)
            if largest >= self.shape.vocab:  # checked at Submit; a file changed since is caught here
                raise ValueError(f"data: token id {largest} is not below the model's vocabulary of "
                                 f"{self.shape.vocab} (the file changed since the job was submitted?)")
        return {k: torch.stack([p[k] for p in parts]) for k in parts[0]}

    def _synthetic(self, seed: int, indices: range) -> dict[str, Tensor]:
        text = causal_lm_shape(self.spec, self.user_inputs)
        if text is not None:
            return progressions(*text, seed, indices)
        parts = [example_input(self.spec, 1, generator=torch.Generator().manual_seed(mix(seed, n)),
                               user_inputs=self.user_inputs) for n in indices]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def progressions(vocab: int, s: int, seed: int, indices: range) -> dict[str, Tensor]:
    h = np.array([mix(seed, n) for n in indices], dtype=np.uint64)
    start = (h % np.uint64(vocab)).astype(np.int64)
    step = ((h >> np.uint64(32)) % np.uint64(MAX_STEP)).astype(np.int64) + 1
    tokens = (start[:, None] + step[:, None] * np.arange(s + 1)[None, :]) % vocab
    t = torch.from_numpy(tokens)
    return {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


Data = job_pb2.DataSpec | Mapping[str, Any]  # the message, or its JSON form (WorkerConfig.data; {}: synthetic)


def data_spec(data: Data) -> job_pb2.DataSpec:
    return data if isinstance(data, job_pb2.DataSpec) else ParseDict(dict(data), job_pb2.DataSpec())


def job_data(spec: model_pb2.ModelSpec, data: Data, user_inputs: UserInputs = NO_USER_INPUTS) -> JobData:
    """The job's data, opened once per process for a (model, data, operator settings)."""
    return _opened(spec.SerializeToString(deterministic=True),
                   data_spec(data).SerializeToString(deterministic=True), user_inputs)


@functools.lru_cache(maxsize=8)
def _opened(spec_bytes: bytes, data_bytes: bytes, user_inputs: UserInputs) -> JobData:
    spec, data = model_pb2.ModelSpec.FromString(spec_bytes), job_pb2.DataSpec.FromString(data_bytes)
    if data.WhichOneof("source") is None:
        return JobData(spec, None, None, None, user_inputs)
    shape = text_shape(spec, user_inputs) if data.WhichOneof("source") != "factory" else None
    if shape is None and data.WhichOneof("source") != "factory":
        raise FailedPrecondition("token data feeds next-token and masked-token models only", field="spec.data",
                                 fix="use a data factory for this model, or train it on its synthetic samples")
    train, validation = open_sources(data, shape, user_inputs)
    return JobData(spec, shape, train, validation, user_inputs)


def batch_for(spec: model_pb2.ModelSpec, data: Data, seed: int, iteration: int, sample_begin: int,
              sample_end: int, *, global_batch_size: int,
              user_inputs: UserInputs = NO_USER_INPUTS) -> dict[str, Tensor]:
    """Training samples [sample_begin, sample_end) of 0-based iteration `iteration`, keyed as the layers read them."""
    if not 0 <= sample_begin < sample_end <= global_batch_size:
        raise ValueError(f"samples [{sample_begin}, {sample_end}) outside the global batch of {global_batch_size}")
    return job_data(spec, data, user_inputs).train_batch(seed, iteration * global_batch_size + sample_begin,
                                                         sample_end - sample_begin)


def validation_batch_for(spec: model_pb2.ModelSpec, data: Data, seed: int, batch: int,
                         sample_begin: int, sample_end: int, *, global_batch_size: int,
                         user_inputs: UserInputs = NO_USER_INPUTS) -> dict[str, Tensor]:
    """Samples [sample_begin, sample_end) of validation batch `batch` (of `global_batch_size` samples)."""
    if not 0 <= sample_begin < sample_end <= global_batch_size:
        raise ValueError(f"samples [{sample_begin}, {sample_end}) outside the global batch of {global_batch_size}")
    return job_data(spec, data, user_inputs).validation_batch(seed, batch * global_batch_size + sample_begin,
                                                              sample_end - sample_begin)
