"""Harmony's training schedule (Harmony §3, §4.3): layer packs bound to devices by the wrap-around pipeline.

A schedule is the search's four-tuple (forward micro-batch U_F, forward packs P_F, backward micro-batch U_B,
backward packs P_B) on N devices. The last backward pack is also the end of the forward pass: one task runs its
forward, the loss and its backward back to back on each forward micro-batch (jit-compute, Alg. 2 line 2), so the
forward packs cover the layers before it. The task list is PFB = P_F + reversed(P_B), task i on device i mod N.
Each task runs its pack on every micro-batch of the global batch before the next task on that device (input-batch
grouping), so a pack's weights come to the device once per visit. A backward task updates its pack right after
its last micro-batch (just-in-time update) and sends the updated weights and optimizer states back to the host.
Forward tasks run without autograd and write to the host the input of every backward pack that starts inside
them; a backward task reads that input back and recomputes its pack before its backward.

`traffic` is what one iteration moves: host->device, device->host and device->device bytes per device. The
executor (services/executor/train/harmony.py) counts the bytes it really copies and the planner prices these,
so both read the same schedule. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Span = tuple[int, int]  # layers [begin, end)

FORWARD, FORWARD_BACKWARD, BACKWARD = "forward", "forward_backward", "backward"


@dataclass(frozen=True)
class Task:
    index: int  # position in PFB
    kind: str  # FORWARD, FORWARD_BACKWARD (the last pack: jit-compute) or BACKWARD
    span: Span
    device: int
    micro_batch: int  # samples per micro-batch of this task (U_F or U_B)
    source: int | None  # the task whose outputs (forward) or input gradients (backward) this reads; None: batch
    stash: tuple[int, ...]  # forward: layers whose input it writes to the host for a backward pack
    reads_stash: bool  # backward: its pack's input comes back from the host


@dataclass(frozen=True)
class HarmonySchedule:
    forward_micro_batch: int
    forward_packs: tuple[Span, ...]
    backward_micro_batch: int
    backward_packs: tuple[Span, ...]
    devices: int

    def check(self, num_layers: int, global_batch_size: int) -> None:
        """Raise ValueError naming what is wrong: packs must tile the layers; micro-batches divide the global batch."""
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        for name, size in (("forward_micro_batch", self.forward_micro_batch),
                           ("backward_micro_batch", self.backward_micro_batch)):
            if size < 1 or global_batch_size % size:
                raise ValueError(f"{name} {size} must divide the global batch of {global_batch_size} samples")
        if not self.backward_packs:
            raise ValueError("backward_packs is empty: give at least one pack")
        _tiles(self.backward_packs, 0, num_layers, "backward_packs")
        _tiles(self.forward_packs, 0, self.backward_packs[-1][0], "forward_packs")

    def tasks(self) -> list[Task]:
        starts = {a for a, _ in self.backward_packs if a > 0}
        tasks: list[Task] = []
        for k, (a, b) in enumerate(self.forward_packs):
            stash = tuple(sorted(s for s in starts if a <= s < b))
            tasks.append(Task(k, FORWARD, (a, b), k % self.devices, self.forward_micro_batch,
                              k - 1 if k else None, stash, False))
        k = len(tasks)
        tasks.append(Task(k, FORWARD_BACKWARD, self.backward_packs[-1], k % self.devices, self.forward_micro_batch,
                          k - 1 if k else None, (), False))
        for a, b in reversed(self.backward_packs[:-1]):
            k = len(tasks)
            tasks.append(Task(k, BACKWARD, (a, b), k % self.devices, self.backward_micro_batch, k - 1, (), a > 0))
        return tasks


def _tiles(packs: Sequence[Span], begin: int, end: int, name: str) -> None:
    at = begin
    for a, b in packs:
        if a != at or b <= a:
            raise ValueError(f"{name} must tile layers [{begin}, {end}) in order with non-empty packs, got "
                             f"{list(packs)}")
        at = b
    if at != end:
        raise ValueError(f"{name} must end at layer {end}, got {list(packs)}")


@dataclass(frozen=True)
class LayerBytes:
    """What a layer brings to the traffic: its weights, its optimizer states (Adam: 2x the fp32 weights; plain
    SGD: none) and, per sample, the activation it reads from its predecessor."""

    weights: int
    states: int
    input_per_sample: int


@dataclass(frozen=True)
class HarmonyLayer:
    """One layer as the planner's profile gives it (bytes and seconds per sample; weights and states whole)."""

    weights: int
    states: int
    input_per_sample: int
    saved_per_sample: int  # activations autograd keeps for the backward, per sample
    forward_s_per_sample: float
    backward_s_per_sample: float

    def bytes(self) -> LayerBytes:
        return LayerBytes(self.weights, self.states, self.input_per_sample)


@dataclass(frozen=True)
class Traffic:
    """Bytes one iteration moves, per device: host->device, device->host, device->device (sent)."""

    to_device: tuple[int, ...]
    to_host: tuple[int, ...]
    peer: tuple[int, ...]

    @property
    def total(self) -> dict[str, int]:
        return {"to_device": sum(self.to_device), "to_host": sum(self.to_host), "peer": sum(self.peer)}


def traffic(schedule: HarmonySchedule, layers: Sequence[LayerBytes], global_batch_size: int) -> Traffic:
    """The bytes `schedule` moves in one iteration of `global_batch_size` samples (the executor's counters,
    predicted)."""
    schedule.check(len(layers), global_batch_size)
    n = schedule.devices
    down, up, peer = [0] * n, [0] * n, [0] * n

    def weights(span: Span) -> int:
        return sum(layer.weights for layer in layers[span[0]:span[1]])

    def states(span: Span) -> int:
        return sum(layer.states for layer in layers[span[0]:span[1]])

    tasks = schedule.tasks()
    for task in tasks:
        d, a = task.device, task.span[0]
        down[d] += weights(task.span)
        up[d] += sum(layers[s].input_per_sample for s in task.stash) * global_batch_size
        if task.kind != FORWARD:
            down[d] += states(task.span) + (layers[a].input_per_sample * global_batch_size if task.reads_stash else 0)
            up[d] += weights(task.span) + states(task.span)
        if task.source is not None and tasks[task.source].device != d:
            # forward outputs travel to the next pack; backward sends its input gradient (same size) back
            boundary = a if task.kind != BACKWARD else tasks[task.source].span[0]
            peer[tasks[task.source].device] += layers[boundary].input_per_sample * global_batch_size
    return Traffic(tuple(down), tuple(up), tuple(peer))


def host_bytes(schedule: HarmonySchedule, layers: Sequence[LayerBytes], global_batch_size: int) -> int:
    """What the host store holds for `schedule`: every layer's weights and optimizer states, and the stashed
    input of every backward pack but the first for the whole global batch."""
    stashed = sum(layers[a].input_per_sample for a, _ in schedule.backward_packs[:-1] if a > 0) * global_batch_size
    return sum(x.weights + x.states for x in layers) + stashed
