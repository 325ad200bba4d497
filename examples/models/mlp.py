"""A user's own model for Ballast: a residual MLP classifier over feature vectors (docs/models.md).

What Ballast asks of a model built by a factory, and how this file keeps to it:
- the factory (`build`) returns an nn.Module whose top-level children, run in the order they are registered,
  map batch["x"] to the output: `embed`, `block0`..`block3`, `head`. Its own forward is not used (it is
  written here so the module also runs as plain PyTorch);
- `loss(output, labels)` returns one number summed over the samples (Ballast divides by the batch once);
- `example_input(batch_size, generator)` returns {"x", "labels"} drawn from the generator: Ballast profiles the
  model on it and, with no dataset given, trains on it (here a task it can learn);
- every parameter lives in a child; the spec's cut_points name the children a pipeline stage may end after.
Optional: a child that declares which of its linears split column- and row-wise (`tensor_parallel_plan`) and the
degrees it splits at (`tensor_parallel_ways`) can run tensor-parallel when it is a layer of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """x + W2 gelu(W1 norm(x)): a residual block, split Megatron-style when the planner picks TP for it."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"up": "colwise", "down": "rowwise"}

    def tensor_parallel_ways(self) -> int:
        return self.up.out_features


class ResidualMLP(nn.Module):
    def __init__(self, features: int, width: int, hidden: int, depth: int, classes: int) -> None:
        super().__init__()
        self.features, self.classes = features, classes
        self.embed = nn.Linear(features, width)
        for i in range(depth):
            self.add_module(f"block{i}", Block(width, hidden))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, classes))

    def forward(self, x: Tensor) -> Tensor:
        for child in self.children():
            x = child(x)
        return x

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits, labels, reduction="sum")

    def example_input(self, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        """Random features; the label is the slice of features (one per class) with the largest sum."""
        x = torch.randn(batch_size, self.features, generator=generator)
        per_class = self.features // self.classes
        labels = x[:, : per_class * self.classes].reshape(batch_size, self.classes, per_class).sum(-1).argmax(-1)
        return {"x": x, "labels": labels}


def build(features: int = 32, width: int = 64, hidden: int = 256, depth: int = 4, classes: int = 8) -> nn.Module:
    return ResidualMLP(features, width, hidden, depth, classes)
