"""The per-layer cost model every planner shares (pure: no I/O, no grpc, deterministic).

profile_view: a Profile as interpolating per-layer tables (ModelView); comm: collective and p2p prices from
measured fits or fleet links; strategy: per-layer DP/SDP/TP/CKPT/swap, DP flavours (plain, ZeRO-1, ZeRO-2) and
model-state formats; layer: time and memory of one layer under one strategy, transformation costs; stage /
pipeline: StageCost and Pipeline for the simulator (services.planner.sim.model), in-flight counts and peak
memory without simulating. Each module's docstring states its modelling rules.
"""

from services.planner.cost.comm import CommLine, CommModel, FleetView, Scope
from services.planner.cost.context import GALVATRON_OVERLAP_SLOWDOWN, CostContext, CostOptions
from services.planner.cost.layer import (
    LayerCost,
    Transform,
    dim_scopes,
    layer_cost,
    missing_fraction,
    overlap_time,
    transform_cost,
)
from services.planner.cost.pipeline import (
    DeviceLayout,
    Placement,
    bounds_from_sizes,
    build_pipeline,
    in_flight_micro_batches,
    peak_memory,
    pipeline_peak_memory,
    stage_peak_memory,
)
from services.planner.cost.profile_view import (
    LayerDoesNotFit,
    LayerPoint,
    LayerTable,
    LayerView,
    MeasuredFit,
    ModelView,
    from_profile,
)
from services.planner.cost.stage import cut_bytes, stage_cost, stage_layer_costs
from services.planner.cost.strategy import (
    BYTES_PER_PARAM,
    Dim,
    DpSharding,
    LayerStrategy,
    ModelStateFormat,
    Precision,
)

__all__ = [
    "BYTES_PER_PARAM",
    "GALVATRON_OVERLAP_SLOWDOWN",
    "CommLine",
    "CommModel",
    "CostContext",
    "CostOptions",
    "DeviceLayout",
    "Dim",
    "DpSharding",
    "FleetView",
    "LayerCost",
    "LayerDoesNotFit",
    "LayerPoint",
    "LayerStrategy",
    "LayerTable",
    "LayerView",
    "MeasuredFit",
    "ModelStateFormat",
    "ModelView",
    "Placement",
    "Precision",
    "Scope",
    "Transform",
    "bounds_from_sizes",
    "build_pipeline",
    "cut_bytes",
    "dim_scopes",
    "from_profile",
    "in_flight_micro_batches",
    "layer_cost",
    "missing_fraction",
    "overlap_time",
    "peak_memory",
    "pipeline_peak_memory",
    "stage_cost",
    "stage_layer_costs",
    "stage_peak_memory",
    "transform_cost",
]
