"""Users' models for the tests: tiny Hugging Face specs built in code (no hub, HF_HUB_OFFLINE=1), and a user's own
module written to a directory outside the repository with the operator's word (UserInputs) that admits it."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2
from services.specs.user_inputs import UserInputs

SEQ = 16
CAUSAL, MASKED, IMAGE = "HF_TASK_CAUSAL_LM", "HF_TASK_MASKED_LM", "HF_TASK_IMAGE_CLASSIFICATION"
DECODER = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": (CAUSAL, {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4,
                      "n_positions": 64}),
    "llama": (CAUSAL, {"model_type": "llama", **DECODER}),
    "mistral": (CAUSAL, {"model_type": "mistral", **DECODER, "sliding_window": 8}),
    "qwen2": (CAUSAL, {"model_type": "qwen2", **DECODER}),
    "bert": (MASKED, {"model_type": "bert", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "intermediate_size": 64}),
    "vit": (IMAGE, {"model_type": "vit", "image_size": 16, "patch_size": 4, "hidden_size": 32,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64, "num_labels": 5}),
}


def hf_spec(arch: str, *, name: str = "", dropout: float = 0.0, **config: Any) -> model_pb2.ModelSpec:
    """The tiny `arch` model (CONFIGS), its config fields overridden by `config`."""
    task, base = CONFIGS[arch]
    hf = {"task": task, "config": {**base, **config}, **({"seq_length": SEQ} if task != IMAGE else {})}
    return ParseDict({"name": name or f"hf-{arch}", "family": "MODEL_FAMILY_HF", "dropout": dropout, "hf": hf},
                     model_pb2.ModelSpec())


MODEL_FILE = '''
    """A user's model in a file of their own: a residual MLP classifier, its children run in order."""
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Residual(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))


    class Classifier(nn.Module):
        def __init__(self, features, width, depth, classes):
            super().__init__()
            self.features, self.classes = features, classes
            self.embed = nn.Linear(features, width)
            for i in range(depth):
                self.add_module(f"block{i}", Residual(width))
            self.out = nn.Linear(width, classes)

        def loss(self, logits, labels):
            return F.cross_entropy(logits, labels, reduction="sum")

        def example_input(self, batch_size, generator):
            x = torch.randn(batch_size, self.features, generator=generator)
            return {"x": x, "labels": (x[:, : self.classes] > 0).sum(-1) % self.classes}


    def build(features=8, width=16, depth=3, classes=4):
        return Classifier(features, width, depth, classes)
'''


def user_model(directory: Path, name: str = "my_classifier") -> tuple[model_pb2.ModelSpec, UserInputs]:
    """The user's file written outside the repository, the spec naming its factory, and the operator's word."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(textwrap.dedent(MODEL_FILE))
    spec = model_pb2.ModelSpec(name="my-classifier", family=model_pb2.MODEL_FAMILY_CUSTOM,
                               custom=model_pb2.CustomModel(factory=f"{name}:build",
                                                            cut_points=["embed", "block0", "block1"]))
    return spec, UserInputs.of([f"{name}:build"], [str(directory)])
