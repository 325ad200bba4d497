"""Fail-stutter detection (Varuna §4.6): a worker persistently slower than its data-parallel peers.

Replicas of one stage run the same computation on equal shares of the batch, so their compute time (forward +
backward, which the agents report per iteration) should match; one that stays well above its peers' median
over a window is a straggler, and in a synchronous job it sets everyone's pace. Pure: samples in, findings out.
A stage with a single replica has no peers to compare with, so nothing is found there.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 10  # iterations each replica is judged over (and how often the verdict is taken again)
WARMUP = 2  # iterations after a (re)start left out: allocations and first-touch make them slow for everyone
THRESHOLD = 0.25  # slower than its peers' median by more than this: a straggler (Varuna saw outliers ~30% slow)


@dataclass(frozen=True)
class Finding:
    """A replica slower than its peers over the window."""

    stage: int
    replica: int
    ratio: float  # its median compute over its peers' median
    own_s: float
    peers_s: float
    window: int

    def evidence(self) -> dict[str, float | int]:
        return {"stage": self.stage, "replica": self.replica, "ratio": round(self.ratio, 4),
                "own_compute_s": round(self.own_s, 6), "peers_compute_s": round(self.peers_s, 6),
                "window": self.window}


class StutterWatch:
    """Per job: the last WINDOW compute times of every (stage, replica)."""

    def __init__(self, window: int = WINDOW, threshold: float = THRESHOLD):
        self.window, self.threshold = window, threshold
        self._samples: dict[tuple[int, int], deque[float]] = {}

    def observe(self, stage: int, replica: int, compute_s: float) -> None:
        self._samples.setdefault((stage, replica), deque(maxlen=self.window)).append(compute_s)

    def straggler(self) -> Finding | None:
        """The slowest replica past the threshold, once every replica of its stage has a full window."""
        worst: Finding | None = None
        stages = sorted({s for s, _ in self._samples})
        for stage in stages:
            replicas = {r: q for (s, r), q in self._samples.items() if s == stage}
            if len(replicas) < 2 or any(len(q) < self.window for q in replicas.values()):
                continue
            medians = {r: statistics.median(q) for r, q in replicas.items()}
            for r, own in medians.items():
                peers = statistics.median(m for other, m in medians.items() if other != r)
                if peers > 0 and own > (1 + self.threshold) * peers and (worst is None or own / peers > worst.ratio):
                    worst = Finding(stage, r, own / peers, own, peers, self.window)
        return worst


def faster_without(iteration_s: float, finding: Finding, devices: int) -> float | None:
    """The iteration time expected without the straggler's device, or None when it cannot be left out.

    Everyone waits for the straggler, so the healthy iteration is the measured one less the straggler's extra
    compute. Without its device each of the others computes devices / (devices - 1) of its share (the global
    batch is kept), so the peers' compute grows by 1 / (devices - 1); the rest of the iteration (communication,
    the optimizer) is taken to stay as measured."""
    if devices < 2:
        return None
    healthy = max(iteration_s - (finding.own_s - finding.peers_s), 0.0)
    return healthy + finding.peers_s / (devices - 1)
