"""ZeRO-1 / ZeRO-2 data parallelism per layer (issue 24, sharding.py): on real gloo process groups a 2-replica run
under either flavour reproduces plain DP's losses (rtol 1e-5, fp32) while each replica holds half the optimizer
state and, after the reduction, half the gradients; checkpoints stay unsharded (a ZeRO-2 checkpoint resumes
under one plain replica); flavours compose with pipeline stages and survive live migration. Plus the bucket
arithmetic, the config and command validation and the agent's mapping of `LayerStrategy.dp_sharding`."""

from __future__ import annotations

import json

import pytest
import torch
from google.protobuf.json_format import MessageToDict, ParseDict
from torch import nn

from ballast.v1 import common_pb2, executor_pb2, model_pb2, plan_pb2
from services.executor import inventory
from services.executor.train.checkpoint import checkpoint_path
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.migration import Plan, PlanInbox
from services.executor.train.reference import train_single
from services.executor.train.sharding import ZERO1, ZERO2, Bucket, flavours
from services.executor.train.stage import model_info
from services.executor.workers import plan_command, policies, worker_config
from services.runtime.allocator import STEADY_ALLOCATOR
from services.zoo import build_model
from tests.executor.assigns import assign_on_one_host
from tests.harness import losses, of, torch_threads

# embed, block.0, block.1, head (its weight tied to the embedding): 4 layers
SPEC = ParseDict({"name": "gpt-zero", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 2, "hidden_size": 64, "num_heads": 2, "vocab_size": 128, "seq_length": 32,
    "tie_embeddings": True}}, model_pb2.ModelSpec())
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
DATA = {}
SEED, STEPS, MICRO, NUM_MICRO, REPLICAS = 3, 4, 2, 2, 2
GLOBAL_BATCH = MICRO * NUM_MICRO * REPLICAS
ALL = [0, 1, 2, 3]
TENSORS = len(list(build_model(SPEC, device="meta").parameters()))  # distinct parameter tensors


def template(bounds: list[list[int]], **changes) -> WorkerConfig:
    return WorkerConfig(**{
        "job_id": "job-zero", "model": MessageToDict(SPEC, preserving_proto_field_name=True), "stage_bounds": bounds,
        "num_replicas": 1, "stage_index": 0, "replica_index": 0, "rank": 0, "world_size": 1,
        "micro_batch_size": MICRO, "num_micro_batches": NUM_MICRO, "iterations": STEPS, "init_method": "",
        "optimizer": ADAM, "seed": SEED, "data": DATA, "timeout_s": 60, "online": False, **changes})


def run(bounds: list[list[int]], replicas: int = REPLICAS, commands: list[dict] | None = None,
        **changes) -> list[list[dict]]:
    configs = plan_configs(template(bounds, **changes), bounds, replicas)
    return run_local(configs, env=STEADY_ALLOCATOR, timeout_s=180,
                     commands={c.rank: commands for c in configs} if commands else None)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    with torch_threads(1):
        return train_single(SPEC, DATA, SEED, GLOBAL_BATCH, 2 * STEPS, ADAM)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def plain(plain_dir) -> list[list[dict]]:
    return run([[0, 4]], checkpoint_dir=plain_dir, checkpoint_every=STEPS)


# --- 2 replicas, 1 stage: losses, optimizer-state and gradient bytes ---------------------------------------------


@pytest.mark.parametrize("flavour", [ZERO1, ZERO2])
def test_zero_keeps_plain_dp_losses_with_half_the_state_per_replica(plain, reference, flavour):
    events = run([[0, 4]], **{f"{flavour}_layers": ALL})
    assert losses(plain) == pytest.approx(reference[:STEPS], rel=1e-5)
    assert losses(events) == pytest.approx(losses(plain), rel=1e-5)
    for rank, rank_events in enumerate(events):
        assert [e["event"] for e in rank_events] == ["started"] + ["iteration"] * STEPS + ["done"]
        for zero, base in zip(of(rank_events, "iteration"), of(plain[rank], "iteration"), strict=True):
            assert zero[f"{flavour}_layers"] == ALL and base["zero1_layers"] == base["zero2_layers"] == []
            # Half, up to Adam's 4-byte step scalars (one per parameter tensor under plain DP, one per layer under
            # ZeRO) and the padding to a multiple of 2 elements (none: every layer of this model has an even size).
            assert abs(zero["optimizer_state_bytes"] - base["optimizer_state_bytes"] / 2) <= 4 * TENSORS, (zero, base)
            assert zero["gradient_bytes"] == base["gradient_bytes"] / 2, (zero, base)
            assert zero["allgather_bytes"] == base["gradient_bytes"]  # every layer's parameters gathered once
            assert base["allgather_bytes"] == base["reduce_scatter_bytes"] == 0
            if flavour == ZERO2:  # gradients reduce-scattered, not all-reduced (only the 2 loss scalars are)
                assert zero["reduce_scatter_bytes"] == base["gradient_bytes"]
                assert zero["allreduce_bytes"] == base["allreduce_bytes"] - base["gradient_bytes"]
            else:
                assert zero["reduce_scatter_bytes"] == 0 and zero["allreduce_bytes"] == base["allreduce_bytes"]
    assert events[0][-1]["param_sha256"] == events[1][-1]["param_sha256"]  # replicas end bit-identical
    assert events[0][-1]["param_sum"] == pytest.approx(plain[0][-1]["param_sum"], rel=1e-6)


# --- unsharded checkpoints -----------------------------------------------------------------------------------------


def test_a_zero2_checkpoint_resumes_under_one_plain_replica(tmp_path, reference, plain, plain_dir):
    first = run([[0, 4]], zero2_layers=ALL, checkpoint_dir=str(tmp_path), checkpoint_every=STEPS)
    assert losses(first) == pytest.approx(reference[:STEPS], rel=1e-5)
    directory = checkpoint_path(tmp_path, STEPS)
    assert json.loads((directory / "manifest.json").read_text())["complete"] is True
    for i in range(4):  # plain DP's files: the same keys, shapes and values (each replica's half was gathered)
        zero = torch.load(directory / f"layer-{i:05d}.pt", weights_only=True)
        want = torch.load(checkpoint_path(plain_dir, STEPS) / f"layer-{i:05d}.pt", weights_only=True)
        assert sorted(zero) == sorted(want) and any(k.startswith("state/exp_avg_sq/") for k in zero)
        for key, value in want.items():
            assert zero[key].shape == value.shape, key
            torch.testing.assert_close(zero[key], value, rtol=1e-5, atol=1e-7)

    # One replica, the same global batch (4 micro-batches of 2): the uninterrupted run's losses go on.
    resumed = run([[0, 4]], replicas=1, micro_batch_size=MICRO, num_micro_batches=NUM_MICRO * REPLICAS,
                  iterations=2 * STEPS, resume_from=str(directory), zero2_layers=ALL)
    assert of(resumed[0], "started")[0]["start_iteration"] == STEPS
    assert all("zero2_layers" not in e for e in of(resumed[0], "iteration"))  # one replica: plain DP, no ZeRO
    assert losses(resumed) == pytest.approx(reference[STEPS:], rel=1e-5)


@pytest.mark.slow
def test_a_plain_checkpoint_resumes_under_zero1_on_two_replicas(tmp_path, reference):
    first = run([[0, 2], [2, 4]], replicas=1, num_micro_batches=NUM_MICRO * REPLICAS, checkpoint_dir=str(tmp_path),
                checkpoint_every=STEPS)
    assert losses(first) == pytest.approx(reference[:STEPS], rel=1e-5)
    resumed = run([[0, 4]], iterations=2 * STEPS, resume_from=str(checkpoint_path(tmp_path, STEPS)),
                  zero1_layers=[0, 1], zero2_layers=[2, 3])
    assert losses(resumed) == pytest.approx(reference[STEPS:], rel=1e-5)


# --- with pipeline stages, and through live migration -----------------------------------------------------------


@pytest.mark.slow
def test_zero_composes_with_two_pipeline_stages(reference):
    events = run([[0, 2], [2, 4]], zero1_layers=[1, 3], zero2_layers=[0, 2], iterations=2 * STEPS)
    assert losses(events) == pytest.approx(reference, rel=1e-5)
    for stage in range(2):
        assert len({events[stage * REPLICAS + r][-1]["param_sha256"] for r in range(REPLICAS)}) == 1
    assert len({rank_events[-1]["tied_sha256"] for rank_events in events}) == 1  # embedding and head copies agree
    for rank_events in events:
        it = of(rank_events, "iteration")[-1]
        assert it["replica_allgathers"] == 2 and it["replica_reduce_scatters"] == 1


@pytest.mark.slow
def test_zero_layers_migrate_and_switch_flavour_live(reference):
    # At step 3 block.1 (layer 2, ZeRO-2) moves from stage 1 to stage 0 with its full Adam state; the embedding
    # turns from ZeRO-2 to ZeRO-1, block.0 to plain DP, the head from ZeRO-1 to ZeRO-2.
    command = {"command": "plan", "version": 1, "not_before": 3, "stage_bounds": [[0, 3], [3, 4]],
               "checkpoint_layers": [], "swap_layers": [], "zero1_layers": [0], "zero2_layers": [2, 3]}
    events = run([[0, 2], [2, 4]], commands=[command], zero1_layers=[1, 3], zero2_layers=[0, 2],
                 iterations=2 * STEPS, online=True)
    assert losses(events) == pytest.approx(reference, rel=1e-5)
    for rank, rank_events in enumerate(events):
        stage = rank // REPLICAS
        (applied,) = of(rank_events, "plan_applied")
        assert (applied["zero1_layers"], applied["zero2_layers"]) == ([0], [2, 3])
        flavoured = [(it["zero1_layers"], it["zero2_layers"]) for it in of(rank_events, "iteration")]
        before, after = [([1], [0]), ([3], [2])][stage], [([0], [2]), ([], [3])][stage]
        assert flavoured == [before] * 3 + [after] * (2 * STEPS - 3)
        moved = of(rank_events, "migration")
        assert [m["layer_index"] for m in moved] == ([2] if stage == 0 else [])
        block = build_model(SPEC, device="meta").decompose().layers[2].module
        adam = 2 * 4 * sum(p.numel() for p in block.parameters())
        assert all(m["bytes"] > adam for m in moved)  # the full Adam state travelled, not a chunk
    for stage in range(2):
        assert len({events[stage * REPLICAS + r][-1]["param_sha256"] for r in range(REPLICAS)}) == 1
    assert len({rank_events[-1]["tied_sha256"] for rank_events in events}) == 1


# --- without processes ----------------------------------------------------------------------------------------------


def test_buckets_split_a_layer_elementwise_into_equal_chunks():
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3)) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    buckets = [Bucket.create(7, ZERO2, list(m.parameters()), rank, 2) for rank, m in enumerate(layers)]
    numel = 5 * 3 + 3 + 3 + 3  # 24 elements: 12 per replica
    assert [(b.numel, b.chunk, b.flat.numel()) for b in buckets] == [(numel, 12, 24)] * 2
    with torch.no_grad():  # the chunk is a view of the real parameters: stepping it steps them
        buckets[0].shard.add_(1.0)
    assert torch.equal(layers[0][0].weight.reshape(-1)[:12], layers[1][0].weight.reshape(-1)[:12] + 1)
    assert torch.equal(layers[0][0].weight.reshape(-1)[12:], layers[1][0].weight.reshape(-1)[12:])

    # Full per-parameter state sliced per replica: the chunks, end to end, are the whole state.
    states = {p: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(p)} for p in layers[1].parameters()}
    twin = {q: states[p] for p, q in zip(layers[1].parameters(), layers[0].parameters(), strict=True)}
    chunks = [buckets[0].chunk_state(twin), buckets[1].chunk_state(states)]
    assert [float(c["step"]) for c in chunks] == [3.0, 3.0] and [c["exp_avg"].numel() for c in chunks] == [12, 12]
    whole = torch.cat([states[p]["exp_avg"].reshape(-1) for p in layers[1].parameters()])
    assert torch.equal(torch.cat([c["exp_avg"] for c in chunks]), whole)
    states[next(iter(layers[1].parameters()))]["step"] = torch.tensor(2.0)
    with pytest.raises(ValueError, match="step"):  # a layer's parameters step together under ZeRO
        buckets[1].chunk_state(states)

    # Gradients accumulate in place into one flat buffer per layer (views); ZeRO-1 keeps its chunk of it.
    buckets[1].prepare()
    for p in layers[1].parameters():
        p.grad += 2.0  # what autograd's accumulation does
    flat = buckets[1].flat_grad()
    assert torch.equal(flat, torch.full((24,), 2.0)) and all(p.grad is None for p in layers[1].parameters())
    buckets[1].keep_chunk(flat)
    assert torch.equal(buckets[1].shard.grad, torch.full((12,), 2.0)) and buckets[1].grad is None
    # Without a prepared buffer (or a gradient replaced rather than accumulated) the gradients are copied in.
    for p in layers[0].parameters():
        p.grad = torch.ones_like(p)
    assert buckets[0].has_grad() and torch.equal(buckets[0].flat_grad(), torch.ones(24))
    assert all(p.grad is None for p in layers[0].parameters())


def test_odd_sizes_are_padded_and_the_padding_stays_zero():
    layer = nn.Linear(3, 1)  # 4 elements over 3 replicas: chunks of 2, 2 padded elements
    bucket = Bucket.create(0, ZERO1, list(layer.parameters()), 2, 3)
    assert (bucket.chunk, bucket.flat.numel()) == (2, 6)
    assert torch.equal(bucket.flat[4:], torch.zeros(2)) and bucket.shard.data_ptr() == bucket.flat[4:].data_ptr()


def test_zero_lists_are_validated_in_configs_and_plan_commands():
    assert flavours([1], [2, 3]) == {1: ZERO1, 2: ZERO2, 3: ZERO2}
    with pytest.raises(ValueError, match="both"):
        flavours([1], [1])
    config = template([[0, 4]], zero1_layers=[0], zero2_layers=[1, 2], init_method="tcp://127.0.0.1:1")
    assert WorkerConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="zero2_layers"):
        WorkerConfig.from_json(template([[0, 4]], zero1_layers=[0], zero2_layers=[0],
                                        init_method="tcp://127.0.0.1:1").to_json())
    assert Plan.initial(config).flavours() == {0: ZERO1, 1: ZERO2, 2: ZERO2}

    box = PlanInbox(model_info(SPEC, MICRO), 2, Plan(0, 0, ((0, 2), (2, 4)), (), ()))
    base = {"command": "plan", "not_before": 0, "stage_bounds": [[0, 3], [3, 4]], "checkpoint_layers": [],
            "swap_layers": []}
    for version, extra, field in [(1, {"zero1_layers": [4]}, "'zero1_layers'"),
                                  (2, {"zero1_layers": [1], "zero2_layers": [1]}, "'zero2_layers'")]:
        assert box.submit(json.dumps({**base, "version": version, **extra})) is None
        ((_, message),) = box.take_rejections()
        assert field in message
    accepted = box.submit(json.dumps({**base, "version": 3, "zero1_layers": [2, 0], "zero2_layers": [3]}))
    assert accepted is not None and (accepted.zero1_layers, accepted.zero2_layers) == ((0, 2), (3,))
    assert accepted.describe()["zero2_layers"] == [3]
    legacy = box.submit(json.dumps({**base, "version": 4}))  # no ZeRO lists: plain DP everywhere
    assert legacy is not None and legacy.flavours() == {}


def test_policies_map_dp_sharding_to_the_worker_lists():
    plan = plan_pb2.Plan(version=3, micro_batch_size=4, num_micro_batches=2)
    plan.stages.add(index=0, layer_begin=0, layer_end=4, devices=2)
    plan.layers.add(layer_index=0, dp_sharding=common_pb2.DP_SHARDING_ZERO2)
    plan.layers.add(layer_index=1, checkpoint=True, dp_sharding=common_pb2.DP_SHARDING_ZERO1)
    plan.layers.add(layer_index=2)
    plan.layers.add(layer_index=3, dp_sharding=common_pb2.DP_SHARDING_ZERO2)
    assert policies(plan) == {"checkpoint_layers": [1], "swap_layers": [], "zero1_layers": [1],
                              "zero2_layers": [0, 3]}
    assert "zero1_layers" not in policies(plan_pb2.Plan())  # plain everywhere: nothing to say

    for layer in plan.layers:  # plain DP over the stage's 2 devices, as the planner writes it
        layer.dp = 2
    assign = assign_on_one_host(plan, "job-z")
    config = WorkerConfig.from_json(worker_config(assign, assign.workers[1], "job-z").to_json())
    assert (config.zero1_layers, config.zero2_layers, config.num_replicas) == ([1], [0, 3], 2)
    message = executor_pb2.PlannerMessage(version=3, repartition=executor_pb2.RepartitionInstruction(
        plan=plan, effective_iteration=5))
    command = plan_command(message)
    assert (command["zero1_layers"], command["zero2_layers"]) == ([1], [0, 3])
    box = PlanInbox(model_info(SPEC, MICRO), 1, Plan(0, 0, ((0, 4),), (), ()))
    parsed = box.submit(json.dumps(command))
    assert parsed is not None and parsed.flavours() == {0: ZERO2, 1: ZERO1, 3: ZERO2}


def test_agents_declare_zero1_and_zero2():
    assert {common_pb2.PARALLEL_DIM_ZERO1, common_pb2.PARALLEL_DIM_ZERO2} <= set(inventory.SUPPORTED)
