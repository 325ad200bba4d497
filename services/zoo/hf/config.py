"""A Hugging Face config from a ModelSpec: the inline fields or a config.json directory, never the hub, never
remote code. Every dropout probability of the config is set to the spec's `dropout` (0 by default: runs are
exactly comparable and tensor-parallel ranks draw no masks)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from ballast.v1 import model_pb2
from services.runtime.errors import InvalidArgument
from services.specs.model import HF_REMOTE_CODE, check_hf_architecture
from services.specs.user_inputs import UserInputs
from services.zoo.base import struct_values

FIELD = "spec.hf"
DROPOUT_SUFFIXES = ("dropout", "pdrop", "dropout_prob")


def read_config_dir(directory: str) -> dict[str, Any]:
    """config.json of a directory the caller already placed under the model directories."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument(f"{directory} holds no config.json", field=f"{FIELD}.config_dir",
                              fix="point config_dir at a directory with config.json (save_pretrained writes one)"
                              ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{path} cannot be read as JSON: {exc}", field=f"{FIELD}.config_dir",
                              fix="give a config.json that AutoConfig can read") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{path} is not a JSON object", field=f"{FIELD}.config_dir", fix="give a config.json")
    return raw


def hf_config(spec: model_pb2.ModelSpec, user_inputs: UserInputs) -> PretrainedConfig:
    """The transformers config the model is built from (architecture checked, dropouts set, sdpa attention)."""
    cfg = spec.hf
    if cfg.config_dir:
        directory = user_inputs.directory(cfg.config_dir, f"{FIELD}.config_dir")
        fields = read_config_dir(directory)
        where = f"{FIELD}.config_dir"
    else:
        fields = struct_values(cfg.config)
        where = f"{FIELD}.config"
    remote = [k for k in HF_REMOTE_CODE if k in fields]
    if remote:
        raise InvalidArgument(f"the config asks for code from the hub ({remote[0]})", field=where,
                              fix=f"remove {remote[0]}: Ballast never runs remote code")
    model_type = fields.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InvalidArgument("the config has no model_type", field=f"{where}.model_type", fix='set e.g. "llama"')
    check_hf_architecture(model_type, cfg.task, f"{where}.model_type")
    kwargs = {k: v for k, v in fields.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"transformers refused the config: {exc}", field=where,
                              fix="give the fields of the model_type's config class") from None
    for key, value in config.to_dict().items():
        if key.endswith(DROPOUT_SUFFIXES) and isinstance(value, int | float) and not isinstance(value, bool):
            setattr(config, key, spec.dropout)
    config._attn_implementation = "sdpa"
    return config


@dataclass(frozen=True)
class HFShape:
    """What the synthetic data needs of a Hugging Face config (the config class's defaults applied)."""

    vocab_size: int
    type_vocab_size: int
    channels: int
    image_size: int
    num_labels: int


def hf_shape(spec: model_pb2.ModelSpec, user_inputs: UserInputs) -> HFShape:
    return _shape(spec.SerializeToString(deterministic=True), user_inputs)


@functools.lru_cache(maxsize=64)
def _shape(spec_bytes: bytes, user_inputs: UserInputs) -> HFShape:
    config = hf_config(model_pb2.ModelSpec.FromString(spec_bytes), user_inputs)
    return HFShape(int(getattr(config, "vocab_size", 0) or 0), int(getattr(config, "type_vocab_size", 0) or 0),
                   int(getattr(config, "num_channels", 0) or 0), int(getattr(config, "image_size", 0) or 0),
                   int(getattr(config, "num_labels", 0) or 0))
