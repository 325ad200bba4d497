"""Hold (issue 41, item 10) on every training path: told to hold mid-run, every rank waits at the same iteration
boundary and, released, trains on to the same losses as a run never held -- nothing lost, nothing trained twice.
PP (two stages), DP with ZeRO-1, chunk offload (PatrickStar) and Harmony, each on real gloo process groups."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.executor.train.config import WorkerConfig
from services.executor.train.hold import Hold
from services.executor.train.launch import plan_configs, run_local
from services.runtime.allocator import STEADY_ALLOCATOR
from tests.executor.train import test_chunks_worker as chunks
from tests.executor.train import test_harmony_worker as harmony
from tests.executor.train.test_resume import template

pytestmark = pytest.mark.slow
# The hold is asked once rank 0 reports iteration 2, and reaches the ranks a few milliseconds later over stdin:
# a run of 6 iterations could (and under load did) finish first; the rest of 24 cannot.
ITERATIONS = 24


def stage_pp(tmp_path) -> list[WorkerConfig]:
    return plan_configs(template(iterations=ITERATIONS), [[0, 3], [3, 6]], 1)


def stage_dp_zero(tmp_path) -> list[WorkerConfig]:
    return plan_configs(template(iterations=ITERATIONS, zero1_layers=[1, 2]), [[0, 6]], 2)


def chunk_offload(tmp_path) -> list[WorkerConfig]:
    return plan_configs(replace(chunks.TEMPLATE, iterations=ITERATIONS), [[0, chunks.LAYERS]], 2)


def harmony_two_devices(tmp_path) -> list[WorkerConfig]:
    choice = harmony.search(harmony.layers(), harmony.GLOBAL_BATCH_SIZE, harmony.Machine(2, harmony.BUDGET, 5e9, 5e9))
    config = harmony.template(harmony.settings(choice.schedule, tmp_path / "store", choice.prefetch))
    return plan_configs(replace(config, iterations=ITERATIONS), [[0, harmony.LAYERS]], 2)


@pytest.mark.parametrize("configs", [stage_pp, stage_dp_zero, chunk_offload, harmony_two_devices],
                         ids=["pp2", "dp2-zero1", "chunks-dp2", "harmony"])
def test_a_held_job_waits_at_one_boundary_and_trains_on_unchanged(tmp_path, configs):
    plain = run_local(configs(tmp_path), env=STEADY_ALLOCATOR, timeout_s=180)
    held = run_local(configs(tmp_path), env=STEADY_ALLOCATOR, timeout_s=180, hold=(2, 1.5))
    boundaries = set()
    for rank_events in held:
        kinds = [e["event"] for e in rank_events]
        assert kinds.count("held") == 1 and kinds.count("released") == 1, kinds
        wait, release = kinds.index("held"), kinds.index("released")
        assert release == wait + 1 and kinds.count("iteration") == ITERATIONS and kinds[-1] == "done", kinds
        at = rank_events[wait]["iteration"]
        assert rank_events[release]["iteration"] == at and rank_events[release]["outcome"] == "release"
        assert rank_events[release]["held_s"] > 0 and rank_events[wait]["reason"] == "run_local"
        # it held after iteration `at` and the next one it ran was at + 1
        assert [e["iteration"] for e in rank_events[:wait] if e["event"] == "iteration"][-1] == at
        assert [e["iteration"] for e in rank_events[release:] if e["event"] == "iteration"][0] == at + 1
        boundaries.add(at)
    assert len(boundaries) == 1 and 2 <= boundaries.pop() < ITERATIONS  # every rank at the same one
    losses = [[e["loss"] for e in rank if e["event"] == "iteration" and e.get("has_loss", True)] for rank in held]
    expected = [[e["loss"] for e in rank if e["event"] == "iteration" and e.get("has_loss", True)] for rank in plain]
    assert losses == expected


def test_hold_commands_are_told_from_plan_commands():
    hold = Hold()
    assert not hold.take('{"command": "plan", "version": 2}') and not hold.take("not json") and not hold.asked()
    assert hold.take('{"command": "hold", "held": true, "reason": "disk"}') and hold.asked() and hold.reason == "disk"
    assert hold.take('{"command": "hold", "held": false}') and not hold.asked()
