"""What a layer-wise profile cannot see by itself: layers in sequence, neighbours, and the optimizer step.

Each layer is timed alone, many times over, with its weights and activations warm in the caches; in a training
step the layers run one after another and evict each other, which on a CPU costs several percent. One whole
forward+backward at a measured micro-batch size, over the sum of the layers' rows at that size, gives the
composition factor the cost model applies to compute. The optimizer step runs once per iteration per layer;
its time (Adam, states created by a first step) is measured here per layer, with the gradients that whole
backward left. Devices sharing a host (CPU worker slots) slow each other down through caches and memory
bandwidth: the same whole step, timed while sibling processes run it too, over the step alone, is the
co-location slowdown (measured on the model itself; a cache-resident probe kernel does not see it).
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time

import torch
from torch import Tensor, nn

from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import Decomposition
from services.zoo.graph import run_layers

COMPOSITION_BOUNDS = (0.5, 2.0)  # outside: a measurement gone wrong, not a property of the model


def whole_step_s(decomposition: Decomposition, batch: dict[str, Tensor], repeats: int) -> float:
    """Median of `repeats` whole forward+backward passes after one warm-up."""
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        run_layers(decomposition, batch).backward()
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def optimizer_step_s(decomposition: Decomposition, repeats: int) -> list[float]:
    """Per layer, the median Adam step over its own parameters (a tied one counts at its first layer)."""
    seen: set[int] = set()
    out = []
    for layer in decomposition.layers:
        params: list[nn.Parameter] = []
        for p in layer.module.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                params.append(p)
        if not params:
            out.append(0.0)
            continue
        opt = torch.optim.Adam(params, lr=1e-9)
        opt.step()  # creates the states: the first step of a run pays that once, not every iteration
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
        del opt
    return out


def composition_factor(whole_s: float, layers_s: float) -> float:
    """whole / sum of layers, or 0 (not measured) when the ratio is outside COMPOSITION_BOUNDS."""
    if layers_s <= 0:
        return 0.0
    ratio = whole_s / layers_s
    low, high = COMPOSITION_BOUNDS
    return ratio if low <= ratio <= high else 0.0


def release_gradients(decomposition: Decomposition) -> None:
    for layer in decomposition.layers:
        for p in layer.module.parameters():
            p.grad = None


ROUNDS = 3  # alternating alone / together measurements: a machine whose speed drifts moves both alike


def colocated_slowdown(spec_json: str, decomposition: Decomposition, batch: dict[str, Tensor], repeats: int,
                       siblings: int, timeout_s: float = 120.0,
                       user_inputs: UserInputs = NO_USER_INPUTS) -> float:
    """Whole step with `siblings` processes running the same steps, over the step alone (>= 1; 0 on failure).
    The siblings build the model as this process did: with the operator's `user_inputs` (a user's factory).

    Alone and together are measured in ROUNDS alternating rounds (the siblings paused between: started once,
    they wait on an event), and the ratio is of the two medians: one pair taken minutes apart read 1.27 on one
    profile and 1.00 on the next (benchmarks/profile_repro.py), a drift of the host, not of the crowding."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop, running = ctx.Barrier(siblings + 1), ctx.Event(), ctx.Event()
    m = next(iter(batch.values())).shape[0]
    allowed = user_inputs.to_json()
    procs = [ctx.Process(target=_sibling, args=(spec_json, m, ready, stop, allowed, running), daemon=True)
             for _ in range(siblings)]
    for proc in procs:
        proc.start()
    alone, together = [], []
    try:
        ready.wait(timeout=timeout_s)
        for _ in range(ROUNDS):
            alone.append(whole_step_s(decomposition, batch, repeats))
            running.set()
            time.sleep(0.05)  # the siblings are in their steps
            together.append(whole_step_s(decomposition, batch, repeats))
            running.clear()
            time.sleep(0.05)
    except threading.BrokenBarrierError:  # a sibling never got ready: not measured
        return 0.0
    finally:
        stop.set()
        running.set()  # a paused sibling sees the stop
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return max(1.0, statistics.median(together) / statistics.median(alone))


def _sibling(spec_json: str, m: int, ready, stop, allowed: dict, running=None) -> None:
    """Spawn target: build the same model and run whole steps until told to stop (one intra-op thread), only
    while `running` is set when there is one."""
    from google.protobuf.json_format import Parse

    from ballast.v1 import model_pb2
    from services.zoo import build_model, example_input

    torch.set_num_threads(1)
    spec, user_inputs = Parse(spec_json, model_pb2.ModelSpec()), UserInputs.from_json(allowed)
    decomposition = build_model(spec, seed=0, user_inputs=user_inputs).decompose()
    batch = example_input(spec, m, user_inputs=user_inputs)
    run_layers(decomposition, batch).backward()  # warm
    ready.wait()
    while not stop.is_set():
        if running is not None and not running.wait(timeout=0.5):
            continue
        run_layers(decomposition, batch).backward()
