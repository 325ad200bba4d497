"""Builders shared by the cost-model tests (no tests here): small hand-checkable models and fleets."""

from __future__ import annotations

from services.planner.cost import FleetView, LayerTable, LayerView, ModelView
from services.planner.sim.model import LinkCost

SIZES = (1, 2, 4, 8)
GB = 1e9


def table(
    fwd: float = 1e-3,
    bwd: float = 2e-3,
    rec: float | None = None,
    boundary: float = 100,
    stashed: float = 1000,
    output: float = 100,
    peak: float = 0,
    sizes: tuple[int, ...] = SIZES,
) -> LayerTable:
    """Everything proportional to m (per-sample values given), so hand arithmetic stays simple."""
    rec = fwd if rec is None else rec
    return LayerTable.from_rows(
        (m, fwd * m, bwd * m, rec * m, boundary * m, stashed * m, output * m, peak * m) for m in sizes
    )


def layer(index: int, params: int = 1000, kind: str = "block", **kw: object) -> LayerView:
    extra = tuple(kw.pop("extra_inputs", ()))  # type: ignore[arg-type]
    tied = tuple(kw.pop("tied_with", ()))  # type: ignore[arg-type]
    return LayerView(
        index=index,
        name=f"{kind}.{index}",
        kind=kind,
        parameter_count=params,
        parameter_bytes=4 * params,
        gradient_bytes=4 * params,
        optimizer_state_bytes=8 * params,
        table=table(**kw),  # type: ignore[arg-type]
        extra_inputs=extra,
        tied_with=tied,
    )


def model(num_layers: int = 4, **kw: object) -> ModelView:
    return ModelView(layers=tuple(layer(i, **kw) for i in range(num_layers)))


def fleet(
    devices_per_node: int = 4,
    nodes: int = 2,
    intra_bw: float = 100 * GB,
    inter_bw: float = 10 * GB,
    intra_lat: float = 0.0,
    inter_lat: float = 0.0,
    host_bw: float | None = 20 * GB,
) -> FleetView:
    return FleetView(
        devices_per_node=devices_per_node,
        nodes=nodes,
        intra_node=LinkCost(intra_lat, intra_bw),
        inter_node=LinkCost(inter_lat, inter_bw),
        host_link=None if host_bw is None else LinkCost(0.0, host_bw),
        device_memory_bytes=80 * 2**30,
    )
