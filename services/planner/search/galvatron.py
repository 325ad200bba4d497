"""Galvatron-BMW's hybrid-parallel search (Algorithms 1 and 2) on Ballast's shared cost model and simulator.

Configurations: every global batch size B (the throughput sweep 1, 2, 4, ... up to max_global_batch_size
when no batch is given, else Algorithm 2's B0 - r .. B0 + r), every PP degree P (divisors of N, at most the
layer count), a few micro-batch counts nm (Init_Microbatch_Num: the smallest divisor of B that is >= P, and
the next ones >= 2x and 4x it) and every schedule. For one configuration (`Planner.optimize`):

1. the strategy set of a stage's group of N / P devices (space.layer_candidates: decision trees, Takeaway 3,
   and the DP flavours ZeRO-1/2 where options.dims lists them);
2. the partition (partition.py): every partition when there are at most `exhaustive_limit`, else Algorithm 2
   from the memory-balanced start; each stage priced by the per-stage DP (dp.py) at its in-flight count;
3. the cheap objective, Eq. 5 (J = (nm - 1) max_i u_i + sum_i u_i, u_i = stage cost / nm, the stage's
   exposed gradient sync included), picks the plan of that configuration.

`Planner.plan` then re-prices it with `problem.price()` -- the cost model's Pipeline and the event
simulator -- whose iteration time (boundary sends, tied-weight syncs, the schedule's real order, 1F1B's
last stage skipping recomputes) and peak memory are final; a plan the DP thought would fit but the
simulator finds out of memory is dropped. Throughput = B / simulated iteration time.

Order and stopping (`Planner.run`). Instead of Algorithm 1's stop at the first batch size where nothing
fits, configurations are planned in decreasing order of a proven throughput bound (`throughput_bound`: the
pipeline's fill and drain over each layer's fastest strategy) and the sweep stops once no remaining bound
beats the k-th best simulated throughput; configurations whose smallest layers cannot fit are skipped
(`may_fit`), and a plan whose slowest stage already rules it out is not simulated. The top_k distinct
plans come back best first ([] when nothing fits), the same ones planning every configuration gives.
Pure and deterministic: same inputs, same plans.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from services.planner.cost import CostContext, in_flight_micro_batches
from services.planner.search import partition as part
from services.planner.search.dp import (
    ENUMERATE_LIMIT,
    Arena,
    LayerTables,
    StagePlan,
    StageSolver,
    layer_tables,
    scope_key,
)
from services.planner.search.problem import PricedPlan, SearchOptions, fill_fits, price, time_floor
from services.planner.search.space import SEQUENCE, Candidate, executable, layer_candidates, pipeline_degrees
from services.planner.sim import Schedule

ENGINE, NAME = "galvatron", "Ballast"


def batch_sizes(options: SearchOptions) -> list[int]:
    """B0 - r .. B0 + r with a fixed batch, else the powers of two up to max_global_batch_size (and it)."""
    if options.global_batch_size is not None:
        b0, r = options.global_batch_size, max(0, options.batch_radius)
        return list(range(max(1, b0 - r), b0 + r + 1))
    top = max(1, options.max_global_batch_size)
    ladder = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
    return ladder + ([top] if ladder[-1] != top else [])


def micro_batch_counts(global_batch_size: int, pp: int, choices: int = 3) -> list[int]:
    """Init_Microbatch_Num: divisors of B, the first >= P (so every stage is busy), then >= 2x and 4x it."""
    divisors = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
    start = next((d for d in divisors if d >= pp), divisors[-1])
    out = [start]
    for factor in (2, 4)[: max(0, choices - 1)]:
        nxt = next((d for d in divisors if d >= factor * start), None)
        if nxt is not None and nxt not in out:
            out.append(nxt)
    return out


@dataclass
class SearchStats:
    """What one search did (for benchmarks and explanations)."""

    configurations: int = 0  # (B, P, nm, schedule) tuples planned
    stage_dps: int = 0
    partitions: int = 0
    priced: int = 0
    dropped_by_simulator: int = 0
    table_builds: int = 0
    skipped_memory: int = 0  # configurations whose smallest layers cannot fit
    skipped_bound: int = 0  # configurations whose throughput bound could not enter the top_k
    skipped_pricing: int = 0  # plans whose slowest stage already rules them out of the top_k


@dataclass
class Planner:
    """One (context, devices, options) with the caches a search reuses across configurations."""

    ctx: CostContext
    num_devices: int
    options: SearchOptions
    exhaustive_limit: int = part.EXHAUSTIVE_LIMIT
    enumerate_limit: int = ENUMERATE_LIMIT  # stages with at most this many assignments are solved exactly (dp.py)
    stats: SearchStats = field(default_factory=SearchStats)
    _candidates: dict[int, list[Candidate]] = field(default_factory=dict)
    _tables: dict[tuple, LayerTables] = field(default_factory=dict)
    _scopes: dict[tuple[int, int], tuple] = field(default_factory=dict)
    _prefix: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _quick: dict[tuple[int, int], float] = field(default_factory=dict)
    _arena: Arena = field(default_factory=Arena)

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.num_devices > self.ctx.fleet.devices:
            raise ValueError(f"num_devices {self.num_devices} outside 1..{self.ctx.fleet.devices} (the fleet)")

    @property
    def num_layers(self) -> int:
        return len(self.ctx.view)

    def candidates(self, pp: int) -> list[Candidate]:
        if pp not in self._candidates:
            o = self.options
            self._candidates[pp] = [c for c in layer_candidates(
                self.num_devices // pp, pp=pp, checkpoint=o.checkpoint, takeaway3=o.takeaway3, dims=o.dims
            ) if not o.executable_only or executable(c)]
        return self._candidates[pp]

    def tables(self, pp: int, micro_batch_size: int, stage: int) -> LayerTables:
        """Layer tables of stage `stage`'s device block (stages whose links look alike share one)."""
        key = (pp, micro_batch_size, self._scope(pp, stage))
        if key not in self._tables:
            offsets = ((self.num_devices // pp) * stage,)
            self._tables[key] = layer_tables(self.ctx, self.candidates(pp), micro_batch_size, offsets,
                                             executable_only=self.options.executable_only,
                                             sequence=SEQUENCE in self.options.dims)
            self.stats.table_builds += 1
        return self._tables[key]

    def optimize(
        self, pp: int, micro_batch_size: int, num_micro_batches: int, schedule: Schedule
    ) -> part.PartitionResult:
        """The least-J partition and per-stage strategies of one configuration (before simulation)."""
        budget, gran = self.options.memory_budget_bytes, self.options.memory_granularity_bytes
        solvers: dict[tuple, StageSolver] = {}
        answers: dict[tuple, StagePlan] = {}

        by_stage: dict[int, StageSolver] = {}

        def solver(stage: int) -> StageSolver:
            if stage not in by_stage:
                tables = self.tables(pp, micro_batch_size, stage)
                n = in_flight_micro_batches(schedule, pp, stage, num_micro_batches)
                key = (id(tables), n)
                if key not in solvers:
                    solvers[key] = StageSolver(tables, num_micro_batches=num_micro_batches, in_flight=n,
                                               budget_bytes=budget, granularity_bytes=gran,
                                               enumerate_limit=self.enumerate_limit if self.options.exact_stages
                                               else 0, arena=self._arena)
                by_stage[stage] = solvers[key]
            return by_stage[stage]

        def solve(begin: int, end: int, stage: int) -> StagePlan:
            s = solver(stage)
            key = (id(s), begin, end)
            if key not in answers:
                self.stats.stage_dps += 1
                answers[key] = s.solve(begin, end)
            return answers[key]

        def bound(begin: int, end: int, stage: int) -> float:
            return solver(stage).lower_bound(begin, end)

        n_layers = self.num_layers
        if part.count_partitions(n_layers, pp) <= self.exhaustive_limit:
            result = part.exhaustive(n_layers, pp, num_micro_batches, solve, bound)
        else:
            tables = self.tables(pp, micro_batch_size, 0)
            costs = tables.layer_costs(num_micro_batches)
            ref = np.argmin(costs, axis=1)  # each layer's fastest strategy: the reference for the initial splits
            rows = np.arange(n_layers)
            in_flight = [in_flight_micro_batches(schedule, pp, s, num_micro_batches) for s in range(pp)]
            p_m = part.memory_balanced(tables.memory(num_micro_batches)[0][rows, ref],
                                       tables.forward_activation_bytes[rows, ref], in_flight)
            p_t = part.time_balanced(costs[rows, ref], pp)
            result = part.adjust(p_m, p_t, num_micro_batches, budget, solve)
        self.stats.partitions += result.evaluated
        self.stats.configurations += 1
        solvers.clear()
        by_stage.clear()
        self._arena.reclaim()
        return result

    def configurations(self, global_batch_size: int) -> Iterator[tuple[int, int, int, Schedule]]:
        """(P, micro-batch size, nm, schedule) for one global batch."""
        for pp in pipeline_degrees(self.num_devices, max_pp=self.num_layers):
            if self.options.pipeline_stages not in (0, pp) or not self.candidates(pp):
                continue
            for nm in micro_batch_counts(global_batch_size, pp):
                for schedule in self.options.schedules:
                    yield pp, global_batch_size // nm, nm, schedule

    def plan(
        self, pp: int, micro_batch_size: int, num_micro_batches: int, schedule: Schedule, floor: float = 0.0
    ) -> PricedPlan | None:
        """Optimise one configuration and price it on the simulator; None when nothing fits, or when the plan
        cannot simulate faster than `floor` samples/s: each stage's device runs nm micro-batches and then its
        gradient sync, so the iteration lasts at least the largest stage cost C_i less the recomputes a
        schedule may skip (1F1B's last stage keeps its activations instead)."""
        result = self.optimize(pp, micro_batch_size, num_micro_batches, schedule)
        if not result.feasible:
            return None
        slowest = max(stage.cost_s - num_micro_batches * stage.recompute_s for stage in result.stages) * self.time_floor
        if floor > 0 and micro_batch_size * num_micro_batches <= floor * slowest:
            self.stats.skipped_pricing += 1
            return None
        strategies = tuple(st for stage in result.stages for st in stage.strategies)
        self.stats.priced += 1
        priced = price(self.ctx, result.bounds, strategies, micro_batch_size, num_micro_batches, schedule,
                       self.options.memory_budget_bytes, engine=ENGINE, name=NAME)
        if priced.out_of_memory:
            self.stats.dropped_by_simulator += 1
            return None
        return priced

    def throughput_bound(self, global_batch_size: int, pp: int, micro_batch_size: int, num_micro_batches: int) -> float:
        """No plan of the configuration simulates faster (so the sweep may skip it).

        Stage b's device cannot start before the first micro-batch's forwards on stages < b, then runs its nm
        micro-batches (t_b each), and the last backward's gradient still crosses stages < b: iteration >=
        sum_{s<b} t_s + nm t_b for every b (t without recomputes: a schedule may skip them or run them before
        the gradient arrives). Over all splits of T = sum over layers of each layer's fastest strategy, the
        least such maximum makes every term equal: t_b = X q^b / nm with q = 1 - 1/nm, so
        X = T / (1 - q^P) (nm T for P = 1; the pipeline bubble for P > 1).
        """
        fastest = float(self._fastest(pp, micro_batch_size)[0][-1]) * self.time_floor
        iteration = fastest / (1.0 - (1.0 - 1.0 / num_micro_batches) ** pp)
        return math.inf if iteration <= 0 else global_batch_size / iteration

    def quick_bound(self, global_batch_size: int, pp: int, micro_batch_size: int, num_micro_batches: int) -> float:
        """An upper bound of `throughput_bound` without the layer tables: each layer's compute alone (no
        communication, no recompute) at the fastest split of its group's devices into dp x sdp sharing the
        micro-batch and tp dividing the work, over every split (a superset of the strategies)."""
        key = (pp, micro_batch_size)
        if key not in self._quick:
            group, m = self.num_devices // pp, micro_batch_size
            splits = [d for d in range(1, group + 1) if group % d == 0 and m % d == 0]
            view, scale, total = self.ctx.view, self.ctx.compute_scale, 0.0
            for index, count in self._layer_kinds.items():
                total += count * min((view.point(index, m // d).forward_s + view.point(index, m // d).backward_s)
                                     * scale / (group // d) for d in splits)
            self._quick[key] = total * (1 - 1e-9)  # slack: stay below the tables' sums, rounding included
        fastest = self._quick[key] * self.time_floor
        iteration = fastest / (1.0 - (1.0 - 1.0 / num_micro_batches) ** pp)
        return math.inf if iteration <= 0 else global_batch_size / iteration

    @functools.cached_property
    def _layer_kinds(self) -> dict[int, int]:
        """One layer index per distinct time table, with how many layers share it."""
        first: dict[object, int] = {}
        counts: dict[int, int] = {}
        for index, layer in enumerate(self.ctx.view.layers):
            rep = first.setdefault(layer.table, index)
            counts[rep] = counts.get(rep, 0) + 1
        return counts

    def may_beat(self, floor: float, global_batch_size: int, pp: int, micro_batch_size: int,
                 num_micro_batches: int) -> bool:
        """False when no split of the layers into `pp` stages brings the pipeline bound of `throughput_bound`
        under B / floor: that bound splits T continuously, so it overstates a deep pipeline over few layers.
        Each stage's device also syncs its gradients and runs its layers' optimizer steps and parameter
        all-gathers after its last backward (the simulator's allreduce_s + update_s; the exposed sync is at
        least w x the layers' sync when it overlaps the backward, dp.py's module docstring), so a stage from
        layer i to layer j ends no earlier than W(i) + G(j) - G(i) (W: prefix sums of each layer's fastest
        time t; G: of its least nm t + tail, over every strategy), and problem.fill_fits finds whether some
        split keeps them all under X."""
        if floor <= 0:
            return True
        prefix, ends = self._fastest(pp, micro_batch_size, num_micro_batches)
        # slack: never skip on a rounding difference
        return fill_fits(prefix, ends, pp, global_batch_size / floor / self.time_floor * (1 + 1e-9))

    @property
    def time_floor(self) -> float:
        return time_floor(self.ctx)

    def _fastest(self, pp: int, micro_batch_size: int, num_micro_batches: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Prefix sums (0 first) of each layer's fastest forward + backward per micro-batch t, recomputes left
        out (a schedule may skip them), and of its least nm t + what follows its stage's last backward (w x
        its gradient sync where that overlaps the backward, its optimizer step and parameter all-gather), over
        every strategy and stage position."""
        key = (pp, micro_batch_size)
        if key not in self._prefix:
            tables = [self.tables(pp, micro_batch_size, s) for s in self._distinct_stages(pp)]
            self._prefix[key] = (
                np.min([t.per_micro_batch_s - t.recompute_s for t in tables], axis=0),
                np.min([(t.sync_weight if t.overlap_grad_sync else 0.0) * t.grad_sync_s + t.post_sync_s
                        for t in tables], axis=0))
        per, tail = self._prefix[key]
        fastest = per.min(axis=1)
        stage = (num_micro_batches * per + tail).min(axis=1)
        return np.concatenate(([0.0], np.cumsum(fastest))), np.concatenate(([0.0], np.cumsum(stage)))

    def may_fit(self, pp: int, micro_batch_size: int, num_micro_batches: int, schedule: Schedule) -> bool:
        """False when even each layer's smallest Oms + n x Of cannot be split into P stages under the budget."""
        t = self.tables(pp, micro_batch_size, 0)  # bytes do not depend on where a stage sits
        in_flight = [in_flight_micro_batches(schedule, pp, s, num_micro_batches) for s in range(pp)]
        states = t.memory(num_micro_batches)[0]
        least = np.stack([(states + n * t.forward_activation_bytes).min(axis=1) for n in in_flight])
        if not np.isfinite(least).all():
            return False  # a layer no strategy can run (e.g. no dp x sdp divides the micro-batch)
        if least.sum(axis=1).max() + t.baseline_bytes <= self.options.memory_budget_bytes:
            return True  # the whole model fits on any stage, so every split does
        bounds = part.balanced(least) if pp > 1 else ((0, self.num_layers),)
        worst = max(least[s, b:e].sum() for s, (b, e) in enumerate(bounds))
        return worst + t.baseline_bytes <= self.options.memory_budget_bytes

    def _distinct_stages(self, pp: int) -> list[int]:
        """One stage index per distinct LayerTables (stages whose links look alike share one)."""
        seen: dict[tuple, int] = {}
        for s in range(pp):
            seen.setdefault(self._scope(pp, s), s)
        return list(seen.values())

    def _scope(self, pp: int, stage: int) -> tuple:
        if (pp, stage) not in self._scopes:
            offsets = ((self.num_devices // pp) * stage,)
            self._scopes[(pp, stage)] = scope_key(self.ctx, self.candidates(pp), offsets)
        return self._scopes[(pp, stage)]

    def run(self) -> list[PricedPlan]:
        """Every configuration of the ladder, most promising first; stop once no remaining one can enter the
        top_k (its throughput bound is no better than the k-th best plan's simulated throughput).

        The order is by `throughput_bound`, which needs a configuration's layer tables; most configurations of
        a large fleet's ladder never come up, so each enters the queue under `quick_bound` (never below its
        throughput bound) and is re-queued under its throughput bound (and checked by `may_fit`) when it first
        comes to the front: the order is the one sorting every configuration by its throughput bound gives."""
        if self.ctx.view.unfit_layers:
            return []
        queue: list[tuple[float, int, bool, tuple[int, int, int, Schedule]]] = []
        for batch in batch_sizes(self.options):
            for pp, m, nm, schedule in self.configurations(batch):
                queue.append((-self.quick_bound(batch, pp, m, nm), len(queue), False, (pp, m, nm, schedule)))
        heapq.heapify(queue)
        found: list[PricedPlan] = []
        best: list[float] = []  # the top_k throughputs so far, ascending
        k = max(1, self.options.top_k)
        while queue:
            neg_bound, order, exact, cfg = heapq.heappop(queue)
            if len(best) >= k and -neg_bound <= best[0]:
                self.stats.skipped_bound += 1 + len(queue)
                break
            if not exact:
                if not self.may_fit(*cfg):
                    self.stats.skipped_memory += 1
                else:
                    pp, m, nm, _ = cfg
                    bound = self.throughput_bound(m * nm, pp, m, nm)
                    if bound > 0:  # 0: some layer has no strategy at all, so no plan
                        heapq.heappush(queue, (-bound, order, True, cfg))
                    else:
                        self.stats.skipped_memory += 1
                continue
            if len(best) >= k and not self.may_beat(best[0], cfg[1] * cfg[2], *cfg[:3]):
                self.stats.skipped_bound += 1
                continue
            plan = self.plan(*cfg, floor=best[0] if len(best) >= k else 0.0)
            if plan is not None:
                found.append(plan)
                bisect.insort(best, plan.throughput)
                del best[:-k]
        return top_plans(found, self.options.top_k)


def _plan_key(p: PricedPlan) -> tuple:
    return (p.stage_bounds, p.strategies, p.micro_batch_size, p.num_micro_batches, p.schedule.value)


def top_plans(plans: list[PricedPlan], k: int) -> list[PricedPlan]:
    """Distinct plans by throughput, best first (ties: shorter iteration, then discovery order)."""
    order = sorted(range(len(plans)), key=lambda i: (-plans[i].throughput, plans[i].iteration_s, i))
    out, seen = [], set()
    for i in order:
        key = _plan_key(plans[i])
        if key not in seen:
            seen.add(key)
            out.append(plans[i])
        if len(out) >= max(1, k):
            break
    return out


def search(
    ctx: CostContext, num_devices: int, options: SearchOptions, *, exhaustive_limit: int = part.EXHAUSTIVE_LIMIT
) -> list[PricedPlan]:
    """Galvatron-BMW search (module docstring): PricedPlans best first, [] when nothing fits."""
    return Planner(ctx, num_devices, options, exhaustive_limit).run()


__all__ = ["ENGINE", "NAME", "Planner", "SearchStats", "batch_sizes", "micro_batch_counts", "search", "top_plans"]
