"""A Hugging Face transformers model as a zoo model: built from its config (hf_config), optionally started from
safetensors weights, cut into layers by its architecture's adapter."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    PretrainedConfig,
)

from ballast.v1 import model_pb2
from services.runtime.errors import InvalidArgument
from services.specs.model import HF_TEXT_TASKS
from services.specs.user_inputs import UserInputs
from services.zoo.base import CutModel
from services.zoo.graph import Layer
from services.zoo.hf.adapters import ADAPTERS, Block
from services.zoo.hf.config import FIELD, hf_config

T = model_pb2.HFTask
AUTO = {T.HF_TASK_CAUSAL_LM: AutoModelForCausalLM, T.HF_TASK_MASKED_LM: AutoModelForMaskedLM,
        T.HF_TASK_IMAGE_CLASSIFICATION: AutoModelForImageClassification}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class HuggingFace(CutModel):
    """`self.hf` is the unmodified transformers model (its own parameter names: what an export writes); the layers
    wrap its submodules."""

    def __init__(self, spec: model_pb2.ModelSpec, user_inputs: UserInputs) -> None:
        super().__init__(spec)
        config = hf_config(spec, user_inputs)
        check_seq_length(spec.hf, config)
        self.config = config
        self.hf = AUTO[spec.hf.task].from_config(config, attn_implementation="sdpa")
        if spec.hf.weights_dir and next(self.hf.parameters()).device.type != "meta":  # a meta build has no values
            self.load_weights(user_inputs.directory(spec.hf.weights_dir, f"{FIELD}.weights_dir"))

    def cut(self) -> list[Layer]:
        layers = ADAPTERS[self.config.model_type](self.hf, self.config)
        for layer in layers:  # a text block's sequence length: sequence parallelism splits it
            if isinstance(layer.module, Block) and self.spec.hf.task in HF_TEXT_TASKS:
                layer.module.tokens = self.spec.hf.seq_length
        return layers

    def load_weights(self, directory: str) -> None:
        """The weights of a safetensors directory (save_pretrained's layout), every parameter accounted for."""
        root = Path(directory)
        if (root / "model.safetensors.index.json").exists():
            index = json.loads((root / "model.safetensors.index.json").read_text())
            files = sorted(set(index.get("weight_map", {}).values()))
        elif (root / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise InvalidArgument(f"{directory} holds no safetensors weights", field=f"{FIELD}.weights_dir",
                                  fix=f"give a directory with {' or '.join(WEIGHT_FILES)} (pickled .bin weights are "
                                      "never read)")
        state: dict[str, Tensor] = {}
        for name in files:
            state.update(load_file(str(root / name)))
        own = self.hf.state_dict()
        prefix = self.hf.base_model_prefix
        if state and not set(state) & set(own):  # a base model's checkpoint: its names lack the head's prefix
            state = {f"{prefix}.{k}": v for k, v in state.items()}
        missing = sorted(set(own) - set(state) - tied_names(self.hf))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
            raise InvalidArgument(f"the weights in {directory} do not fit the config: {what}",
                                  field=f"{FIELD}.weights_dir", fix="give the weights saved with this config")
        with torch.no_grad():
            for name, value in state.items():
                target = own[name]
                if target.shape != value.shape:
                    raise InvalidArgument(f"weight {name} is {tuple(value.shape)}, the config makes it "
                                          f"{tuple(target.shape)}", field=f"{FIELD}.weights_dir",
                                          fix="give the weights saved with this config")
                target.copy_(value.to(target.dtype))


def tied_names(model: nn.Module) -> set[str]:
    """State-dict names that are a second name of a tied Parameter (a checkpoint may leave them out)."""
    seen: dict[int, str] = {}
    names = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            names.add(name)
        seen.setdefault(id(p), name)
    return names


def check_seq_length(cfg: model_pb2.HuggingFaceModel, config: PretrainedConfig) -> None:
    limit = getattr(config, "max_position_embeddings", 0) or 0
    if cfg.task in HF_TEXT_TASKS and limit and cfg.seq_length > limit:
        raise InvalidArgument(f"seq_length {cfg.seq_length} is past the config's {limit} positions",
                              field=f"{FIELD}.seq_length", fix=f"use at most {limit}, or raise max_position_embeddings")
