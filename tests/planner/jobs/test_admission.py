"""The admission engine's behaviour: gangs, order, fair share, quotas, backfilling, re-planning, preemption."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from services.planner.admission import (
    DEVICES_BUSY,
    JOB_AHEAD,
    NO_EXECUTOR,
    PREEMPTED,
    QUOTA,
    REPLANNING,
    Decision,
    Demand,
    Holding,
    Policy,
    Slot,
    admission_order,
    decayed_usage,
    decide,
    predicted_starts,
)

NOW = 1_000.0
GPU = "h100"
ONLINE = {GPU, "cpu"}


def host(name: str, n: int, kind: str = GPU, first: int = 0) -> list[Slot]:
    return [Slot(f"id-{name}", i, kind, name) for i in range(first, first + n)]


def job(job_id: str, devices: int, tenant: str = "t1", priority: int = 0, submitted: float = 0.0,
        duration: float = 100.0, **kw) -> Demand:
    return Demand(job_id=job_id, tenant_id=tenant, priority=priority, submitted_at=submitted, devices=devices,
                  kind=kw.pop("kind", GPU), duration_s=duration, **kw)


def holding(job_id: str, slots: list[Slot], end: float, tenant: str = "t9", priority: int = 0, **kw) -> Holding:
    return Holding(job_id=job_id, tenant_id=tenant, priority=priority, slots=tuple(slots), predicted_end=end, **kw)


def run(queue, free, running=(), policy=None, usage=None, online=ONLINE, **kw) -> Decision:
    return decide(list(queue), list(free), list(running), policy or Policy(), usage or {}, NOW, online, **kw)


def admitted(d: Decision) -> dict[str, tuple[Slot, ...]]:
    return dict(d.admit)


# --- gangs and order ----------------------------------------------------------------------------------


def test_a_gang_starts_with_all_its_devices_or_not_at_all():
    d = run([job("j", 4)], host("a", 2) + host("b", 1))
    assert d.admit == []
    assert d.waiting["j"].reason == DEVICES_BUSY
    d = run([job("j", 4)], host("a", 2) + host("b", 2))
    assert len(admitted(d)["j"]) == 4


def test_a_gang_spans_as_few_hosts_as_it_can_and_fits_the_tightest_host():
    free = host("a", 3) + host("b", 8) + host("c", 2) + host("d", 5)
    d = run([job("two", 2, submitted=0), job("ten", 10, submitted=1)], free)
    placed = admitted(d)
    assert {s.host_name for s in placed["two"]} == {"c"}  # best fit, host b stays whole
    # fullest host first (b: 8), the rest on the tightest host that fits it (a: 3), so d's 5 stay together
    assert sorted(s.host_name for s in placed["ten"]) == ["a", "a"] + ["b"] * 8


def test_a_plan_priced_on_nodes_keeps_each_nodes_ranks_on_one_host():
    """A 2-device plan priced on one node must not be split over two hosts with one free each (the fleet-scale
    replay found it), and a 3 x 4 plan takes whole groups of 4 from each host, in rank order."""
    fragmented = host("a", 1) + host("b", 1) + host("c", 1)
    d = run([job("pair", 2, group=2)], fragmented)
    assert d.admit == [] and d.waiting["pair"].reason == DEVICES_BUSY
    assert "as 1 host(s) with 2 free each" in d.waiting["pair"].detail
    assert len(admitted(run([job("pair", 2)], fragmented))["pair"]) == 2  # no group: any two devices
    d = run([job("pair", 2, group=2)], fragmented + host("d", 2, first=4))
    assert {s.host_name for s in admitted(d)["pair"]} == {"d"}
    free = host("a", 6) + host("b", 3) + host("c", 4) + host("e", 5)
    placed = admitted(run([job("twelve", 12, group=4)], free))["twelve"]
    per_host = {h: sum(s.host_name == h for s in placed) for h in "abce"}
    assert sum(per_host.values()) == 12 and all(n % 4 == 0 for n in per_host.values()), per_host
    names = [s.host_name for s in placed]  # rank r runs on slot r: a host's ranks are whole groups
    assert all(len(set(names[i:i + 4])) == 1 for i in range(0, 12, 4))


def test_a_replan_keeps_the_cut_fleets_groups_on_one_host():
    """A re-plan for f devices is priced on cut_shape(f, 4): 6 as three nodes of 2, which the free hosts
    (3, 1, 3) cannot hold (a pair each on a and c); 5 as five nodes of 1, which they can."""
    free = host("a", 3) + host("b", 1) + host("c", 3)
    d = run([job("flex", 8, min_devices=2, max_devices=6, per_node=4)], free)
    assert d.replan == [("flex", 5)]
    d = run([job("flex", 8, min_devices=2, max_devices=6)], free)
    assert d.replan == [("flex", 6)]  # without a node shape: any six devices


def test_higher_priority_goes_first_whatever_the_submission_order():
    d = run([job("low", 4, submitted=0), job("high", 4, priority=5, submitted=9)], host("a", 4))
    assert d.order == ["high", "low"]
    assert list(admitted(d)) == ["high"]


def test_fair_share_puts_the_heavier_past_user_second_and_weights_count():
    queue = [job("heavy", 4, tenant="t1", submitted=0), job("light", 4, tenant="t2", submitted=5)]
    usage = {"t1": 1000.0, "t2": 100.0}
    assert [d.job_id for d in admission_order(queue, usage, Policy())] == ["light", "heavy"]
    assert list(admitted(run(queue, host("a", 4), usage=usage))) == ["light"]
    # With 20x the weight, t1's 1000 device-seconds weigh 50 against t2's 100: t1 goes first.
    weighted = Policy(weights={"t1": 20.0})
    assert [d.job_id for d in admission_order(queue, usage, weighted)] == ["heavy", "light"]


def test_equal_priority_and_share_is_first_come_first_served_then_by_job_id():
    queue = [job("c", 1, submitted=2), job("b", 1, submitted=1), job("a", 1, submitted=2)]
    assert [d.job_id for d in admission_order(queue, {}, Policy())] == ["b", "a", "c"]


# --- quota and executors --------------------------------------------------------------------------------


def test_a_job_over_its_tenants_quota_waits_and_reserves_nothing():
    policy = Policy(quotas={"t1": 4})
    running = [holding("r", host("a", 2), end=NOW + 500, tenant="t1")]
    queue = [job("over", 4, tenant="t1", priority=9), job("other", 8, tenant="t2", duration=1e6)]
    d = run(queue, host("b", 8), running, policy)
    assert d.waiting["over"].reason == QUOTA
    assert d.waiting["over"].predicted_start is None
    assert list(admitted(d)) == ["other"]  # the quota-bound job held nothing back


def test_quota_is_never_exceeded_within_a_pass():
    policy = Policy(quotas={"t1": 5})
    queue = [job(f"j{i}", 2, tenant="t1", submitted=i) for i in range(4)]
    d = run(queue, host("a", 8), policy=policy)
    assert list(admitted(d)) == ["j0", "j1"]
    assert {d.waiting[j].reason for j in ("j2", "j3")} == {QUOTA}


def test_a_kind_no_executor_serves_waits_for_one():
    d = run([job("tpu", 1, kind="tpu"), job("gpu", 1)], host("a", 1), online={GPU})
    assert d.waiting["tpu"].reason == NO_EXECUTOR
    assert list(admitted(d)) == ["gpu"]


# --- backfilling ----------------------------------------------------------------------------------------


def backfill_case(small_duration: float) -> Decision:
    """8 devices: 6 held until NOW+100, 2 free; a big 8-device job ahead of a small 2-device one."""
    running = [holding("r", host("a", 6), end=NOW + 100)]
    queue = [job("big", 8, submitted=0, duration=50), job("small", 2, submitted=1, duration=small_duration)]
    return run(queue, host("b", 2), running)


def test_a_short_job_backfills_when_it_ends_before_the_reservation_ahead():
    d = backfill_case(small_duration=60)
    assert list(admitted(d)) == ["small"]
    assert (d.waiting["big"].reason, d.waiting["big"].predicted_start) == (DEVICES_BUSY, NOW + 100)


@pytest.mark.parametrize(("high", "backfills"), [(0.0, True), (90.0, True), (120.0, False)])
def test_a_backfill_must_end_in_time_at_its_predictions_upper_bound(high: float, backfills: bool):
    """Issue 45: a guess that runs long delays the job the devices were reserved for, so the backfill is judged at
    Prediction.iteration_time_high_s's run time (none given: the nominal one). The nominal 60 s fits the 100 s
    before the reservation; at an upper bound of 120 s it does not."""
    running = [holding("r", host("a", 6), end=NOW + 100)]
    queue = [job("big", 8, submitted=0, duration=50),
             replace(job("small", 2, submitted=1, duration=60), duration_high_s=high)]
    d = run(queue, host("b", 2), running)
    assert list(admitted(d)) == (["small"] if backfills else [])
    assert d.waiting["big"].predicted_start == NOW + 100  # the reservation ahead holds either way


def test_a_job_that_would_delay_the_reservation_ahead_waits_for_it():
    d = backfill_case(small_duration=101)
    assert d.admit == []
    assert d.waiting["big"].predicted_start == NOW + 100
    assert d.waiting["small"].reason == JOB_AHEAD
    assert d.waiting["small"].predicted_start == NOW + 150  # after the big job's predicted run


def test_a_long_job_backfills_on_devices_the_reservation_does_not_need():
    running = [holding("r", host("a", 4), end=NOW + 100)]
    queue = [job("big", 6, submitted=0), job("long", 2, submitted=1, duration=1e6)]
    d = run(queue, host("b", 4), running)  # 8 devices: big takes 6 at NOW+100, 2 stay spare forever
    assert list(admitted(d)) == ["long"]
    assert d.waiting["big"].predicted_start == NOW + 100


def test_an_unknown_duration_never_backfills():
    running = [holding("r", host("a", 6), end=NOW + 100)]
    queue = [job("big", 8, submitted=0), job("unknown", 2, submitted=1, duration=0)]
    assert run(queue, host("b", 2), running).waiting["unknown"].reason == JOB_AHEAD


def test_an_overdue_job_still_holds_its_devices():
    running = [holding("late", host("a", 4), end=NOW - 50)]
    d = run([job("j", 4)], host("b", 2), running)
    assert d.admit == [] and d.waiting["j"].predicted_start == pytest.approx(NOW, abs=0.01)


def test_predicted_starts_cover_the_whole_queue_and_the_depth_limit_bounds_decide():
    running = [holding("r", host("a", 8), end=NOW + 100)]
    queue = [job(f"j{i}", 8, submitted=i, duration=100) for i in range(5)]
    starts = predicted_starts(queue, [], running, Policy(), {}, NOW, ONLINE)
    assert starts == {f"j{i}": NOW + 100 * (i + 1) for i in range(5)}
    d = run(queue, [], running, reserve_depth=2)
    assert [d.waiting[f"j{i}"].predicted_start for i in range(5)] == [NOW + 100, NOW + 200, None, None, None]


def test_a_job_bigger_than_the_fleet_is_never_predicted_to_start():
    d = run([job("huge", 16)], host("a", 8))
    assert d.waiting["huge"].predicted_start is None
    assert "only 8 h100 devices ever free up" in d.waiting["huge"].detail


# --- re-planning ----------------------------------------------------------------------------------------


def test_a_job_with_a_range_is_replanned_for_the_devices_free_now_and_takes_them():
    queue = [job("flex", 8, min_devices=2, max_devices=8, submitted=0), job("next", 1, submitted=1)]
    d = run(queue, host("a", 5), [holding("r", host("b", 3), end=NOW + 1000)])
    assert d.replan == [("flex", 5)]
    assert d.waiting["flex"].reason == REPLANNING
    assert d.admit == []  # the five slots went to the re-planned job in this pass
    assert d.waiting["next"].reason == DEVICES_BUSY


def test_a_replan_stays_within_the_range_and_the_quota():
    running = [holding("r", host("b", 7), end=NOW + 1000)]
    d = run([job("flex", 8, min_devices=2, max_devices=8)], host("a", 1), running)
    assert d.replan == [] and d.waiting["flex"].reason == DEVICES_BUSY  # 1 free < min 2
    d = run([job("flex", 8, min_devices=2, max_devices=8)], host("a", 6), policy=Policy(quotas={"t1": 3}))
    assert d.replan == [("flex", 3)]


# --- preemption -----------------------------------------------------------------------------------------


def fleet_of_victims() -> list[Holding]:
    return [
        holding("a4", host("a", 4), end=NOW + 500, priority=1),
        holding("b2", host("b", 2), end=NOW + 500, priority=0),
        holding("c2", host("c", 2), end=NOW + 600, priority=0),
        holding("d3", host("d", 3), end=NOW + 500, priority=0),
    ]


def test_preemption_takes_the_fewest_devices():
    d = run([job("urgent", 3, priority=9, preempts=True)], [], fleet_of_victims())
    assert d.preempt == [("d3", "urgent")]
    assert d.waiting["urgent"].reason == DEVICES_BUSY
    assert "d3" in d.waiting["urgent"].detail
    assert d.waiting["urgent"].predicted_start == NOW


def test_preemption_ties_go_to_the_lowest_priority_then_the_latest_end():
    # Four devices: {a4} or {b2, c2}; b2 and c2 have the lower priority.
    d = run([job("urgent", 4, priority=9, preempts=True)], [], fleet_of_victims())
    assert sorted(d.preempt) == [("b2", "urgent"), ("c2", "urgent")]
    # Two devices: b2 or c2, same priority; c2 ends later, so it loses less by going.
    d = run([job("urgent", 2, priority=9, preempts=True)], [], fleet_of_victims())
    assert d.preempt == [("c2", "urgent")]


def test_a_victim_whose_devices_a_job_ahead_reserves_at_its_end_is_not_enough():
    running = [holding("short", host("a", 2), end=NOW + 10, priority=0),
               holding("long", host("b", 2), end=NOW + 5000, priority=1)]
    queue = [job("ahead", 2, priority=9, duration=100), job("p", 2, priority=5, preempts=True, duration=1000)]
    d = run(queue, [], running)
    # "short" is the cheaper victim by priority, but "ahead" takes its devices at NOW+10
    assert d.preempt == [("long", "p")]
    assert d.waiting["p"].predicted_start == NOW


def test_preemption_counts_free_devices_and_never_takes_equal_or_higher_priority():
    running = [holding("same", host("a", 4), end=NOW + 500, priority=5),
               holding("low", host("b", 2), end=NOW + 500, priority=1)]
    d = run([job("p", 4, priority=5, preempts=True)], host("c", 2), running)
    assert d.preempt == [("low", "p")]
    d = run([job("p", 8, priority=5, preempts=True)], host("c", 2), running)
    assert d.preempt == []  # even taking "low" is not enough without "same", which is not lower
    assert d.waiting["p"].reason == DEVICES_BUSY


def test_only_a_preempting_class_preempts_and_only_one_job_per_pass():
    running = fleet_of_victims()
    assert run([job("plain", 2, priority=9)], [], running).preempt == []
    queue = [job("p1", 2, priority=9, preempts=True, submitted=0), job("p2", 2, priority=9, preempts=True,
                                                                           submitted=1)]
    d = run(queue, [], running)
    assert {for_job for _, for_job in d.preempt} == {"p1"}


def test_preemption_respects_the_hourly_limit():
    running = [holding("tired", host("a", 2), end=NOW + 500, preemptions_last_hour=2),
               holding("fresh", host("b", 4), end=NOW + 500)]
    d = run([job("p", 2, priority=9, preempts=True)], [], running, Policy(max_preemptions_per_hour=2))
    assert d.preempt == [("fresh", "p")]
    d = run([job("p", 2, priority=9, preempts=True)], [], running, Policy(max_preemptions_per_hour=3))
    assert d.preempt == [("tired", "p")]


def test_draining_devices_serve_the_job_they_were_freed_for_not_a_lower_one():
    running = [holding("victim", host("a", 2), end=NOW + 500, draining=True),
               holding("other", host("b", 4), end=NOW + 500)]
    queue = [job("p", 4, priority=9, preempts=True), job("lower", 2, priority=0, duration=10)]
    d = run(queue, host("c", 2), running)
    assert d.preempt == []  # two free plus two draining are enough: no second victim
    assert d.waiting["p"].predicted_start == NOW
    assert d.admit == [] and d.waiting["lower"].reason == JOB_AHEAD


def test_a_preempted_job_waits_as_preempted_unless_something_more_specific_holds():
    running = [holding("r", host("a", 4), end=NOW + 100)]
    queue = [job("back", 4, preempted=True), job("capped", 4, tenant="t2", preempted=True)]
    d = run(queue, [], running, Policy(quotas={"t2": 2}))
    assert d.waiting["back"].reason == PREEMPTED
    assert d.waiting["back"].predicted_start == NOW + 100
    assert d.waiting["capped"].reason == QUOTA


# --- determinism, usage ------------------------------------------------------------------------------------


def test_the_same_inputs_give_the_same_decision_in_any_input_order():
    rng = random.Random(7)
    queue, free, running, policy, usage = random_case(rng)
    first = run(queue, free, running, policy, usage)
    for _ in range(5):
        rng.shuffle(queue)
        rng.shuffle(free)
        rng.shuffle(running)
        assert run(queue, free, running, policy, usage) == first


def test_decayed_usage_halves_a_device_second_per_half_life():
    h = 600.0
    recent = decayed_usage([("t", NOW - 1, NOW)], NOW, h)["t"]
    old = decayed_usage([("t", NOW - h - 1, NOW - h)], NOW, h)["t"]
    assert old / recent == pytest.approx(0.5, rel=1e-3)
    # closed form against the integral; a live lease counts up to now, the future not at all
    live = decayed_usage([("t", NOW - 1200, None), ("u", NOW + 5, None)], NOW, h)
    assert live["t"] == pytest.approx(h / math.log(2) * (1 - 0.25))
    assert live["u"] == 0.0
    both = decayed_usage([("t", NOW - 10, NOW), ("t", NOW - 10, NOW + 50)], NOW, 0)
    assert both == {"t": 20.0}  # no half-life, no decay; two leases, two devices


# --- properties on random fleets ----------------------------------------------------------------------------


def random_case(rng: random.Random):
    kinds = [GPU, "cpu"]
    hosts = [(f"h{i}", rng.choice(kinds), rng.randint(1, 8)) for i in range(rng.randint(1, 6))]
    free, running = [], []
    for name, kind, n in hosts:
        slots = host(name, n, kind)
        rng.shuffle(slots)
        while slots:
            if rng.random() < 0.4:
                free.append(slots.pop())
                continue
            take = [slots.pop() for _ in range(rng.randint(1, len(slots)))]
            running.append(holding(f"r{len(running)}", take, end=NOW + rng.choice([-10, 0, 50, 500, 5000]),
                                   tenant=f"t{rng.randint(0, 3)}", priority=rng.randint(0, 2),
                                   preemptions_last_hour=rng.randint(0, 2), draining=rng.random() < 0.1))
    queue = []
    for i in range(rng.randint(0, 30)):
        n = rng.randint(1, 8)
        lo = rng.randint(1, n) if rng.random() < 0.3 else 0
        queue.append(job(f"j{i}", n, tenant=f"t{rng.randint(0, 3)}", priority=rng.randint(0, 2),
                         submitted=rng.random() * 100, duration=rng.choice([0, 10, 100, 1000, 1e5]),
                         kind=rng.choice(kinds + ["tpu"]), preempts=rng.random() < 0.3,
                         min_devices=lo, max_devices=rng.randint(n, 8) if lo else 0,
                         preempted=rng.random() < 0.2))
    quotas = {f"t{i}": rng.choice([0, 2, 4, 8]) for i in range(4)}
    weights = {f"t{i}": rng.choice([0.5, 1.0, 3.0]) for i in range(4)}
    usage = {f"t{i}": rng.random() * 1000 for i in range(4)}
    return queue, free, running, Policy(quotas, weights, rng.randint(1, 3)), usage


def test_random_queues_never_double_book_overfill_or_break_a_quota():
    rng = random.Random(20260101)
    for _ in range(400):
        queue, free, running, policy, usage = random_case(rng)
        d = run(queue, free, running, policy, usage, reserve_depth=rng.choice([None, 0, 3, 64]))
        jobs = {q.job_id: q for q in queue}
        taken = [s for _, slots in d.admit for s in slots]
        assert len(taken) == len(set(taken))  # no slot twice
        assert set(taken) <= set(free)  # only free slots: never a running job's
        assert not set(taken) & {s for h in running for s in h.slots}
        leased = {h.tenant_id: 0 for h in running}
        for h in running:
            leased[h.tenant_id] += len(h.slots)
        before = dict(leased)
        replanned = dict(d.replan)
        for job_id, slots in d.admit:
            q = jobs[job_id]
            assert len(slots) == q.devices and {s.kind for s in slots} == {q.kind}  # whole gangs, right kind
            leased[q.tenant_id] = leased.get(q.tenant_id, 0) + len(slots)
        for job_id, f in d.replan:
            q = jobs[job_id]
            assert q.min_devices <= f <= q.max_devices and d.waiting[job_id].reason == REPLANNING
            leased[q.tenant_id] = leased.get(q.tenant_id, 0) + f
        per_kind_free = {k: sum(1 for s in free if s.kind == k) for k in {s.kind for s in free}}
        for kind, n in per_kind_free.items():
            used = sum(len(s) for j, s in d.admit if jobs[j].kind == kind)
            used += sum(f for j, f in replanned.items() if jobs[j].kind == kind)
            assert used <= n
        for tenant, n in leased.items():
            quota = policy.quota(tenant)
            if quota and n != before.get(tenant, 0):
                assert n <= quota
        assert sorted(d.order) == sorted(jobs)
        assert set(d.waiting) | set(admitted(d)) == set(jobs) and not set(d.waiting) & set(admitted(d))
        by_id = {h.job_id: h for h in running}
        for victim, for_job in d.preempt:
            assert by_id[victim].priority < jobs[for_job].priority and not by_id[victim].draining
            assert by_id[victim].preemptions_last_hour < policy.max_preemptions_per_hour
        assert len({for_job for _, for_job in d.preempt}) <= 1
        for job_id, w in d.waiting.items():
            if jobs[job_id].kind == "tpu":
                assert w.reason == NO_EXECUTOR


def test_jobs_further_back_never_delay_the_predicted_start_of_a_job_ahead():
    rng = random.Random(99)
    for _ in range(60):
        queue, free, running, policy, usage = random_case(rng)
        full = run(queue, free, running, policy, usage, reserve_depth=None)
        jobs = {q.job_id: q for q in queue}
        for k, job_id in enumerate(full.order):
            if job_id not in full.waiting:
                continue
            alone = run([jobs[j] for j in full.order[: k + 1]], free, running, policy, usage, reserve_depth=None)
            assert alone.waiting[job_id] == full.waiting[job_id]


@pytest.mark.parametrize(("plan_nodes", "per_node", "need", "widest", "spec_per_node", "expected"), [
    (1, 2, 2, 8, 0, (2, 8)),  # a one-node plan of 2 on 8-device hosts: one host
    (3, 4, 12, 8, 0, (4, 8)),  # 12 planned as 3 x 4
    (2, 8, 10, 8, 0, (2, 8)),  # Varuna's 10 of 16: groups of gcd(8, 10)
    (1, 4, 4, 2, 0, (2, 2)),  # a machine of two 2-device agents (tests, the demo) is one node to the planner
    (2, 8, 16, 8, 4, (8, 4)),  # the job's own fleet has 4 per node: re-plans cut it
    (1, 2, 2, 0, 0, (1, 0)),  # no host registered yet
])
def test_a_demands_groups_follow_its_plans_nodes_and_the_hosts(plan_nodes, per_node, need, widest, spec_per_node,
                                                              expected):
    from ballast.v1 import fleet_pb2, job_pb2, plan_pb2
    from services.planner.jobs.admit import node_groups

    plan = plan_pb2.Plan(fleet=fleet_pb2.Fleet(nodes=plan_nodes, devices_per_node=per_node))
    job_ = job_pb2.Job()
    if spec_per_node:
        job_.spec.fleet.devices_per_node = spec_per_node
    assert node_groups(plan, job_, need, widest) == expected
