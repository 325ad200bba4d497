"""Activation checkpointing whose recompute the schedule can run before the gradient arrives (Varuna §3.2).

torch.utils.checkpoint recomputes inside the backward call, i.e. only once the next stage's gradient is here,
so a stage waiting for that gradient idles and then recomputes on the critical path. Here a checkpointed
layer's forward runs under saved-tensor hooks that keep a slot number instead of each tensor autograd would
save; `Segment.rerun` runs the layer again from its kept inputs (with the forward's RNG state) and fills the
slots in the same order. The schedule calls it while the gradient is still in flight; a backward that comes
first (nobody asked earlier) reruns it on first use. Memory then holds the recomputed activations from the
recompute's start to the backward's end, as the simulator's memory model prices it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks


def _rng_state(args: Sequence[Any]) -> tuple[Tensor, list[int], list[Tensor]]:
    cuda = sorted({a.device.index or 0 for a in args if isinstance(a, Tensor) and a.device.type == "cuda"})
    return torch.get_rng_state(), cuda, [torch.cuda.get_rng_state(d) for d in cuda]


class _Done(Exception):
    """Raised from the recompute's pack hook once every slot is filled."""


class Segment:
    """One checkpointed layer run on one micro-batch: autograd holds slot numbers, `rerun` fills them."""

    def __init__(self, fn: Callable[..., Tensor], args: Sequence[Any], clock: Callable[[float], None]) -> None:
        self.fn, self.args, self.clock = fn, tuple(args), clock
        self.rng = _rng_state(self.args)
        self.count = 0
        self.saved: list[Tensor] | None = None

    def run(self) -> Tensor:
        """The forward pass: outputs join the graph, saved activations are dropped (slots kept)."""
        with saved_tensors_hooks(self._pack, self._unpack):
            return self.fn(*self.args)

    def rerun(self) -> None:
        """Recompute the saved activations (once); timed through `clock`."""
        if self.saved is not None:
            return
        if self.count == 0:  # autograd kept nothing of this layer (no input needed a gradient): nothing to redo
            self.saved = []
            return
        start = time.perf_counter()
        saved: list[Tensor] = []
        inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) and a.is_floating_point()
                  else a for a in self.args]
        cpu, cuda, cuda_states = self.rng

        def keep(t: Tensor) -> int:
            saved.append(t.detach())  # detached: the throwaway graph must not stay alive through the list
            if len(saved) == self.count:
                raise _Done  # the rest of the layer saves nothing the backward needs (torch's early stop)
            return len(saved) - 1

        with torch.random.fork_rng(devices=cuda), torch.enable_grad(), saved_tensors_hooks(keep, saved.__getitem__):
            torch.set_rng_state(cpu)
            for d, state in zip(cuda, cuda_states, strict=True):
                torch.cuda.set_rng_state(state, d)
            try:
                self.fn(*inputs)
            except _Done:
                pass
        if len(saved) != self.count:
            raise RuntimeError(f"recompute saved {len(saved)} tensors, the forward {self.count}: the layer is not "
                               "deterministic in what it saves and cannot be checkpointed")
        self.saved = saved
        self.clock(time.perf_counter() - start)

    def _pack(self, _: Tensor) -> int:
        self.count += 1
        return self.count - 1

    def _unpack(self, slot: int) -> Tensor:
        self.rerun()
        assert self.saved is not None
        return self.saved[slot]


__all__ = ["Segment"]
