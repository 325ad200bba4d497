"""Vectorised engines for GPipe and 1F1B without swaps: the pricing path's hot case.

Both schedules are recurrences of the form x[i] = max(x[i-1] + a[i], y[i]) + b[i] (a device or link that is
free at x[i-1], an input ready at y[i]). With prefix sums P, x - P is a running maximum, so a whole chain is one
`np.maximum.accumulate`:
- GPipe: every stage's forward chain depends only on the stage before, every backward chain only on the stage
  after, so 2P chain evaluations over the micro-batches do it.
- 1F1B: after the warm-up, step j of stage s is (forward w_s+j, recompute j, backward j), w_s = P-s-1. The
  forward needs the previous step of stage s-1; backward j needs backward j of stage s+1, so within a step the
  backwards form one chain over stages (evaluated in reverse), and Nm steps do it.
Results equal the fixed-order recurrence (`fixed.py`) up to floating-point rounding; tests cross-check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.planner.sim.core import B, F, Noise, Prepared, R
from services.planner.sim.model import Schedule


@dataclass
class Timing:
    """Per kind (F, R, B), stage and micro-batch; transfers per sending stage and micro-batch."""

    start: np.ndarray  # [3, P, Nm]
    end: np.ndarray  # [3, P, Nm]
    dur: np.ndarray  # [3, P, Nm]; recompute 0 where skipped
    has_r: np.ndarray  # [P, Nm] bool
    act_sent: np.ndarray  # [P, Nm]: F(s, m)'s output enters link s -> s+1
    act_time: np.ndarray
    grad_sent: np.ndarray  # [P, Nm]: B(s, m)'s output enters link s -> s-1
    grad_time: np.ndarray


def _chain(free: float, ready: np.ndarray, pre: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tasks in order on one resource free at `free`: task i first runs `pre[i]` (a recompute, which needs no
    input), then waits for `ready[i]`, then runs `dur[i]`. Returns (when task i's resource became free, end)."""
    step = np.cumsum(pre + dur)
    ends = np.maximum.accumulate(np.concatenate(([free], ready + dur - step)))[1:] + step
    return np.concatenate(([free], ends[:-1])), ends


def _setup(prep: Prepared, noise: Noise) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    P, Nm = prep.P, prep.Nm
    dur = np.empty((3, P, Nm))
    for kind in (F, R, B):
        dur[kind] = np.asarray(prep.dur[kind], dtype=float)[:, None]
        if noise.compute[kind] is not None:
            dur[kind] *= noise.compute[kind]
    act = np.zeros((P, Nm))
    grad = np.zeros((P, Nm))
    if P > 1:
        act[:-1] = np.asarray(prep.act_link)[:, None]
        grad[1:] = np.asarray(prep.grad_link)[:, None]
        if noise.act is not None:
            act[:-1] *= noise.act[:-1]
        if noise.grad is not None:
            grad[1:] *= noise.grad[:-1]
    return dur, act, grad


def run_gpipe(prep: Prepared, noise: Noise) -> Timing:
    P, Nm = prep.P, prep.Nm
    dur, act_t, grad_t = _setup(prep, noise)
    dur[R, P - 1, Nm - 1] = 0.0  # the last stage's newest backward follows its forward
    start, end = np.zeros((3, P, Nm)), np.zeros((3, P, Nm))
    act_sent, grad_sent = np.zeros((P, Nm)), np.zeros((P, Nm))
    arrive = np.zeros(Nm)
    zero = np.zeros(Nm)
    for s in range(P):
        prev, fe = _chain(0.0, arrive, zero, dur[F, s])
        start[F, s] = np.maximum(prev, arrive)
        end[F, s] = fe
        if s < P - 1:
            act_sent[s], arrive = _link(fe, act_t[s])
    grad_in = end[F, P - 1][::-1]
    for s in reversed(range(P)):
        r, b = dur[R, s][::-1], dur[B, s][::-1]
        prev, be = _chain(end[F, s, -1], grad_in, r, b)
        re = prev + r
        start[R, s] = prev[::-1]
        end[R, s] = re[::-1]
        start[B, s] = np.maximum(re, grad_in)[::-1]
        end[B, s] = be[::-1]
        if s > 0:
            sent, grad_in = _link(be, grad_t[s][::-1])
            grad_sent[s] = sent[::-1]
    has_r = dur[R] > 0
    return Timing(start, end, dur, has_r, act_sent, act_t, grad_sent, grad_t)


def _link(produced: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FIFO transfers of outputs produced in order: (when each enters the link, when it arrives)."""
    prev, arrive = _chain(0.0, produced, np.zeros_like(times), times)
    return np.maximum(prev, produced), arrive


def run_1f1b(prep: Prepared, noise: Noise) -> Timing:
    P, Nm = prep.P, prep.Nm
    dur, act_t, grad_t = _setup(prep, noise)
    dur[R, P - 1] = 0.0  # the last stage runs each backward right after its forward
    start, end = np.zeros((3, P, Nm)), np.zeros((3, P, Nm))
    act_sent, grad_sent = np.zeros((P, Nm)), np.zeros((P, Nm))
    act_in = np.zeros((P, Nm))  # arrival of F(s, m)'s input
    rows = np.arange(P)[:, None]
    warm = np.minimum(P - 1 - np.arange(P), Nm)
    free, link_f = np.zeros(P), np.zeros(P)
    zero = np.zeros(Nm)
    for s in range(P):  # warm-up forwards, stage by stage
        w = warm[s]
        if w == 0:
            continue
        prev, fe = _chain(0.0, act_in[s, :w], zero[:w], dur[F, s, :w])
        start[F, s, :w] = np.maximum(prev, act_in[s, :w])
        end[F, s, :w] = fe
        free[s] = fe[-1]
        if s < P - 1:
            act_sent[s, :w], act_in[s + 1, :w] = _link(fe, act_t[s, :w])
            link_f[s] = act_in[s + 1, w - 1]
    # Skewed view: column j holds what stage s does in step j (forward of micro-batch warm[s] + j); padding is 0.
    mb = warm[:, None] + np.arange(Nm)[None, :]
    on = mb < Nm
    mbc = np.minimum(mb, Nm - 1)
    fd = np.where(on, dur[F][rows, mbc], 0.0).T.copy()
    at = np.where(on, act_t[rows, mbc], 0.0).T.copy()
    arrive_in = np.zeros((Nm + 1, P))
    arrive_in[:Nm] = np.where(on, act_in[rows, mbc], 0.0).T
    on_t = on.T.copy()
    rd, bd = dur[R].T.copy(), dur[B].T.copy()
    gt = grad_t.T[:, 1:].copy()  # [j, s]: stage s+1 -> s
    fs_t, fe_t, sent_f = np.zeros((Nm, P)), np.zeros((Nm, P)), np.zeros((Nm, P))
    re_t, bs_t, be_t, sent_b = np.zeros((Nm, P)), np.zeros((Nm, P)), np.zeros((Nm, P)), np.zeros((Nm, P - 1))
    last = P - 1
    link_b = np.zeros(last)
    q = np.empty(P)
    before = np.zeros(P)
    for j in range(Nm):
        fs = np.maximum(free, arrive_in[j])
        fe = fs + fd[j]
        fs_t[j], fe_t[j] = fs, fe
        sent = np.maximum(link_f, fe)
        sent_f[j] = sent
        link_f = sent + at[j]
        np.copyto(arrive_in[j + 1, 1:], link_f[:-1], where=on_t[j, :-1])
        re = fe + rd[j]
        re_t[j] = re
        # Backward j over stages, last to first: x[s] = max(q[s], x[s+1] + a[s]).
        g, b = gt[j], bd[j]
        np.add(np.maximum(re[:last], link_b + g), b[:last], out=q[:last])
        q[last] = re[last] + b[last]
        np.cumsum(g + b[:last], out=before[1:])
        be = np.maximum.accumulate((q + before)[::-1])[::-1] - before
        sent = np.maximum(link_b, be[1:])
        sent_b[j] = sent
        link_b = sent + g
        bs_t[j, :last] = np.maximum(re[:last], link_b)
        bs_t[j, last] = re[last]
        be_t[j] = be
        free = be
    steady_s, steady_j = np.nonzero(on)
    steady_m = mb[steady_s, steady_j]
    start[F, steady_s, steady_m] = fs_t[steady_j, steady_s]
    end[F, steady_s, steady_m] = fe_t[steady_j, steady_s]
    act_sent[steady_s, steady_m] = sent_f[steady_j, steady_s]
    start[R], end[R] = fe_t.T, re_t.T
    start[B], end[B] = bs_t.T, be_t.T
    grad_sent[1:] = sent_b.T
    has_r = dur[R] > 0
    return Timing(start, end, dur, has_r, act_sent, act_t, grad_sent, grad_t)


def stage_order(schedule: Schedule, P: int, Nm: int, s: int, recompute: bool) -> tuple[np.ndarray, np.ndarray]:
    """(kinds, micro-batches) stage s runs, in order; the same orders as `orders.py` builds, as arrays."""
    mbs = np.arange(Nm)
    if schedule is Schedule.GPIPE:
        back = mbs[::-1]
        chain = np.stack([np.full(Nm, R if recompute else -1), np.full(Nm, B)], axis=1)
        if s == P - 1:
            chain[0, 0] = -1
        kinds = np.concatenate([np.full(Nm, F), chain.ravel()])
        mb = np.concatenate([mbs, np.repeat(back, 2)])
    else:
        w = min(P - 1 - s, Nm)
        step_f = np.where(mbs + w < Nm, F, -1)
        steps = np.stack([step_f, np.full(Nm, R if recompute and s < P - 1 else -1), np.full(Nm, B)], axis=1)
        kinds = np.concatenate([np.full(w, F), steps.ravel()])
        mb = np.concatenate([np.arange(w), np.stack([mbs + w, mbs, mbs], axis=1).ravel()])
    keep = kinds >= 0
    return kinds[keep], mb[keep]
