"""Per-layer tensor parallelism and sharded data parallelism inside pipeline stages (issue 18, hybrid.py), on real
gloo process groups: each layout's per-iteration losses equal a single-process run of the same model and batch
(fp32, dropout 0, summed-token loss), and each test shows the run was distributed (world size, mesh shape, this
rank's share of the layer's parameters from the worker's "started" event).

Tolerance: rtol 1e-5 as the issue asks. TP changes summation order (each row-parallel output is a sum of t
partial products, all-reduced; each column shard's gradient is a separate matmul), SDP reduce-scatters instead of
summing in one process; on these sizes the losses agree to about 1e-7 relative, so 1e-5 leaves room for the last
bits and still fails on any real error: a wrong head layout moves the losses within two steps, and the SGD case
(whose update is the gradient itself, where Adam's would not see a uniformly scaled one) catches a gradient
summed the wrong number of times."""

from __future__ import annotations

import pytest
import torch
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import common_pb2, model_pb2, plan_pb2
from services.executor.train.checkpoint import checkpoint_path
from services.executor.train.config import WorkerConfig
from services.executor.train.hybrid import SDP, TP, strategies
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import train_single
from services.executor.workers import hybrid_layers
from services.runtime.allocator import STEADY_ALLOCATOR
from services.zoo import build_model
from services.zoo.base import to_head_major
from tests.harness import losses, of, torch_threads

# embed, block.0, block.1, head (its weight tied to the embedding): 4 layers; 4 heads, MLP width 128
SPEC = ParseDict({"name": "gpt-hybrid", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_length": 16,
    "tie_embeddings": True}}, model_pb2.ModelSpec())
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
DATA = {}
SEED, STEPS, MICRO, NUM_MICRO = 5, 3, 2, 2
BLOCK = sum(p.numel() for p in build_model(SPEC, device="meta").blocks[0].parameters())
LAYER_NORMS = 4 * 32  # two LayerNorms' weights and biases: replicated under TP
ROW_BIASES = 2 * 32  # the row-parallel linears' biases (attention output, MLP out): replicated under TP
TCP = "tcp://127.0.0.1:1"  # validate() only checks one is given


def template(bounds: list[list[int]], **changes) -> WorkerConfig:
    return WorkerConfig(**{
        "job_id": "job-hybrid", "model": MessageToDict(SPEC, preserving_proto_field_name=True),
        "stage_bounds": bounds, "num_replicas": 1, "stage_index": 0, "replica_index": 0, "rank": 0, "world_size": 1,
        "micro_batch_size": MICRO, "num_micro_batches": NUM_MICRO, "iterations": STEPS, "init_method": "",
        "optimizer": ADAM, "seed": SEED, "data": DATA, "timeout_s": 60, "online": False, **changes})


def run(bounds: list[list[int]], replicas: int, **changes) -> list[list[dict]]:
    configs = plan_configs(template(bounds, **changes), bounds, replicas)
    return run_local(configs, env=STEADY_ALLOCATOR, timeout_s=240)


def reference(replicas: int) -> list[float]:
    with torch_threads(1):
        return train_single(SPEC, DATA, SEED, MICRO * NUM_MICRO * replicas, STEPS, ADAM)


def started(events: list[list[dict]]) -> list[dict]:
    return [of(rank, "started")[0] for rank in events]


def test_tp2_equals_one_process():
    events = run([[0, 4]], 2, tp_layers=[[1, 2], [2, 2]])
    assert losses(events) == pytest.approx(reference(2), rel=1e-5)
    for rank in started(events):
        assert rank["world_size"] == 2
        for layer in ("1", "2"):
            info = rank["hybrid"][layer]
            assert (info["strategy"], info["mesh"]) == (TP, {"dp": 1, "tp": 2})
            assert info["elements"] == BLOCK
            # column/row shards halve every weight and the column biases; LayerNorms and row biases replicate
            assert info["local_elements"] == (BLOCK - LAYER_NORMS - ROW_BIASES) // 2 + LAYER_NORMS + ROW_BIASES
        assert "0" not in rank["hybrid"] and "3" not in rank["hybrid"]  # the tied embedding and head stay DP
        # the two TP blocks keep the gathered samples between them: one gather before, one slice after
        assert (rank["hybrid"]["1"]["gathers_input"], rank["hybrid"]["1"]["slices_output"]) == (True, False)
        assert (rank["hybrid"]["2"]["gathers_input"], rank["hybrid"]["2"]["slices_output"]) == (False, True)


def test_tp2_with_sequence_parallelism_equals_one_process():
    """Sequence parallelism (issue 44): the two TP blocks hold their dp group's samples split by sequence between
    them (half of the 16 tokens each), gather it into each TP region and reduce-scatter it after; the norms'
    gradients are summed over the tp ranks."""
    events = run([[0, 4]], 2, tp_layers=[[1, 2], [2, 2]], sp_layers=[1, 2])
    assert losses(events) == pytest.approx(reference(2), rel=1e-5)
    for rank in started(events):
        for layer in ("1", "2"):
            info = rank["hybrid"][layer]
            assert (info["strategy"], info["mesh"], info["sequence_parallel"]) == (TP, {"dp": 1, "tp": 2}, True)
            assert info["local_elements"] == (BLOCK - LAYER_NORMS - ROW_BIASES) // 2 + LAYER_NORMS + ROW_BIASES
        assert (rank["hybrid"]["1"]["gathers_input"], rank["hybrid"]["1"]["slices_output"]) == (True, False)
        assert (rank["hybrid"]["2"]["gathers_input"], rank["hybrid"]["2"]["slices_output"]) == (False, True)


def test_sequence_parallel_norm_gradients_are_summed_over_tp_and_dp_ranks():
    """TP2 x DP2 with sequence parallelism on one block and plain TP on the next, under SGD at a large rate: a
    norm gradient left partial (one rank's tokens) or summed twice moves these losses by far more than 1e-5, and
    the re-layout between the two blocks (sequence parts to the group's whole samples: an all-gather, as priced,
    not a round trip through the plain layout) must be right."""
    sgd = {"name": "sgd", "learning_rate": 0.5}
    events = run([[0, 4]], 4, tp_layers=[[1, 2], [2, 2]], sp_layers=[1], optimizer=sgd)
    with torch_threads(1):
        expected = train_single(SPEC, DATA, SEED, MICRO * NUM_MICRO * 4, STEPS, sgd)
    assert losses(events) == pytest.approx(expected, rel=1e-5)
    assert abs(expected[-1] - expected[0]) > 1e-3
    ranks = started(events)
    assert all(r["hybrid"]["1"]["sequence_parallel"] and "sequence_parallel" not in r["hybrid"]["2"] for r in ranks)
    for r in ranks:  # joined: block 2 re-lays block 1's output itself, neither slices nor gathers through DP's
        assert (r["hybrid"]["1"]["slices_output"], r["hybrid"]["2"]["gathers_input"]) == (False, False)
        assert r["hybrid"]["2"]["relays_input"] and "relays_input" not in r["hybrid"]["1"]


def test_sdp2_equals_one_process():
    events = run([[0, 4]], 2, sdp_layers=[1, 2])
    assert losses(events) == pytest.approx(reference(2), rel=1e-5)
    for rank in started(events):
        assert rank["world_size"] == 2
        for layer in ("1", "2"):
            info = rank["hybrid"][layer]
            assert (info["strategy"], info["mesh"]) == (SDP, {"dp": 2})
            assert info["local_elements"] * 2 == info["elements"] == BLOCK  # each rank holds half of every tensor


def test_tp2_x_dp2_equals_one_process():
    events = run([[0, 4]], 4, tp_layers=[[1, 2], [2, 2]])
    assert losses(events) == pytest.approx(reference(4), rel=1e-5)
    ranks = started(events)
    assert [r["world_size"] for r in ranks] == [4] * 4
    assert all(r["hybrid"]["1"]["mesh"] == {"dp": 2, "tp": 2} for r in ranks)
    # the two tp ranks of one dp group hold different shards; the same tp index in both dp groups the same
    final = [of(rank, "done")[0]["param_sha256"] for rank in events]
    assert final[0] == final[2] and final[1] == final[3] and final[0] != final[1]


def test_sgd_sees_a_wrongly_scaled_gradient_too():
    """TP2 x DP2 and SDP in one run under SGD at a large rate: a gradient summed t times, or not summed over the
    dp ranks, moves these losses by far more than 1e-5."""
    sgd = {"name": "sgd", "learning_rate": 0.5}
    events = run([[0, 4]], 4, tp_layers=[[1, 2]], sdp_layers=[2], optimizer=sgd)
    with torch_threads(1):
        expected = train_single(SPEC, DATA, SEED, MICRO * NUM_MICRO * 4, STEPS, sgd)
    assert losses(events) == pytest.approx(expected, rel=1e-5)
    assert abs(expected[-1] - expected[0]) > 1e-3  # the steps move the loss: the comparison has teeth


def test_pp2_with_tp2_in_one_stage_and_dp2_in_the_other():
    events = run([[0, 2], [2, 4]], 2, tp_layers=[[1, 2]])
    assert losses(events) == pytest.approx(reference(2), rel=1e-5)
    ranks = started(events)
    assert [(r["world_size"], r["stage"]) for r in ranks] == [(4, 0), (4, 0), (4, 1), (4, 1)]
    assert all(r["hybrid"]["1"]["mesh"] == {"dp": 1, "tp": 2} for r in ranks[:2])
    assert all(r["hybrid"] == {} for r in ranks[2:])  # stage 1: plain DP over its two ranks


@pytest.mark.parametrize("sp_layers", [
    pytest.param([], id="tp"),
    pytest.param([1], id="tp+sp", marks=pytest.mark.slow),  # a third multi-process TP run in the everyday suite
])
def test_checkpointed_tp_and_sdp_layers_equal_one_process(sp_layers):
    """A plan mixing TP (layer 1, with or without sequence parallelism: the recompute gathers and reduce-scatters
    again) and SDP (layer 2) on the first of two stages, both recomputed in backward (activation checkpointing;
    the last stage's micro-batches are never recomputed under 1F1B)."""
    events = run([[0, 3], [3, 4]], 2, tp_layers=[[1, 2]], sdp_layers=[2], checkpoint_layers=[1, 2],
                 sp_layers=sp_layers)
    assert losses(events) == pytest.approx(reference(2), rel=1e-5)
    ranks = started(events)
    assert [r["hybrid"]["1"]["strategy"] for r in ranks[:2]] == [TP, TP]
    assert [r["hybrid"]["2"]["strategy"] for r in ranks[:2]] == [SDP, SDP]
    assert all(of(rank, "iteration")[-1]["recompute_s"] > 0 for rank in events[:2])


@pytest.mark.slow  # several worker processes on the 2 cores: over 10 s even on a quiet machine
def test_checkpoints_are_unsharded_and_resume_across_strategies(tmp_path):
    """A TP+SDP run's checkpoint resumes as one plain process, and a plain single-process checkpoint resumes as
    TP+SDP: files hold whole layers in the model's own order, whatever strategy wrote or reads them."""
    steps = 4
    with torch_threads(1):
        plain_dir = tmp_path / "plain"
        expected = train_single(SPEC, DATA, SEED, MICRO * NUM_MICRO * 2, steps, ADAM, checkpoint_dir=str(plain_dir),
                                checkpoint_every=2)
    hybrid_dir = tmp_path / "hybrid"
    mixed = {"tp_layers": [[1, 2]], "sdp_layers": [2]}
    events = run([[0, 4]], 2, iterations=steps, checkpoint_dir=str(hybrid_dir), checkpoint_every=2, **mixed)
    assert losses(events) == pytest.approx(expected, rel=1e-5)
    one = run([[0, 4]], 1, micro_batch_size=MICRO * 2, iterations=steps,
              resume_from=str(checkpoint_path(hybrid_dir, 2)))
    assert losses(one) == pytest.approx(expected[2:], rel=1e-5)
    back = run([[0, 4]], 2, iterations=steps, resume_from=str(checkpoint_path(plain_dir, 2)), **mixed)
    assert losses(back) == pytest.approx(expected[2:], rel=1e-5)
    assert started(back)[0]["hybrid"]["1"]["strategy"] == TP


@pytest.mark.parametrize("sp_layers", [
    pytest.param([], id="tp"),
    pytest.param([1], id="tp+sp", marks=pytest.mark.slow),  # near the everyday suite's per-test budget
])
def test_tp_and_sdp_layers_migrate_live_between_stages_keeping_the_losses(sp_layers):
    """block.0 (TP2, with or without sequence parallelism) and block.1 (SDP2) move between two stages at two
    boundaries: gathered whole on the source, sent as any layer, split again on the target (with the gathers and
    slices rewired for the new neighbours)."""
    steps = 6
    commands = [
        {"command": "plan", "version": 1, "not_before": 2, "stage_bounds": [[0, 3], [3, 4]],
         "checkpoint_layers": [], "swap_layers": []},  # block.1 -> stage 0
        {"command": "plan", "version": 2, "not_before": 4, "stage_bounds": [[0, 1], [1, 4]],
         "checkpoint_layers": [], "swap_layers": []},  # both -> stage 1
    ]
    configs = plan_configs(template([[0, 2], [2, 4]], iterations=steps, online=True, tp_layers=[[1, 2]],
                                    sdp_layers=[2], sp_layers=sp_layers), [[0, 2], [2, 4]], 2)
    events = run_local(configs, env=STEADY_ALLOCATOR, timeout_s=240, commands={c.rank: commands for c in configs})
    with torch_threads(1):
        expected = train_single(SPEC, DATA, SEED, MICRO * NUM_MICRO * 2, steps, ADAM)
    assert losses(events) == pytest.approx(expected, rel=1e-5)
    moved = sorted((e["iteration"], e["layer_index"], e["from_stage"], e["to_stage"])
                   for rank in events for e in of(rank, "migration"))
    assert moved == [(2, 2, 1, 0), (2, 2, 1, 0), (4, 1, 0, 1), (4, 1, 0, 1), (4, 2, 0, 1), (4, 2, 0, 1)]
    applied = [e["layers"] for e in of(events[-1], "plan_applied")]
    assert applied == [[3], [1, 2, 3]]


# --- pure parts ----------------------------------------------------------------------------------------------------


def test_head_major_reorder_keeps_the_block_function():
    torch.manual_seed(0)
    block = build_model(SPEC, seed=1).blocks[0]
    x = torch.randn(2, 16, 32)
    before = block(x)
    to_head_major(block.attn)
    assert block.attn.head_major
    torch.testing.assert_close(block(x), before, rtol=0, atol=1e-6)


def test_every_rank_refuses_tp_of_a_layer_it_cannot_split_before_the_rendezvous():
    from services.executor.train.hybrid import Strategy, check_model
    from services.executor.train.stage import model_info

    check_model(model_info(SPEC, MICRO), {1: Strategy(TP, 4), 2: Strategy(SDP, 2)})  # 4 heads, MLP 128
    with pytest.raises(ValueError, match="layer 1 \\(block.0\\): tp degree 8 must divide 4 \\(the gcd of its heads"):
        check_model(model_info(SPEC, MICRO), {1: Strategy(TP, 8)})
    with pytest.raises(ValueError, match="layer 0 \\(embed\\) shares a parameter"):  # held by stage 0 only
        check_model(model_info(SPEC, MICRO), {0: Strategy(SDP, 2)})
    dropout = model_pb2.ModelSpec()
    dropout.CopyFrom(SPEC)
    dropout.dropout = 0.1
    with pytest.raises(ValueError, match="layer 2 \\(block.1\\): tensor-parallel layers need dropout 0"):
        check_model(model_info(dropout, MICRO), {2: Strategy(TP, 2)})


def test_sequence_parallelism_needs_a_degree_dividing_the_tokens_and_declared_regions():
    from services.executor.train.hybrid import Strategy, check_model
    from services.executor.train.stage import model_info

    six = model_pb2.ModelSpec()
    six.CopyFrom(SPEC)
    six.transformer.seq_length = 6  # 4 heads, MLP 128, 6 tokens: TP 4 ways, sequence 2 ways
    info = model_info(six, MICRO)
    assert [layer.sequence_parallel for layer in info.dec.layers] == [0, 2, 2, 0]
    check_model(info, {1: Strategy(TP, 4), 2: Strategy(TP, 2, sequence=True)})
    with pytest.raises(ValueError, match="layer 1 \\(block.0\\): sequence parallelism: tp degree 4 must divide 2 "
                                         "\\(its TP ways and its sequence length\\); plan it TP without"):
        check_model(info, {1: Strategy(TP, 4, sequence=True)})
    block = info.dec.layers[1].module
    block.sequence_parallel_regions = list  # a module declaring no regions
    with pytest.raises(ValueError, match="Block declares no sequence-parallel regions"):
        check_model(info, {1: Strategy(TP, 2, sequence=True)})


def test_a_plan_command_cannot_put_a_tp_or_sdp_layer_under_zero_or_swap():
    from services.executor.train.migration import Plan, PlanInbox, Rejected
    from services.executor.train.stage import model_info

    config = template([[0, 2], [2, 4]], tp_layers=[[1, 2]], sdp_layers=[2])
    inbox = PlanInbox(model_info(SPEC, MICRO), 2, Plan.initial(config), hybrid=frozenset({1, 2}))
    command = {"command": "plan", "version": 1, "not_before": 0, "stage_bounds": [[0, 3], [3, 4]],
               "checkpoint_layers": [2], "swap_layers": []}
    assert inbox.parse(command).stage_bounds == ((0, 3), (3, 4))  # moving and recomputing them is fine
    with pytest.raises(Rejected, match="'zero1_layers': layers \\[1\\] are TP or SDP layers"):
        inbox.parse({**command, "zero1_layers": [1]})
    with pytest.raises(Rejected, match="'swap_layers': layers \\[2\\] are TP or SDP layers"):
        inbox.parse({**command, "swap_layers": [2]})


def test_strategies_name_the_field_and_the_fix():
    assert strategies([[1, 2]], [2], 4)[1].degree == 2
    with pytest.raises(ValueError, match="tp_layers: layer 1 has tp degree 3; it must be >= 2 and divide"):
        strategies([[1, 3]], [], 4)
    with pytest.raises(ValueError, match="sdp_layers: layers \\[1\\] are also in tp_layers"):
        strategies([[1, 2]], [1], 2)
    with pytest.raises(ValueError, match="sdp_layers: sharded data parallelism needs num_replicas >= 2"):
        strategies([], [1], 1)
    assert strategies([[1, 2]], [], 2, sp_layers=[1])[1].sequence
    with pytest.raises(ValueError, match="sp_layers: layers \\[2\\] are not in tp_layers"):
        strategies([[1, 2]], [], 2, sp_layers=[2])


def test_config_refuses_what_does_not_combine_yet():
    with pytest.raises(ValueError, match="zero1_layers: layers \\[1\\] are also TP or SDP layers"):
        template([[0, 4]], tp_layers=[[1, 2]], zero1_layers=[1], init_method=TCP).validate()
    with pytest.raises(ValueError, match="tp_layers: each entry is \\[layer_index, tp degree\\]"):
        template([[0, 4]], tp_layers=[[1]], init_method=TCP).validate()
    with pytest.raises(ValueError, match="sp_layers: layers \\[2\\] are not TP layers"):
        template([[0, 4]], tp_layers=[[1, 2]], sp_layers=[2], init_method=TCP).validate()


def test_tensor_parallelism_of_a_tied_layer_is_refused():
    events = run_local(plan_configs(template([[0, 4]], tp_layers=[[3, 2]]), [[0, 4]], 2), env=STEADY_ALLOCATOR,
                       timeout_s=120, check=False)
    errors = [e["message"] for rank in events for e in of(rank, "error")]
    assert errors and all("shares a parameter with another layer" in m for m in errors)


def test_the_agent_maps_plan_strategies_to_worker_layers():
    DP, SDP_, TP_ = common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_SDP, common_pb2.PARALLEL_DIM_TP
    plan = plan_pb2.Plan(layers=[
        plan_pb2.LayerStrategy(layer_index=0, dp=4, order=[DP]),
        plan_pb2.LayerStrategy(layer_index=1, dp=2, tp=2, order=[DP, TP_]),
        plan_pb2.LayerStrategy(layer_index=2, tp=4, order=[TP_]),
        plan_pb2.LayerStrategy(layer_index=3, sdp=4, order=[SDP_])])
    assert hybrid_layers(plan) == {"tp_layers": [[1, 2], [2, 4]], "sdp_layers": [3]}
    for strategy in (plan_pb2.LayerStrategy(layer_index=5, dp=2, tp=2, order=[TP_, DP]),  # TP outside DP
                     plan_pb2.LayerStrategy(layer_index=5, sdp=2, tp=2, order=[SDP_, TP_]),
                     plan_pb2.LayerStrategy(layer_index=5, sdp=2, dp=2, order=[DP, SDP_])):
        with pytest.raises(ValueError, match="plan layer 5: .* is not a strategy the workers run"):
            hybrid_layers(plan_pb2.Plan(layers=[strategy]))
