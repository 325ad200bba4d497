"""Fault hooks for tests and benchmarks: make real worker processes misbehave on purpose.

BALLAST_FAULTS holds a JSON list of faults; each applies to the workers whose model name and rank match
("" / -1: any). `raise_at` makes the model raise in its forward pass at that iteration (0-based), as a bug in
the user's model would; `slow` makes every iteration that many times as long (a fail-stutter worker);
`alone_s` adds that many seconds to each iteration of a job trained by one worker, so that on one small
machine a grown layout is surely the faster one (the grow test, without a model big enough to show it).
Unset (production), nothing changes. The agent passes its environment on to its workers, so an agent started
with the variable injects the faults into the jobs it runs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

ENV = "BALLAST_FAULTS"


@dataclass(frozen=True)
class Fault:
    model: str = ""
    rank: int = -1
    raise_at: int = -1
    slow: float = 1.0
    alone_s: float = 0.0


class Faults:
    """The faults that apply to one worker."""

    def __init__(self, faults: list[Fault], world_size: int = 1):
        self.faults, self.world_size = faults, world_size

    @classmethod
    def from_env(cls, model: str, rank: int, world_size: int = 1) -> Faults:
        text = os.environ.get(ENV, "")
        entries = json.loads(text) if text else []
        faults = [Fault(**e) for e in entries]
        return cls([f for f in faults if f.model in ("", model) and f.rank in (-1, rank)], world_size)

    def before_forward(self, iteration: int) -> None:
        for f in self.faults:
            if f.raise_at == iteration:
                raise ValueError(f"injected fault: the model raised in its forward pass at iteration {iteration}")

    def after_iteration(self, seconds: float) -> None:
        """Stretch the iteration that took `seconds` to `slow` times as long."""
        factor = max((f.slow for f in self.faults), default=1.0)
        alone = max((f.alone_s for f in self.faults), default=0.0) if self.world_size == 1 else 0.0
        if factor > 1.0 or alone > 0:
            time.sleep(max(factor - 1.0, 0.0) * seconds + alone)
