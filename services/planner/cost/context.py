"""Options and the memoising context every pricing call goes through.

A `CostContext` binds one profile view, one fleet, one comm model and one set of options, and caches
what dynamic programs ask for over and over: layer costs per (layer, strategy, micro-batch, node
alignment), transformation costs and link scopes. It holds no I/O and is cheap to build; make one
per search, not one per call.

Non-model memory: the profile's `non_model_memory_bytes` is the peak of activations, their
gradients and temporaries of a whole-model warm-up iteration on one device at the largest profiled
micro-batch (profiler memtrace, PatrickStar §8.1). The per-layer activations priced here already
cover the activation part, so adding it to every stage would count activations twice; it is
therefore off by default (`include_profile_non_model_memory`) and a fixed per-device reserve
(allocator slack, CUDA context, workspaces) goes in `extra_resident_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.planner.cost.calibration import Calibration
from services.planner.cost.comm import CommModel, FleetView, as_fleet_view
from services.planner.cost.strategy import ModelStateFormat, model_state_bytes

if TYPE_CHECKING:
    from ballast.v1 import fleet_pb2
    from services.planner.cost.profile_view import ModelView

# Compute slowdown while DP/SDP communication overlaps it, when the profile did not measure one
# (Galvatron-BMW §V: 1.3x on their GPUs).
GALVATRON_OVERLAP_SLOWDOWN = 1.3

# Megatron-style activation allreduces per layer per pass (forward, backward, recompute) under TP:
# a transformer block has two (attention, MLP; Varuna §3 Obs. 1), a decoder block with
# cross-attention three (Galvatron's estimator counts 6 per decoder layer for forward + backward),
# a vocab-parallel embedding or head one, a replicated norm none. Unknown kinds count as blocks.
TP_ALLREDUCES_PER_PASS: dict[str, int] = {
    "block": 2,
    "encoder_block": 2,
    "decoder_block": 3,
    "embed": 1,
    "embedding": 1,
    "head": 1,
    "norm": 0,
}
DEFAULT_TP_ALLREDUCES = 2


@dataclass(frozen=True)
class CostOptions:
    """Modelling switches shared by every planner (defaults follow Galvatron-BMW)."""

    state_format: ModelStateFormat = ModelStateFormat.MEASURED
    # None: the profile's measured factor, else GALVATRON_OVERLAP_SLOWDOWN. 1.0 = free overlap (PipeDream's max).
    overlap_slowdown: float | None = None
    # True: the iteration-end gradient sync overlaps the last micro-batch's backward (DDP buckets);
    # False: it runs after the last backward (Varuna §4.4: N_m micro-batches followed by the allreduce).
    overlap_grad_sync: bool = True
    # True: a ZeRO-2 layer reduce-scatters its gradient as soon as the iteration's last backward of that layer
    # ends, so with one micro-batch only the running layer's full gradient is held (DeepSpeed-style); False:
    # the reduce-scatters wait for the stage's whole backward, so every ZeRO-2 layer's full gradient is held
    # through it (ZeRO-1's peak, ZeRO-2's traffic) -- what Ballast's executors do (services/executor/train/
    # sharding.py), so plans for jobs pass False. Several micro-batches hold full gradients either way.
    zero2_reduce_scatter_per_layer: bool = True
    # False prices every collective from the fleet's links (what-if fleets other than the profiled one).
    # Measured fits are also ignored when the profile's device kind differs from the fleet's.
    use_measured_comm: bool = True
    include_profile_non_model_memory: bool = False
    extra_resident_bytes: int = 0
    # None: the profile's measured co-location slowdown (compute of devices sharing a node, all busy), applied when
    # the fleet's node has several devices of the profiled kind; 1.0 ignores it.
    colocated_slowdown: float | None = None
    # Overrides of TP_ALLREDUCES_PER_PASS, as (kind, count) pairs.
    tp_allreduces: tuple[tuple[str, int], ...] = ()
    # Corrections learnt from runs on this fleet's host class (cost/calibration.py); None: the profile alone.
    # Ignored when its host class names another device kind than the fleet's.
    calibration: Calibration | None = None

    def tp_allreduces_for(self, kind: str) -> int:
        for k, n in self.tp_allreduces:
            if k == kind:
                return n
        return TP_ALLREDUCES_PER_PASS.get(kind, DEFAULT_TP_ALLREDUCES)


class CostContext:
    """One (profile view, fleet, options) with caches; see the module docstring."""

    def __init__(
        self,
        view: ModelView,
        fleet: FleetView | fleet_pb2.Fleet,
        options: CostOptions | None = None,
        comm: CommModel | None = None,
    ) -> None:
        self.view = view
        self.fleet = as_fleet_view(fleet)
        self.options = options or CostOptions()
        same_device = not view.device_kind or not self.fleet.device_kind or view.device_kind == self.fleet.device_kind
        self.comm = comm or CommModel(
            self.fleet, view.comm_fits, use_measured=self.options.use_measured_comm and same_device
        )
        self.overlap_slowdown = max(
            1.0, self.options.overlap_slowdown or view.overlap_slowdown or GALVATRON_OVERLAP_SLOWDOWN
        )
        crowded = self.fleet.devices_per_node > 1 and same_device
        colocated = self.options.colocated_slowdown or view.colocated_slowdown or 1.0
        self.compute_scale = max(1.0, colocated) if crowded else 1.0
        if same_device and view.composition_factor:  # layers in sequence, not each alone with warm caches
            self.compute_scale *= view.composition_factor
        # (parameter, gradient, optimizer) bytes of each whole layer, computed once.
        self.state_bytes = tuple(model_state_bytes(layer, self.options.state_format) for layer in view.layers)
        self.tp_allreduces = tuple(self.options.tp_allreduces_for(layer.kind) for layer in view.layers)
        baseline = self.options.extra_resident_bytes
        if self.options.include_profile_non_model_memory:
            baseline += view.non_model_memory_bytes
        self.resident_baseline_bytes = baseline
        cal = self.options.calibration
        kind = cal.host_class.split("/")[0] if cal is not None else ""
        self.calibration = cal if cal is not None and kind == self.fleet.device_kind else None
        self.layer_cache: dict[tuple, object] = {}
        self.transform_cache: dict[tuple, object] = {}
        self.scope_cache: dict[tuple, object] = {}

    def node_offsets(self, offsets: tuple[int, ...]) -> tuple[int, ...]:
        """Offsets reduced to what link scopes depend on: the position inside a node."""
        dpn = self.fleet.devices_per_node
        if len(offsets) == 1:
            return (offsets[0] % dpn,)
        return tuple(sorted({o % dpn for o in offsets})) or (0,)
