"""Harmony's configuration search (§4.3.1, Algorithms 1 and 2) and its event-driven runtime estimator.

The search sweeps the backward micro-batch size U_B, packs the layers for the backward pass by balanced time
(Alg. 2), then sweeps the forward micro-batch size U_F and packs the layers before the last backward pack (that
pack runs forward and backward together: jit-compute, Alg. 2 line 2). Each four-tuple becomes a task graph
(`services.memory.harmony_schedule.HarmonySchedule`, wrap-around binding) that is checked against the device budget,
task by task with the next task's prefetched weights beside it, and timed by `estimate`. The fastest feasible
one wins. Micro-batch sizes are the divisors of the global batch up to a cap (equal micro-batches keep the loss
exactly the in-memory one).

Memory per task (what `services/executor/train/harmony.py` places on its pool):
- forward: the pack's weights + U x (largest input + output of one layer) + the global batch's outputs (each stays
  until the next task has it: on this device it waits there, to a peer the send completes when received);
- backward: weights + gradients + U x (stashed input + saved activations of the pack + incoming gradient) + the
  global batch's input gradients (sent on), and during the just-in-time update weights + gradients + one layer's
  optimizer states.

Time: a device runs its tasks in order; a task's micro-batch starts when the device is free, the pack's
weights are in and the micro-batch's input (or gradient) has arrived; host copies queue on the device's own
host link (a PCIe link per GPU), device-to-device transfers take `peer_bandwidth`. Pure: no torch, no I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.memory.harmony_schedule import (
    BACKWARD,
    FORWARD,
    HarmonyLayer,
    HarmonySchedule,
    Span,
    Task,
    Traffic,
    traffic,
)

ACTIVATION_MARGIN = 1.1  # activations measured on a profile of one size, held against a budget: leave room


@dataclass(frozen=True)
class Machine:
    devices: int
    device_budget: int  # bytes per device
    host_bandwidth: float  # bytes/s between the host and one device (each device has its own link)
    peer_bandwidth: float  # bytes/s device to device
    max_micro_batch: int = 64


@dataclass(frozen=True)
class HarmonyChoice:
    schedule: HarmonySchedule
    iteration_s: float
    traffic: Traffic
    peak_bytes: tuple[int, ...]  # predicted high-water mark per device
    explored: int  # configurations priced
    prefetch: bool  # bring the next task's weights while this one computes


def divisors(n: int, cap: int) -> list[int]:
    return [u for u in range(1, min(n, cap) + 1) if n % u == 0]


def balanced_packs(times: Sequence[float], begin: int, end: int, memory: Callable[[int, int], float],
                   capacity: float) -> tuple[Span, ...] | None:
    """Algorithm 2: the fewest packs of layers [begin, end) with near-equal time whose memory each fits."""
    t = list(times[begin:end])
    n = len(t)
    if n == 0:
        return ()
    prefix = [0.0]
    for x in t:
        prefix.append(prefix[-1] + x)
    whole = memory(begin, end)
    for s in range(max(1, math.ceil(whole / capacity)) if capacity > 0 else n, n + 1):
        avg = prefix[-1] / s
        cuts = sorted({min(max(bisect.bisect_left(prefix, k * avg), 1), n - 1) for k in range(1, s)}) if n > 1 else []
        bounds = [0, *cuts, n] if s < n else list(range(n + 1))  # uneven times never cut to single layers
        packs = tuple((begin + a, begin + b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a)
        if all(memory(a, b) <= capacity for a, b in packs):
            return packs
    return None


class _Costs:
    """Per-pack sums over layers (prefix sums: Alg. 1 prices thousands of packs)."""

    def __init__(self, layers: Sequence[HarmonyLayer], global_batch_size: int) -> None:
        self.layers, self.global_batch_size = layers, global_batch_size
        self._w = _prefix([x.weights for x in layers])
        self._saved = _prefix([x.saved_per_sample for x in layers])

    def weights(self, a: int, b: int) -> int:
        return self._w[b] - self._w[a]

    def boundary(self, i: int) -> int:
        return self.layers[i].input_per_sample if i < len(self.layers) else 0

    def forward_memory(self, a: int, b: int, u: int) -> float:
        acts = max(self.boundary(i) + self.boundary(i + 1) for i in range(a, b)) * u * ACTIVATION_MARGIN
        return self.weights(a, b) + acts + self.boundary(b) * self.global_batch_size

    def backward_memory(self, a: int, b: int, u: int) -> float:
        acts = (self.boundary(a) + self._saved[b] - self._saved[a] + self.boundary(b)) * u * ACTIVATION_MARGIN
        states = max(self.layers[i].states for i in range(a, b))
        return 2 * self.weights(a, b) + max(acts, states) + self.boundary(a) * self.global_batch_size


def _prefix(values: Sequence[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def task_peaks(schedule: HarmonySchedule, costs: _Costs, prefetch: bool) -> list[int]:
    """Predicted high-water mark per device: each task's own peak plus its successor's weights when prefetched."""
    tasks = schedule.tasks()
    peaks = [0] * schedule.devices
    for t in tasks:
        own = (costs.forward_memory(*t.span, t.micro_batch) if t.kind == FORWARD
               else costs.backward_memory(*t.span, t.micro_batch))
        later = [x for x in tasks[t.index + 1:] if x.device == t.device]
        ahead = costs.weights(*later[0].span) if prefetch and later else 0
        peaks[t.device] = max(peaks[t.device], math.ceil(own + ahead))
    return peaks


def estimate(schedule: HarmonySchedule, layers: Sequence[HarmonyLayer], global_batch_size: int, machine: Machine,
             prefetch: bool = True) -> float:
    """Seconds of one iteration of `schedule`, by replaying its tasks as events (Alg. 1 line 11)."""
    tasks = schedule.tasks()
    device_free = [0.0] * schedule.devices
    task_start = [0.0] * schedule.devices  # when the device's current task began (prefetch starts there)
    host_free = [0.0] * schedule.devices  # each device's host link, busy until
    ready: list[list[tuple[int, float]]] = []  # per task: (samples done, time they reach the next task)

    def host(device: int, start: float, nbytes: float) -> float:
        host_free[device] = max(start, host_free[device]) + nbytes / machine.host_bandwidth
        return host_free[device]

    for t in tasks:
        a, b = t.span
        w = sum(x.weights for x in layers[a:b])
        loaded = host(t.device, task_start[t.device] if prefetch else device_free[t.device], w)
        task_start[t.device] = clock = max(device_free[t.device], loaded)
        per = sum(x.forward_s_per_sample for x in layers[a:b])
        if t.kind != FORWARD:
            per += sum(x.backward_s_per_sample for x in layers[a:b]) + (
                per if t.kind == BACKWARD else 0.0)  # recompute the pack, then its backward
        sent = _boundary_bytes(t, tasks, layers)
        out: list[tuple[int, float]] = []
        for begin in range(0, global_batch_size, t.micro_batch):
            start = max(clock, _arrival(ready[t.source], begin + t.micro_batch) if t.source is not None else 0.0)
            if t.reads_stash:
                start = host(t.device, start, layers[a].input_per_sample * t.micro_batch)
            clock = start + per * t.micro_batch
            if t.stash:
                host(t.device, clock, sum(layers[s].input_per_sample for s in t.stash) * t.micro_batch)
            link = sent * t.micro_batch / machine.peer_bandwidth if sent else 0.0
            out.append((begin + t.micro_batch, clock + link))
        ready.append(out)
        if t.kind != FORWARD:
            states = sum(x.states for x in layers[a:b])
            clock = host(t.device, clock, 2 * states + w)  # states in, then weights and states out
        device_free[t.device] = clock
    return max(*device_free, *host_free)


def _boundary_bytes(t: Task, tasks: Sequence[Task], layers: Sequence[HarmonyLayer]) -> int:
    """Per-sample bytes `t` sends to the next task when that one runs on another device."""
    if t.index + 1 >= len(tasks) or tasks[t.index + 1].device == t.device:
        return 0
    edge = t.span[1] if t.kind == FORWARD else t.span[0]
    return layers[edge].input_per_sample if edge < len(layers) else 0


def _arrival(ready: list[tuple[int, float]], samples: int) -> float:
    """When the first `samples` samples of a task's output have arrived."""
    for done, at in ready:
        if done >= samples:
            return at
    return ready[-1][1]


PACK_FILLS = (1.0, 0.75, 0.5)  # packs as large as the budget allows, or smaller to leave room for a prefetch


def search(layers: Sequence[HarmonyLayer], global_batch_size: int, machine: Machine) -> HarmonyChoice | None:
    """Algorithm 1 over (U_F, P_F, U_B, P_B), each packed to a few fills of the budget and run with or without
    prefetching the next task's weights; None when no configuration fits the device budget."""
    costs = _Costs(layers, global_batch_size)
    fwd = [x.forward_s_per_sample for x in layers]
    bwd = [x.forward_s_per_sample + x.backward_s_per_sample for x in layers]
    best: HarmonyChoice | None = None
    explored = 0
    sizes = divisors(global_batch_size, machine.max_micro_batch)
    for fill in PACK_FILLS:
        capacity = machine.device_budget * fill
        for ub in sizes:
            backward = balanced_packs(bwd, 0, len(layers), lambda a, b, u=ub: costs.backward_memory(a, b, u),
                                      capacity)
            if backward is None:
                continue
            for uf in sizes:
                forward = balanced_packs(fwd, 0, backward[-1][0], lambda a, b, u=uf: costs.forward_memory(a, b, u),
                                         capacity)
                if forward is None:
                    continue
                schedule = HarmonySchedule(uf, forward, ub, backward, machine.devices)
                for prefetch in (True, False):
                    explored += 1
                    peaks = task_peaks(schedule, costs, prefetch)
                    if max(peaks) > machine.device_budget:
                        continue
                    t = estimate(schedule, layers, global_batch_size, machine, prefetch)
                    if best is None or t < best.iteration_s:
                        moved = traffic(schedule, [x.bytes() for x in layers], global_batch_size)
                        best = HarmonyChoice(schedule, t, moved, tuple(peaks), 0, prefetch)
    if best is None:
        return None
    return dataclasses.replace(best, explored=explored)
