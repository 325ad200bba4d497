"""Online repartitioning (vPipe): the training monitor and the swap/recompute/repartition (SRP) planner.

Pure like the cost model and simulator they build on: no I/O, no grpc, deterministic. The planner's
scheduler feeds every executor StageStats to `TrainingMonitor.observe`, asks `observation(job_id)` once
`ready(job_id)`, and hands it with the running plan to `propose`, whose `Decision.new_plan` (version + 1,
engine PLAN_ENGINE_VPIPE) is what to migrate to when `accepted`.
"""

from services.planner.online.kl import SearchTrace, moved_layers, repartition
from services.planner.online.monitor import (
    MonitorOptions,
    Observation,
    StageObservation,
    TrainingMonitor,
    WorkerSample,
    WorkloadChange,
)
from services.planner.online.srp import (
    Calibration,
    Candidate,
    Decision,
    Move,
    OnlineOptions,
    Pricer,
    RunningPlan,
    calibrate,
    new_plan,
    propose,
    scaled_view,
)

__all__ = [
    "Calibration",
    "Candidate",
    "Decision",
    "MonitorOptions",
    "Move",
    "Observation",
    "OnlineOptions",
    "Pricer",
    "RunningPlan",
    "SearchTrace",
    "StageObservation",
    "TrainingMonitor",
    "WorkerSample",
    "WorkloadChange",
    "calibrate",
    "moved_layers",
    "new_plan",
    "propose",
    "repartition",
    "scaled_view",
]
