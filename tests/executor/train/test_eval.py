"""Evaluation (issue 40): validation loss after every `eval_every` iterations and after the last, forward only,
under every layout the workers run. It never changes training (the losses are bit-identical with and without it)
and it is the loss the whole model computes in one process on the same validation batches from the exported
weights."""

from __future__ import annotations

import pytest

from services.executor.train import checkpoint as ckpt
from services.executor.train import weights
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import validation_loss
from services.runtime.allocator import STEADY_ALLOCATOR
from services.specs.user_inputs import NO_USER_INPUTS
from tests.executor.train.test_hybrid import DATA, MICRO, NUM_MICRO, SEED, SPEC, template
from tests.harness import losses, of, torch_threads

STEPS, EVERY, BATCHES = 4, 2, 2

LAYOUTS = {
    "pp2xdp2": ([[0, 2], [2, 4]], 2, {}),
    "pp2-recompute-swap": ([[0, 2], [2, 4]], 1, {"checkpoint_layers": [1], "swap_layers": [2]}),
    "zero2": ([[0, 4]], 2, {"zero2_layers": [1, 2]}),
    "tp2": ([[0, 4]], 2, {"tp_layers": [[1, 2], [2, 2]]}),
    "sdp": ([[0, 4]], 2, {"sdp_layers": [1, 2]}),
}


def run(tmp_path, bounds, replicas, **changes) -> list[list[dict]]:
    config = template(bounds, iterations=STEPS, checkpoint_dir=str(tmp_path / "ckpt"), final_checkpoint=True,
                      **changes)
    return run_local(plan_configs(config, bounds, replicas), env=STEADY_ALLOCATOR, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_evaluation_reports_the_whole_models_validation_loss_and_leaves_training_alone(tmp_path, layout):
    bounds, replicas, changes = LAYOUTS[layout]
    evaluated = run(tmp_path, bounds, replicas, eval_every=EVERY, eval_batches=BATCHES, **changes)
    plain = run(tmp_path / "plain", bounds, replicas, **changes)
    assert losses(evaluated) == losses(plain)  # bit for bit: evaluation changes nothing in training
    reports = [e for rank in evaluated for e in of(rank, "evaluation")]
    assert [e["iteration"] for e in reports] == [2, 4]  # after every EVERY iterations, and the last
    assert all(e["stage"] == len(bounds) - 1 and e["replica"] == 0 for e in reports)  # reported once
    last = reports[-1]
    global_batch_size = MICRO * NUM_MICRO * replicas
    assert last["samples"] == BATCHES * global_batch_size and last["eval_s"] > 0
    state, _ = weights.checkpoint_weights(ckpt.checkpoint_path(tmp_path / "ckpt", STEPS), SPEC, NO_USER_INPUTS)
    with torch_threads(1):
        expected = validation_loss(SPEC, DATA, SEED, global_batch_size, BATCHES, state)
    assert last["loss"] == pytest.approx(expected, rel=1e-5)
    assert last["perplexity"] == pytest.approx(2.718281828 ** last["loss"], rel=1e-9)
