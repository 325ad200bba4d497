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

WINDOW = 6  # iterations each replica is judged over (and how often the verdict is taken again)
WARMUP = 2  # iterations after a (re)start left out: allocations and first-touch make them slow for everyone
THRESHOLD = 0.25  # slower than its peers' median by more than this: a straggler (Varuna saw outliers ~30% slow)
SHARED_CPU_THRESHOLD = 0.5  # the same where CPU workers share one machine's cores (scheduler skew reads ~40%)


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
        self._through: dict[tuple[int, int], int] = {}  # the last iteration each replica's samples reach

    def observe(self, stage: int, replica: int, compute_s: float, iteration: int | None = None,
                times: int = 1) -> None:
        """A compute time, `times` over (a window of iterations reported as one, through `iteration`)."""
        samples = self._samples.setdefault((stage, replica), deque(maxlen=self.window))
        samples.extend([compute_s] * min(times, self.window))
        if iteration is not None:
            self._through[(stage, replica)] = iteration

    def ready(self) -> bool:
        """Whether some stage can be judged now: two or more replicas, each with a full window, all through the
        same iteration. Hosts report in their own time, so a verdict taken as the first replica's report arrives
        would find its peers one report behind and judge nothing; the caller waits for this instead."""
        return any(self._judged(stage) is not None for stage in {s for s, _ in self._samples})

    def _judged(self, stage: int) -> dict[int, deque[float]] | None:
        replicas = {r: q for (s, r), q in self._samples.items() if s == stage}
        if len(replicas) < 2 or any(len(q) < self.window for q in replicas.values()):
            return None
        if len({self._through.get((stage, r)) for r in replicas}) > 1:
            return None  # one replica's newest window is in, a peer's not yet: judge the same iterations
        return replicas

    def straggler(self) -> Finding | None:
        """The slowest replica past the threshold, once every replica of its stage has a full window."""
        worst: Finding | None = None
        stages = sorted({s for s, _ in self._samples})
        for stage in stages:
            replicas = self._judged(stage)
            if replicas is None:
                continue
            medians = {r: statistics.median(q) for r, q in replicas.items()}
            for r, own in medians.items():
                peers = statistics.median(m for other, m in medians.items() if other != r)
                if peers > 0 and own > (1 + self.threshold) * peers and (worst is None or own / peers > worst.ratio):
                    worst = Finding(stage, r, own / peers, own, peers, self.window)
        return worst


def faster_without(iteration_s: float, finding: Finding, predicted_now_s: float,
                   predicted_without_s: float) -> float | None:
    """The iteration time expected without the straggler's device, from the simulator's two predictions: the
    job's current plan, and its re-plan (Varuna's P x D at the same global batch, as the morph would choose) on
    the devices left. None when either prediction is missing (no plan fits the devices left).

    Everyone waits for the straggler, so the healthy iteration is the measured one less the straggler's extra
    compute; how far the current plan's prediction is from that healthy measurement corrects the re-plan's
    prediction the same way (the simulator's error is taken to carry over to a neighbouring layout)."""
    if predicted_now_s <= 0 or predicted_without_s <= 0:
        return None
    healthy = max(iteration_s - (finding.own_s - finding.peers_s), 0.0)
    return predicted_without_s * healthy / predicted_now_s
