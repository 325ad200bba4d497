"""Elastic fleet (issue 20): give devices to the jobs that gain most from them, and prove it on a simulator.

Pure: no I/O, no clock. `trace` reads, checks and generates job traces; `curves` says what each device
count is worth to a (model, global batch); `policy` allocates devices (fifo, backfill, elastic); `simulate`
replays a trace through the policies and reports completion times, utilisation, waits, morphs and fairness.
"""

from services.planner.elastic.curves import (
    DEFAULT_SHAPE,
    SYNTHETIC_SHAPES,
    CurveCache,
    ScalingCurve,
    amdahl_curve,
    fleet_of,
    planner_curve,
    synthetic_curve,
)
from services.planner.elastic.policy import (
    BACKFILL,
    ELASTIC,
    FIFO,
    POLICIES,
    ElasticPolicy,
    JobState,
    allocate,
    remaining_s,
)
from services.planner.elastic.simulate import DEFAULT_MORPH_COST_S, JobCosts, PolicyResult, simulate
from services.planner.elastic.trace import COLUMNS, TraceError, TraceJob, generate_trace, parse_trace, write_trace

__all__ = [
    "BACKFILL",
    "COLUMNS",
    "CurveCache",
    "DEFAULT_MORPH_COST_S",
    "DEFAULT_SHAPE",
    "ELASTIC",
    "FIFO",
    "POLICIES",
    "ElasticPolicy",
    "JobCosts",
    "JobState",
    "PolicyResult",
    "SYNTHETIC_SHAPES",
    "ScalingCurve",
    "TraceError",
    "TraceJob",
    "allocate",
    "amdahl_curve",
    "fleet_of",
    "generate_trace",
    "parse_trace",
    "planner_curve",
    "remaining_s",
    "simulate",
    "synthetic_curve",
    "write_trace",
]
