"""What the iteration simulator consumes and returns.

The cost model (services.planner.cost) turns a profile, a fleet and per-layer strategies into a
`Pipeline`; the simulator turns a `Pipeline` and `SimOptions` into a `SimResult`. Both are pure:
these dataclasses are the only contract between them, so measured calibration enters once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class Schedule(str, Enum):  # noqa: UP042 (kept as the contract defines it)
    """Pipeline schedules the simulator can run (names match plan.proto's Schedule)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    VARUNA = "varuna"
    HARMONY_WRAP = "harmony_wrap"


@dataclass(frozen=True)
class LinkCost:
    """time(bytes) = latency_s + bytes / bandwidth_bytes_per_s; bandwidth inf means free transfer."""

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = math.inf

    def time(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


FREE_LINK = LinkCost()


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage on one replica's devices, per micro-batch (times already include TP/SDP
    collectives and the overlap slowdown the cost model priced in)."""

    forward_s: float
    backward_s: float
    # Extra forward before backward under activation checkpointing; 0 when the stage keeps activations.
    recompute_s: float = 0.0
    # Activation bytes sent to the next stage per micro-batch; the gradient sent back has the same size.
    output_bytes: int = 0
    # Gradient synchronisation of this stage across replicas at the end of the iteration (0 when D = 1).
    allreduce_s: float = 0.0
    # The optimizer step after that synchronisation, once per iteration.
    update_s: float = 0.0
    # Resident for the whole iteration: parameters, gradients, optimizer state, non-model baseline.
    model_memory_bytes: int = 0
    # Held per in-flight micro-batch from its forward until its backward finishes (boundary input only
    # under checkpointing, all stashed intermediates otherwise).
    activation_bytes: int = 0
    # Extra transient peak while one backward runs (recomputed intermediates, workspace).
    transient_bytes: int = 0
    # Activations swapped to host memory after forward and back before backward (vPipe/Harmony swap).
    swap_bytes: int = 0
    # Weights (and gradients) moved host<->device each time the stage's layer pack is visited (Harmony).
    weight_swap_bytes: int = 0


@dataclass(frozen=True)
class Pipeline:
    """P stages x D identical replicas x Nm micro-batches of one training iteration."""

    stages: tuple[StageCost, ...]
    num_micro_batches: int
    replicas: int = 1
    # Link between stage s and s+1 (len P-1): intra- or inter-node as the placement decided.
    boundary_links: tuple[LinkCost, ...] = ()
    # Host<->device link (PCIe) used by swaps.
    host_link: LinkCost = FREE_LINK
    # Device running each stage (len P); default stage s on device s. Harmony's wrap-around binds
    # several layer packs to one device.
    device_of_stage: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SimOptions:
    """How to simulate: schedule, jitter, and how much detail to keep."""

    schedule: Schedule = Schedule.ONE_F_ONE_B
    # Coefficient of variation of multiplicative lognormal noise on compute / on transfers (0 = none).
    compute_jitter: float = 0.0
    comm_jitter: float = 0.0
    seed: int = 0
    # False is the pricing path: no events, no memory curves, identical replicas collapsed.
    keep_timeline: bool = True


@dataclass(frozen=True)
class Event:
    """One interval on one resource (a device's compute stream or a link)."""

    kind: str  # forward, backward, recompute, send_activation, send_gradient, allreduce, swap_out, swap_in
    stage: int
    device: int
    replica: int
    micro_batch: int  # -1 for per-iteration events (allreduce, weight swaps)
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """One simulated iteration."""

    iteration_s: float
    busy_s: tuple[float, ...]  # per stage: compute time on its device
    idle_s: tuple[float, ...]  # per stage: iteration_s - busy_s
    peak_memory_bytes: tuple[int, ...]  # per stage
    bubble_fraction: float  # idle share of all stage time
    # Per stage, (time, bytes) steps; empty on the pricing path.
    memory_timeline: tuple[tuple[tuple[float, int], ...], ...] = ()
    events: tuple[Event, ...] = field(default=())
    # Bytes moved over host links in the iteration, all replicas: activation swaps (out + in) and weight
    # swaps (Harmony: in per forward and backward visit, out for the update). Added by the simulator.
    swapped_activation_bytes: int = 0
    swapped_weight_bytes: int = 0
