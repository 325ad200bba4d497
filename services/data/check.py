"""A job's data checked against its model before anything is stored (ProfilerService.Inspect runs this in a worker
process at Submit): the files exist under the data roots, a token file's size fits its dtype, every token id is
below the model's vocabulary, a dataset's split and column exist, a factory's samples hold what the layers read,
and there is at least one sample. Each refusal names the field and the fix."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ballast.v1 import job_pb2, model_pb2, services_pb2
from services.data.sources import DTYPES, TextShape, load_factory, splits, text_shape, tokenizer_dir
from services.runtime.errors import InvalidArgument
from services.specs.data import validate_data_spec
from services.specs.user_inputs import UserInputs
from services.zoo import build_model
from services.zoo.base import struct_values

SCAN_ROWS = 1 << 20  # token ids read per block when a file's largest id is looked for


def inspect_data(spec: model_pb2.ModelSpec, data: job_pb2.DataSpec,
                 user_inputs: UserInputs) -> services_pb2.DataInspection:
    """What the data holds for this model; InvalidArgument naming the field and the fix when it cannot feed it."""
    validate_data_spec(data, user_inputs)
    which = data.WhichOneof("source")
    if which is None:
        return services_pb2.DataInspection(source="synthetic")
    if which == "factory":
        return _factory(spec, data.factory, user_inputs)
    shape = text_shape(spec, user_inputs)
    if shape is None:
        raise InvalidArgument("token data feeds next-token and masked-token models only (GPT, Hugging Face causal "
                              "and masked LMs)", field=f"spec.data.{which}",
                              fix="give this model a data factory, or train it on its synthetic samples")
    if which == "tokens":
        return _tokens(data.tokens, shape, user_inputs)
    return _dataset(data.hf_dataset, shape, user_inputs)


def _tokens(cfg: job_pb2.TokenFile, shape: TextShape, user_inputs: UserInputs) -> services_pb2.DataInspection:
    out = services_pb2.DataInspection(source="tokens", fields=_text_fields(shape))
    for name, path in (("path", cfg.path), ("validation_path", cfg.validation_path)):
        if not path:
            continue
        field = f"spec.data.tokens.{name}"
        real = user_inputs.data_path(path, field)
        if not os.path.isfile(real):
            raise InvalidArgument(f"{path} does not exist", field=field, fix="give an existing file of token ids")
        width = np.dtype(DTYPES[cfg.dtype]).itemsize
        size = os.path.getsize(real)
        if size % width:
            raise InvalidArgument(f"{path} holds {size} bytes, not a whole number of {8 * width}-bit ids",
                                  field=field, fix="set dtype to the width the file was written with "
                                                   "(TOKEN_DTYPE_UINT16 or TOKEN_DTYPE_UINT32)")
        tokens = np.memmap(real, dtype=DTYPES[cfg.dtype], mode="r") if size else np.zeros(0, np.uint16)
        samples = len(tokens) // shape.width
        if not samples:
            raise InvalidArgument(f"{path} holds {len(tokens)} tokens, fewer than one sample of {shape.width}",
                                  field=field, fix=f"give at least {shape.width} tokens (seq_length + 1)")
        largest = max(int(tokens[i:i + SCAN_ROWS].max()) for i in range(0, len(tokens), SCAN_ROWS))
        _below_vocabulary(largest, shape, field, "tokenize with the model's vocabulary, or check dtype")
        out.largest_token = max(out.largest_token, largest)
        if name == "path":
            out.train_samples = samples
        else:
            out.validation_samples = samples
    return out


def _dataset(cfg: job_pb2.HFDataset, shape: TextShape, user_inputs: UserInputs) -> services_pb2.DataInspection:
    import datasets  # noqa: PLC0415 - pyarrow and pandas: only for such data
    import pyarrow.compute as pc

    field = "spec.data.hf_dataset.path"
    real = Path(user_inputs.data_path(cfg.path, field))
    if not ((real / "dataset_dict.json").exists() or (real / "state.json").exists()):
        raise InvalidArgument(f"{cfg.path} is not a saved dataset", field=field,
                              fix="give the directory datasets' save_to_disk wrote")
    try:
        loaded = datasets.load_from_disk(str(real))
    except Exception as exc:  # a damaged or foreign directory: datasets' own words
        raise InvalidArgument(f"{cfg.path} cannot be read as a saved dataset: {type(exc).__name__}: {exc}",
                              field=field, fix="give the directory datasets' save_to_disk wrote") from exc
    train_split, validation_split = splits(cfg)
    names = list(loaded) if isinstance(loaded, datasets.DatasetDict) else []
    out = services_pb2.DataInspection(source="hf_dataset", fields=_text_fields(shape))
    tokenizer = None
    if cfg.text_column:
        from tokenizers import Tokenizer

        folder = Path(tokenizer_dir(cfg, user_inputs))
        if not (folder / "tokenizer.json").exists():
            raise InvalidArgument(f"{cfg.tokenizer_dir} holds no tokenizer.json", field="spec.data.hf_dataset."
                                  "tokenizer_dir", fix="give the directory a tokenizer's save_pretrained wrote")
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        _below_vocabulary(tokenizer.get_vocab_size() - 1, shape, "spec.data.hf_dataset.tokenizer_dir",
                          "use the tokenizer of the model's vocabulary")
    for split, split_field in ((train_split, "split"), (validation_split, "validation_split")):
        if names and split not in names:
            raise InvalidArgument(f"the dataset has no split {split!r}", field=f"spec.data.hf_dataset.{split_field}",
                                  fix=f"one of {names}")
        if split_field == "validation_split" and not split:
            continue
        rows = loaded[split] if names else loaded
        column = cfg.column or cfg.text_column
        if column not in rows.column_names:
            raise InvalidArgument(f"unknown column {column!r}", field="spec.data.hf_dataset."
                                  f"{'column' if cfg.column else 'text_column'}", fix=f"one of {rows.column_names}")
        if not len(rows):
            raise InvalidArgument(f"split {split or 'train'!r} is empty", field=f"spec.data.hf_dataset.{split_field}",
                                  fix="give a dataset with at least one row")
        if cfg.column:
            table = rows.data.column(column)
            largest = pc.max(pc.list_flatten(table)).as_py()
            if largest is None:
                raise InvalidArgument(f"column {column!r} holds no token ids", field="spec.data.hf_dataset.column",
                                      fix="give a column of lists of token ids")
            _below_vocabulary(int(largest), shape, "spec.data.hf_dataset.column", "tokenize with the model's "
                              "vocabulary")
            out.largest_token = max(out.largest_token, int(largest))
        if split_field == "split":
            out.train_samples = len(rows)
        else:
            out.validation_samples = len(rows)
    return out


def _factory(spec: model_pb2.ModelSpec, cfg: job_pb2.DataFactory,
             user_inputs: UserInputs) -> services_pb2.DataInspection:
    """The factory's first samples run through the model (meta device) as the workers would draw them."""
    field = "spec.data.factory.factory"
    factory = load_factory(cfg.factory, user_inputs, field)
    kwargs = struct_values(cfg.kwargs) if cfg.HasField("kwargs") else {}
    try:
        train, validation = factory(split="train", **kwargs), factory(split="validation", **kwargs)
        counts = [len(train), len(validation) if validation is not None else 0]
        first = [train[i] for i in range(min(2, counts[0]))]
    except Exception as exc:  # the user's code
        raise InvalidArgument(f"data factory {cfg.factory!r} raised {type(exc).__name__}: {exc}", field=field,
                              fix="return a sequence (len, [i]) of {field: tensor} samples for split='train'") from exc
    if not counts[0]:
        raise InvalidArgument("the factory's training split is empty", field=field, fix="return at least one sample")
    model = build_model(spec, device="meta", user_inputs=user_inputs)
    dec = model.decompose()
    wanted = sorted({k for layer in dec.layers for k in layer.batch_keys} | set(type(model).label_keys))
    if not all(isinstance(s, dict) for s in first) or set(wanted) - set(first[0]):
        raise InvalidArgument(f"a sample is {_describe(first[0])}; the model's layers read {wanted}", field=field,
                              fix=f"return one {{{', '.join(repr(k) for k in wanted)}: tensor}} per sample")
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in first]).to("meta") for k in wanted}
    env: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for layer in dec.layers:
            try:
                env[layer.index] = layer.module(*[env[i] for i in layer.inputs], *[batch[k] for k in layer.batch_keys])
            except Exception as exc:
                raise InvalidArgument(f"the model's layer {layer.name} failed on the factory's samples: "
                                      f"{type(exc).__name__}: {str(exc)[:300]}", field=field,
                                      fix="give samples shaped as the model's example_input draws them") from exc
    return services_pb2.DataInspection(source="factory", train_samples=counts[0], validation_samples=counts[1],
                                       fields=wanted)


def _text_fields(shape: TextShape) -> list[str]:
    return ["input_ids", "labels"] if shape.kind == "causal" else ["input_ids", "token_type_ids", "labels"]


def _below_vocabulary(largest: int, shape: TextShape, field: str, fix: str) -> None:
    if largest >= shape.vocab:
        raise InvalidArgument(f"token id {largest} is not below the model's vocabulary of {shape.vocab}", field=field,
                              fix=fix)


def _describe(sample: object) -> str:
    return f"a dict of {sorted(sample)}" if isinstance(sample, dict) else f"a {type(sample).__name__}"

