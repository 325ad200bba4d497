"""StageStats -> IterationMetric (services/planner/jobs/metrics.py): every measured part carried over, and the
plan's predictions for the row's own stage beside them, with the documented fallbacks."""

from __future__ import annotations

import pytest

from ballast.v1 import executor_pb2, plan_pb2
from services.executor.workers import stage_stats
from services.planner.jobs.metrics import MAX_WINDOW, iteration_metric, window_iterations

MEASURED = {"iteration_time_s": 1.0, "forward_s": 0.25, "backward_s": 0.375, "recompute_s": 0.125, "p2p_s": 0.25,
            "allreduce_s": 0.0625, "optimizer_s": 0.03125, "overhead_s": 0.03125, "comm_s": 0.3125,
            "idle_s": 0.03125, "peak_memory_bytes": 7 << 20, "throughput_samples_per_s": 8.0}


def stats(stage: int = 1, **changes) -> executor_pb2.StageStats:
    return executor_pb2.StageStats(job_id="job-1", stage_index=stage, replica_index=1, iteration=4, plan_version=2,
                                   **{**MEASURED, **changes})


def plan(memory: tuple[int, int] = (3 << 20, 6 << 20)) -> plan_pb2.Plan:
    stages = [plan_pb2.Stage(index=s, predicted_time_s=0.1 * (s + 1), predicted_peak_memory_bytes=m)
              for s, m in enumerate(memory)]
    return plan_pb2.Plan(version=2, num_micro_batches=4, stages=stages,
                         prediction=plan_pb2.Prediction(iteration_time_s=0.9, peak_memory_bytes=8 << 20))


def test_every_measured_part_and_the_stage_predictions_are_carried():
    row = iteration_metric(stats(), plan())
    assert (row.job_id, row.iteration, row.stage_index, row.replica_index, row.plan_version) == ("job-1", 4, 1, 1, 2)
    for name, value in MEASURED.items():
        assert getattr(row, name) == value, name
    assert row.predicted_iteration_time_s == 0.9
    assert row.predicted_peak_memory_bytes == 6 << 20  # stage 1's, not the plan-wide peak
    assert row.predicted_stage_compute_s == pytest.approx(0.2 * 4)  # per micro-batch x micro-batches
    assert not row.has_loss and row.loss == 0.0
    assert iteration_metric(stats(loss=2.5, has_loss=True), plan()).loss == 2.5


def test_a_row_is_stamped_when_the_worker_ended_its_iteration():
    """The worker's report time, not the store's write (stats wait up to a batch, rows in the planner's
    buffer): a job's time per iteration by the clock holds what happens between iterations (checkpoints)."""
    event = {"event": "iteration", "iteration": 5, "iteration_s": 0.5, "time": 1_790_000_000.25}
    st = stage_stats(event, "job-1")
    assert st.ended_at.ToNanoseconds() == 1_790_000_000_250_000_000
    assert iteration_metric(st, plan()).recorded_at == st.ended_at
    for odd in (None, True, "soon", -1.0, float("nan"), float("inf"), 1e300):  # unset: the store stamps it
        st = stage_stats({**event, "time": odd}, "job-1")
        assert not st.HasField("ended_at") and not iteration_metric(st, plan()).HasField("recorded_at"), odd


def test_fallbacks_without_a_stage_prediction():
    unpriced = iteration_metric(stats(), plan(memory=(3 << 20, 0)))
    assert unpriced.predicted_peak_memory_bytes == 8 << 20  # the plan-wide peak bounds every stage
    beyond = iteration_metric(stats(stage=5), plan())
    assert (beyond.predicted_peak_memory_bytes, beyond.predicted_stage_compute_s) == (8 << 20, 0.0)
    unknown = iteration_metric(stats(), None)
    assert (unknown.predicted_iteration_time_s, unknown.predicted_peak_memory_bytes,
            unknown.predicted_stage_compute_s) == (0.0, 0, 0.0)
    assert unknown.p2p_s == MEASURED["p2p_s"]


class FlakyStore:
    """A sink that refuses with the given errors first, then stores rows by their key (as the store does)."""

    def __init__(self, *errors: Exception):
        self.errors = list(errors)
        self.rows: dict[tuple[int, int], object] = {}
        self.calls = 0

    def __call__(self, rows) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        for r in rows:
            self.rows.setdefault((r.iteration, r.replica_index), r)


def rows(*iterations: int) -> list:
    from ballast.v1 import job_pb2

    return [job_pb2.IterationMetric(job_id="job-1", iteration=i) for i in iterations]


def test_rows_a_passing_failure_refused_are_sent_again_with_the_next_ones_oldest_first():
    from services.planner.jobs.metrics import RetainedRows
    from services.runtime.errors import Unavailable

    store = FlakyStore(Unavailable("store restarting"), Unavailable("still away"))
    sink_order: list[int] = []
    writer = RetainedRows(lambda batch: (sink_order.extend(r.iteration for r in batch), store(batch)),
                          (Unavailable,))
    assert writer.write(rows(0, 1)) is False and writer.retained == 2
    assert writer.write(rows(2)) is False and writer.retained == 3
    assert writer.flush() is True and writer.retained == 0
    assert sorted(i for i, _ in store.rows) == [0, 1, 2]
    assert sink_order[-3:] == [0, 1, 2]  # the last, successful batch: oldest first
    assert writer.flush() is True and store.calls == 3  # nothing retained: no call


def test_a_bounded_writer_drops_the_oldest_and_counts_them():
    from services.planner.jobs.metrics import RetainedRows
    from services.runtime.errors import Unavailable
    from services.runtime.metrics import DROPPED

    before = DROPPED.labels("iteration_metrics")._value.get()
    store = FlakyStore(Unavailable("away"), Unavailable("away"))
    writer = RetainedRows(store, (Unavailable,), limit=3)
    writer.write(rows(0, 1))
    writer.write(rows(2, 3))
    assert writer.retained == 3
    assert DROPPED.labels("iteration_metrics")._value.get() - before == 1
    writer.flush()
    assert sorted(i for i, _ in store.rows) == [1, 2, 3]  # iteration 0, the oldest, was the one dropped


def test_a_refusal_that_is_not_passing_drops_its_batch_and_is_raised():
    from services.planner.jobs.metrics import RetainedRows
    from services.runtime.errors import NotFound, Unavailable

    writer = RetainedRows(FlakyStore(Unavailable("away"), NotFound("job gone")), (Unavailable,))
    writer.write(rows(0))
    with pytest.raises(NotFound):
        writer.write(rows(1))
    assert writer.retained == 0


def test_a_backlog_goes_in_parts_and_a_part_refused_for_good_costs_only_itself(monkeypatch):
    from services.planner.jobs import metrics
    from services.runtime.errors import NotFound, Unavailable

    monkeypatch.setattr(metrics, "SEND_ROWS", 2)
    store = FlakyStore(Unavailable("away"), Unavailable("away"))
    sizes: list[int] = []
    writer = metrics.RetainedRows(lambda part: (sizes.append(len(part)), store(part)), (Unavailable,))
    writer.write(rows(0, 1, 2))
    writer.write(rows(3, 4))
    assert writer.flush() is True and sizes[-3:] == [2, 2, 1]
    assert sorted(i for i, _ in store.rows) == [0, 1, 2, 3, 4]

    store.errors = [Unavailable("away"), NotFound("job gone")]
    writer.write(rows(5, 6, 7))
    with pytest.raises(NotFound):
        writer.flush()  # the first part (5, 6) is refused for good
    assert writer.retained == 1 and writer.flush() is True and 7 in {i for i, _ in store.rows}


@pytest.mark.parametrize(("window_s", "predicted_s", "raw", "checkpoint_every", "size"), [
    (10.0, 0.5, False, 0, 20),  # about ten seconds of predicted iterations
    (10.0, 0.5, True, 0, 1),  # the job asked for a row per iteration
    (0.0, 0.5, False, 0, 1),  # the operator turned windows off
    (10.0, 0.0, False, 0, 1),  # no prediction to size a window by
    (10.0, 30.0, False, 0, 1),  # iterations longer than the window
    (10.0, 1e-9, False, 0, MAX_WINDOW),
    (10.0, 0.5, False, 50, 20),  # windows restart at each checkpoint: the cadence need not be a multiple
    (10.0, 0.5, False, 7, 7),  # a cadence shorter than the window: one window per checkpoint interval
    (10.0, 0.5, False, 23, 20),  # a prime cadence above the window: 20, then 3 (a row per iteration before)
])
def test_a_window_is_about_its_seconds_of_predicted_iterations_and_no_longer_than_the_checkpoint_cadence(
        window_s: float, predicted_s: float, raw: bool, checkpoint_every: int, size: int):
    assert window_iterations(window_s, predicted_s, raw, checkpoint_every) == size


def test_a_window_becomes_a_row_of_the_window_and_a_single_iteration_a_row_of_one():
    window = executor_pb2.StageStats(job_id="j", iteration=19, first_iteration=10, iterations=10, plan_version=1,
                                     iteration_time_s=1.2, iteration_time_p50_s=1.1, iteration_time_p95_s=1.9,
                                     iteration_time_max_s=2.5)
    row = iteration_metric(window, None)
    assert (row.first_iteration, row.iteration, row.iterations) == (10, 19, 10)
    assert (row.iteration_time_p50_s, row.iteration_time_p95_s, row.iteration_time_max_s) == (1.1, 1.9, 2.5)
    old = iteration_metric(executor_pb2.StageStats(job_id="j", iteration=4, iteration_time_s=0.7), None)  # older agent
    assert (old.first_iteration, old.iteration, old.iterations, old.iteration_time_p95_s) == (4, 4, 1, 0.7)


def test_rows_added_from_many_heartbeats_reach_the_store_in_one_call_at_the_flush():
    from services.planner.jobs.metrics import RetainedRows
    from services.runtime.errors import Unavailable
    from services.runtime.metrics import DROPPED

    store = FlakyStore()
    writer = RetainedRows(store, (Unavailable,), limit=4)
    for i in range(3):
        writer.add(rows(i))
    assert store.calls == 0 and writer.retained == 3
    assert writer.flush() is True and store.calls == 1 and sorted(i for i, _ in store.rows) == [0, 1, 2]
    before = DROPPED.labels("iteration_metrics")._value.get()
    writer.add(rows(3, 4, 5, 6, 7))  # past the bound: the oldest go, counted
    assert writer.retained == 4 and DROPPED.labels("iteration_metrics")._value.get() - before == 1
    writer.flush()
    assert sorted(i for i, _ in store.rows) == [0, 1, 2, 4, 5, 6, 7]


def test_a_row_the_store_refuses_for_good_costs_only_itself_when_every_jobs_rows_go_together():
    """One bad row (a diverged job's NaN loss, say) among every job's rows: the part is halved until it is alone,
    it is dropped and counted, the others are stored, and the tick that flushed goes on."""
    from services.planner.jobs.metrics import RetainedRows
    from services.runtime.errors import InvalidArgument, Unavailable
    from services.runtime.metrics import DROPPED

    stored: list[int] = []

    def sink(batch) -> None:
        if any(r.iteration == 5 for r in batch):
            raise InvalidArgument("metrics[0].loss: not a finite number", field="metrics[0].loss")
        stored.extend(r.iteration for r in batch)

    before = DROPPED.labels("iteration_metrics")._value.get()
    writer = RetainedRows(sink, (Unavailable,), isolate=True)
    writer.add(rows(*range(10)))
    assert writer.flush() is True and writer.retained == 0
    assert sorted(stored) == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert DROPPED.labels("iteration_metrics")._value.get() - before == 1


def test_a_flush_waits_for_a_write_in_flight_on_another_thread():
    """Rows taken by one thread's write are not yet stored; a flush on another thread returns only after that
    write has answered, so what it vouches for (a job ended, a morph recorded) follows the rows."""
    import threading

    from services.planner.jobs.metrics import RetainedRows
    from services.runtime.errors import Unavailable

    entered, release, stored = threading.Event(), threading.Event(), []

    def sink(batch) -> None:
        entered.set()
        release.wait(10)
        stored.extend(r.iteration for r in batch)

    writer = RetainedRows(sink, (Unavailable,))
    first = threading.Thread(target=writer.write, args=(rows(0, 1),))
    first.start()
    assert entered.wait(10)
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (writer.flush(), second_done.set()))
    second.start()
    assert not second_done.wait(0.2)  # held while the first write is in flight
    release.set()
    first.join(10)
    second.join(10)
    assert second_done.is_set() and stored == [0, 1]
