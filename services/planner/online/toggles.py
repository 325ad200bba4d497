"""A job's layer toggles (JobSpec.layer_toggles) as workload changes the online planner knows in advance.

vPipe's planner learns of a workload change from the stage statistics after it happened. A toggle is written
in the job's spec, so Ballast knows when the set of computing layers will change. Two things follow. Evidence
measured under one set says nothing about iterations under another. And a move decided just before a switch is
priced on a workload that ends before the move can repay itself or be measured. In `make demo` such a move,
applied one iteration after the second-half blocks switched on, ran at 101 ms an iteration until the next
window moved the layer back (76 ms).

Pure: toggles in, switches out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ballast.v1 import job_pb2


@dataclass(frozen=True)
class Switch:
    """Layers whose state changes at one iteration (from that iteration on)."""

    iteration: int
    on: tuple[int, ...] = ()
    off: tuple[int, ...] = ()

    def describe(self) -> str:
        parts = [f"layer(s) {', '.join(map(str, layers))} switch {word}"
                 for layers, word in ((self.on, "on"), (self.off, "off")) if layers]
        return f"{' and '.join(parts)} at iteration {self.iteration}"


def switches(toggles: Iterable[job_pb2.LayerToggle]) -> list[Switch]:
    """The iterations at which some layer's state really changes, in order. A layer computes unless toggled
    off; a toggle that repeats the state its layer is in changes nothing. Toggles of one layer at one
    iteration: the last one listed wins, as when the workers apply them."""
    at: dict[int, dict[int, bool]] = {}
    for t in toggles:
        at.setdefault(int(t.iteration), {})[int(t.layer_index)] = bool(t.active)
    state: dict[int, bool] = {}
    out = []
    for iteration in sorted(at):
        on, off = [], []
        for layer, active in sorted(at[iteration].items()):
            if state.get(layer, True) != active:
                (on if active else off).append(layer)
            state[layer] = active
        if on or off:
            out.append(Switch(iteration, tuple(on), tuple(off)))
    return out


def unsettled(toggles: Iterable[job_pb2.LayerToggle], since: int, until: int) -> list[Switch]:
    """The switches that take effect after iteration `since` and no later than `until`: a window of evidence
    starting at `since` does not hold for a move measured up to `until` if any does."""
    return [s for s in switches(toggles) if since < s.iteration <= until]


__all__ = ["Switch", "switches", "unsettled"]
