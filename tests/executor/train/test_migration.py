"""Plan changes while training (vPipe §4): "plan" commands on the workers' stdin, agreed by every rank at an
iteration boundary, migrate layers live (parameters, buffers, Adam state) and switch recompute/swap; the losses
stay those of the single-process run. Also the state wire format and the command validation, without processes."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import model_pb2
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.migration import (
    Plan,
    PlanInbox,
    empty_state,
    first_tensors,
    install_state,
    plan_moves,
    state_header,
    state_tensors,
    wire_names,
)
from services.executor.train.reference import train_single
from services.executor.train.stage import make_optimizer, model_info
from services.runtime.allocator import STEADY_ALLOCATOR
from services.zoo import build_model
from tests.harness import losses, of, torch_threads

SPEC = ParseDict({"name": "gpt-migrate", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 6, "hidden_size": 64, "num_heads": 2, "vocab_size": 128, "seq_length": 32,
    "tie_embeddings": True}}, model_pb2.ModelSpec())  # embed, block.0-5, head (tied to the embedding): 8 layers
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
DATA = {}
SEED, STEPS, MICRO, NUM_MICRO, REPLICAS = 3, 20, 2, 2, 2


def plan(version: int, not_before: int, bounds: list[list[int]], checkpoint: list[int] | None = None,
         swap: list[int] | None = None) -> dict:
    return {"command": "plan", "version": version, "not_before": not_before, "stage_bounds": bounds,
            "checkpoint_layers": checkpoint or [], "swap_layers": swap or []}


def template(bounds: list[list[int]], schedule: str = "1f1b", **changes) -> WorkerConfig:
    return WorkerConfig(**{
        "job_id": "job-migrate", "model": MessageToDict(SPEC, preserving_proto_field_name=True),
        "stage_bounds": bounds, "num_replicas": 1, "stage_index": 0, "replica_index": 0, "rank": 0, "world_size": 1,
        "micro_batch_size": MICRO, "num_micro_batches": NUM_MICRO, "iterations": STEPS, "init_method": "",
        "schedule": schedule, "optimizer": ADAM, "seed": SEED, "data": DATA, "timeout_s": 60, **changes})


def run(bounds: list[list[int]], commands: list[dict] | None = None, schedule: str = "1f1b",
        replicas: int = REPLICAS, **changes) -> list[list[dict]]:
    configs = plan_configs(template(bounds, schedule, **changes), bounds, replicas)
    return run_local(configs, env=STEADY_ALLOCATOR, timeout_s=120,
                     commands={c.rank: commands for c in configs} if commands else None)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    with torch_threads(1):
        return train_single(SPEC, DATA, SEED, MICRO * NUM_MICRO * REPLICAS, STEPS, ADAM)


@pytest.fixture(scope="module")
def unchanged() -> list[list[dict]]:
    """The same 2 x 2 run without plan commands."""
    return run([[0, 3], [3, 8]])


def check_migrated(events: list[list[dict]], before: list[list[int]], after: list[list[int]], at: int,
                   moved: dict[int, tuple[int, int]]) -> None:
    for rank, rank_events in enumerate(events):
        stage, replica = divmod(rank, REPLICAS)
        kinds = [e["event"] for e in rank_events]
        assert "error" not in kinds and kinds[-1] == "done", kinds
        (applied,) = of(rank_events, "plan_applied")
        assert applied["plan_version"] == 1 and applied["iteration"] == at and applied["stage_bounds"] == after
        assert applied["layers"] == list(range(*after[stage])) and applied["apply_s"] >= 0
        iterations = of(rank_events, "iteration")
        assert len(iterations) == STEPS
        for it in iterations:  # the layers each iteration really ran with, and the version in force
            bounds, version = (before, 0) if it["iteration"] <= at else (after, 1)
            assert it["layers"] == it["active_layers"] == list(range(*bounds[stage]))
            assert it["plan_version"] == version
        received = of(rank_events, "migration")
        expected = sorted(i for i, (_, target) in moved.items() if target == stage)
        assert [m["layer_index"] for m in received] == expected
        for m in received:  # each replica receives its own copy from the same replica index of the source
            assert (m["from_stage"], m["to_stage"]) == moved[m["layer_index"]]
            assert m["bytes"] > 3 * 4 * 64 * 64 and m["iteration"] == at and m["plan_version"] == 1
            assert m["duration_s"] >= 0
    for stage in range(2):  # replicas stayed bit-identical through the move
        assert len({events[stage * REPLICAS + r][-1]["param_sha256"] for r in range(REPLICAS)}) == 1
    assert len({rank_events[-1]["tied_sha256"] for rank_events in events}) == 1
    sizes = {i: sum(p.numel() for p in layer.module.parameters())
             for i, layer in enumerate(build_model(SPEC, device="meta").decompose().layers)}
    assert events[0][-1]["parameters"] == sum(sizes[i] for i in range(*after[0]))


@pytest.mark.slow  # several worker processes on the 2 cores: over 10 s even on a quiet machine
def test_moving_a_layer_backward_at_step_10_keeps_the_losses(reference, unchanged):
    # block.2 (layer 3) moves from stage 1 to stage 0; a non-contiguous plan is refused without a trace.
    bad = plan(2, 3, [[0, 4], [5, 8]])
    events = run([[0, 3], [3, 8]], [plan(1, 10, [[0, 4], [4, 8]]), bad])
    check_migrated(events, [[0, 3], [3, 8]], [[0, 4], [4, 8]], 10, {3: (1, 0)})
    for rank_events in events:
        (rejected,) = of(rank_events, "command_rejected")
        assert "stage_bounds" in rejected["message"] and "contiguous" in rejected["message"]
        assert rejected["version"] == 2  # the agent fails that instruction by its version
    assert losses(events) == pytest.approx(reference, rel=1e-5)
    assert losses(events) == pytest.approx(losses(unchanged), rel=1e-5)
    assert losses(unchanged) == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow  # several worker processes on the 2 cores: over 10 s even on a quiet machine
def test_moving_layers_forward_under_gpipe_keeps_the_losses(reference):
    # block.1 and block.2 (layers 2, 3) move from stage 0 to stage 1 at step 10; version 1 (also ready at 10) is
    # skipped in favour of version 2.
    commands = [plan(1, 5, [[0, 3], [3, 8]], checkpoint=[1]), plan(2, 10, [[0, 2], [2, 8]])]
    commands[0]["not_before"] = 10
    events = run([[0, 4], [4, 8]], commands, schedule="gpipe")
    for rank_events in events:
        (applied,) = of(rank_events, "plan_applied")
        assert applied["plan_version"] == 2 and applied["iteration"] == 10
        assert [it["plan_version"] for it in of(rank_events, "iteration")] == [0] * 10 + [2] * 10
    moved = of(events[REPLICAS], "migration")
    assert [(m["layer_index"], m["from_stage"], m["to_stage"]) for m in moved] == [(2, 0, 1), (3, 0, 1)]
    assert of(events[0], "migration") == []
    assert [e["layers"] for e in of(events[REPLICAS], "iteration")][-1] == list(range(2, 8))
    assert losses(events) == pytest.approx(reference, rel=1e-5)
    assert len({events[REPLICAS + r][-1]["param_sha256"] for r in range(REPLICAS)}) == 1


def test_swap_and_recompute_switched_on_at_step_5_keep_the_losses(unchanged):
    # Stage 0 swaps blocks 0-1 and recomputes block 1 (checkpoint wins); stage 1 swaps block 3.
    events = run([[0, 3], [3, 8]], [plan(1, 5, [[0, 3], [3, 8]], checkpoint=[1], swap=[1, 2, 4])])
    for rank, rank_events in enumerate(events):
        (applied,) = of(rank_events, "plan_applied")
        assert (applied["iteration"], applied["checkpoint_layers"], applied["swap_layers"]) == (5, [1], [1, 2, 4])
        assert of(rank_events, "migration") == []
        swapped = [it["swapped_bytes"] for it in of(rank_events, "iteration")]
        assert swapped[:5] == [0] * 5 and all(b > 0 for b in swapped[5:]), swapped
        assert len(set(swapped[5:])) == 1  # the same tensors every iteration
        recompute = [it["recompute_s"] for it in of(rank_events, "iteration")]
        if rank < REPLICAS:  # stage 0 recomputes block 1 from step 5 on
            assert all(r == 0 for r in recompute[:5]) and all(r > 0 for r in recompute[5:])
    activation = MICRO * 32 * 64 * 4
    stage0 = of(events[0], "iteration")[-1]["swapped_bytes"]
    assert stage0 >= NUM_MICRO * activation  # at least block 2's input LayerNorm input per micro-batch
    assert losses(events) == pytest.approx(losses(unchanged), rel=1e-5)


# --- no processes ------------------------------------------------------------------------------------------


def test_layer_state_round_trips_through_the_wire_format():
    torch.manual_seed(0)
    source = build_model(SPEC, seed=1).decompose().layers[2].module
    optimizer = make_optimizer(list(source.parameters()), ADAM)
    source.ln1.weight.grad = None  # never had a gradient: no state
    for name, p in source.named_parameters():
        if name != "ln1.weight":
            p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.step()
    names = wire_names(source, set())
    header = state_header(source, names, optimizer, torch.device("cpu"))
    assert header.dtype == torch.int64 and header.shape == (len(names), 2)
    assert header[names.index("ln1.weight")].tolist() == [0, 0]
    assert header[names.index("attn.qkv.weight")].tolist() == [1, 2]
    sent = first_tensors(source, names) + state_tensors(source, names, header, optimizer, "adam")
    # The target: the same layer from the meta model, materialised, received into.
    meta = model_info(SPEC, 2).dec.layers[2].module
    target = copy.deepcopy(meta).to_empty(device="cpu")
    phase1 = first_tensors(target, wire_names(target, set()))
    state = empty_state(target, names, header, "adam")
    assert [(t.shape, t.dtype) for t in phase1 + state] == [(t.shape, t.dtype) for t in sent]
    for dst, src in zip(phase1 + state, sent, strict=True):
        dst.copy_(src)  # what irecv does
    target_opt = make_optimizer(list(target.parameters()), ADAM)
    install_state(target, names, header, state, target_opt, "adam")
    for (name, p), q in zip(source.named_parameters(), target.parameters(), strict=True):
        assert torch.equal(p, q)
        if name == "ln1.weight":
            assert q not in target_opt.state
        else:
            a, b = optimizer.state[p], target_opt.state[q]
            assert set(a) == set(b) and torch.equal(a["step"], b["step"]) and a["step"].dtype == b["step"].dtype
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    # One more identical step on both sides stays identical.
    for p, q in zip(source.parameters(), target.parameters(), strict=True):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
    optimizer.step()
    target_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(source.parameters(), target.parameters(), strict=True))


def inbox() -> PlanInbox:
    initial = Plan(0, 0, ((0, 3), (3, 8)), (), ())
    return PlanInbox(model_info(SPEC, MICRO), 2, initial)


@pytest.mark.parametrize(("command", "field"), [
    ("not json", "JSON"),
    ('{"command": "reboot"}', "'command'"),
    ('{"command": "plan", "version": 1, "not_before": 0, "stage_bounds": [[0, 3], [3, 8]], "checkpoint_layers": []}',
     "'swap_layers'"),
    ('{"command": "plan", "version": 0, "not_before": 0, "stage_bounds": [[0, 3], [3, 8]], "checkpoint_layers": [], '
     '"swap_layers": []}', "'version'"),
    ('{"command": "plan", "version": 1, "not_before": -1, "stage_bounds": [[0, 3], [3, 8]], "checkpoint_layers": [], '
     '"swap_layers": []}', "'not_before'"),
    ('{"command": "plan", "version": 1, "not_before": 0, "stage_bounds": [[0, 8]], "checkpoint_layers": [], '
     '"swap_layers": []}', "'stage_bounds'"),
    ('{"command": "plan", "version": 1, "not_before": 0, "stage_bounds": [[0, 3], [3, 3], [3, 8]], '
     '"checkpoint_layers": [], "swap_layers": []}', "'stage_bounds'"),
    ('{"command": "plan", "version": 1, "not_before": 0, "stage_bounds": [[0, 3], [3, 7]], "checkpoint_layers": [], '
     '"swap_layers": []}', "'stage_bounds'"),
    ('{"command": "plan", "version": 1, "not_before": 0, "stage_bounds": [[0, 3], [3, 8]], "checkpoint_layers": [9], '
     '"swap_layers": []}', "'checkpoint_layers'"),
    ('{"command": "plan", "version": 1, "not_before": 0, "stage_bounds": [[0, 3], [3, 8]], "checkpoint_layers": [], '
     '"swap_layers": [], "extra": 1}', "'extra'"),
])
def test_bad_commands_are_rejected_naming_the_field(command, field):
    box = inbox()
    assert box.submit(command) is None
    ((version, message),) = box.take_rejections()
    assert field in message
    assert version == (json.loads(command).get("version", 0) if command.startswith("{") else 0)
    assert box.ready(100, 0) == 0


def test_ready_version_and_moves():
    box = inbox()
    box.submit('{"command": "plan", "version": 2, "not_before": 5, "stage_bounds": [[0, 2], [2, 8]], '
               '"checkpoint_layers": [1], "swap_layers": [2, 2]}')
    box.submit('{"command": "plan", "version": 3, "not_before": 9, "stage_bounds": [[0, 5], [5, 8]], '
               '"checkpoint_layers": [], "swap_layers": []}')
    assert box.take_rejections() == []
    assert [box.ready(d, 0) for d in (4, 5, 8, 9)] == [0, 2, 2, 3]
    assert box.ready(9, 5) == 5
    assert box.get(2).swap_layers == (2,)
    assert plan_moves([[0, 3], [3, 8]], [[0, 5], [5, 8]], 8) == [(3, 1, 0), (4, 1, 0)]
    assert plan_moves([[0, 4], [4, 6], [6, 8]], [[0, 2], [2, 3], [3, 8]], 8) == [
        (2, 0, 1), (3, 0, 2), (4, 1, 2), (5, 1, 2)]


T5 = ParseDict({"name": "t", "family": "MODEL_FAMILY_T5", "transformer": {
    "hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_length": 16, "tie_embeddings": True, "num_layers": 2,
    "num_decoder_layers": 2, "decoder_seq_length": 8}}, model_pb2.ModelSpec())


def test_plans_that_change_the_stages_of_a_tied_weight_are_rejected():
    # enc.embed, enc.block.0-1 | enc.norm, dec.embed, dec.block.0 | dec.block.1, head: the decoder's relative
    # bias table is shared by both decoder blocks, on stages (1, 2).
    initial = Plan(0, 0, ((0, 3), (3, 6), (6, 8)), (), ())
    box = PlanInbox(model_info(T5, 2), 3, initial)
    box.submit('{"command": "plan", "version": 1, "not_before": 0, "stage_bounds": [[0, 3], [3, 7], [7, 8]], '
               '"checkpoint_layers": [], "swap_layers": []}')
    ((version, message),) = box.take_rejections()
    assert version == 1 and "tied" in message and "(1, 2)" in message and "(1,)" in message
    box.submit('{"command": "plan", "version": 2, "not_before": 0, "stage_bounds": [[0, 4], [4, 6], [6, 8]], '
               '"checkpoint_layers": [], "swap_layers": []}')  # enc.norm moves: it holds no tied weight
    assert box.take_rejections() == []
    assert box.ready(0, 0) == 2


def test_a_worker_not_online_ignores_plan_commands():
    # A job not submitted for live repartitioning has no agreement or migration groups; commands are not read.
    events = run([[0, 3], [3, 8]], [plan(1, 1, [[0, 4], [4, 8]])], replicas=1, online=False, iterations=3)
    for rank_events in events:
        kinds = [e["event"] for e in rank_events]
        assert kinds[-1] == "done" and "plan_applied" not in kinds and "migration" not in kinds, kinds
        assert all(e["plan_version"] == 0 for e in of(rank_events, "iteration"))
