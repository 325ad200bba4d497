"""Checkpointing with a recompute the schedule can run early (services/executor/train/recompute.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.executor.train.recompute import Segment


class Block(nn.Module):
    """Linear -> GELU -> dropout -> Linear: saves several activations, and draws random numbers."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.nn.functional.gelu(self.a(x))))


def grads(block: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]


def reference(p: float) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    block, x = Block(p), torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(1)
    block(x).square().sum().backward()
    return block, grads(block, x)


@pytest.mark.parametrize("early", [True, False])
def test_early_or_lazy_recompute_gives_the_plain_gradients_with_dropout(early: bool) -> None:
    _, expected = reference(0.3)
    torch.manual_seed(0)
    block, x = Block(0.3), torch.randn(4, 16, requires_grad=True)
    spent: list[float] = []
    torch.manual_seed(1)
    segment = Segment(block, [x], spent.append)
    out = segment.run()
    assert segment.count > 0 and segment.saved is None  # the graph holds slot numbers, no activations
    torch.rand(100)  # the RNG moves on before the recompute: it must replay the forward's draws anyway
    if early:
        segment.rerun()
        assert segment.saved is not None and len(segment.saved) == segment.count and len(spent) == 1
    out.square().sum().backward()
    assert len(spent) == 1  # recomputed exactly once, early or on the backward's first use
    for got, want in zip(grads(block, x), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rerun_restores_the_callers_rng_and_runs_once() -> None:
    block, x = Block(0.5), torch.randn(4, 16, requires_grad=True)
    segment = Segment(block, [x], lambda _: None)
    segment.run()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    segment.rerun()
    assert torch.equal(torch.get_rng_state(), before)  # the recompute's draws do not leak into the caller's
    saved = segment.saved
    segment.rerun()
    assert segment.saved is saved
