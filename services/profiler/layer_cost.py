"""LayerCost: the device-independent work of one layer, the input of roofline timing.

Its own module because two producers fill it: closed forms for GPT (projection.py) and meta-device
traces for every zoo family (meta_costs.py, which loads torch). projection turns either into times and
calls meta_costs; meta_costs needs only this type, so the dependency runs one way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCost:
    """Device-independent work of one layer, per sample, in elements (so precision is a parameter).

    The zoo computes these for every family; transformer_layer_costs covers GPT-style models now.
    Weight traffic is per micro-batch (weights are read once however many samples run).
    """

    name: str
    kind: str
    parameter_count: int  # every parameter the layer uses, tied ones too (as measure.py counts)
    flops_fwd_per_sample: float
    traffic_elems_fwd_per_sample: float  # activation elements read + written by the forward kernels
    boundary_elems_per_sample: int  # layer input, kept under checkpointing
    stashed_elems_per_sample: int  # saved for backward without checkpointing
    output_elems_per_sample: int
    flops_bwd_per_sample: float | None = None  # default 2x forward (Galvatron-BMW §V)
    traffic_elems_bwd_per_sample: float | None = None  # default 2x forward
    weight_elems_fwd: int | None = None  # weights read by forward; default parameter_count
    weight_elems_bwd: int | None = None  # weights read + gradients written; default 2x forward's
    extra_inputs: tuple[int, ...] = ()
    tied_with: tuple[int, ...] = ()
    tensor_parallel: int = 0  # TP degrees dividing it are runnable (zoo.graph.Layer.tensor_parallel)
    sequence_parallel: int = 0  # ... and with the sequence split too (zoo.graph.Layer.sequence_parallel)

    def flops(self, phase: str, micro_batch: int) -> float:
        per_sample = self.flops_fwd_per_sample
        if phase == "backward":
            per_sample = 2 * per_sample if self.flops_bwd_per_sample is None else self.flops_bwd_per_sample
        return per_sample * micro_batch

    def bytes_moved(self, phase: str, micro_batch: int, element_bytes: int) -> float:
        weights = self.parameter_count if self.weight_elems_fwd is None else self.weight_elems_fwd
        traffic = self.traffic_elems_fwd_per_sample
        if phase == "backward":
            weights = 2 * weights if self.weight_elems_bwd is None else self.weight_elems_bwd
            traffic = 2 * traffic if self.traffic_elems_bwd_per_sample is None else self.traffic_elems_bwd_per_sample
        return (weights + traffic * micro_batch) * element_bytes
