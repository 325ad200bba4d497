"""Harmony's simplified swap analysis (Harmony §3, "Intuitive Example") and the wrap-around device binding.

Setting: each GPU holds one layer on one micro-batch at a time; an R-layer model with weights |W|; m
micro-batches per GPU; N GPUs. Per-iteration weight swap volume (in + out):
- per-GPU memory virtualization swaps W in and out for every forward and backward of every micro-batch, plus
  once in and out for the update: (4m+2)|W| per pipeline, (4m+2)N|W| for data parallelism (W on every GPU);
- Harmony groups a layer pack's micro-batches (input-batch grouping) and updates right after the backward
  (just-in-time update): W comes in once for the forward and once for the backward and goes out once:
  3|W| for the wrap-around pipeline, 3N|W| for Harmony DP.
The simulator counts weight swaps per visit, so a `harmony_wrap` run reports 3|W| (`SimResult.swapped_weight_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSwapVolumes:
    """Bytes of weights moved between host and GPUs in one iteration, per execution mode."""

    wrap_around_pipeline: float  # Harmony PP: 3|W|
    pipeline_virtualized: float  # PP with per-GPU memory virtualization: (4m+2)|W|
    data_parallel_virtualized: float  # DP with per-GPU memory virtualization: (4m+2)N|W|
    harmony_data_parallel: float  # Harmony DP: 3N|W|


def weight_swap_volumes(weight_bytes: float, micro_batches_per_gpu: int, gpus: int) -> WeightSwapVolumes:
    if micro_batches_per_gpu < 1 or gpus < 1 or weight_bytes < 0:
        raise ValueError("need micro_batches_per_gpu >= 1, gpus >= 1, weight_bytes >= 0")
    per_gpu_virtualized = (4 * micro_batches_per_gpu + 2) * weight_bytes
    return WeightSwapVolumes(
        wrap_around_pipeline=3 * weight_bytes,
        pipeline_virtualized=per_gpu_virtualized,
        data_parallel_virtualized=per_gpu_virtualized * gpus,
        harmony_data_parallel=3 * gpus * weight_bytes,
    )


def wrap_around_devices(num_packs: int, num_devices: int) -> tuple[int, ...]:
    """`Pipeline.device_of_stage` for Harmony's wrap-around: forward pack s on device s mod N (the simulator
    binds backward pack s to device (2P-1-s) mod N, following PFB = PF + reversed(PB))."""
    if num_packs < 1 or num_devices < 1:
        raise ValueError("need at least one pack and one device")
    return tuple(s % num_devices for s in range(num_packs))
