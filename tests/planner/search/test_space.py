"""The per-layer strategy space: Galvatron-BMW's counts, the non-power-of-two rule, filters and input checks."""

from __future__ import annotations

from itertools import product
from math import factorial, prod

import pytest

from ballast.v1 import common_pb2
from services.planner.search import (
    Candidate,
    InvalidSpace,
    count,
    layer_candidates,
    pipeline_degrees,
    strategy_space,
)
from services.planner.search.space import global_batch_fits, nearest_global_batches
from services.runtime.errors import InvalidArgument

# N -> (before Takeaway 3, after Takeaway 3, after Takeaway 3 without checkpointing).
# By hand: a group of g devices has 3*f1 + 6*f2 + 6*f3 ordered sequences of distinct dims (f_k = ordered
# factorizations of g into exactly k factors >= 2; 3, 3*2, 3*2*1 ways to name them), 3*f1 + 4*f2 after
# Takeaway 3 (the DP+SDP pairs and every 3-dim tree go). Per group:
#   g:        1  2  3  4   6   8  12  16  24  32  64
#   all:      1  3  3  9  15  21  45  39  93  63  93
#   T3:       1  3  3  7  11  11  19  15  27  19  23
# (2**m: f2 = m-1, f3 = C(m-1, 2); 6: f2 = 2; 12: f2 = 4, f3 = 3; 24: f2 = 6, f3 = 3 + 6.)
# Summed over the groups N/pp for every divisor pp of N, times 2 for checkpointing on/off.
# 8 devices is the paper's figure (§III-B: "68 different hybrid parallelism strategies", 44 after T3).
COUNTS = {
    1: (2, 2, 1),
    2: (8, 8, 4),
    4: (26, 22, 11),  # groups 4+2+1: 9+3+1 = 13, T3 7+3+1 = 11
    8: (68, 44, 22),  # groups 8+4+2+1: 21+9+3+1 = 34, T3 11+7+3+1 = 22
    16: (146, 74, 37),  # 39+21+9+3+1 = 73, T3 15+11+7+3+1 = 37
    64: (458, 158, 79),  # 93+63+39+21+9+3+1 = 229, T3 23+19+15+11+7+3+1 = 79
    6: (44, 36, 18),  # groups 6,3,2,1: 15+3+3+1 = 22, T3 11+3+3+1 = 18
    12: (152, 88, 44),  # groups 12,6,4,3,2,1: 45+15+9+3+3+1 = 76, T3 19+11+7+3+3+1 = 44
    24: (380, 164, 82),  # groups 24,12,8,6,4,3,2,1: 93+45+21+15+9+3+3+1 = 190, T3 27+19+11+11+7+3+3+1 = 82
}


def brute_force(group: int, takeaway3: bool) -> int:
    """Independent count: degrees per dim (1 = absent) multiplying to the group, times the orders of the used dims."""
    divisors = [d for d in range(1, group + 1) if group % d == 0]
    total = 0
    for dp, sdp, tp in product(divisors, repeat=3):
        if dp * sdp * tp != group or (takeaway3 and dp > 1 and sdp > 1):
            continue
        total += factorial(sum(d > 1 for d in (dp, sdp, tp)))
    return total


@pytest.mark.parametrize("n", sorted(COUNTS))
def test_pinned_counts(n):
    before, after, no_ckpt = COUNTS[n]
    assert count(n, takeaway3=False) == before
    assert count(n) == after
    assert count(n, checkpoint=(False,)) == no_ckpt


@pytest.mark.parametrize("n", sorted(COUNTS))
def test_pinned_counts_match_brute_force(n):
    groups = [n // p for p in range(1, n + 1) if n % p == 0]
    assert COUNTS[n] == (
        2 * sum(brute_force(g, False) for g in groups),
        2 * sum(brute_force(g, True) for g in groups),
        sum(brute_force(g, True) for g in groups),
    )


def test_paper_per_tree_counts_for_8_gpus():
    space = strategy_space(8, takeaway3=False, checkpoint=(False,))
    assert {pp: len(c) for pp, c in space.items()} == {1: 21, 2: 9, 4: 3, 8: 1}
    space = strategy_space(8, checkpoint=(False,))
    assert {pp: len(c) for pp, c in space.items()} == {1: 11, 2: 7, 4: 3, 8: 1}


@pytest.mark.parametrize("n", [8, 12, 24, 64])
def test_candidates_are_unique_and_fill_their_group(n):
    for pp, cands in strategy_space(n, takeaway3=False).items():
        assert len(set(cands)) == len(cands)
        for c in cands:
            assert c.pp == pp and c.group_size == n // pp == c.dp * c.sdp * c.tp
            assert all(d >= 2 for _, d in c.dims)
            assert len(set(c.order)) == len(c.order)


def test_pipeline_degrees_are_divisors():
    assert pipeline_degrees(8) == [1, 2, 4, 8]
    assert pipeline_degrees(12) == [1, 2, 3, 4, 6, 12]
    assert pipeline_degrees(7) == [1, 7]
    assert pipeline_degrees(24, max_pp=4) == [1, 2, 3, 4]


def test_non_power_of_two_orders_both_ways():
    shapes = {c.dims for c in layer_candidates(6, checkpoint=(False,), dims=("dp", "tp"))}
    assert shapes == {
        (("dp", 6),),
        (("tp", 6),),
        (("dp", 2), ("tp", 3)),
        (("dp", 3), ("tp", 2)),
        (("tp", 2), ("dp", 3)),
        (("tp", 3), ("dp", 2)),
    }


def test_takeaway3_removes_exactly_the_dp_sdp_mixes():
    for n in (8, 12, 16):
        full = {c for cs in strategy_space(n, takeaway3=False).values() for c in cs}
        kept = {c for cs in strategy_space(n).values() for c in cs}
        assert kept <= full
        assert full - kept == {c for c in full if c.dp > 1 and c.sdp > 1}
        assert full - kept  # there was something to remove


def test_dims_restriction():
    # A fleet whose executors only run pipeline x data parallel.
    space = strategy_space(8, dims=("pp", "dp"), checkpoint=(False,))
    assert {pp: [c.label for c in cs] for pp, cs in space.items()} == {
        1: ["PP1 · DP8"],
        2: ["PP2 · DP4"],
        4: ["PP4 · DP2"],
        8: ["PP8 · none"],
    }
    # The executor's ParallelDim enums work too; without PP only PP1 is tried.
    supported = [common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_TP]
    space = strategy_space(4, dims=supported, checkpoint=(False,))
    assert list(space) == [1]
    assert {c.label for c in space[1]} == {"PP1 · DP4", "PP1 · TP4", "PP1 · DP2×TP2", "PP1 · TP2×DP2"}
    # One dim: a single factor (a dim never repeats); no dims: only a one-device group has a strategy.
    assert all(c.order == ("tp",) for c in layer_candidates(12, dims=("tp",)))
    assert layer_candidates(4, dims=()) == []
    assert strategy_space(4, dims=("pp",), checkpoint=(False,)) == {4: [Candidate(4, ())]}


def test_group_of_one_device():
    assert layer_candidates(1, pp=8) == [Candidate(8, (), False), Candidate(8, (), True)]
    c = layer_candidates(1, checkpoint=(True,))[0]
    assert (c.dp, c.sdp, c.tp, c.group_size, c.label) == (1, 1, 1, 1, "PP1 · none · ckpt")


def test_candidate_properties_and_label():
    c = Candidate(2, (("dp", 2), ("tp", 2)), True)
    assert (c.dp, c.sdp, c.tp, c.group_size, c.order) == (2, 1, 2, 4, ("dp", "tp"))
    assert c.label == "PP2 · DP2×TP2 · ckpt"
    assert hash(c) == hash(Candidate(2, (("dp", 2), ("tp", 2)), True))
    assert prod(d for _, d in c.dims) == c.group_size


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: strategy_space(0), "num_devices"),
        (lambda: pipeline_degrees(-4), "num_devices"),
        (lambda: count(True), "num_devices"),
        (lambda: pipeline_degrees(8, max_pp=0), "max_pp"),
        (lambda: layer_candidates(0), "group_size"),
        (lambda: layer_candidates(2.0), "group_size"),
        (lambda: layer_candidates(4, pp=0), "pp"),
        (lambda: layer_candidates(4, dims=("zero3",)), "dims"),
        (lambda: layer_candidates(4, dims=(99,)), "dims"),
        (lambda: layer_candidates(4, checkpoint=()), "checkpoint"),
        (lambda: layer_candidates(4, checkpoint=("yes",)), "checkpoint"),
    ],
)
def test_invalid_input(call, field):
    with pytest.raises(ValueError) as err:
        call()
    assert isinstance(err.value, InvalidSpace) and isinstance(err.value, InvalidArgument)
    assert err.value.field == field


def test_zero_devices_message_is_clear():
    with pytest.raises(ValueError, match=r"num_devices: must be a positive integer, got 0"):
        count(0)


def test_global_batches_must_split_into_whole_samples():
    """8 devices, 4 layers, pipeline x data parallel: stages hold 8, 4 or 2 replicas, so batches are even."""
    dp_only = {"num_layers": 4, "dims": ("pp", "dp")}
    assert global_batch_fits(6, 8, **dp_only) and global_batch_fits(8, 8, **dp_only)
    assert not global_batch_fits(7, 8, **dp_only)
    assert nearest_global_batches(7, 8, **dp_only) == [6, 8]
    # One layer leaves no pipeline: only multiples of 8, and nothing below 8 for a batch of 3.
    assert nearest_global_batches(3, 8, num_layers=1, dims=("pp", "dp")) == [8]
    assert global_batch_fits(7, 8, num_layers=4)  # tensor parallelism replicates samples instead
    assert {c.batch_split for c in layer_candidates(4, dims=("dp", "tp"), checkpoint=(False,))} == {1, 2, 4}
