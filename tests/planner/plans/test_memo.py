"""PlanMemo: a repeated search answers what make_plan would, without searching; nothing crosses tenants."""

from __future__ import annotations

from dataclasses import replace

import pytest
from google.protobuf.json_format import ParseDict

from ballast.v1 import model_pb2, profile_pb2
from services.planner.cost.calibration import Calibration
from services.planner.plans import memo as memo_module
from services.planner.plans.make import PlanInputs, make_plan
from services.planner.plans.memo import PlanMemo, memo_key
from services.profiler.projection import analytical_profile
from services.runtime.errors import FailedPrecondition
from services.specs.fleet import fleet_from_dict

GPT = {"name": "memo-gpt", "family": "MODEL_FAMILY_GPT", "dtype": "DTYPE_FP32",
       "transformer": {"num_layers": 4, "hidden_size": 128, "num_heads": 4, "vocab_size": 1024, "seq_length": 64}}
INPUTS = PlanInputs(max_global_batch_size=32)


@pytest.fixture(scope="module")
def profile() -> profile_pb2.Profile:
    prof = analytical_profile(ParseDict(GPT, model_pb2.ModelSpec()), "nvidia-a100-80gb", "fp32")
    prof.id, prof.model_id, prof.tenant_id = "prf-a", "mdl-a", "ten-a"
    return prof


@pytest.fixture(scope="module")
def fleet():
    return fleet_from_dict({"name": "memo-1x4", "device": "nvidia-a100-80gb", "nodes": 1, "devices_per_node": 4},
                           dtype="fp32")


@pytest.fixture
def searches(monkeypatch) -> list[PlanInputs]:
    """Every search the memo runs (make_plan itself, counted)."""
    ran: list[PlanInputs] = []

    def counted(profile, fleet, inputs):
        ran.append(inputs)
        return make_plan(profile, fleet, inputs)

    monkeypatch.setattr(memo_module, "make_plan", counted)
    return ran


def test_a_repeated_search_is_answered_from_the_memo_with_the_same_plan(profile, fleet, searches):
    memo = PlanMemo()
    first = memo.plan(profile, fleet, INPUTS)
    again = memo.plan(profile, fleet, INPUTS)
    assert len(searches) == 1
    assert again.SerializeToString(deterministic=True) == make_plan(profile, fleet, INPUTS).SerializeToString(
        deterministic=True)
    assert again == first


def test_a_caller_changing_its_copy_changes_no_later_answer(profile, fleet, searches):
    memo = PlanMemo()
    mine = memo.plan(profile, fleet, INPUTS)
    searched = (mine.job_id, mine.version, mine.stages[0].devices)
    mine.job_id, mine.version = "job-mine", 7
    mine.stages[0].devices = 99
    later = memo.plan(profile, fleet, INPUTS)
    assert (later.job_id, later.version, later.stages[0].devices) == searched != ("job-mine", 7, 99)
    assert len(searches) == 1


def test_any_other_input_profile_or_fleet_is_searched(profile, fleet, searches):
    memo = PlanMemo()
    memo.plan(profile, fleet, INPUTS)
    memo.plan(profile, fleet, replace(INPUTS, global_batch_size=16))
    memo.plan(profile, fleet, replace(INPUTS, calibration=Calibration(host_class="a100", forward_scale=1.2)))
    smaller = type(fleet)()
    smaller.CopyFrom(fleet)
    smaller.devices_per_node = 2
    memo.plan(profile, smaller, INPUTS)
    assert len(searches) == 4
    assert len(memo) == 4


def test_another_tenants_identical_model_is_searched_for_that_tenant(profile, fleet, searches):
    """Same layers, another tenant's profile: its own search, so no tenant learns what another submitted."""
    theirs = profile_pb2.Profile()
    theirs.CopyFrom(profile)
    theirs.id, theirs.model_id, theirs.tenant_id = "prf-b", "mdl-b", "ten-b"
    assert memo_key(profile, fleet, INPUTS) != memo_key(theirs, fleet, INPUTS)
    memo = PlanMemo()
    mine, other = memo.plan(profile, fleet, INPUTS), memo.plan(theirs, fleet, INPUTS)
    assert len(searches) == 2
    assert (mine.profile_id, other.profile_id) == ("prf-a", "prf-b")


def test_the_least_recently_used_plan_goes_first(profile, fleet, searches):
    memo = PlanMemo(kept=2)
    a, b, c = (replace(INPUTS, global_batch_size=n) for n in (8, 16, 32))
    memo.plan(profile, fleet, a)
    memo.plan(profile, fleet, b)
    memo.plan(profile, fleet, a)  # a is now the most recent: b goes when c comes
    memo.plan(profile, fleet, c)
    assert len(memo) == 2
    memo.plan(profile, fleet, a)
    memo.plan(profile, fleet, b)
    assert searches == [a, b, c, b]


def test_the_memo_keeps_within_its_bytes(profile, fleet, searches):
    size = make_plan(profile, fleet, INPUTS).ByteSize()
    memo = PlanMemo(kept_bytes=size * 3 // 2)  # room for one plan of this size, not two
    a, b = INPUTS, replace(INPUTS, top_k=4)
    memo.plan(profile, fleet, a)
    memo.plan(profile, fleet, b)  # a goes to make room
    memo.plan(profile, fleet, b)
    assert len(memo) == 1
    memo.plan(profile, fleet, a)
    assert searches == [a, b, a]
    tiny = PlanMemo(kept_bytes=size - 1)  # a plan larger than the whole bound is answered, not kept
    assert tiny.plan(profile, fleet, a) == memo.plan(profile, fleet, a)
    assert len(tiny) == 0


def test_a_failed_search_is_not_kept(profile, fleet, searches):
    memo = PlanMemo()
    tiny = replace(INPUTS, memory_budget_bytes=1 << 20)
    for _ in range(2):
        with pytest.raises(FailedPrecondition) as err:
            memo.plan(profile, fleet, tiny)
        assert err.value.field == "memory_budget_bytes"
    assert len(searches) == 2
    assert len(memo) == 0


def test_the_key_covers_every_plan_input():
    """A new PlanInputs field must reach the key: its repr carries every field, so one that does not is caught."""
    fields = set(PlanInputs.__dataclass_fields__)
    text = repr(PlanInputs())
    assert fields and all(f"{name}=" in text for name in fields)
