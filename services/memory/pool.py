"""A memory budget for one worker's device (or its host side), enforced by accounting.

Why: on a GPU the allocator fails loudly when a schedule keeps too much resident; on the CPU nothing does, so a
chunk or swap schedule that forgot to evict would pass every test while keeping the whole model in "device"
memory. `MemoryPool` accounts every byte the offload runtime places on its side, by kind (model data in chunks,
optimizer states, gradients, activations saved for backward), and raises `BudgetExceeded` on the placement that
would go over the budget. Before raising it asks `on_pressure` (the chunk manager) to evict, so eviction happens
exactly when a placement needs room. The high-water mark (`peak`) is what the acceptance tests compare with the
model's size; `peak_non_model` is PatrickStar's traced non-model peak (§8.1), which sets the margin for optimizer
states (§8.2).
"""

from __future__ import annotations

from collections.abc import Callable

KINDS = ("chunk", "optimizer", "grad", "activation")
NON_MODEL = ("grad", "activation")


class BudgetExceeded(RuntimeError):
    """A placement would take a pool over its budget and nothing could be evicted to make room."""


class MemoryPool:
    def __init__(self, name: str, budget_bytes: int | None) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"{name} budget_bytes must be positive (or None for unlimited), got {budget_bytes}")
        self.name, self.budget = name, budget_bytes
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.peak = 0
        self.peak_by_kind = dict.fromkeys(KINDS, 0)
        self.peak_non_model = 0
        self.on_pressure: Callable[[int], None] | None = None
        self._window_peak = dict.fromkeys(KINDS, 0)  # highest use of each kind since `mark`

    def mark(self) -> None:
        """Start a window: `window_peak(kind)` is the highest use of `kind` from now on."""
        self._window_peak = dict(self.by_kind)

    def window_peak(self, kind: str) -> int:
        return self._window_peak[kind]

    @property
    def used(self) -> int:
        return sum(self.by_kind.values())

    @property
    def non_model(self) -> int:
        return sum(self.by_kind[k] for k in NON_MODEL)

    def free_bytes(self) -> int | None:
        return None if self.budget is None else self.budget - self.used

    def reserve(self, kind: str, nbytes: int) -> None:
        """Account `nbytes` of `kind`; evict through `on_pressure` first if they do not fit, raise if still not."""
        if kind not in self.by_kind:
            raise ValueError(f"unknown memory kind {kind!r}: use one of {KINDS}")
        if self.budget is not None and self.used + nbytes > self.budget and self.on_pressure is not None:
            self.on_pressure(self.used + nbytes - self.budget)
        if self.budget is not None and self.used + nbytes > self.budget:
            shown = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.by_kind.items() if v)
            raise BudgetExceeded(
                f"{self.name} budget {self.budget / 2**20:.1f} MiB exceeded placing {nbytes / 2**20:.2f} MiB of {kind} "
                f"(resident: {shown or 'nothing'}; nothing more can be evicted): raise the {self.name} budget, "
                "lower the micro-batch size or the chunk size")
        self.by_kind[kind] += nbytes
        self.peak = max(self.peak, self.used)
        self.peak_by_kind[kind] = max(self.peak_by_kind[kind], self.by_kind[kind])
        self._window_peak[kind] = max(self._window_peak[kind], self.by_kind[kind])
        self.peak_non_model = max(self.peak_non_model, self.non_model)

    def release(self, kind: str, nbytes: int) -> None:
        if nbytes > self.by_kind[kind]:
            raise RuntimeError(f"{self.name}: releasing {nbytes} bytes of {kind} but only {self.by_kind[kind]} held")
        self.by_kind[kind] -= nbytes
