"""A worker's per-iteration StageStats as the stored IterationMetric row, with the plan's predictions for the
same stage beside the measurements, so the estimator's error is a query and can be attributed to a part
(compute, p2p, allreduce, optimizer, the rest) and to memory; and the writer that keeps rows the store could
not take yet. No store, no grpc: the writer is handed its sink."""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable

from ballast.v1 import executor_pb2, job_pb2, plan_pb2
from ballast.windows import first_iteration, time_quantiles, weight
from services.runtime.errors import BallastError
from services.runtime.metrics import DROPPED, ITERATION_SECONDS, JOB_ITERATION_SECONDS

log = logging.getLogger("ballast.metrics")
MAX_RETAINED = 200_000  # rows kept for a store that is away (a few minutes of a large job's reports)
SEND_ROWS = 2_000  # rows per store call when a backlog is sent (about 0.3 MB)
MAX_WINDOW = 100_000  # iterations; a longer window is a prediction gone wrong, not a summary


def window_iterations(window_s: float, predicted_iteration_s: float, raw: bool, checkpoint_every: int = 0) -> int:
    """Iterations each worker's stats are summarised over (AssignInstruction.metrics_window): about `window_s`
    of the plan's predicted iterations; 1 (a row per iteration) when the job asked for raw rows, the operator
    turned windows off (0), or the plan predicts no time. No longer than the checkpoint cadence: the agents'
    windows restart at each checkpoint (executor/telemetry.py), as a morph deletes the rows from its checkpoint on,
    so a longer one would only be cut there."""
    if raw or window_s <= 0 or predicted_iteration_s <= 0:
        return 1
    size = max(1, min(MAX_WINDOW, math.floor(window_s / predicted_iteration_s)))
    return min(size, checkpoint_every) if checkpoint_every > 0 else size


def plan_stage(plan: plan_pb2.Plan | None, stage_index: int) -> plan_pb2.Stage | None:
    """The plan's stage at `stage_index` (by its index field), if the plan has one."""
    if plan is None:
        return None
    return next((s for s in plan.stages if s.index == stage_index), None)


def predicted_memory(plan: plan_pb2.Plan | None, stage: plan_pb2.Stage | None) -> int:
    """The stage's predicted peak bytes per device; a plan without it gives its plan-wide peak (the largest
    stage's, an upper bound for this one); no plan gives 0."""
    if stage is not None and stage.predicted_peak_memory_bytes:
        return stage.predicted_peak_memory_bytes
    return plan.prediction.peak_memory_bytes if plan is not None else 0


def predicted_compute(plan: plan_pb2.Plan | None, stage: plan_pb2.Stage | None) -> float:
    """The stage's predicted forward + backward (with recompute) for one iteration: the plan prices one
    micro-batch (Stage.predicted_time_s) and each replica runs num_micro_batches of them. 0 when unknown."""
    if plan is None or stage is None:
        return 0.0
    return stage.predicted_time_s * plan.num_micro_batches


def iteration_metric(st: executor_pb2.StageStats, plan: plan_pb2.Plan | None) -> job_pb2.IterationMetric:
    """The row for one stage replica's iteration; `plan` is the plan version it ran under (None: unknown, the
    predictions are 0)."""
    stage = plan_stage(plan, st.stage_index)
    return job_pb2.IterationMetric(
        job_id=st.job_id, iteration=st.iteration, stage_index=st.stage_index, replica_index=st.replica_index,
        plan_version=st.plan_version, iteration_time_s=st.iteration_time_s, forward_s=st.forward_s,
        backward_s=st.backward_s, comm_s=st.comm_s, idle_s=st.idle_s, peak_memory_bytes=st.peak_memory_bytes,
        loss=st.loss if st.has_loss else 0.0, has_loss=st.has_loss,
        throughput_samples_per_s=st.throughput_samples_per_s,
        predicted_iteration_time_s=plan.prediction.iteration_time_s if plan is not None else 0.0,
        recompute_s=st.recompute_s, p2p_s=st.p2p_s, allreduce_s=st.allreduce_s, optimizer_s=st.optimizer_s,
        overhead_s=st.overhead_s, predicted_peak_memory_bytes=predicted_memory(plan, stage),
        predicted_stage_compute_s=predicted_compute(plan, stage),
        swap_in_bytes=st.swap_in_bytes, swap_out_bytes=st.swap_out_bytes, swap_s=st.swap_s, data_s=st.data_s,
        predicted_swap_in_bytes=predicted_swap(plan, st.replica_index)[0],
        predicted_swap_out_bytes=predicted_swap(plan, st.replica_index)[1],
        recorded_at=st.ended_at if st.HasField("ended_at") else None,
        first_iteration=first_iteration(st), iterations=weight(st),
        **dict(zip(("iteration_time_p50_s", "iteration_time_p95_s", "iteration_time_max_s"), time_quantiles(st),
                   strict=True)))


def predicted_swap(plan: plan_pb2.Plan | None, replica: int) -> tuple[int, int]:
    """(host -> device, device -> host) bytes the plan predicts for one worker's iteration: chunk offload's
    rank-0 steady state, or Harmony's for that device (replica = device); 0 without offload."""
    if plan is None:
        return 0, 0
    if plan.HasField("harmony"):
        h = plan.harmony
        ins, outs = h.predicted_to_device_by_device, h.predicted_to_host_by_device
        return (ins[replica] if replica < len(ins) else 0), (outs[replica] if replica < len(outs) else 0)
    return plan.offload.predicted_to_device_bytes, plan.offload.predicted_to_host_bytes


def observe_iteration(row: job_pb2.IterationMetric) -> None:
    """A stored row, for Prometheus: the iteration-time histogram, and the job's latest measured and predicted
    time (from stage 0, replica 0, which sees the whole iteration)."""
    ITERATION_SECONDS.observe(row.iteration_time_s)
    if row.stage_index == 0 and row.replica_index == 0:
        JOB_ITERATION_SECONDS.labels(row.job_id, "measured").set(row.iteration_time_s)
        if row.predicted_iteration_time_s > 0:
            JOB_ITERATION_SECONDS.labels(row.job_id, "predicted").set(row.predicted_iteration_time_s)


class RetainedRows:
    """Writes rows to the store, keeping the ones a passing failure (the store restarting, its database away,
    overloaded) refused, to send again, oldest first, with the next rows or at `flush()`.

    A worker reports each iteration (and each checkpoint) once, so a row the planner does not keep is lost
    for good. Sending a row twice is harmless: the store skips iteration rows it already holds (same job, plan
    version, iteration, stage and replica) and answers a repeated checkpoint with its row, so a batch whose
    answer was lost is not stored twice. Bounded: past `limit` the oldest rows are dropped and counted
    (ballast_dropped_total{what}). A backlog goes in parts of `part` rows; a refusal that is not passing (a job
    deleted meanwhile) drops its part, counted, keeps the rest and is raised. With `isolate` (rows of many jobs
    in one call) a refused part is halved until the rows the store refuses are alone: those are dropped, counted
    and logged, the others stored, and nothing is raised. One write at a time: a `flush()` that returns True has
    sent every row added before it."""

    def __init__(self, sink: Callable[[list], object], transient: tuple[type[BallastError], ...],
                 limit: int = MAX_RETAINED, *, what: str = "iteration_metrics", part: int = 0, isolate: bool = False):
        self._sink, self._transient, self._limit = sink, transient, limit
        self._what, self._part_size, self._isolate = what, part, isolate
        self._rows: deque = deque()
        self._lock = threading.Lock()  # the kept rows
        self._sending = threading.Lock()  # one write at a time, held while the store answers
        self.refusal: BallastError | None = None  # why the store refused the rows still kept, if it did

    @property
    def retained(self) -> int:
        with self._lock:
            return len(self._rows)

    def write(self, rows: list[job_pb2.IterationMetric]) -> bool:
        """Send the retained rows and `rows`; True when the store took them all (or, with `isolate`, all but the
        rows it refused for good)."""
        with self._sending:
            with self._lock:
                batch = [*self._rows, *rows]
                self._rows.clear()
            size = self._part_size or SEND_ROWS  # rows per store call (0: SEND_ROWS, read when sent)
            # a long outage's backlog goes in messages of bounded size
            parts = [batch[start:start + size] for start in range(0, len(batch), size)]
            while parts:
                part = parts.pop(0)
                try:
                    self._sink(part)
                except self._transient as exc:
                    self.refusal = exc
                    self._retain([row for p in (part, *parts) for row in p])
                    return False
                except BallastError as exc:
                    if self._isolate and len(part) > 1:  # find the rows refused: the rest are good
                        parts[:0] = [part[:len(part) // 2], part[len(part) // 2:]]
                        continue
                    DROPPED.labels(self._what).inc(len(part))
                    if not self._isolate:
                        self._retain([row for p in parts for row in p])
                        raise
                    log.error("a row the store refused was dropped", extra={"what": self._what, "why": str(exc)})
            self.refusal = None
            return True

    def flush(self) -> bool:
        return self.write([])

    def add(self, rows: list) -> None:
        """Keep `rows` for the next `flush()`: rows arriving from many hosts then reach the store in one call per
        flush (the scheduler's tick), not one per heartbeat. Bounded as the rows a refusal keeps."""
        with self._lock:
            self._rows.extend(rows)
            over = len(self._rows) - self._limit
            for _ in range(max(0, over)):
                self._rows.popleft()
        if over > 0:
            DROPPED.labels(self._what).inc(over)
            log.error("rows dropped: more arrived than the store took", extra={"what": self._what, "dropped": over})

    def _retain(self, batch: list[job_pb2.IterationMetric]) -> None:
        if not batch:  # a last part refused for good leaves nothing to keep (and nothing to warn about)
            return
        with self._lock:
            first = not self._rows
            self._rows.extendleft(reversed(batch))  # before anything retained meanwhile: oldest first
            over = len(self._rows) - self._limit
            for _ in range(max(0, over)):
                self._rows.popleft()
            kept = len(self._rows)
        if over > 0:
            DROPPED.labels(self._what).inc(over)
            log.error("rows dropped: the store has been away too long", extra={"what": self._what, "dropped": over})
        elif first:
            log.warning("the store did not take rows; keeping them to send again",
                        extra={"what": self._what, "retained": kept})
