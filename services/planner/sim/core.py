"""Shared internals of the simulator engines: task kinds, the prepared pipeline, per-replica noise and traces.

Engines work on plain lists of floats indexed by stage and micro-batch, not on the frozen contract types,
because the pricing path runs tens of thousands of tasks per call and attribute lookups dominate otherwise.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from services.planner.sim.model import FREE_LINK, Pipeline, Schedule, SimOptions

# Compute kinds (index into durations and noise).
F, R, B = 0, 1, 2
# Transfer kinds; swaps carry micro_batch -1 for weights.
SEND_ACT, SEND_GRAD, SWAP_OUT, SWAP_IN, ALLREDUCE = 3, 4, 5, 6, 7
KIND_NAMES = ("forward", "recompute", "backward", "send_activation", "send_gradient", "swap_out", "swap_in",
              "allreduce")


@dataclass
class Prepared:
    """A validated pipeline flattened into per-stage lists (durations in seconds, devices as compact indices)."""

    P: int
    Nm: int
    replicas: int
    dur: tuple[list[float], list[float], list[float]]  # forward, recompute, backward per stage
    act_link: list[float]  # transfer time stage s -> s+1 (0 when both sides share a device)
    grad_link: list[float]  # transfer time stage s+1 -> s
    swap_out: list[float]
    swap_in: list[float]
    weight_in: list[float]
    weight_out: list[float]
    fdev: list[int]  # device running stage s's forward (and recompute/backward unless Harmony)
    bdev: list[int]  # device running stage s's recompute and backward
    device_ids: list[int]  # compact index -> id from Pipeline.device_of_stage
    allreduce: list[float]
    swap_bytes: list[int]
    weight_bytes: list[int]


def prepare(pipe: Pipeline, schedule: Schedule) -> Prepared:
    """Validate a pipeline and bind stages to devices (Harmony: PFB = forward packs + reversed backward packs)."""
    P, Nm = len(pipe.stages), pipe.num_micro_batches
    if P < 1 or Nm < 1 or pipe.replicas < 1:
        raise ValueError("need at least one stage, one micro-batch and one replica")
    if pipe.boundary_links and len(pipe.boundary_links) != P - 1:
        raise ValueError(f"boundary_links has {len(pipe.boundary_links)} entries, expected {P - 1}")
    for s, st in enumerate(pipe.stages):
        values = (st.forward_s, st.backward_s, st.recompute_s, st.allreduce_s, st.update_s, st.output_bytes,
                  st.model_memory_bytes, st.activation_bytes, st.transient_bytes, st.swap_bytes,
                  st.weight_swap_bytes)
        if any(v < 0 or not math.isfinite(v) for v in values):
            raise ValueError(f"stage {s} has a negative or non-finite cost")
    ids = list(pipe.device_of_stage) if pipe.device_of_stage is not None else list(range(P))
    if len(ids) != P:
        raise ValueError(f"device_of_stage has {len(ids)} entries, expected {P}")
    distinct = list(dict.fromkeys(ids))
    if schedule is Schedule.HARMONY_WRAP:
        n = len(distinct)
        if any(ids[s] != distinct[s % n] for s in range(P)):
            raise ValueError("harmony_wrap needs the wrap-around binding: device_of_stage[s] == device of pack s mod N")
        fdev = [s % n for s in range(P)]
        bdev = [(2 * P - 1 - s) % n for s in range(P)]
    else:
        if len(distinct) != P:
            raise ValueError(f"{schedule.value} runs one stage per device; device_of_stage repeats a device")
        fdev = bdev = list(range(P))
    links = pipe.boundary_links or (FREE_LINK,) * (P - 1)
    st = pipe.stages
    act_link = [links[s].time(st[s].output_bytes) if fdev[s] != fdev[s + 1] else 0.0 for s in range(P - 1)]
    grad_link = [links[s].time(st[s].output_bytes) if bdev[s] != bdev[s + 1] else 0.0 for s in range(P - 1)]
    harmony = schedule is Schedule.HARMONY_WRAP
    host = pipe.host_link
    return Prepared(
        P=P, Nm=Nm, replicas=pipe.replicas,
        dur=([x.forward_s for x in st], [x.recompute_s for x in st], [x.backward_s for x in st]),
        act_link=act_link, grad_link=grad_link,
        swap_out=[host.time(x.swap_bytes) for x in st], swap_in=[host.time(x.swap_bytes) for x in st],
        weight_in=[host.time(x.weight_swap_bytes) if harmony else 0.0 for x in st],
        weight_out=[host.time(x.weight_swap_bytes) if harmony else 0.0 for x in st],
        fdev=fdev, bdev=bdev, device_ids=distinct, allreduce=[x.allreduce_s + x.update_s for x in st],
        swap_bytes=[x.swap_bytes for x in st], weight_bytes=[x.weight_swap_bytes if harmony else 0 for x in st],
    )


Grid = np.ndarray  # [stage, micro_batch] factors


@dataclass
class Noise:
    """Multiplicative factors per task identity (kind, stage, micro-batch) for one replica; None = no jitter.

    Drawn up front in a fixed layout, so a task gets the same factor whatever order an engine reaches it in
    (and two schedules simulated with one seed see the same noise on the same work)."""

    compute: tuple[Grid | None, Grid | None, Grid | None] = (None, None, None)
    act: Grid | None = None  # transfer s -> s+1 of micro-batch m, by sending stage
    grad: Grid | None = None  # transfer s+1 -> s, by receiving stage
    swap_out: Grid | None = None
    swap_in: Grid | None = None
    weight: list[list[float]] | None = None  # per stage: forward-visit in, backward-visit in, out
    allreduce: list[float] | None = None

    def as_lists(self) -> ListNoise:
        """The same factors as nested lists, for engines that read them one task at a time."""

        def lists(grid: Grid | None) -> list[list[float]] | None:
            return None if grid is None else grid.tolist()

        return ListNoise(compute=tuple(lists(g) for g in self.compute), act=lists(self.act),  # type: ignore[arg-type]
                         grad=lists(self.grad), swap_out=lists(self.swap_out), swap_in=lists(self.swap_in),
                         weight=self.weight, allreduce=self.allreduce)


@dataclass
class ListNoise:
    """`Noise` with grids as nested lists (element access on numpy arrays is slow and leaks numpy floats)."""

    compute: tuple[list[list[float]] | None, ...] = (None, None, None)
    act: list[list[float]] | None = None
    grad: list[list[float]] | None = None
    swap_out: list[list[float]] | None = None
    swap_in: list[list[float]] | None = None
    weight: list[list[float]] | None = None
    allreduce: list[float] | None = None


def draw_noise(prep: Prepared, options: SimOptions, rng: random.Random) -> Noise:
    """Factors for one replica: lognormal with mean 1 and the options' coefficient of variation.

    `rng` (random.Random(seed)) seeds a numpy generator per replica, so a seed fixes every draw while tens of
    thousands of factors cost one vectorised call per category; categories without jitter draw nothing."""
    P, Nm = prep.P, prep.Nm
    gen = np.random.default_rng(rng.getrandbits(64))

    def factors(cv: float, shape: tuple[int, ...]) -> np.ndarray:
        sigma = math.sqrt(math.log1p(cv * cv))
        return gen.lognormal(-0.5 * sigma * sigma, sigma, size=shape)

    def grid(cv: float, bases: list[float]) -> Grid | None:
        if not any(bases):
            return None
        values = factors(cv, (P, Nm))
        values[np.asarray(bases[:P]) <= 0] = 1.0
        return values

    noise = Noise()
    if options.compute_jitter > 0:
        cv = options.compute_jitter
        noise.compute = (grid(cv, prep.dur[F]), grid(cv, prep.dur[R]), grid(cv, prep.dur[B]))
    if options.comm_jitter > 0:
        cv = options.comm_jitter
        noise.act = grid(cv, prep.act_link + [0.0])
        noise.grad = grid(cv, prep.grad_link + [0.0])
        noise.swap_out = grid(cv, prep.swap_out)
        noise.swap_in = grid(cv, prep.swap_in)
        if any(prep.weight_in):
            noise.weight = factors(cv, (P, 3)).tolist()
        if any(prep.allreduce):
            noise.allreduce = factors(cv, (P,)).tolist()
    return noise


@dataclass
class Trace:
    """What one replica did. Tasks per stage are in the order its device ran them."""

    tasks: list[list[tuple[int, int, float, float]]]  # per stage: (kind, micro_batch, start, end)
    swaps: list[list[tuple[int, int, float, float, int]]]  # per stage: (kind, micro_batch, start, end, device)
    transfers: list[tuple[int, int, int, float, float]] = field(default_factory=list)  # (kind, stage, mb, s, e)
    busy: list[float] = field(default_factory=list)
    last_backward_end: list[float] = field(default_factory=list)
    stage_end: list[float] = field(default_factory=list)  # latest activity of the stage (weight swap-out)
    activation_swap_bytes: int = 0
    weight_swap_bytes: int = 0


def new_trace(P: int) -> Trace:
    return Trace(tasks=[[] for _ in range(P)], swaps=[[] for _ in range(P)], busy=[0.0] * P,
                 last_backward_end=[0.0] * P, stage_end=[0.0] * P)
