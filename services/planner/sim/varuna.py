"""Varuna's schedule (Varuna §3.2) on an event queue: its decisions depend on arrival times.

Generation (nominal times) applies the three rules greedily on each stage whenever its device is free:
  3. a ready backward always wins;
  2. after a recompute the stage waits for that micro-batch's backward;
  1. a recompute is placed to end just as the gradient arrives: once the next stage starts working on the
     micro-batch's backward, the arrival is predictable, and a forward runs first only if it still fits before
     the latest recompute start.
The last stage never recomputes: it runs each backward right after its forward. What the stages ran becomes the
static per-stage order (as Varuna's offline tool produces one).
Execution follows that order with Varuna's runtime opportunism (as its pipeline runtime does it): when the next
task starts a micro-batch's backward work (its recompute) but the gradient has not arrived and forwards remain,
the stage runs its next forward instead, waiting for that forward's input if need be. Jitter only changes
durations; the same policy runs with or without it, so results vary continuously with the jitter.
Activation swaps (stages before the last) go out after the forward and come back as soon as the next stage
starts the micro-batch's backward work.
"""

from __future__ import annotations

import heapq

from services.planner.sim.core import (
    SEND_ACT,
    SEND_GRAD,
    SWAP_IN,
    SWAP_OUT,
    B,
    F,
    Noise,
    Prepared,
    R,
    Trace,
    new_trace,
)

Order = list[tuple[int, int]]  # per stage: (kind, micro_batch)
_DONE, _WAKE = 0, 1


class _Run:
    """State of one replica on the event queue."""

    def __init__(self, prep: Prepared, noise: Noise, record: bool, orders: list[Order] | None, opportunistic: bool):
        P, Nm = prep.P, prep.Nm
        self.prep, self.record, self.orders, self.opportunistic = prep, record, orders, opportunistic
        self.noise = noise.as_lists()
        self.trace = new_trace(P)
        self.act: list[list[float | None]] = [[0.0] * Nm] + [[None] * Nm for _ in range(P - 1)]
        self.grad: list[list[float | None]] = [[None] * Nm for _ in range(P)]
        self.est: list[list[float | None]] = [[None] * Nm for _ in range(P)]
        self.swapped_in: list[list[float | None]] = [[None] * Nm for _ in range(P)]
        self.swapped_out: list[list[float]] = [[0.0] * Nm for _ in range(P)]
        self.rc_done = [[False] * Nm for _ in range(P)]
        self.swap = [prep.swap_bytes[k] > 0 and k < P - 1 for k in range(P)]
        if orders is None:
            self.needs_rc = [[prep.dur[R][k] > 0 and k < P - 1] * Nm for k in range(P)]
            self.ran: list[Order] = [[] for _ in range(P)]
        else:
            self.needs_rc = [[False] * Nm for _ in range(P)]
            for k, order in enumerate(orders):
                for kind, m in order:
                    if kind == R:
                        self.needs_rc[k][m] = True
            self.pos = [0] * P
            self.done = [[False] * len(o) for o in orders]
            self.fpos = [{m: i for i, (kind, m) in enumerate(o) if kind == F} for o in orders]
            self.committed: list[tuple[int, int, int] | None] = [None] * P
        self.nf, self.nb = [0] * P, [0] * P
        self.running: list[tuple[int, int, int] | None] = [None] * P  # kind, micro_batch, order index
        self.link_f, self.link_b, self.h2d, self.d2h = [0.0] * P, [0.0] * P, [0.0] * P, [0.0] * P
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0

    def push(self, t: float, code: int, k: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, code, k))

    # --- readiness -------------------------------------------------------------------------------------------
    def fwd_ready(self, k: int, t: float) -> bool:
        m = self.nf[k]
        if m >= self.prep.Nm:
            return False
        a = self.act[k][m]
        return a is not None and a <= t

    def back_ready(self, k: int, m: int, t: float) -> bool:
        g = self.grad[k][m]
        if g is None or g > t:
            return False
        return self.rc_done[k][m] if self.needs_rc[k][m] else self.stash_ready(k, m, t)

    def stash_ready(self, k: int, m: int, t: float) -> bool:
        if not self.swap[k]:
            return True
        s = self.swapped_in[k][m]
        return s is not None and s <= t

    # --- policies --------------------------------------------------------------------------------------------
    def choose_by_rules(self, k: int, t: float) -> tuple[int, int, int] | None:
        prep, m = self.prep, self.nb[k]
        fwd = self.fwd_ready(k, t)
        if m < self.nf[k]:
            if self.back_ready(k, m, t):
                return B, m, -1
            if self.needs_rc[k][m]:
                if self.rc_done[k][m]:
                    return None  # rule 2: wait for this backward
                e = self.est[k][m]
                if e is not None:
                    latest = e - prep.dur[R][k]
                    if fwd and t + prep.dur[F][k] <= latest:
                        return F, self.nf[k], -1
                    if fwd or t >= latest:
                        if self.stash_ready(k, m, t):
                            return R, m, -1
                        return (F, self.nf[k], -1) if fwd else None
                    self.push(latest, _WAKE, k)
                    return None
        return (F, self.nf[k], -1) if fwd else None

    def choose_by_order(self, k: int, t: float) -> tuple[int, int, int] | None:
        pick = self.committed[k]
        if pick is None:
            order, done, i = self.orders[k], self.done[k], self.pos[k]
            while i < len(order) and done[i]:
                i += 1
            self.pos[k] = i
            if i == len(order):
                return None
            kind, m = order[i]
            pick = kind, m, i
            chain_first = kind == R or (kind == B and not self.needs_rc[k][m])
            if self.opportunistic and chain_first and self.nf[k] < self.prep.Nm and k < self.prep.P - 1:
                g = self.grad[k][m]
                if g is None or g > t:  # gradient not here yet: run the next forward instead, waiting for it
                    pick = F, self.nf[k], self.fpos[k][self.nf[k]]
            self.committed[k] = pick
        kind, m, _ = pick
        if kind == F:
            ok = self.fwd_ready(k, t)
        elif kind == R:
            ok = self.stash_ready(k, m, t)
        else:
            ok = self.back_ready(k, m, t)
        if not ok:
            return None
        self.committed[k] = None
        return pick

    # --- execution -------------------------------------------------------------------------------------------
    def start(self, k: int, t: float, kind: int, m: int, index: int) -> None:
        prep, noise, P = self.prep, self.noise, self.prep.P
        if index >= 0:
            self.done[k][index] = True
        else:
            self.ran[k].append((kind, m))
        if kind == F:
            self.nf[k] += 1
        elif kind == B:
            self.nb[k] += 1
        nz = noise.compute[kind]
        dur = prep.dur[kind][k] * (nz[k][m] if nz is not None else 1.0)
        self.trace.tasks[k].append((kind, m, t, t + dur))
        self.trace.busy[k] += dur
        self.running[k] = (kind, m, index)
        self.push(t + dur, _DONE, k)
        if k > 0 and (kind != F or k == P - 1):
            self.announce(k, m, kind, t)

    def announce(self, k: int, m: int, kind: int, t: float) -> None:
        """Stage k starts m's backward work: stage k-1 learns when m's gradient will arrive (nominal times) and
        starts bringing m's activations back from the host."""
        prep, up = self.prep, k - 1
        tail = prep.dur[B][k] + prep.grad_link[up]
        if kind == F:
            e = t + prep.dur[F][k] + tail
        elif kind == R:
            g = self.grad[k][m] if self.grad[k][m] is not None else self.est[k][m]
            e = max(t + prep.dur[R][k], g or 0.0) + tail
        else:
            e = t + tail
        self.est[up][m] = e
        if self.swap[up] and self.swapped_in[up][m] is None:
            begin = max(self.h2d[up], t, self.swapped_out[up][m])
            nz = self.noise.swap_in
            end = self.h2d[up] = begin + prep.swap_in[up] * (nz[up][m] if nz else 1.0)
            self.swapped_in[up][m] = end
            self.trace.swaps[up].append((SWAP_IN, m, begin, end, up))
            self.trace.activation_swap_bytes += prep.swap_bytes[up]
            self.push(end, _WAKE, up)
        if self.orders is None and self.running[up] is None:
            self.push(t, _WAKE, up)

    def finish(self, k: int, t: float) -> None:
        prep, noise, P = self.prep, self.noise, self.prep.P
        kind, m, _ = self.running[k]
        self.running[k] = None
        if kind == F:
            if k == P - 1:
                self.grad[k][m] = t
            else:
                c = prep.act_link[k] * (noise.act[k][m] if noise.act else 1.0)
                begin = max(self.link_f[k], t)
                arrive = self.act[k + 1][m] = self.link_f[k] = begin + c
                if c > 0 and self.record:
                    self.trace.transfers.append((SEND_ACT, k, m, begin, arrive))
                self.push(arrive, _WAKE, k + 1)
                if self.swap[k]:
                    begin = max(self.d2h[k], t)
                    end = self.d2h[k] = self.swapped_out[k][m] = begin + prep.swap_out[k] * (
                        noise.swap_out[k][m] if noise.swap_out else 1.0)
                    self.trace.swaps[k].append((SWAP_OUT, m, begin, end, k))
                    self.trace.activation_swap_bytes += prep.swap_bytes[k]
        elif kind == R:
            self.rc_done[k][m] = True
        else:
            self.trace.last_backward_end[k] = max(self.trace.last_backward_end[k], t)
            if k > 0:
                c = prep.grad_link[k - 1] * (noise.grad[k - 1][m] if noise.grad else 1.0)
                begin = max(self.link_b[k], t)
                arrive = self.grad[k - 1][m] = self.link_b[k] = begin + c
                if c > 0 and self.record:
                    self.trace.transfers.append((SEND_GRAD, k, m, begin, arrive))
                self.push(arrive, _WAKE, k - 1)

    def run(self) -> Trace:
        choose = self.choose_by_rules if self.orders is None else self.choose_by_order
        for k in range(self.prep.P):
            self.push(0.0, _WAKE, k)
        heap, running = self.heap, self.running
        while heap:
            t, _, code, k = heapq.heappop(heap)
            if code == _DONE:
                self.finish(k, t)
            if running[k] is None:
                pick = choose(k, t)
                if pick is not None:
                    self.start(k, t, *pick)
        if any(n < self.prep.Nm for n in self.nb):
            raise RuntimeError(f"schedule deadlocked: backwards done per stage {self.nb}")
        return self.trace


def generate(prep: Prepared) -> list[Order]:
    """Apply Varuna's rules at nominal times; returns the static per-stage orders they produce."""
    run = _Run(prep, Noise(), False, None, opportunistic=False)
    run.run()
    return run.ran


def execute(prep: Prepared, orders: list[Order], noise: Noise, record: bool, opportunistic: bool = True) -> Trace:
    """Follow static per-stage orders; with `opportunistic`, run the next ready forward when the scheduled task's
    input is late (Varuna's jitter policy). Without it, this is a plain fixed-order run (used to cross-check)."""
    return _Run(prep, noise, record, orders, opportunistic).run()
