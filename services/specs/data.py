"""A job's data spec: the rules checked without opening a file (which source, paths under the operator's data
roots, the factory allowed), and what identifies its content (paths with their size and modification time), so a
check is redone when a file changes. What needs the files (they exist, their dtype, token ids below the
vocabulary, columns, sample counts) is services/data/check.py's, run at Submit in a profiler worker process."""

from __future__ import annotations

import hashlib
import os

from ballast.v1 import job_pb2
from services.runtime.errors import InvalidArgument
from services.specs.user_inputs import ALLOWED_DATA_FACTORIES_FIX, FACTORY_FIX, FACTORY_RE, UserInputs


def data_paths(data: job_pb2.DataSpec) -> list[tuple[str, str]]:
    """(field, path) of every file or directory the spec names."""
    which = data.WhichOneof("source")
    if which == "tokens":
        named = [("path", data.tokens.path), ("validation_path", data.tokens.validation_path)]
        return [(f"spec.data.tokens.{k}", v) for k, v in named if v]
    if which == "hf_dataset":
        named = [("path", data.hf_dataset.path), ("tokenizer_dir", data.hf_dataset.tokenizer_dir)]
        return [(f"spec.data.hf_dataset.{k}", v) for k, v in named if v]
    return []


def validate_data_spec(data: job_pb2.DataSpec, user_inputs: UserInputs) -> None:
    """InvalidArgument naming the first bad field of a job's data spec (paths start at "spec.data")."""
    which = data.WhichOneof("source")
    if which == "tokens":
        if not data.tokens.path:
            raise InvalidArgument("the token file is not named", field="spec.data.tokens.path",
                                  fix="give the absolute path of a file of token ids")
    elif which == "hf_dataset":
        cfg = data.hf_dataset
        if not cfg.path:
            raise InvalidArgument("the dataset is not named", field="spec.data.hf_dataset.path",
                                  fix="give the directory save_to_disk wrote")
        if bool(cfg.column) == bool(cfg.text_column):
            raise InvalidArgument("name either the column of token ids or the column of text", field=(
                "spec.data.hf_dataset.column"), fix="set column (token ids) or text_column with tokenizer_dir")
        if cfg.text_column and not cfg.tokenizer_dir:
            raise InvalidArgument("a text column needs a tokenizer", field="spec.data.hf_dataset.tokenizer_dir",
                                  fix="give a directory holding tokenizer.json")
    elif which == "factory":
        field = "spec.data.factory.factory"
        if not FACTORY_RE.match(data.factory.factory):
            raise InvalidArgument(f"data factory {data.factory.factory!r} is not an import path", field=field,
                                  fix=FACTORY_FIX)
        if not user_inputs.allows_data(data.factory.factory):
            raise InvalidArgument(f"data factory {data.factory.factory!r} is not allowed", field=field,
                                  fix=ALLOWED_DATA_FACTORIES_FIX)
    for field, path in data_paths(data):
        if field.endswith("tokenizer_dir"):  # a model's tokenizer may sit among the model directories
            try:
                user_inputs.data_path(path, field)
            except InvalidArgument:
                user_inputs.directory(path, field)
        else:
            user_inputs.data_path(path, field)


def data_fingerprint(data: job_pb2.DataSpec) -> str:
    """The spec and, for each file it names, its size and modification time: equal when nothing changed."""
    digest = hashlib.sha256(data.SerializeToString(deterministic=True))
    for _, path in data_paths(data):
        try:
            stat = os.stat(path)
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        except OSError:
            digest.update(f"{path}:missing".encode())
    return digest.hexdigest()
