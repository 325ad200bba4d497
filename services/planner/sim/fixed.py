"""Engine for fixed-order schedules (GPipe, 1F1B, Harmony): a recurrence, not an event queue.

With the order on each device fixed, a task starts at max(device free, input ready), so times follow from one
pass in dependency order: each device runs its order as far as its inputs allow and is woken when a missing
input is produced. O(tasks), no heap. A transfer is computed when its producer runs, in the order it reaches
its link, so FIFO serialisation needs only the link's "free at" time.

It serves Harmony and schedules with swaps (plain GPipe/1F1B go to the vectorised `fast.py`, and tests hold the
two equal). A 48 x 288 pipeline is ~40k tasks, so the per-task loop touches only flat lists prepared once per
schedule shape (`Layout`, cached): the slot of the input it waits for, the slot its output fills, the link it
crosses and the device to wake. Host-link work (swaps, Harmony weights) is flagged per task and handled off the
hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from services.planner.sim.core import (
    SEND_ACT,
    SEND_GRAD,
    SWAP_IN,
    SWAP_OUT,
    B,
    F,
    ListNoise,
    Noise,
    Prepared,
    R,
    Trace,
    new_trace,
)
from services.planner.sim.model import Schedule
from services.planner.sim.orders import SWAP_IN_BEFORE, SWAP_OUT_AFTER, WEIGHT_IN, WEIGHT_OUT, device_orders

_FEND_OUT = 16  # Harmony: a forward whose end gates the recompute/backward on another device


@dataclass(frozen=True)
class Layout:
    """One schedule shape flattened per device. Slot 0 always holds 0.0 (an input that is always there)."""

    kind: tuple[tuple[int, ...], ...]
    stage: tuple[tuple[int, ...], ...]
    mb: tuple[tuple[int, ...], ...]
    flags: tuple[tuple[int, ...], ...]
    dep: tuple[tuple[int, ...], ...]  # slot holding this task's input-ready time
    out: tuple[tuple[int, ...], ...]  # slot this task's output fills (0: none)
    link: tuple[tuple[int, ...], ...]  # link its output crosses (-1: none, ready at task end)
    wake: tuple[tuple[int, ...], ...]  # device waiting on that output
    key: tuple[tuple[int, ...], ...]  # kind * P + stage, to look durations up
    single_stage: tuple[bool, ...]  # device runs one stage only (its tasks are that stage's, in time order)
    slots: int
    stage_zero_inputs: int  # slots 1..Nm: stage 0's inputs, ready at 0


@lru_cache(maxsize=32)
def layout(schedule: Schedule, P: int, Nm: int, recompute: tuple[bool, ...], swaps: tuple[bool, ...],
           weights: tuple[bool, ...], fdev: tuple[int, ...], bdev: tuple[int, ...]) -> Layout:
    """Flatten the device orders for a shape; durations do not enter, so the planner's repeated calls reuse it."""
    shape = Prepared(P=P, Nm=Nm, replicas=1, dur=([], [1.0 if r else 0.0 for r in recompute], []), act_link=[],
                     grad_link=[], swap_out=[], swap_in=[], weight_in=[], weight_out=[], fdev=list(fdev),
                     bdev=list(bdev), device_ids=list(range(max(fdev) + 1)), allreduce=[],
                     swap_bytes=[int(x) for x in swaps], weight_bytes=[int(x) for x in weights])
    orders = device_orders(shape, schedule)

    def act(s: int, m: int) -> int:
        return 1 + s * Nm + m

    def grad(s: int, m: int) -> int:
        return 1 + (P + s) * Nm + m

    def fend(s: int, m: int) -> int:
        return 1 + (2 * P + s) * Nm + m

    cols: dict[str, list[tuple[int, ...]]] = {c: [] for c in ("dep", "out", "link", "wake", "key", "flags")}
    for d, order in enumerate(orders):
        rows = []
        for kind, s, m, flags in order:
            if kind == F:
                last = s == P - 1
                if fdev[s] != bdev[s] and (recompute[s] or last):
                    flags |= _FEND_OUT
                row = (act(s, m), grad(s, m) if last else act(s + 1, m), -1 if last else s,
                       bdev[s] if last else fdev[s + 1])
            elif kind == R:
                row = (fend(s, m) if fdev[s] != bdev[s] else 0, 0, -1, d)
            else:
                row = (grad(s, m), grad(s - 1, m) if s else 0, P + s - 1 if s else -1, bdev[s - 1] if s else d)
            rows.append((*row, kind * P + s, flags))
        for name, column in zip(cols, zip(*rows, strict=True) if rows else [()] * 6, strict=True):
            cols[name].append(tuple(column))
    return Layout(kind=tuple(tuple(e[0] for e in o) for o in orders),
                  stage=tuple(tuple(e[1] for e in o) for o in orders),
                  mb=tuple(tuple(e[2] for e in o) for o in orders), slots=1 + 3 * P * Nm, stage_zero_inputs=Nm,
                  single_stage=tuple(len({e[1] for e in o}) == 1 for o in orders),
                  **{name: tuple(v) for name, v in cols.items()})


def layout_for(prep: Prepared, schedule: Schedule) -> Layout:
    return layout(schedule, prep.P, prep.Nm, tuple(x > 0 for x in prep.dur[R]), tuple(x > 0 for x in prep.swap_bytes),
                  tuple(x > 0 for x in prep.weight_bytes), tuple(prep.fdev), tuple(prep.bdev))


def _durations(prep: Prepared, lay: Layout, noise: Noise) -> tuple[list[list[float]], list[list[float]]]:
    """Per device and order position: compute time and the time of the transfer the task's output makes."""
    P = prep.P
    base = [*prep.dur[F], *prep.dur[R], *prep.dur[B]]
    comm = [*prep.act_link, 0.0, *[0.0] * P, 0.0, *prep.grad_link]  # F: s -> s+1; B: s -> s-1
    durs = [[base[x] for x in keys] for keys in lay.key]
    comms = [[comm[x] for x in keys] for keys in lay.key]
    if any(g is not None for g in noise.compute) or noise.act is not None or noise.grad is not None:
        for d in range(len(lay.key)):
            kind, s, m = np.asarray(lay.kind[d]), np.asarray(lay.stage[d]), np.asarray(lay.mb[d])
            compute, link = np.ones(len(kind)), np.ones(len(kind))
            for k, grid in enumerate(noise.compute):
                if grid is not None:
                    mask = kind == k
                    compute[mask] = grid[s[mask], m[mask]]
            if noise.act is not None:
                mask = kind == F
                link[mask] = noise.act[s[mask], m[mask]]
            if noise.grad is not None:
                mask = (kind == B) & (s > 0)
                link[mask] = noise.grad[s[mask] - 1, m[mask]]
            durs[d] = (np.asarray(durs[d]) * compute).tolist()
            comms[d] = (np.asarray(comms[d]) * link).tolist()
    return durs, comms


class _HostLinks:
    """Per-device host link, one queue per direction (PCIe is full duplex): swap-outs (D2H) and swap-ins (H2D).
    A swap-in is issued when the device starts the task before the one needing it (one-task prefetch)."""

    def __init__(self, prep: Prepared, noise: ListNoise, trace: Trace):
        n = len(prep.device_ids)
        self.prep, self.noise, self.trace = prep, noise, trace
        self.d2h, self.h2d = [0.0] * n, [0.0] * n
        self.swapped_out: list[list[float | None]] = [[None] * prep.Nm for _ in range(prep.P)]

    def swap_in(self, d: int, s: int, m: int, flags: int, forward: bool, issue: float) -> float:
        """Weights then activations for the task about to run; returns when both are on the device."""
        prep, noise, trace = self.prep, self.noise, self.trace
        done = 0.0
        if flags & WEIGHT_IN:
            dur = prep.weight_in[s] * (noise.weight[s][0 if forward else 1] if noise.weight else 1.0)
            start = max(self.h2d[d], issue)
            done = self.h2d[d] = start + dur
            trace.swaps[s].append((SWAP_IN, -1, start, done, d))
            trace.weight_swap_bytes += prep.weight_bytes[s]
        if flags & SWAP_IN_BEFORE:
            dur = prep.swap_in[s] * (noise.swap_in[s][m] if noise.swap_in else 1.0)
            start = max(self.h2d[d], issue, self.swapped_out[s][m])
            done = self.h2d[d] = start + dur
            trace.swaps[s].append((SWAP_IN, m, start, done, d))
            trace.activation_swap_bytes += prep.swap_bytes[s]
        return done

    def swap_out(self, d: int, s: int, m: int, flags: int, end: float) -> None:
        prep, noise, trace = self.prep, self.noise, self.trace
        if flags & SWAP_OUT_AFTER:
            start = max(self.d2h[d], end)
            done = self.d2h[d] = start + prep.swap_out[s] * (noise.swap_out[s][m] if noise.swap_out else 1.0)
            self.swapped_out[s][m] = done
            trace.swaps[s].append((SWAP_OUT, m, start, done, d))
            trace.activation_swap_bytes += prep.swap_bytes[s]
        if flags & WEIGHT_OUT:
            start = max(self.d2h[d], end)
            done = self.d2h[d] = start + prep.weight_out[s] * (noise.weight[s][2] if noise.weight else 1.0)
            trace.swaps[s].append((SWAP_OUT, -1, start, done, d))
            trace.weight_swap_bytes += prep.weight_bytes[s]
            trace.stage_end[s] = max(trace.stage_end[s], done)


@dataclass
class FixedRun:
    """Start/end of every task per device and order position, and the trace for the parts kept per stage."""

    layout: Layout
    starts: list[list[float]]
    ends: list[list[float]]
    durs: list[list[float]]
    sent: list[list[float]]  # when the task's output entered its link
    comms: list[list[float]]
    trace: Trace


def run_fixed(prep: Prepared, schedule: Schedule, noise: Noise) -> FixedRun:
    """Simulate one replica: each device follows its order, waiting for inputs."""
    lay = layout_for(prep, schedule)
    trace = new_trace(prep.P)
    host = _HostLinks(prep, noise.as_lists(), trace)
    swapped_out = host.swapped_out
    durs, comms = _durations(prep, lay, noise)
    n = len(lay.kind)
    starts = [[0.0] * len(k) for k in lay.kind]
    ends = [[0.0] * len(k) for k in lay.kind]
    sent = [[0.0] * len(k) for k in lay.kind]
    ready: list[float | None] = [None] * lay.slots
    ready[0 : lay.stage_zero_inputs + 1] = [0.0] * (lay.stage_zero_inputs + 1)
    link_free = [0.0] * (2 * prep.P)
    ptr, free = [0] * n, [0.0] * n
    queued = [True] * n
    stack = list(reversed(range(n)))
    while stack:
        d = stack.pop()
        queued[d] = False
        k, size = ptr[d], len(lay.kind[d])
        if k >= size:
            continue
        dep, out, link, wake, flags = lay.dep[d], lay.out[d], lay.link[d], lay.wake[d], lay.flags[d]
        dur, com, S, E, X = durs[d], comms[d], starts[d], ends[d], sent[d]
        t = free[d]
        while k < size:
            r = ready[dep[k]]
            if r is None:
                break
            f = flags[k]
            if f:
                s, m = lay.stage[d][k], lay.mb[d][k]
                if f & SWAP_IN_BEFORE and swapped_out[s][m] is None:
                    break
                if f & (WEIGHT_IN | SWAP_IN_BEFORE):
                    arrived = host.swap_in(d, s, m, f, lay.kind[d][k] == F, S[k - 1] if k else 0.0)
                    r = r if r > arrived else arrived
            if r > t:
                t = r
            S[k] = t
            t += dur[k]
            E[k] = t
            o = out[k]
            if o:
                lk = link[k]
                if lk >= 0:
                    lf = link_free[lk]
                    if t > lf:
                        lf = t
                    X[k] = lf
                    lf += com[k]
                    link_free[lk] = ready[o] = lf
                else:
                    ready[o] = t
                w = wake[k]
                if w != d and not queued[w]:
                    queued[w] = True
                    stack.append(w)
            if f:
                _after(prep, lay, host, ready, d, k, f, t, stack, queued)
            k += 1
        ptr[d], free[d] = k, t
    stuck = [d for d in range(n) if ptr[d] < len(lay.kind[d])]
    if stuck:
        raise RuntimeError(f"schedule deadlocked: devices {stuck} wait on inputs that never arrive")
    return FixedRun(lay, starts, ends, durs, sent, comms, trace)


def _after(prep: Prepared, lay: Layout, host: _HostLinks, ready: list[float | None], d: int, k: int, f: int,
           end: float, stack: list[int], queued: list[bool]) -> None:
    """Off the hot path: swap-outs, weight swap-outs, and Harmony's cross-device forward-done signal."""
    s, m = lay.stage[d][k], lay.mb[d][k]
    if f & (SWAP_OUT_AFTER | WEIGHT_OUT):
        host.swap_out(d, s, m, f, end)
    if f & _FEND_OUT:
        ready[1 + (2 * prep.P + s) * prep.Nm + m] = end
    if f & (SWAP_OUT_AFTER | _FEND_OUT):
        w = prep.bdev[s]
        if w != d and not queued[w]:
            queued[w] = True
            stack.append(w)


def finish_trace(prep: Prepared, run: FixedRun, record: bool) -> Trace:
    """Fill the per-stage parts of the trace (busy, last backward, and with `record` tasks and transfers)."""
    lay, trace = run.layout, run.trace
    for d, kinds in enumerate(lay.kind):
        stages, S, E, dur = lay.stage[d], run.starts[d], run.ends[d], run.durs[d]
        single = lay.single_stage[d]
        if single:  # one stage, run in order: its last backward is the last one in the order
            trace.busy[stages[0]] += sum(dur)
            last = len(kinds) - 1 - kinds[::-1].index(B)
            trace.last_backward_end[stages[0]] = E[last]
        else:
            for k, kind in enumerate(kinds):
                s = stages[k]
                trace.busy[s] += dur[k]
                if kind == B and E[k] > trace.last_backward_end[s]:
                    trace.last_backward_end[s] = E[k]
        if record or not single or prep.swap_bytes[stages[0]]:  # memory under swaps needs the times
            for k, (kind, s, m) in enumerate(zip(kinds, stages, lay.mb[d], strict=True)):
                trace.tasks[s].append((kind, m, S[k], E[k]))
                if record and lay.link[d][k] >= 0 and run.comms[d][k] > 0:
                    x = run.sent[d][k]
                    trace.transfers.append((SEND_ACT if kind == F else SEND_GRAD, s, m, x, x + run.comms[d][k]))
    return trace
