"""simulate(): one training iteration of P stages x D replicas x Nm micro-batches under a schedule.

Replicas are identical without jitter, so one is simulated and stands for all; with jitter each replica gets
its own noise and every stage's allreduce waits for that stage's slowest replica. The iteration ends when the
last stage finishes its allreduce (and, for Harmony, its last weight swap-out).

Engines: GPipe and 1F1B without swaps run vectorised (`fast`); other fixed orders (Harmony, swaps) run the
per-task recurrence (`fixed`); Varuna needs the event queue (`varuna`). `engine=` forces one, for cross-checks.
"""

from __future__ import annotations

import random
from operator import attrgetter

import numpy as np

from services.planner.sim.core import (
    ALLREDUCE,
    KIND_NAMES,
    SEND_ACT,
    SEND_GRAD,
    B,
    F,
    Noise,
    Prepared,
    Trace,
    draw_noise,
    new_trace,
    prepare,
)
from services.planner.sim.fast import Timing, run_1f1b, run_gpipe, stage_order
from services.planner.sim.fixed import finish_trace, run_fixed
from services.planner.sim.memory import peak_in_order, stage_memory
from services.planner.sim.model import Event, Pipeline, Schedule, SimOptions, SimResult
from services.planner.sim.orders import device_orders
from services.planner.sim.varuna import execute, generate

StageOrder = tuple[np.ndarray, np.ndarray] | tuple[tuple[int, ...], tuple[int, ...]]


def simulate(pipeline: Pipeline, options: SimOptions, engine: str = "auto") -> SimResult:
    """Simulate one iteration. keep_timeline=False (pricing) skips events and memory curves, nothing else:
    both paths give the same times and peaks. `engine` ("auto", "vector", "recurrence", "events") picks the
    implementation of a fixed-order schedule; all agree."""
    prep = prepare(pipeline, options.schedule)
    jittered = options.compute_jitter > 0 or options.comm_jitter > 0
    rng = random.Random(options.seed)
    noises = [draw_noise(prep, options, rng) for _ in range(prep.replicas)] if jittered else [Noise()]
    record = options.keep_timeline
    schedule = options.schedule
    orders: list[StageOrder] | None = None
    if schedule is Schedule.VARUNA:
        static = generate(prep)
        traces = [execute(prep, static, noise, record) for noise in noises]
    else:
        vector_ok = schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B) and not any(prep.swap_bytes)
        if engine == "vector" or (engine == "auto" and vector_ok):
            if not vector_ok:
                raise ValueError("the vectorised engine runs GPipe and 1F1B without swaps only")
            run = run_gpipe if schedule is Schedule.GPIPE else run_1f1b
            orders = [stage_order(schedule, prep.P, prep.Nm, s, prep.dur[1][s] > 0) for s in range(prep.P)]
            traces = [_trace(prep, run(prep, noise), orders, record) for noise in noises]
        elif engine == "events":
            if not vector_ok:
                raise ValueError("the event engine runs GPipe and 1F1B without swaps only (and Varuna)")
            fixed = [[(kind, m) for kind, _, m, _ in order] for order in device_orders(prep, schedule)]
            traces = [execute(prep, fixed, noise, record, opportunistic=False) for noise in noises]
        else:
            runs = [run_fixed(prep, schedule, noise) for noise in noises]
            lay = runs[0].layout
            orders = [(lay.kind[d], lay.mb[d]) if lay.single_stage[d] else None for d in prep.fdev]
            traces = [finish_trace(prep, run, record) for run in runs]
    return _result(pipeline, prep, traces, noises[0], record, orders)


def _trace(prep: Prepared, timing: Timing, orders: list[StageOrder], record: bool) -> Trace:
    trace = new_trace(prep.P)
    trace.busy = timing.dur.sum(axis=(0, 2)).tolist()
    trace.last_backward_end = timing.end[B].max(axis=1).tolist()
    if record:
        for s, (kinds, mbs) in enumerate(orders):
            trace.tasks[s] = list(zip(kinds.tolist(), mbs.tolist(), timing.start[kinds, s, mbs].tolist(),
                                      timing.end[kinds, s, mbs].tolist(), strict=True))
        for kind, sent, dur in ((SEND_ACT, timing.act_sent, timing.act_time),
                                (SEND_GRAD, timing.grad_sent, timing.grad_time)):
            for s, m in zip(*np.nonzero(dur), strict=True):
                trace.transfers.append((kind, int(s), int(m), float(sent[s, m]), float(sent[s, m] + dur[s, m])))
    return trace


def _result(pipe: Pipeline, prep: Prepared, traces: list[Trace], noise: Noise, record: bool,
            orders: list[StageOrder | None] | None) -> SimResult:
    P = prep.P
    ar_start = [max(t.last_backward_end[s] for t in traces) for s in range(P)]
    ar_end = [ar_start[s] + prep.allreduce[s] * (noise.allreduce[s] if noise.allreduce else 1.0) for s in range(P)]
    stage_done = [max(ar_end[s], *(t.stage_end[s] for t in traces)) for s in range(P)]
    iteration = max(stage_done)
    busy = tuple(sum(t.busy[s] for t in traces) / len(traces) for s in range(P))
    devices = len(prep.device_ids)
    bubble = 1.0 - sum(busy) / (devices * iteration) if iteration > 0 else 0.0
    peaks, timelines = _memory(pipe, prep, traces, record, orders)
    scale = prep.replicas // len(traces)  # identical replicas collapsed into one trace
    return SimResult(
        iteration_s=iteration,
        busy_s=busy,
        idle_s=tuple(iteration - b for b in busy),
        peak_memory_bytes=tuple(peaks),
        bubble_fraction=max(0.0, bubble),
        memory_timeline=tuple(timelines),
        events=_events(prep, traces, ar_start, ar_end) if record else (),
        swapped_activation_bytes=scale * sum(t.activation_swap_bytes for t in traces),
        swapped_weight_bytes=scale * sum(t.weight_swap_bytes for t in traces),
    )


def _memory(pipe: Pipeline, prep: Prepared, traces: list[Trace], record: bool,
            orders: list[StageOrder | None] | None) -> tuple[list[int], list[tuple[tuple[float, int], ...]]]:
    """Peaks per stage (worst replica) and replica 0's timeline. A stage on its own device without swaps has
    its peak computed from its task order, the same way on both paths."""
    peaks, timelines = [], []
    for s, stage in enumerate(pipe.stages):
        in_order = prep.fdev[s] == prep.bdev[s] and prep.swap_bytes[s] == 0
        if in_order and orders is not None and orders[s] is not None:
            peak = peak_in_order(stage, *orders[s], prep.Nm)
        elif in_order:
            peak = max(peak_in_order(stage, *zip(*[(k, m) for k, m, _, _ in t.tasks[s]], strict=True), prep.Nm)
                       for t in traces)
        else:
            peak = max(stage_memory(stage, t.tasks[s], t.swaps[s], False, False)[0] for t in traces)
        peaks.append(peak)
        if record:
            timelines.append(stage_memory(stage, traces[0].tasks[s], traces[0].swaps[s], in_order, True)[1])
    return peaks, timelines


def _events(prep: Prepared, traces: list[Trace], ar_start: list[float], ar_end: list[float]) -> tuple[Event, ...]:
    ids, fdev, bdev = prep.device_ids, prep.fdev, prep.bdev
    out: list[Event] = []
    for r, trace in enumerate(traces):
        for s in range(prep.P):
            fid, bid = ids[fdev[s]], ids[bdev[s]]
            out += [Event(KIND_NAMES[kind], s, fid if kind == F else bid, r, m, start, end)
                    for kind, m, start, end in trace.tasks[s]]
            out += [Event(KIND_NAMES[kind], s, ids[d], r, m, start, end) for kind, m, start, end, d in trace.swaps[s]]
            if ar_end[s] > ar_start[s]:
                out.append(Event(KIND_NAMES[ALLREDUCE], s, bid, r, -1, ar_start[s], ar_end[s]))
        out += [Event(KIND_NAMES[kind], s, ids[fdev[s] if kind == SEND_ACT else bdev[s]], r, m, start, end)
                for kind, s, m, start, end in trace.transfers]
    out.sort(key=attrgetter("start_s"))
    return tuple(out)
