"""A tiny allow-listed factory for the zoo's custom-model tests (tests.zoo_factory:tiny_mlp)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TinyMLP(nn.Module):
    """Children run in order: embed -> hidden layers -> out; `out` shares its weight with `embed`."""

    def __init__(self, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.width, self.classes = width, classes
        self.embed = nn.Linear(classes, width, bias=False)
        for i in range(depth):
            self.add_module(f"hidden{i}", nn.Sequential(nn.Linear(width, width), nn.Tanh()))
        self.out = _Transposed(self.embed)

    def loss(self, output: Tensor, labels: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output, labels, reduction="sum")

    def example_input(self, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        return {
            "x": torch.randn(batch_size, self.classes, generator=generator),
            "labels": torch.randint(self.classes, (batch_size,), generator=generator),
        }


class _Transposed(nn.Module):
    """Output layer reusing the input layer's weight (a tied weight across cut-points)."""

    def __init__(self, tied: nn.Linear) -> None:
        super().__init__()
        self.weight = tied.weight

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight


def tiny_mlp(width: int = 8, depth: int = 3, classes: int = 4) -> nn.Module:
    return TinyMLP(width, depth, classes)
