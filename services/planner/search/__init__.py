"""Search engines' shared pieces: the per-layer strategy space."""

from services.planner.search.space import (
    CAPABILITIES,
    DIMS,
    FLAVOURS,
    PARALLEL_DIM,
    Candidate,
    InvalidSpace,
    count,
    layer_candidates,
    pipeline_degrees,
    strategy_space,
)

__all__ = [
    "CAPABILITIES",
    "DIMS",
    "FLAVOURS",
    "PARALLEL_DIM",
    "Candidate",
    "InvalidSpace",
    "count",
    "layer_candidates",
    "pipeline_degrees",
    "strategy_space",
]
