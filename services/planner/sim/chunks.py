"""Chunk offload (PatrickStar) simulated: swap bytes, device peak and feasibility of a data-parallel run.

The executor's runtime and this simulator run one residency policy (`services.memory.chunk_policy`); here it
is driven by the training's order of events at layer granularity, with no data behind it:
- forward, layer by layer: access the layer's parameters, place its saved activations at their peak during the
  layer and keep what is left at its end, release the parameters HOLD_AFTER_FWD; then the FWD reset;
- backward, last layer first: access the layer's parameters; each parameter whose last user this is gets its
  final gradient (kept on the device across micro-batches until the last one); the layer's activations go;
- the step, chunk by chunk where its optimizer states are; the first iteration is the warm-up.
The simulated iteration is the steady one (the last of `iterations`); `traffic[0]` is the warm-up's.
`ChunkModel` comes from the model's parameter tensors (sizes in initialisation order, and which layers use
each) and the profile's activation bytes per layer at the micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.memory.chunk_layout import plan_chunks
from services.memory.chunk_policy import OS_KINDS, ChunkPolicy, TensorState, Traffic
from services.memory.pool import BudgetExceeded, MemoryPool


@dataclass(frozen=True)
class ChunkModel:
    tensors: tuple[int, ...]  # elements of every distinct parameter tensor, in initialisation order
    layer_tensors: tuple[tuple[int, ...], ...]  # per layer: the tensors (indices) it uses
    activation_bytes: tuple[int, ...]  # per layer: bytes it keeps for backward at its end, one micro-batch
    activation_peak_bytes: tuple[int, ...] = ()  # per layer: the most it held during its forward (default: the same)
    element_size: int = 4

    def parameter_bytes(self) -> int:
        return sum(self.tensors) * self.element_size


@dataclass(frozen=True)
class ChunkOptions:
    chunk_bytes: int
    device_budget: int | None
    host_budget: int | None = None
    world: int = 1
    micro_batches: int = 1
    optimizer: str = "adam"


@dataclass
class ChunkSim:
    feasible: bool
    reason: str  # why not, when not
    traffic: list[Traffic]  # one per simulated iteration of rank 0; the first is the warm-up
    device_peak: int
    non_model_peak: int
    host_peak: int
    chunks: int
    optimizer_chunks_on_device: int

    @property
    def steady(self) -> Traffic:
        return self.traffic[-1] if self.traffic else Traffic()


def simulate_chunks(model: ChunkModel, options: ChunkOptions, iterations: int = 3, rank: int = 0) -> ChunkSim:
    if len(model.layer_tensors) != len(model.activation_bytes):
        raise ValueError("ChunkModel: one activation size per layer")
    peaks = model.activation_peak_bytes or model.activation_bytes
    if len(peaks) != len(model.activation_bytes) or any(
            p < a for p, a in zip(peaks, model.activation_bytes, strict=True)):
        raise ValueError("ChunkModel: activation_peak_bytes needs one size per layer, each >= activation_bytes")
    layout = plan_chunks(model.tensors, options.chunk_bytes // model.element_size, options.world)
    device, host = MemoryPool("device", options.device_budget), MemoryPool("host", options.host_budget)
    kinds = OS_KINDS if options.optimizer == "adam" else OS_KINDS[:1]
    policy = ChunkPolicy(layout, model.element_size, device, host, os_kinds=kinds, rank=rank)
    last_user = {t: min(i for i, ts in enumerate(model.layer_tensors) if t in ts)
                 for ts in model.layer_tensors for t in ts}
    traffic: list[Traffic] = []
    try:
        for _ in range(iterations):
            for k in range(options.micro_batches):
                last = k == options.micro_batches - 1
                for tensors, act, peak in zip(model.layer_tensors, model.activation_bytes, peaks, strict=True):
                    policy.access(tensors)
                    device.reserve("activation", peak)
                    device.release("activation", peak - act)
                    policy.release(tensors, TensorState.HOLD_AFTER_FWD)
                policy.forward_done()
                for layer in reversed(range(len(model.layer_tensors))):
                    tensors = model.layer_tensors[layer]
                    policy.access(tensors)
                    for t in reversed(list(dict.fromkeys(tensors))):  # autograd finishes the last-used first
                        if last_user[t] != layer:
                            continue
                        if last:
                            policy.grad_final(t)
                        else:
                            policy.hold_grad(t, model.tensors[t] * model.element_size)
                    device.release("activation", model.activation_bytes[layer])
                policy.backward_done(last)
            for c, _where in policy.step_chunks():
                policy.finish_step(c, policy.prepare_step(c))
            policy.end_iteration()
            traffic.append(policy.traffic.take())
    except BudgetExceeded as e:
        return ChunkSim(False, str(e), traffic, device.peak, device.peak_non_model, host.peak, layout.num_chunks,
                        policy.os_on_device)
    return ChunkSim(True, "", traffic, device.peak, device.peak_non_model, host.peak, layout.num_chunks,
                    policy.os_on_device)
