"""Plans for a model that fits no plan in device memory: chunk offload (PatrickStar) or Harmony's swap schedule.

`plan` prices whichever of the two the executors run (cost/offload.py, cost/harmony.py), picks the faster one
that fits and builds its Plan; the explanation says why memory forced it, what the other one would cost and
where the chosen one's time goes. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from ballast.v1 import fleet_pb2, plan_pb2, profile_pb2
from services.planner.cost import CostContext
from services.planner.cost.harmony import HarmonyPrice, price_harmony
from services.planner.cost.offload import ChunkPrice, price_chunks
from services.planner.cost.strategy import LayerStrategy

GiB = float(1 << 30)
P = TypeVar("P", ChunkPrice, HarmonyPrice)


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps a readable number (budgets range from MiB to TiB)."""
    for unit, scale in (("GiB", GiB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def plan(ctx: CostContext, profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, batch: int, budget: int, why: str,
         *, chunks: bool, harmony: bool, calibration_note: str = "", pinned: bool = False) -> plan_pb2.Plan | str:
    """The faster runnable offload plan, or the text saying why neither fits (to append to `why`); `pinned`: one
    was asked for by engine, so the other is not mentioned."""
    devices = fleet.nodes * fleet.devices_per_node
    chunk = _host_fits(price_chunks(ctx, devices, batch, budget), fleet) if chunks else None
    swap = _host_fits(price_harmony(ctx, batch, budget), fleet) if harmony else None
    # the host class's calibration scales each estimator by what its runs measured against it (issue 45)
    chunk_scale, swap_scale = (ctx.calibration.offload(False), ctx.calibration.offload(True)) if ctx.calibration \
        else (1.0, 1.0)
    chunk_s = chunk.iteration_s * chunk_scale if chunk is not None and chunk.feasible else None
    swap_s = swap.choice.iteration_s * swap_scale if swap is not None and swap.feasible and swap.choice else None
    if swap_s is not None and (chunk_s is None or swap_s < chunk_s):
        assert swap is not None
        other = (f"Chunk offload was priced at {chunk_s:.4g} s per iteration." if chunk_s is not None else
                 _not(chunk, "chunk offload"))
        return _harmony_plan(ctx, profile, fleet, swap, batch, budget, why, "" if pinned else other,
                             calibration_note, swap_scale)
    if chunk_s is not None:
        assert chunk is not None
        other = (f"Harmony's swap schedule was priced at {swap_s:.4g} s per iteration." if swap_s is not None else
                 _not(swap, "Harmony's swap schedule"))
        return _chunk_plan(ctx, profile, fleet, chunk, batch, budget, why, "" if pinned else other,
                           calibration_note, chunk_scale)
    reasons = [f"chunk offload does not fit either: {chunk.reason}" if chunk is not None else
               "the executors do not run chunk offload (PARALLEL_DIM_CHUNKS)",
               f"Harmony's swap schedule does not fit either: {swap.reason}" if swap is not None else
               "the executors do not run Harmony's swap schedule (PARALLEL_DIM_HARMONY)"]
    return "; " + "; ".join(reasons)


def _host_fits(price: P, fleet: fleet_pb2.Fleet) -> P:
    """`price`, made infeasible when what it keeps in host memory per node exceeds the fleet's (when known)."""
    limit = fleet.host_memory_bytes_per_node
    if not limit or not price.feasible:
        return price
    if isinstance(price, ChunkPrice):
        assert price.sim is not None
        need = price.sim.host_peak * fleet.devices_per_node
    else:
        assert price.choice is not None
        need = price.host_bytes
    if need <= limit:
        return price
    return dataclasses.replace(price, feasible=False, reason=(
        f"it keeps {human_bytes(need)} in host memory per node, over the fleet's host_memory_bytes_per_node "
        f"{human_bytes(limit)}"))


def _not(price: ChunkPrice | HarmonyPrice | None, name: str) -> str:
    if price is None:
        return f"The executors do not run {name}."
    return f"{name[0].upper()}{name[1:]} does not fit: {price.reason}."


def _base(profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, engine: int, batch: int, budget: int,
          iteration_s: float, peak: int, stage_s: float, micro_batch: int) -> plan_pb2.Plan:
    """One stage of every layer over every device: the shape both offload plans take."""
    devices = fleet.nodes * fleet.devices_per_node
    layers = len(profile.layers)
    out = plan_pb2.Plan(
        model_id=profile.model_id, profile_id=profile.id, engine=engine, version=1, global_batch_size=batch,
        micro_batch_size=micro_batch, num_micro_batches=batch // micro_batch, schedule=plan_pb2.SCHEDULE_1F1B,
        memory_budget_bytes=budget,
        prediction=plan_pb2.Prediction(iteration_time_s=iteration_s,
                                       throughput_samples_per_s=batch / iteration_s if iteration_s else 0.0,
                                       peak_memory_bytes=peak))
    out.fleet.CopyFrom(fleet)
    out.stages.append(plan_pb2.Stage(index=0, layer_begin=0, layer_end=layers, devices=devices,
                                     predicted_time_s=stage_s, predicted_peak_memory_bytes=peak))
    strategy = LayerStrategy(dp=devices)
    out.layers.extend(strategy.to_proto(i, 0) for i in range(layers))
    return out


def _scaled(estimate: float, scale: float, kind: str) -> str:
    """How the calibration moved the estimator's time (nothing when it did not)."""
    if scale == 1.0:
        return ""
    return f" (the estimator's {estimate:.4g} s x {scale:.2f}, what this host class's {kind} runs measured against it)"


def _plain_bytes(ctx: CostContext) -> int:
    return sum(layer.parameter_bytes + layer.gradient_bytes + layer.optimizer_state_bytes for layer in ctx.view.layers)


def _chunk_plan(ctx: CostContext, profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, price: ChunkPrice,
                batch: int, budget: int, why: str, other: str, calibration_note: str, scale: float) -> plan_pb2.Plan:
    """One stage of every layer, data parallel over every device, model data in chunks (PatrickStar)."""
    devices = fleet.nodes * fleet.devices_per_node
    sim = price.sim
    assert sim is not None
    steady, peak, plain = sim.steady, sim.device_peak, _plain_bytes(ctx)
    iteration_s = price.iteration_s * scale
    out = _base(profile, fleet, plan_pb2.PLAN_ENGINE_PATRICKSTAR, batch, budget, iteration_s, peak,
                price.compute_s, batch)
    out.offload.CopyFrom(plan_pb2.ChunkOffload(
        chunk_bytes=price.chunk_bytes, device_budget_bytes=budget, predicted_to_device_bytes=steady.to_device,
        predicted_to_host_bytes=steady.to_host, predicted_gathered_bytes=steady.gathered,
        predicted_reduced_bytes=steady.reduced, predicted_swap_s=price.swap_s + price.collective_s,
        chunks=sim.chunks, predicted_device_peak_bytes=peak, plain_peak_memory_bytes=plain,
        predicted_host_bytes=sim.host_peak, predicted_iteration_s=price.iteration_s))
    lines = [
        f"Chosen: chunk offload (PatrickStar): every layer on one stage, data parallel over {devices} device(s), "
        f"global batch {batch} = {batch // devices} per device, model data in {sim.chunks} chunks of "
        f"{human_bytes(price.chunk_bytes)} moving between device and host memory.",
        f"Why: {why}. Model states alone need {human_bytes(plain)} per device as plain data parallel; chunks keep "
        f"the device at or under the {human_bytes(budget)} budget (predicted peak {human_bytes(peak)}) and hold "
        f"{human_bytes(sim.host_peak)} per device in host memory.",
        f"Predicted {iteration_s:.4g} s per iteration{_scaled(price.iteration_s, scale, 'chunk offload')}, "
        f"{batch / iteration_s:.4g} samples/s: compute "
        f"{price.compute_s:.4g} s, optimizer step {price.optimizer_s:.4g} s, chunk moves {price.swap_s:.4g} s "
        f"({human_bytes(steady.to_device)} in, {human_bytes(steady.to_host)} out per iteration), gathers and "
        f"reductions {price.collective_s:.4g} s ({human_bytes(steady.gathered)} gathered, "
        f"{human_bytes(steady.reduced)} reduced).",
        other,
    ]
    out.explanation = "\n".join(x for x in [*lines, price.note and price.note + ".", calibration_note] if x)
    return out


def _harmony_plan(ctx: CostContext, profile: profile_pb2.Profile, fleet: fleet_pb2.Fleet, price: HarmonyPrice,
                  batch: int, budget: int, why: str, other: str, calibration_note: str, scale: float) -> plan_pb2.Plan:
    """Harmony's wrap-around pipeline over one server's devices, weights and states in host memory."""
    choice = price.choice
    assert choice is not None
    s, moved, peak = choice.schedule, choice.traffic.total, max(choice.peak_bytes)
    iteration_s = choice.iteration_s * scale
    out = _base(profile, fleet, plan_pb2.PLAN_ENGINE_HARMONY, batch, budget, iteration_s, peak,
                price.compute_s, s.backward_micro_batch)
    out.schedule = plan_pb2.SCHEDULE_HARMONY_WRAP
    out.harmony.CopyFrom(plan_pb2.HarmonySwap(
        forward_micro_batch=s.forward_micro_batch,
        forward_packs=[plan_pb2.LayerSpan(begin=a, end=b) for a, b in s.forward_packs],
        backward_micro_batch=s.backward_micro_batch,
        backward_packs=[plan_pb2.LayerSpan(begin=a, end=b) for a, b in s.backward_packs],
        devices=s.devices, prefetch=choice.prefetch, device_budget_bytes=budget,
        predicted_to_device_bytes=moved["to_device"], predicted_to_host_bytes=moved["to_host"],
        predicted_peer_bytes=moved["peer"], predicted_iteration_s=choice.iteration_s,
        predicted_device_peak_bytes=peak, configurations_explored=choice.explored,
        predicted_to_device_by_device=choice.traffic.to_device, predicted_to_host_by_device=choice.traffic.to_host))
    lines = [
        f"Chosen: Harmony's swap schedule: a wrap-around pipeline over {s.devices} device(s) of one server, "
        f"{len(s.forward_packs)} forward pack(s) of micro-batch {s.forward_micro_batch} and "
        f"{len(s.backward_packs)} backward pack(s) of micro-batch {s.backward_micro_batch} (the last one runs "
        f"forward and backward together), each pack's weights and optimizer states brought from host memory once "
        f"per visit and updated right after its backward{'; the next pack is prefetched' if choice.prefetch else ''}.",
        f"Why: {why}. Model states alone need {human_bytes(_plain_bytes(ctx))} per device as plain data parallel; "
        f"the schedule keeps every device at or under the {human_bytes(budget)} budget (predicted peak "
        f"{human_bytes(peak)}) and the host holds {human_bytes(price.host_bytes)} (weights, optimizer states and "
        f"stashed pack inputs); {choice.explored} configurations searched.",
        f"Predicted {iteration_s:.4g} s per iteration{_scaled(choice.iteration_s, scale, 'Harmony')}, "
        f"{batch / iteration_s:.4g} samples/s: compute "
        f"{price.compute_s:.4g} s over all devices, {human_bytes(moved['to_device'])} to the devices and "
        f"{human_bytes(moved['to_host'])} back to the host, {human_bytes(moved['peer'])} device to device per "
        "iteration.",
        other,
    ]
    out.explanation = "\n".join(x for x in [*lines, price.note and price.note + ".", calibration_note] if x)
    return out
