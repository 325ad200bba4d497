"""What measured a profile: one string for storing and for cache lookups, computed without importing
torch (the profiler service looks profiles up; only its worker processes import torch). A user's model adds what
built it beyond its spec: the factory module's content hash, or the transformers version (and the config file's
hash), so an edited model file or a transformers upgrade is profiled again rather than served a stale profile."""

from __future__ import annotations

import hashlib
import os
import sys
from importlib import metadata
from pathlib import Path

from ballast.v1 import model_pb2
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs


def version(package: str) -> str:
    try:
        return metadata.version(package).split("+")[0]
    except metadata.PackageNotFoundError:
        return "unknown"


def software(spec: model_pb2.ModelSpec | None = None, user_inputs: UserInputs = NO_USER_INPUTS) -> str:
    """"torch 2.13.0, ballast 0.1.0" (plus the model's code version): an upgrade misses the cache and re-profiles."""
    base = f"torch {version('torch')}, ballast {version('ballast')}"
    code = code_version(spec, user_inputs) if spec is not None else ""
    return f"{base}, {code}" if code else base


def code_version(spec: model_pb2.ModelSpec, user_inputs: UserInputs) -> str:
    """What built a user's model beyond its spec ("" for the zoo): found on disk, nothing imported."""
    if spec.family == model_pb2.MODEL_FAMILY_CUSTOM:
        module = spec.custom.factory.partition(":")[0]
        found = module_file(module, [*sys.path, *user_inputs.path])
        return f"model {digest(found)}" if found else ""
    if spec.family == model_pb2.MODEL_FAMILY_HF:
        config = Path(spec.hf.config_dir) / "config.json" if spec.hf.config_dir else None
        files = f", config {digest(config)}" if config is not None and config.is_file() else ""
        return f"transformers {version('transformers')}{files}"
    return ""


def module_file(module: str, search: list[str]) -> Path | None:
    """The file `import module` would load from the first directory of `search` holding it (no import)."""
    parts = module.split(".")
    for root in search:
        base = Path(root or os.getcwd()).joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    except OSError:
        return "unreadable"
