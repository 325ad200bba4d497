"""The worker's Harmony mode (issue 19): an AssignInstruction whose plan has `harmony` becomes Harmony WorkerConfigs,
and two real worker processes on gloo run the wrap-around swap schedule of tests/executor/train/test_harmony.py's
untied GPT under a device budget below the model's size: the single-process losses, the bytes the schedule predicts
per rank, the stage trainer's events, an agreed stop, and a host store that is gone when the run ends."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict

from ballast.v1 import plan_pb2, services_pb2
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import train_single
from services.executor.train.worker import STOPPED_EXIT, run
from services.executor.workers import Workers, harmony_store_dir, worker_config
from services.memory.harmony_schedule import FORWARD, HarmonySchedule, traffic
from services.planner.plans.make import PlanInputs, make_plan
from services.planner.sim.harmony_search import Machine, search
from services.profiler import driver
from services.runtime.allocator import STEADY_ALLOCATOR
from services.runtime.errors import InvalidArgument
from services.runtime.ports import free_port
from services.zoo import build_model
from tests.executor.assigns import assign_on_one_host
from tests.executor.test_workers import assign_message
from tests.executor.train.test_harmony import (
    ADAM,
    BUDGET,
    DATA,
    GLOBAL_BATCH_SIZE,
    SEED,
    SPEC,
    STEPS,
    layers,
    reference,
)
from tests.harness import torch_threads
from tests.planner.plans.test_harmony import BUDGET as PLANNED_BUDGET
from tests.planner.plans.test_harmony import SPEC as PLANNED
from tests.planner.plans.test_offload import fleet

LAYERS = len(build_model(SPEC, device="meta").decompose().layers)
ONE_DEVICE = HarmonySchedule(2, ((0, 4), (4, 8)), 1, ((0, 2), (2, 4), (4, 6), (6, 8), (8, 10)), devices=1)


def settings(schedule: HarmonySchedule, store: Path, prefetch: bool = True, budget: int = BUDGET) -> dict:
    return {"forward_micro_batch": schedule.forward_micro_batch,
            "forward_packs": [list(p) for p in schedule.forward_packs],
            "backward_micro_batch": schedule.backward_micro_batch,
            "backward_packs": [list(p) for p in schedule.backward_packs],
            "devices": schedule.devices, "prefetch": prefetch, "device_budget_bytes": budget,
            "store_dir": str(store)}


def template(harmony: dict, devices: int = 2) -> WorkerConfig:
    """Rank 0 of `devices` Harmony workers over MINIBATCH samples (2 x 2: the ranks do not multiply it)."""
    return WorkerConfig(
        job_id="job-harmony", model=MessageToDict(SPEC, preserving_proto_field_name=True),
        stage_bounds=[[0, LAYERS]], num_replicas=devices, stage_index=0, replica_index=0, rank=0, world_size=devices,
        micro_batch_size=2, num_micro_batches=GLOBAL_BATCH_SIZE // 2, iterations=STEPS, init_method="tcp://127.0.0.1:1",
        optimizer=ADAM, seed=SEED, data=DATA, timeout_s=60, harmony=harmony)


@pytest.fixture(scope="module")
def two_devices():
    """The search's schedule for two devices under BUDGET, and the bytes it predicts per device."""
    costs = layers()
    choice = search(costs, GLOBAL_BATCH_SIZE, Machine(2, BUDGET, 5e9, 5e9))
    assert choice is not None and len(choice.schedule.tasks()) >= 4
    return choice, traffic(choice.schedule, [c.bytes() for c in costs], GLOBAL_BATCH_SIZE)


def test_two_harmony_workers_train_like_one_process_and_move_what_the_schedule_says(tmp_path, two_devices):
    choice, predicted = two_devices
    store = tmp_path / "store"
    config = template(settings(choice.schedule, store, choice.prefetch))
    plan = {"command": "plan", "version": 3, "not_before": 1, "stage_bounds": [[0, 2], [2, LAYERS]]}
    events = run_local(plan_configs(config, [[0, LAYERS]], 2), env=STEADY_ALLOCATOR, timeout_s=120,
                       commands={1: [plan]})
    expected, tasks = reference(), choice.schedule.tasks()
    done = []
    for rank, rank_events in enumerate(events):
        rejected = [e for e in rank_events if e["event"] == "command_rejected"]
        assert [(e["version"], "Harmony's swap schedule takes no plan commands" in e["message"]) for e in rejected] == (
            [(3, True)] if rank == 1 else [])
        kept = [e for e in rank_events if e["event"] != "command_rejected"]
        assert [e["event"] for e in kept] == ["started"] + ["iteration"] * STEPS + ["done"], rank_events
        started, iterations = kept[0], kept[1:-1]
        assert [started[k] for k in ("rank", "replica", "num_replicas", "num_stages")] == [rank, rank, 2, 1]
        assert started["layers"] == list(range(LAYERS)) and started["global_batch_size"] == GLOBAL_BATCH_SIZE
        h = started["harmony"]
        assert h["devices"] == 2 and h["device_budget_bytes"] == BUDGET < h["model_bytes"]
        assert h["schedule"]["backward_packs"] == [list(p) for p in choice.schedule.backward_packs]
        assert started["warnings"] == []
        assert [e["loss"] for e in iterations] == pytest.approx(expected, rel=1e-5, abs=0)
        for it in iterations:
            assert it["has_loss"] and it["swap_s"] > 0 and it["swapped_bytes"] == it["swap_out_bytes"]
            assert (it["swap_in_bytes"], it["swap_out_bytes"], it["bytes_sent"]) == (
                predicted.to_device[rank], predicted.to_host[rank], predicted.peer[rank])
            assert it["swap_in_bytes"] > 0 and it["swap_out_bytes"] > 0 and it["bytes_sent"] > 0
            assert it["device_budget_peak_bytes"] <= BUDGET < h["model_bytes"]
            assert it["comm_s"] == pytest.approx(it["p2p_s"] + it["allreduce_s"], rel=1e-12)
            assert 0 <= it["recompute_s"] <= it["backward_s"]
            parts = (it["forward_s"] + it["backward_s"] + it["p2p_s"] + it["allreduce_s"] + it["optimizer_s"]
                     + it["overhead_s"])
            assert parts == pytest.approx(it["iteration_s"], rel=1e-9)
            assert min(it["forward_s"], it["backward_s"], it["optimizer_s"], it["p2p_s"], it["overhead_s"]) >= 0
            assert it["backward_s"] > 0 and it["optimizer_s"] > 0  # every rank runs a backward task (>= 2 tasks each)
            assert (it["forward_s"] > 0) == any(t.kind == FORWARD and t.device == rank for t in tasks)
        done.append((kept[-1]["param_sha256"], kept[-1]["param_sum"]))
    assert done[0] == done[1]  # both hashed the one host store
    assert not store.exists()  # rank 0 removed it once every rank was done
    assert not (tmp_path / "ckpt").exists()


def test_a_drain_on_one_rank_stops_both_at_one_boundary_and_removes_the_store(tmp_path, two_devices):
    """Only rank 1 gets SIGUSR2; the vote on the loss sum stops both after the same iteration, undrained (no
    checkpoint to drain to), and the host store goes."""
    store = tmp_path / "store"
    choice = two_devices[0]  # its prefetch as the search chose it: a schedule may fit only without one
    config = replace(template(settings(choice.schedule, store, choice.prefetch)), iterations=10_000)
    configs = plan_configs(config, [[0, LAYERS]], 2)
    procs = []
    for config in configs:
        path = tmp_path / f"rank-{config.rank}.json"
        path.write_text(config.to_json())
        procs.append(subprocess.Popen([sys.executable, "-m", "services.executor.train.worker", str(path)],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, **STEADY_ALLOCATOR, "OMP_NUM_THREADS": "1"}))
    watchdog = threading.Timer(120, lambda: [p.kill() for p in procs])  # a missed stop must not hang the suite
    watchdog.start()
    outputs: list[list[dict]] = [[], []]
    reader = threading.Thread(target=lambda: outputs[0].extend(json.loads(line) for line in procs[0].stdout))
    reader.start()
    for line in procs[1].stdout:
        outputs[1].append(json.loads(line))
        if outputs[1][-1]["event"] == "iteration" and len(outputs[1]) == 2:
            procs[1].send_signal(signal.SIGUSR2)
    reader.join()
    codes = [p.wait() for p in procs]
    watchdog.cancel()
    assert codes == [STOPPED_EXIT, STOPPED_EXIT]
    stops = [out[-1] for out in outputs]
    assert [(s["event"], s["drained"]) for s in stops] == [("stopped", False)] * 2
    assert stops[0]["iteration"] == stops[1]["iteration"] < 10_000
    for out, stop in zip(outputs, stops, strict=True):
        assert [e["iteration"] for e in out if e["event"] == "iteration"] == list(range(1, stop["iteration"] + 1))
    assert not store.exists()


def test_harmony_refuses_a_stage_short_of_the_model_before_the_rendezvous(tmp_path):
    """Nobody listens on the rendezvous: it never gets there, and it touched no host store."""
    config = replace(template(settings(ONE_DEVICE, tmp_path / "store"), devices=1), stage_bounds=[[0, LAYERS - 1]])
    with torch_threads(1), pytest.raises(ValueError, match=r"^WorkerConfig\.stage_bounds: Harmony's one stage holds"):
        run(config, lambda e: None)
    assert not (tmp_path / "store").exists()


def test_harmony_refuses_packs_that_do_not_tile_the_model_before_the_rendezvous(tmp_path):
    short = HarmonySchedule(2, ((0, 4),), 2, ((0, 4), (4, LAYERS - 1)), devices=1)
    config = template(settings(short, tmp_path / "store"), devices=1)
    with torch_threads(1), pytest.raises(ValueError, match=rf"^WorkerConfig\.harmony: backward_packs must end at "
                                                           rf"layer {LAYERS}"):
        run(config, lambda e: None)
    assert not (tmp_path / "store").exists()


def test_harmony_refuses_a_model_it_cannot_replay_by_field(tmp_path):
    config = template(settings(ONE_DEVICE, tmp_path / "store"), devices=1)
    model = {**config.model, "transformer": {**config.model["transformer"], "tie_embeddings": True}}
    with torch_threads(1), pytest.raises(InvalidArgument) as err:
        run(replace(config, model=model), lambda e: None)
    assert err.value.field == "model.transformer.tie_embeddings"
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("change,field", [
    ({"harmony": {"devices": 3}}, r"harmony\.devices"),
    ({"harmony": {"forward_micro_batch": 3}}, r"harmony\.forward_micro_batch"),
    ({"harmony": {"backward_micro_batch": 0}}, r"harmony\.backward_micro_batch"),
    ({"harmony": {"forward_packs": [[0]]}}, r"harmony\.forward_packs"),
    ({"harmony": {"backward_packs": []}}, r"harmony\.backward_packs"),
    ({"harmony": {"prefetch": "yes"}}, r"harmony\.prefetch"),
    ({"harmony": {"device_budget_bytes": -1}}, r"harmony\.device_budget_bytes"),
    ({"harmony": {"store_dir": "relative/store"}}, r"harmony\.store_dir"),
    ({"harmony": {"pack_count": 2}}, r"harmony"),  # unknown key
    ({"chunk_bytes": 1_000_000}, r"chunk_bytes"),
    ({"device_budget_bytes": BUDGET}, r"device_budget_bytes"),
    ({"stage_bounds": [[0, 5], [5, LAYERS]], "num_replicas": 1}, r"stage_bounds"),
    ({"device": "cuda:0"}, r"device"),
    ({"backend": "nccl", "device": "cuda:0"}, r"backend"),
    ({"layer_toggles": [[1, 0, 0]]}, r"layer_toggles"),
    ({"checkpoint_layers": [1]}, r"checkpoint_layers"),
    ({"swap_layers": [1]}, r"swap_layers"),
    ({"zero1_layers": [1]}, r"zero1_layers"),
    ({"sdp_layers": [1]}, r"sdp_layers"),
])
def test_worker_config_validates_the_harmony_fields(change, field):
    base = template(settings(HarmonySchedule(2, ((0, 4),), 2, ((0, 4), (4, LAYERS)), 2), Path("/dev/shm/x")))
    base.validate()
    assert base.global_batch_size == GLOBAL_BATCH_SIZE
    changed = {**change, "harmony": {**base.harmony, **change.get("harmony", {})}}
    with pytest.raises(ValueError, match=rf"^WorkerConfig\.{field}:"):
        replace(base, **changed).validate()


def test_a_harmony_config_missing_a_key_is_refused_naming_it():
    base = template(settings(ONE_DEVICE, Path("/dev/shm/x")), devices=1)
    without = {k: v for k, v in base.harmony.items() if k != "store_dir"}
    with pytest.raises(ValueError, match=r"^WorkerConfig\.harmony: missing \['store_dir'\]"):
        replace(base, harmony=without).validate()


def harmony_plan(message) -> None:
    message.assign.plan.version = 4
    message.assign.plan.harmony.CopyFrom(plan_pb2.HarmonySwap(
        forward_micro_batch=2, forward_packs=[plan_pb2.LayerSpan(begin=0, end=1)], backward_micro_batch=1,
        backward_packs=[plan_pb2.LayerSpan(begin=0, end=1), plan_pb2.LayerSpan(begin=1, end=3)], devices=2,
        prefetch=True, device_budget_bytes=BUDGET))
    message.assign.placement.CopyFrom(assign_on_one_host(message.assign.plan, message.job_id).placement)  # placed anew


def test_a_harmony_plan_becomes_harmony_worker_configs():
    message = assign_message("job-h", ranks=2)
    assert worker_config(message.assign, message.assign.workers[0], "job-h").harmony == {}
    harmony_plan(message)
    message.assign.placement.backend = "nccl"  # the Harmony worker runs on gloo and the CPU whatever it says
    configs = [worker_config(message.assign, w, "job-h") for w in message.assign.workers]
    store = harmony_store_dir("job-h", 4)
    assert store.endswith("/ballast-harmony-job-h-v4") and store != harmony_store_dir("job-h", 5)
    assert [c.harmony for c in configs] == [{
        "forward_micro_batch": 2, "forward_packs": [[0, 1]], "backward_micro_batch": 1,
        "backward_packs": [[0, 1], [1, 3]], "devices": 2, "prefetch": True, "device_budget_bytes": BUDGET,
        "store_dir": store}] * 2  # one host store for every rank of the job
    assert [(c.replica_index, c.backend, c.device) for c in configs] == [(r, "gloo", "cpu") for r in (0, 1)]
    worker = WorkerConfig.from_json(configs[1].to_json())  # as the worker reads it
    assert worker.global_batch_size == 4  # the plan's 2 x 2, not multiplied by the two devices
    assert "/" not in Path(harmony_store_dir("a/../b", 1)).name


def test_the_agent_removes_a_harmony_store_its_workers_left_behind(tmp_path):
    """Workers killed before rank 0 could clean up: once every worker of the job exited, the agent removes it."""
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    message = assign_message(job_id, ranks=2)
    harmony_plan(message)
    store = Path(harmony_store_dir(job_id, 4))
    exits, done = [], threading.Event()

    def emit(m) -> None:
        if m.HasField("worker_exit"):
            exits.append(m.worker_exit)
            if len(exits) == 2:
                done.set()

    script = (f"import os, sys; os.makedirs({str(store)!r}, exist_ok=True); open({str(store / 'w0')!r}, 'w'); "
              "sys.exit(9)")
    workers = Workers(emit, tmp_path, command=(sys.executable, "-c", script))
    try:
        assert workers.assign(message).ok
        assert done.wait(30)
        assert [e.exit_code for e in exits] == [9, 9]
        deadline = time.monotonic() + 10  # the last exit goes out just before the agent removes the store
        while store.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not store.exists()
    finally:
        shutil.rmtree(store, ignore_errors=True)


def test_a_planned_harmony_schedule_runs_in_the_workers_as_the_plan_predicts():
    """The planner's Plan.harmony (make_plan on a profile of the model) through worker_config into two workers:
    the single-process losses, under the budget and the plan's predicted peak, moving the bytes it predicted."""
    request = services_pb2.ProfileRequest(options=services_pb2.ProfileOptions(
        micro_batch_sizes=[1, 2], intra_op_threads=1, skip_memory_trace=True))
    profile = driver.profile(PLANNED, request)
    profile.id, profile.model_id = "prf-h", "mdl-h"
    plan = make_plan(profile, fleet(profile, devices=2, memory=PLANNED_BUDGET),
                     PlanInputs(global_batch_size=4, harmony=True))
    assert plan.HasField("harmony")
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    assign = assign_on_one_host(plan, job_id, free_port())
    assign.spec.model.CopyFrom(PLANNED)
    assign.spec.iterations, assign.spec.seed = STEPS, SEED
    configs = [worker_config(assign, w, job_id) for w in assign.workers]
    assert configs[0].harmony["store_dir"] == configs[1].harmony["store_dir"]
    events = run_local(configs, env=STEADY_ALLOCATOR, timeout_s=120)
    with torch_threads(1):
        expected = train_single(PLANNED, DATA, SEED, 4, STEPS, configs[0].optimizer)
    its = [[e for e in rank if e["event"] == "iteration"] for rank in events]
    h = plan.harmony
    for rank in its:
        assert [e["loss"] for e in rank] == pytest.approx(expected, rel=1e-5, abs=0)
        assert all(e["device_budget_peak_bytes"] <= h.predicted_device_peak_bytes <= PLANNED_BUDGET for e in rank)
    for k in range(STEPS):
        assert (sum(r[k]["swap_in_bytes"] for r in its), sum(r[k]["swap_out_bytes"] for r in its),
                sum(r[k]["bytes_sent"] for r in its)) == (
            h.predicted_to_device_bytes, h.predicted_to_host_bytes, h.predicted_peer_bytes)
    assert not Path(configs[0].harmony["store_dir"]).exists()
