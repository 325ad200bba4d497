"""Pricing Harmony's swap schedule for a model that does not fit the devices: the search's choice and its cost.

Harmony trains on one server: its devices run the wrap-around pipeline over layer packs whose weights, optimizer
states and stashed pack inputs live in the host's memory (`services.memory.harmony_schedule`). This module turns the
profile into what the configuration search (sim/harmony_search.py, Alg. 1/2 plus its event-driven estimator)
reads, per layer and per sample at micro-batch 1: weights, optimizer states (fp32 Adam: 2x the weights), the
input's bytes (the previous layer's output), the activations saved for the backward, and forward/backward
seconds (scaled as the cost model scales compute on this fleet). Host copies use the fleet's device host link
and device-to-device sends its intra-node link; a fleet without their bandwidth prices them at nothing and the
note says so. Only a one-node fleet runs it: the host store is one server's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.memory.harmony_schedule import HarmonyLayer, host_bytes
from services.planner.cost.context import CostContext
from services.planner.sim.harmony_search import HarmonyChoice, Machine, search


@dataclass(frozen=True)
class HarmonyPrice:
    feasible: bool
    reason: str  # why not, when not
    choice: HarmonyChoice | None = None
    compute_s: float = 0.0  # every layer's forward, recompute and backward over the global batch, on one device
    note: str = ""
    host_bytes: int = 0  # the host store: weights, optimizer states and stashed pack inputs


def harmony_layers(ctx: CostContext, optimizer: str = "adam") -> tuple[HarmonyLayer, ...] | None:
    """The search's view of the profiled model, or None when a layer reads past its predecessor or shares
    weights (the schedule runs a chain of layers, each pack's weights on their own)."""
    view = ctx.view
    if any(layer.extra_inputs or layer.tied_with for layer in view.layers):
        return None
    out = []
    for i, layer in enumerate(view.layers):
        point = view.point(i, 1)
        weights = layer.parameter_bytes
        out.append(HarmonyLayer(
            weights=weights, states=2 * layer.parameter_count * 4 if optimizer == "adam" else 0,
            input_per_sample=0 if i == 0 else math.ceil(view.point(i - 1, 1).output_bytes),
            saved_per_sample=math.ceil(point.stashed_bytes),
            forward_s_per_sample=ctx.compute_scale * point.forward_s,
            backward_s_per_sample=ctx.compute_scale * point.backward_s))
    return tuple(out)


def price_harmony(ctx: CostContext, global_batch_size: int, device_budget: int,
                  optimizer: str = "adam") -> HarmonyPrice:
    fleet = ctx.fleet
    if fleet.nodes != 1:
        return HarmonyPrice(False, f"Harmony runs on one server; this fleet has {fleet.nodes} nodes")
    layers = harmony_layers(ctx, optimizer)
    if layers is None:
        return HarmonyPrice(False, "Harmony's schedule runs a chain of layers without shared weights; this model "
                                   "has skip edges or tied weights")
    host = fleet.host_link.bandwidth_bytes_per_s if fleet.host_link else math.inf
    peer = fleet.intra_node.bandwidth_bytes_per_s if fleet.intra_node else math.inf
    machine = Machine(fleet.devices_per_node, device_budget, host, peer, max_micro_batch=min(global_batch_size, 64))
    choice = search(layers, global_batch_size, machine)
    if choice is None:
        return HarmonyPrice(False, "no layer pack fits the device budget beside its gradients and one layer's "
                                   "optimizer states")
    compute = global_batch_size * sum(2 * x.forward_s_per_sample + x.backward_s_per_sample for x in layers)
    missing = [name for name, link in (("host link", fleet.host_link), ("intra-node link", fleet.intra_node))
               if link is None and (name == "host link" or fleet.devices_per_node > 1)]
    note = f"{' and '.join(missing)} bandwidth unknown for this fleet: priced at 0 s" if missing else ""
    stored = host_bytes(choice.schedule, [x.bytes() for x in layers], global_batch_size)
    return HarmonyPrice(True, "", choice, compute, note, stored)
