"""Event-driven simulator of one training iteration (pure: no I/O, deterministic for a seed).

Schedules: GPipe, 1F1B (PipeDream-flush), Varuna's rule-based opportunistic schedule, Harmony's wrap-around
pipeline. Input and output types live in `model`; the cost model builds the `Pipeline`.
"""

from services.planner.sim.model import (
    FREE_LINK,
    Event,
    LinkCost,
    Pipeline,
    Schedule,
    SimOptions,
    SimResult,
    StageCost,
)
from services.planner.sim.simulate import simulate

__all__ = [
    "FREE_LINK",
    "Event",
    "LinkCost",
    "Pipeline",
    "Schedule",
    "SimOptions",
    "SimResult",
    "StageCost",
    "simulate",
]
