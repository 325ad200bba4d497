"""A whole plan as the simulator's Pipeline, plus memory checks that need no simulation.

Placement. Stage s of a replica uses a block of ``dp*sdp*tp`` consecutive devices (its layers'
common device count); blocks are laid out over nodes in rank order, so a node holds whole stages
where they fit (Galvatron-BMW Takeaway #1: pipeline cuts fall between device islands). With D pipeline
replicas (Varuna's P x D) either each replica's stages are consecutive (PIPELINES_CONTIGUOUS: pipeline
sends stay in a node, the cross-replica allreduce spans nodes) or the D copies of each stage are
(REPLICAS_CONTIGUOUS: the allreduce stays in a node, sends cross nodes). A pipeline boundary uses
the intra-node link when every sending and receiving device pair shares a node, else inter-node;
the link is the measured p2p fit when the profile has one for that scope, else the fleet's Link.

In-flight micro-batches per stage s of P with Nm micro-batches (what a stage's activation memory
is multiplied by):

* GPipe: Nm (all forwards before any backward).
* 1F1B (PipeDream-flush): min(P - s, Nm) (warm-up depth).
* Varuna: Nm. Its opportunistic policy runs any ready forward while a backward is not ready (§3.2),
  so under jitter every forward can precede the first backward; Varuna checkpoints every stage, so
  this is Nm boundary inputs, an upper bound the simulator's timeline refines.
* Harmony wrap-around: Nm for every layer pack (input-batch grouping runs a pack's forward over all
  micro-batches of the group before its backward, Harmony §3; jit-compute's immediate backward is for
  the model's last layer only, so it is not assumed for a whole pack).

Peak memory of a stage = model_memory + in_flight x activation + transient (stage docstring, Eq. 2);
with swapping, in-flight micro-batches keep only ``activation - swap`` on the device and the one in
backward has its swapped part back: ``model + n (act - swap) + swap + transient``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from services.planner.cost.comm import FleetView, Scope
from services.planner.cost.context import CostContext, CostOptions
from services.planner.cost.profile_view import ModelView
from services.planner.cost.stage import stage_cost, stage_strategies
from services.planner.cost.strategy import LayerStrategy
from services.planner.sim.model import FREE_LINK, Pipeline, Schedule, StageCost

if TYPE_CHECKING:
    from ballast.v1 import fleet_pb2


class Placement(StrEnum):
    PIPELINES_CONTIGUOUS = "pipelines_contiguous"
    REPLICAS_CONTIGUOUS = "replicas_contiguous"


@dataclass(frozen=True)
class DeviceLayout:
    """Global device rank of (replica, stage, rank inside the stage's block)."""

    stage_devices: tuple[int, ...]
    replicas: int = 1
    placement: Placement = Placement.PIPELINES_CONTIGUOUS

    @property
    def devices_per_replica(self) -> int:
        return sum(self.stage_devices)

    @property
    def total_devices(self) -> int:
        return self.devices_per_replica * self.replicas

    def device(self, replica: int, stage: int, rank: int) -> int:
        before = sum(self.stage_devices[:stage])
        if self.placement is Placement.PIPELINES_CONTIGUOUS:
            return replica * self.devices_per_replica + before + rank
        return before * self.replicas + replica * self.stage_devices[stage] + rank

    def stage_offsets(self, stage: int) -> tuple[int, ...]:
        return tuple(self.device(r, stage, 0) for r in range(self.replicas))

    def boundary_scope(self, stage: int, devices_per_node: int) -> Scope:
        """Scope of the sends from `stage` to `stage + 1` (every replica, every device pair)."""
        g0, g1 = self.stage_devices[stage], self.stage_devices[stage + 1]
        for r in range(self.replicas):
            for i in range(max(g0, g1)):
                a, b = self.device(r, stage, i % g0), self.device(r, stage + 1, i % g1)
                if a // devices_per_node != b // devices_per_node:
                    return Scope.INTER
        return Scope.INTRA

    def replica_scope(self, stage: int, devices_per_node: int) -> Scope:
        """Scope of the allreduce among the `replicas` copies of `stage`."""
        for i in range(self.stage_devices[stage]):
            nodes = {self.device(r, stage, i) // devices_per_node for r in range(self.replicas)}
            if len(nodes) > 1:
                return Scope.INTER
        return Scope.INTRA


def in_flight_micro_batches(schedule: Schedule | str, num_stages: int, stage: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at once (rules in the module docstring)."""
    schedule = Schedule(schedule)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside 0..{num_stages - 1}")
    nm = num_micro_batches
    if schedule is Schedule.ONE_F_ONE_B:
        return min(num_stages - stage, nm)
    return nm


def peak_memory(stage: StageCost, in_flight: int) -> int:
    """Per-device peak of a stage holding `in_flight` micro-batches' activations (module docstring)."""
    swap = min(stage.swap_bytes, stage.activation_bytes) if in_flight > 0 else 0
    return stage.model_memory_bytes + in_flight * (stage.activation_bytes - swap) + swap + stage.transient_bytes


def stage_peak_memory(
    stage: StageCost, schedule: Schedule | str, num_stages: int, stage_index: int, num_micro_batches: int
) -> int:
    """Peak memory of `stage` under `schedule`, without simulating."""
    return peak_memory(stage, in_flight_micro_batches(schedule, num_stages, stage_index, num_micro_batches))


def pipeline_peak_memory(pipeline: Pipeline, schedule: Schedule | str) -> tuple[int, ...]:
    p = len(pipeline.stages)
    return tuple(
        stage_peak_memory(s, schedule, p, i, pipeline.num_micro_batches) for i, s in enumerate(pipeline.stages)
    )


def check_bounds(stage_bounds: Sequence[tuple[int, int]], num_layers: int) -> tuple[tuple[int, int], ...]:
    """Stage bounds must tile [0, num_layers) in order with non-empty stages."""
    bounds = tuple((int(b), int(e)) for b, e in stage_bounds)
    expect = 0
    for b, e in bounds:
        if b != expect or e <= b:
            raise ValueError(f"stage bounds {bounds} must tile [0, {num_layers}) with non-empty stages in order")
        expect = e
    if expect != num_layers:
        raise ValueError(f"stage bounds {bounds} end at {expect}, model has {num_layers} layers")
    return bounds


def bounds_from_sizes(sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """[(0, n0), (n0, n0 + n1), ...] from layers per stage."""
    out, begin = [], 0
    for n in sizes:
        out.append((begin, begin + n))
        begin += n
    return tuple(out)


def _tied_sync(
    ctx: CostContext, bounds: tuple[tuple[int, int], ...], strategies: Sequence[LayerStrategy], layout: DeviceLayout
) -> list[float]:
    """Per stage: allreduce of gradients of weights tied to a layer on another stage (Varuna §5).

    The profile counts a shared weight in each layer using it, so the shared size is estimated as
    the smaller of the two layers' gradients (a GPT head tied to the embedding: about the embedding).
    """
    stage_of = [s for s, (b, e) in enumerate(bounds) for _ in range(b, e)]
    out = [0.0] * len(bounds)
    dpn = ctx.fleet.devices_per_node
    for layer in ctx.view.layers:
        i = layer.index
        for j in layer.tied_with:
            if not 0 <= j < len(stage_of) or stage_of[j] == stage_of[i]:
                continue
            st = strategies[i]
            shared = min(ctx.state_bytes[i][1], ctx.state_bytes[j][1]) / (st.tp * st.sdp)
            a, b = layout.device(0, stage_of[i], 0), layout.device(0, stage_of[j], 0)
            scope = Scope.INTRA if a // dpn == b // dpn else Scope.INTER
            out[stage_of[i]] += ctx.comm.allreduce(shared, 2, scope)
    return out


def build_pipeline(
    view: ModelView,
    fleet: FleetView | fleet_pb2.Fleet | None,
    stage_bounds: Sequence[tuple[int, int]],
    strategies: Sequence[LayerStrategy] | LayerStrategy,
    micro_batch_size: int,
    num_micro_batches: int,
    *,
    replicas: int = 1,
    placement: Placement = Placement.PIPELINES_CONTIGUOUS,
    options: CostOptions | None = None,
    context: CostContext | None = None,
) -> Pipeline:
    """The simulator's Pipeline for a plan: P stages x `replicas` copies, `micro_batch_size` samples per
    micro-batch per replica, `num_micro_batches` per iteration. Pass a `context` to reuse its caches
    across many calls (then `fleet` and `options` may be None and must otherwise match it)."""
    if context is None:
        if fleet is None:
            raise ValueError("build_pipeline needs a fleet or a context")
        context = CostContext(view, fleet, options)
    elif context.view is not view:
        raise ValueError("context was built for another ModelView")
    ctx = context
    if num_micro_batches < 1 or replicas < 1:
        raise ValueError(f"need num_micro_batches >= 1 and replicas >= 1, got {num_micro_batches}, {replicas}")
    n = len(view)
    bounds = check_bounds(stage_bounds, n)
    if isinstance(strategies, LayerStrategy):
        per_layer: tuple[LayerStrategy, ...] = (strategies,) * n
    elif len(strategies) == n:
        per_layer = tuple(strategies)
    else:
        raise ValueError(f"{len(strategies)} strategies for {n} layers (give one per layer, or one for all)")
    stage_devices = []
    for b, e in bounds:
        counts = {st.devices for st in stage_strategies(per_layer, b, e, n)}
        if len(counts) != 1:
            raise ValueError(f"stage [{b}, {e}) mixes device counts {sorted(counts)}")
        stage_devices.append(counts.pop())
    layout = DeviceLayout(tuple(stage_devices), replicas, placement)
    if layout.total_devices > ctx.fleet.devices:
        raise ValueError(f"plan needs {layout.total_devices} devices, fleet has {ctx.fleet.devices}")

    dpn = ctx.fleet.devices_per_node
    tied = _tied_sync(ctx, bounds, per_layer, layout)
    stages = []
    for s, (b, e) in enumerate(bounds):
        stages.append(stage_cost(
            ctx, b, e, per_layer, micro_batch_size,
            offsets=layout.stage_offsets(s),
            next_strategy=per_layer[e] if e < n else None,
            replicas=replicas,
            replica_scope=layout.replica_scope(s, dpn) if replicas > 1 else Scope.INTRA,
            tied_sync_s=tied[s],
            num_micro_batches=num_micro_batches,
        ))
    links = tuple(ctx.comm.p2p_link(layout.boundary_scope(s, dpn)) for s in range(len(bounds) - 1))
    host = ctx.fleet.host_link
    if host is None:
        if any(st.swap_bytes or st.weight_swap_bytes for st in stages):
            raise ValueError("plan swaps activations but the fleet's device has no host link bandwidth")
        host = FREE_LINK
    return Pipeline(
        stages=tuple(stages),
        num_micro_batches=num_micro_batches,
        replicas=replicas,
        boundary_links=links,
        host_link=host,
    )
