"""Where samples come from, one sample at a time, by index: a token file cut into windows, the rows of a saved
Hugging Face dataset, or an allow-listed factory's sequence. Token sources give token ids; `fields` turns them
into what a next-token or masked-token model's layers read (padding is never a label)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from ballast.v1 import job_pb2, model_pb2
from services.data.order import mix
from services.runtime.errors import InvalidArgument
from services.specs.user_inputs import ALLOWED_DATA_FACTORIES_FIX, UserInputs
from services.zoo import IGNORE_INDEX, causal_lm_shape
from services.zoo.base import struct_values

F, T = model_pb2.ModelFamily, model_pb2.HFTask
DTYPES = {job_pb2.TOKEN_DTYPE_UNSPECIFIED: np.uint16, job_pb2.TOKEN_DTYPE_UINT16: np.uint16,
          job_pb2.TOKEN_DTYPE_UINT32: np.uint32}
MASK_FRACTION = 0.15  # masked-token models: the share of positions masked (BERT's), drawn per sample from the seed


@dataclass(frozen=True)
class TextShape:
    """What a token source must fit: a next-token ("causal") or masked-token ("masked") model's vocabulary and
    sequence length."""

    kind: str
    vocab: int
    seq_length: int

    @property
    def width(self) -> int:
        """Tokens one sample takes: a next-token sample needs its last target too."""
        return self.seq_length + 1 if self.kind == "causal" else self.seq_length


def text_shape(spec: model_pb2.ModelSpec, user_inputs: UserInputs) -> TextShape | None:
    """The model's text shape, if token data can feed it (the zoo's GPT, Hugging Face causal and masked LMs)."""
    causal = causal_lm_shape(spec, user_inputs)
    if causal is not None:
        return TextShape("causal", *causal)
    if spec.family == F.MODEL_FAMILY_HF and spec.hf.task == T.HF_TASK_MASKED_LM:
        from services.zoo.hf.config import hf_shape  # imports transformers: only for such a model

        return TextShape("masked", hf_shape(spec, user_inputs).vocab_size, spec.hf.seq_length)
    return None


class Source(Protocol):
    def __len__(self) -> int: ...

    def sample(self, index: int) -> np.ndarray | dict[str, Tensor]: ...


class TokenWindows:
    """Consecutive windows of `width` tokens of a flat file (nanoGPT's layout; a ragged tail is never used)."""

    def __init__(self, path: str, dtype: int, width: int) -> None:
        self.path, self.width = path, width
        self.tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
        self.count = len(self.tokens) // width

    def __len__(self) -> int:
        return self.count

    def sample(self, index: int) -> np.ndarray:
        return np.asarray(self.tokens[index * self.width:(index + 1) * self.width], dtype=np.int64)


class DatasetRows:
    """One row of a saved Hugging Face dataset per sample: its token ids, or its text through a local tokenizer,
    cut to `width` tokens."""

    def __init__(self, cfg: job_pb2.HFDataset, split: str, width: int, tokenizer_dir: str = "") -> None:
        import datasets  # noqa: PLC0415 - pyarrow and pandas: only for such data

        loaded = datasets.load_from_disk(cfg.path)
        self.rows = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        self.column = cfg.column or cfg.text_column
        self.width = width
        self.tokenizer = None
        if cfg.text_column:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, index: int) -> np.ndarray:
        value = self.rows[index][self.column]
        ids = self.tokenizer.encode(value).ids if self.tokenizer is not None else value
        return np.asarray(ids[:self.width], dtype=np.int64)


class FactorySamples:
    """An allow-listed factory's sequence: item i is one sample, {field: tensor} without a batch dimension."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def sample(self, index: int) -> dict[str, Tensor]:
        return {k: torch.as_tensor(v) for k, v in self.items[index].items()}


def splits(cfg: job_pb2.HFDataset) -> tuple[str, str]:
    """(train split, validation split or "") of a saved dataset, from its dataset_dict.json when it has splits."""
    listed = Path(cfg.path) / "dataset_dict.json"
    names = json.loads(listed.read_text()).get("splits", []) if listed.exists() else []
    train = cfg.split or ("train" if names else "")
    validation = cfg.validation_split or ("validation" if "validation" in names else "")
    return train, validation


def load_factory(path: str, user_inputs: UserInputs, field: str) -> Callable[..., Any]:
    """Import an allow-listed data factory from the import path plus the operator's model directories."""
    if not user_inputs.allows_data(path):
        raise InvalidArgument(f"data factory {path!r} is not allowed", field=field, fix=ALLOWED_DATA_FACTORIES_FIX)
    module_name, _, attr = path.partition(":")
    user_inputs.importable()
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as exc:  # the user's module: its error is the answer
        raise InvalidArgument(f"cannot load data factory {path!r}: {type(exc).__name__}: {exc}", field=field,
                              fix="put its module on BALLAST_MODEL_PATH (or install it) and define the callable"
                              ) from exc
    return target


def open_sources(data: job_pb2.DataSpec, shape: TextShape | None,
                 user_inputs: UserInputs) -> tuple[Source, Source | None]:
    """The training source and the validation source (None without one), paths checked against the data roots."""
    which = data.WhichOneof("source")
    if which == "tokens":
        cfg = data.tokens
        train = TokenWindows(user_inputs.data_path(cfg.path, "spec.data.tokens.path"), cfg.dtype, shape.width)
        validation = (TokenWindows(user_inputs.data_path(cfg.validation_path, "spec.data.tokens.validation_path"),
                                   cfg.dtype, shape.width) if cfg.validation_path else None)
        return train, validation
    if which == "hf_dataset":
        cfg = data.hf_dataset
        user_inputs.data_path(cfg.path, "spec.data.hf_dataset.path")
        tokenizer = tokenizer_dir(cfg, user_inputs) if cfg.text_column else ""
        train_split, validation_split = splits(cfg)
        train = DatasetRows(cfg, train_split, shape.width, tokenizer)
        return train, DatasetRows(cfg, validation_split, shape.width, tokenizer) if validation_split else None
    cfg = data.factory
    factory = load_factory(cfg.factory, user_inputs, "spec.data.factory.factory")
    kwargs = struct_values(cfg.kwargs) if cfg.HasField("kwargs") else {}
    validation = factory(split="validation", **kwargs)
    return FactorySamples(factory(split="train", **kwargs)), FactorySamples(validation) if validation else None


def tokenizer_dir(cfg: job_pb2.HFDataset, user_inputs: UserInputs) -> str:
    """The tokenizer's directory: under the data roots, or among the model directories (a model's tokenizer)."""
    field = "spec.data.hf_dataset.tokenizer_dir"
    try:
        return user_inputs.data_path(cfg.tokenizer_dir, field)
    except InvalidArgument:
        return user_inputs.directory(cfg.tokenizer_dir, field)


def fields(ids: np.ndarray, shape: TextShape, seed: int, index: int) -> dict[str, Tensor]:
    """One sample's tensors from its token ids (at most `shape.width`), padded to the model's sequence length."""
    s = shape.seq_length
    if shape.kind == "causal":
        tokens = torch.from_numpy(ids)
        inputs = torch.zeros(s, dtype=torch.long)
        labels = torch.full((s,), IGNORE_INDEX, dtype=torch.long)
        n = max(len(tokens) - 1, 0)
        inputs[:n], labels[:n] = tokens[:n], tokens[1:n + 1]
        return {"input_ids": inputs, "labels": labels}
    tokens = torch.zeros(s, dtype=torch.long)
    tokens[:len(ids)] = torch.from_numpy(ids)
    g = torch.Generator().manual_seed(mix(seed, index, 0x3A5C))
    masked = (torch.rand(s, generator=g) < MASK_FRACTION) & (torch.arange(s) < len(ids))
    masked[min(1, len(ids) - 1, s - 1)] = len(ids) > 0  # at least one label per sample
    return {"input_ids": tokens.masked_fill(masked, shape.vocab - 1),
            "token_type_ids": torch.zeros(s, dtype=torch.long), "labels": tokens.masked_fill(~masked, IGNORE_INDEX)}
