"""TrainingMonitor: windows, plan versions, replica averaging, warm-up, imbalance and workload changes."""

from __future__ import annotations

import pytest

from ballast.v1 import executor_pb2
from services.planner.online import MonitorOptions, TrainingMonitor

LAYERS = ((0, 1, 2), (3, 4, 5))


def stats(iteration: int, stage: int, *, replica: int = 0, version: int = 1, compute: float = 1.0,
          time: float = 2.0, peak: int = 100, active: tuple[int, ...] | None = None,
          job: str = "job") -> executor_pb2.StageStats:
    layers = LAYERS[stage]
    return executor_pb2.StageStats(
        job_id=job, stage_index=stage, replica_index=replica, iteration=iteration, plan_version=version,
        forward_s=compute / 3, backward_s=2 * compute / 3, recompute_s=0.0, comm_s=0.1, idle_s=time - compute,
        iteration_time_s=time, peak_memory_bytes=peak, layers=list(layers),
        active_layers=list(layers if active is None else active))


def feed(mon: TrainingMonitor, iterations, computes=(1.0, 1.0), **kw) -> None:
    for it in iterations:
        for s, c in enumerate(computes):
            mon.observe(stats(it, s, compute=c, **kw))


def test_window_median_is_robust_to_one_slow_iteration() -> None:
    mon = TrainingMonitor(MonitorOptions(window=5, warmup=0))
    feed(mon, range(4), computes=(1.0, 2.0))
    mon.observe(stats(4, 0, compute=9.0, time=20.0))  # one straggling iteration
    mon.observe(stats(4, 1, compute=2.0, time=20.0))
    obs = mon.observation("job")
    assert obs.samples == 5 and obs.iterations == (0, 1, 2, 3, 4)
    assert obs.stages[0].compute_s == pytest.approx(1.0)
    assert obs.iteration_time_s == pytest.approx(2.0)
    assert obs.stage_layers == LAYERS


def test_window_keeps_only_the_newest_iterations() -> None:
    mon = TrainingMonitor(MonitorOptions(window=3, warmup=0, change_threshold=10.0))
    feed(mon, range(3), computes=(1.0, 1.0))
    feed(mon, range(3, 6), computes=(3.0, 1.0))
    obs = mon.observation("job")
    assert obs.iterations == (3, 4, 5)
    assert obs.stages[0].compute_s == pytest.approx(3.0)


def test_incomplete_iterations_do_not_count() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=0))
    mon.expect("job", 1, num_stages=2)
    feed(mon, range(2))
    mon.observe(stats(2, 0))  # stage 1 has not reported iteration 2
    assert mon.observation("job").iterations == (0, 1)
    assert mon.complete_iterations("job") == 2


def test_inferred_shape_waits_for_every_stage() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=0))
    mon.observe(stats(0, 0))
    mon.observe(stats(1, 0))
    mon.observe(stats(1, 1))  # now two stages are known: iteration 0 lacks stage 1
    assert mon.observation("job").iterations == (1,)


def test_replicas_are_averaged_and_the_worst_peak_kept() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=0))
    mon.expect("job", 1, num_stages=2, replicas=2)
    for it in range(3):
        mon.observe(stats(it, 0, replica=0, compute=1.0, peak=100))
        mon.observe(stats(it, 0, replica=1, compute=3.0, peak=300, time=4.0))
        mon.observe(stats(it, 1, replica=0, compute=1.0))
        if it < 2:
            mon.observe(stats(it, 1, replica=1, compute=1.0))
    obs = mon.observation("job")
    assert obs.iterations == (0, 1)  # iteration 2 misses stage 1 replica 1
    assert obs.stages[0].replicas == 2
    assert obs.stages[0].compute_s == pytest.approx(2.0)
    assert obs.stages[0].peak_memory_bytes == 300
    assert obs.iteration_time_s == pytest.approx(4.0)  # the slowest worker ends the iteration


def test_older_plan_versions_are_ignored_and_a_new_version_resets() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=0))
    feed(mon, range(3), computes=(1.0, 1.0))
    feed(mon, range(3, 5), computes=(5.0, 1.0), version=2)
    assert mon.current_version("job") == 2
    assert not mon.observe(stats(5, 0, version=1, compute=100.0))
    assert mon.ignored == 1
    obs = mon.observation("job")
    assert obs.plan_version == 2 and obs.iterations == (3, 4)
    assert obs.stages[0].compute_s == pytest.approx(5.0)
    assert mon.observation("job", plan_version=1) is None


def test_expect_drops_stale_stats_before_the_new_plan_reports() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=0))
    feed(mon, range(2))
    mon.expect("job", 2, num_stages=2)
    assert not mon.observe(stats(2, 0, version=1))
    assert mon.observation("job") is None


def test_warmup_skips_the_first_iterations_of_each_version() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=2, window=10))
    feed(mon, range(10, 15), computes=(1.0, 1.0), version=3)
    assert mon.observation("job").iterations == (12, 13, 14)
    feed(mon, range(15, 17), computes=(1.0, 1.0), version=4)
    assert mon.observation("job") is None  # both iterations of version 4 are warm-up
    feed(mon, [17], computes=(1.0, 1.0), version=4)
    assert mon.observation("job").iterations == (17,)


def test_imbalance_and_bottleneck() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=0))
    feed(mon, range(3), computes=(1.0, 3.0))
    obs = mon.observation("job")
    assert obs.bottleneck_stage == 1
    assert obs.imbalance == pytest.approx(3.0 / 2.0 - 1)  # max / mean - 1
    mon2 = TrainingMonitor(MonitorOptions(warmup=0))
    feed(mon2, range(3), computes=(2.0, 2.0))
    assert mon2.observation("job").imbalance == pytest.approx(0.0)


def test_workload_change_when_a_layer_is_activated() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=0, window=4, recent=2, change_threshold=0.25))
    for it in range(4):
        mon.observe(stats(it, 0, compute=1.0, active=(0, 1)))
        mon.observe(stats(it, 1, compute=1.0))
    assert not mon.observation("job").workload_change
    for it in range(4, 6):
        mon.observe(stats(it, 0, compute=1.5, active=(0, 1, 2)))
        mon.observe(stats(it, 1, compute=1.02))  # noise under the threshold
    obs = mon.observation("job")
    assert [c.stage_index for c in obs.workload_changes] == [0]
    change = obs.workload_changes[0]
    assert change.before_s == pytest.approx(1.0) and change.after_s == pytest.approx(1.5)
    assert change.active_before == (0, 1) and change.active_after == (0, 1, 2)
    # After a change the observation shows the new workload only.
    assert obs.iterations == (4, 5)
    assert obs.stages[0].compute_s == pytest.approx(1.5)
    assert obs.stages[0].active_layers == (0, 1, 2) and obs.stages[0].inactive_layers == ()
    assert mon.ready("job")


def test_active_layer_change_without_a_time_jump_is_a_change() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=0, window=3, recent=1))
    feed(mon, range(3))
    mon.observe(stats(3, 0, active=(0, 1)))
    mon.observe(stats(3, 1))
    obs = mon.observation("job")
    assert obs.workload_change and obs.inactive_layers == (2,)


def test_empty_active_layers_means_none_computed_unless_configured() -> None:
    mon = TrainingMonitor(MonitorOptions(warmup=0))
    feed(mon, range(2), active=())
    assert mon.observation("job").inactive_layers == (0, 1, 2, 3, 4, 5)
    lenient = TrainingMonitor(MonitorOptions(warmup=0, empty_active_means_all=True))
    feed(lenient, range(2), active=())
    assert lenient.observation("job").inactive_layers == ()


def test_history_is_bounded_and_jobs_are_separate() -> None:
    opt = MonitorOptions(warmup=0, window=3, recent=1, slack=2)
    mon = TrainingMonitor(opt)
    feed(mon, range(100))
    feed(mon, range(2), job="other")
    assert mon.complete_iterations("job") == opt.window + opt.recent + opt.slack
    assert mon.observation("other").iterations == (0, 1)
    mon.forget("job")
    assert mon.observation("job") is None


def test_options_are_validated() -> None:
    with pytest.raises(ValueError):
        MonitorOptions(window=0)
    with pytest.raises(ValueError):
        TrainingMonitor().expect("job", 1, num_stages=0)


def test_jitter_of_a_nearly_idle_stage_is_not_a_workload_change() -> None:
    # The embedding stage doing 2% of the work drops from 17 to 11 ms: -35% for it, noise for the pipeline.
    mon = TrainingMonitor(MonitorOptions(warmup=0, window=4, recent=2, change_threshold=0.25, change_floor=0.05))
    feed(mon, range(4), computes=(0.017, 0.8))
    feed(mon, range(4, 6), computes=(0.011, 0.8))
    assert not mon.observation("job").workload_change
    strict = TrainingMonitor(MonitorOptions(warmup=0, window=4, recent=2, change_threshold=0.25, change_floor=0.0))
    feed(strict, range(4), computes=(0.017, 0.8))
    feed(strict, range(4, 6), computes=(0.011, 0.8))
    assert [c.stage_index for c in strict.observation("job").workload_changes] == [0]


def test_noise_is_the_half_range_of_a_stage_without_one_straggler() -> None:
    mon = TrainingMonitor(MonitorOptions(window=5, warmup=0))
    for it, c in enumerate((1.0, 1.2, 0.8, 1.0, 9.0)):  # stage 1 jitters by +-20%, plus one straggler
        mon.observe(stats(it, 0, compute=1.0))
        mon.observe(stats(it, 1, compute=c, time=max(2.0, c)))
    obs = mon.observation("job")
    # Without the lowest (0.8) and highest (9.0): (1.2 - 1.0) / 2 over the median 1.0.
    assert obs.noise == pytest.approx(0.1)
    steady = TrainingMonitor(MonitorOptions(window=5, warmup=0))
    feed(steady, range(5))
    assert steady.observation("job").noise == 0.0


def test_windows_from_the_agents_line_up_across_stages_and_give_the_same_imbalance() -> None:
    """The agents summarise each worker's iterations over the same blocks of iteration numbers
    (services/executor/telemetry.py): every stage's window ends at the same iteration, so a window is complete
    once every stage sent it, and the imbalance is the per-iteration one."""
    from services.executor.telemetry import StatsWindow

    mon = TrainingMonitor(MonitorOptions(warmup=0, window=3))
    agents = [StatsWindow(10), StatsWindow(10)]
    for it in range(60):
        for s, compute in enumerate((1.0, 3.0)):
            for window in agents[s].add(stats(it, s, compute=compute * (1 + 0.01 * (it % 3)))):
                mon.observe(window)
    obs = mon.observation("job")
    assert obs.iterations == (39, 49, 59) and obs.complete_iterations == 3 + 6  # three alone, six windows
    assert obs.bottleneck_stage == 1 and obs.imbalance == pytest.approx(3.0 / 2.0 - 1, rel=1e-3)
