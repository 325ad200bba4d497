"""Pricing chunk offload (PatrickStar) for a model that does not fit the devices: swap bytes and iteration time.

A chunk-offload plan is one stage holding every layer, data parallel over all D devices, one micro-batch of
B/D samples per device, model data in chunks that move between device and host under the device budget. The
simulator (sim/chunks.py, the runtime's own residency policy) gives the bytes each way, the gathers and
reductions and whether it fits; this module turns them into time:
- compute: every layer's forward + backward at B/D samples from the profile (scaled as the cost model scales
  compute on this fleet);
- the step: each device steps its 1/D of the chunks (the profile's per-layer Adam step over D);
- host link: every chunk move, each way (the fleet's device host link; a fleet without its bandwidth, such as
  the local CPU plane, prices it at nothing and the note says so);
- collectives: a gather per communication group fetched (all-gather of D chunks), a reduction per group after
  the backward (priced as a reduce-scatter of D chunks);
nothing overlapped. Chunk sizes tried: the largest tensor rounded up to a MiB, and 2x and 4x that; the fastest
that fits wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.cost.context import CostContext
from services.planner.sim.chunks import ChunkModel, ChunkOptions, ChunkSim, simulate_chunks

MIB = 1 << 20
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class ChunkPrice:
    feasible: bool
    reason: str  # why not, when not
    chunk_bytes: int = 0
    micro_batch_size: int = 0  # per device
    iteration_s: float = 0.0
    compute_s: float = 0.0
    optimizer_s: float = 0.0
    swap_s: float = 0.0  # host link
    collective_s: float = 0.0  # gathers and reductions
    sim: ChunkSim | None = None
    note: str = ""


def chunk_model(ctx: CostContext, micro_batch: int) -> ChunkModel | None:
    """The simulator's view of the profiled model at `micro_batch` samples, or None when the profile predates
    LayerProfile.parameter_numels (profile the model again)."""
    layers = ctx.view.layers
    if not any(layer.parameter_numels for layer in layers):
        return None
    tensors = tuple(n for layer in layers for n in layer.parameter_numels)
    acts = tuple(round(ctx.view.point(i, micro_batch).stashed_bytes + ctx.view.point(i, micro_batch).boundary_bytes)
                 for i in range(len(layers)))
    return ChunkModel(tensors, tuple(layer.parameter_tensors for layer in layers), acts,
                      element_size=ELEMENT_BYTES.get(ctx.view.dtype, 4))


def price_chunks(ctx: CostContext, devices: int, global_batch_size: int, device_budget: int,
                 optimizer: str = "adam") -> ChunkPrice:
    if devices < 1 or global_batch_size < devices or global_batch_size % devices:
        return ChunkPrice(False, f"chunk offload splits the global batch evenly over {devices} devices: "
                                 f"{global_batch_size} does not")
    m = global_batch_size // devices
    model = chunk_model(ctx, m)
    if model is None:
        return ChunkPrice(False, "the profile does not list the model's parameter tensors (profiled before chunk "
                                 "offload existed): profile the model again")
    largest = max(model.tensors, default=0) * model.element_size
    base = max(MIB, -(-largest // MIB) * MIB)
    best: ChunkPrice | None = None
    reasons = []
    for chunk in (base, 2 * base, 4 * base):
        sim = simulate_chunks(model, ChunkOptions(chunk, device_budget, world=devices, optimizer=optimizer))
        if not sim.feasible:
            reasons.append(f"{chunk // MIB} MiB chunks: {sim.reason}")
            continue
        price = _time(ctx, model, sim, chunk, m, devices)
        if best is None or price.iteration_s < best.iteration_s:
            best = price
    if best is None:
        return ChunkPrice(False, "no chunk size fits: " + "; ".join(reasons))
    return best


def _time(ctx: CostContext, model: ChunkModel, sim: ChunkSim, chunk: int, m: int, devices: int) -> ChunkPrice:
    view = ctx.view
    compute = ctx.compute_scale * sum(view.point(i, m).forward_s + view.point(i, m).backward_s
                                      for i in range(len(view.layers)))
    optimizer = sum(layer.optimizer_step_s for layer in view.layers) / devices
    steady = sim.steady
    link = ctx.fleet.host_link
    moves = (steady.to_device + steady.to_host) // chunk if chunk else 0
    swap = 0.0 if link is None else moves * link.latency_s + (steady.to_device + steady.to_host) / \
        link.bandwidth_bytes_per_s
    collective = 0.0
    if devices > 1:
        group = chunk * devices
        gathers = steady.gathered // (chunk * (devices - 1))
        reductions = steady.reduced // group
        collective = gathers * ctx.comm.allgather(group, devices) + reductions * ctx.comm.reduce_scatter(group, devices)
    note = "" if link is not None else "host link bandwidth unknown for this fleet: chunk moves priced at 0 s"
    return ChunkPrice(True, "", chunk, m, compute + optimizer + swap + collective, compute, optimizer, swap,
                      collective, sim, note)
