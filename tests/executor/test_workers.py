"""The agent's worker processes (workers.py) with stand-in worker commands: what an exit reports, and that
exits are remembered and replayed to a planner that reconnects."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from ballast.v1 import executor_pb2, plan_pb2
from services.executor.workers import REMEMBERED_CHECKPOINTS, Workers, plan_command, policies, worker_config
from tests.executor.assigns import assign_on_one_host


def assign_message(job_id: str, ranks: int = 1) -> executor_pb2.PlannerMessage:
    plan = plan_pb2.Plan(micro_batch_size=2, num_micro_batches=2)
    plan.stages.add(index=0, layer_begin=0, layer_end=3, devices=ranks)
    assign = assign_on_one_host(plan, job_id)
    return executor_pb2.PlannerMessage(instruction_id=f"{job_id}-assign-h", job_id=job_id, assign=assign)


def run_job(tmp_path, script: str, job_id: str = "job-w") -> tuple[Workers, list[executor_pb2.WorkerExit]]:
    exits, done = [], threading.Event()

    def emit(message: executor_pb2.AgentMessage) -> None:
        if message.HasField("worker_exit"):
            exits.append(message.worker_exit)
            done.set()

    workers = Workers(emit, tmp_path, command=(sys.executable, "-c", script))
    assert workers.assign(assign_message(job_id)).ok
    assert done.wait(30)
    return workers, exits


def test_a_worker_that_reports_done_and_exits_zero_finished(tmp_path):
    script = 'print(\'{"event": "iteration", "iteration": 1}\'); print(\'{"event": "done"}\')'
    workers, exits = run_job(tmp_path, script)
    assert [(e.finished, e.exit_code, e.iteration, e.message) for e in exits] == [(True, 0, 1, "")]
    assert [m.worker_exit for m in workers.replay()] == exits  # remembered for a planner that reconnects


def test_the_latest_checkpoint_reports_are_remembered_for_a_reconnect(tmp_path):
    """A checkpoint report in flight when the stream broke would be lost: the latest REMEMBERED_CHECKPOINTS
    iterations' reports go out again on a reconnect (the agent puts them ahead of everything waiting)."""
    lines = [{"event": "checkpoint", "iteration": it, "plan_version": 1,
              "every_layer": [{"layer_index": 0, "uri": f"file:///c/{it}/0.pt"}]} for it in (100, 200, 300)]
    script = "".join(f"print({json.dumps(json.dumps(x))}); " for x in lines) + "print('{\"event\": \"done\"}')"
    workers, exits = run_job(tmp_path, script)
    replayed = workers.replay_checkpoints()
    assert len(replayed) == REMEMBERED_CHECKPOINTS == 2
    assert [m.checkpoint_written.checkpoint.iteration for m in replayed] == [200, 300]
    assert all(m.checkpoint_written.checkpoint.complete for m in replayed)
    assert [m.worker_exit for m in workers.replay()] == exits


def test_iteration_stats_leave_in_windows_and_the_last_one_before_the_exit(tmp_path):
    """With a metrics window of 4, 10 iterations reach the planner as 0, 1, 2 alone, 3, 4-7, then 8-9 (the
    partial last window, flushed as the worker exits), all before its exit."""
    lines = [{"event": "iteration", "iteration": i + 1, "iteration_s": 0.1 * (i + 1), "stage": 0, "replica": 0}
             for i in range(10)]
    script = "".join(f"print({json.dumps(json.dumps(x))}); " for x in lines) + "print('{\"event\": \"done\"}')"
    sent, done = [], threading.Event()

    def emit(message: executor_pb2.AgentMessage) -> None:
        sent.append(message)
        if message.HasField("worker_exit"):
            done.set()

    workers = Workers(emit, tmp_path, command=(sys.executable, "-c", script))
    message = assign_message("job-win")
    message.assign.metrics_window = 4
    assert workers.assign(message).ok
    assert done.wait(30)
    windows = [s for m in sent if m.HasField("heartbeat") for s in m.heartbeat.stages]
    assert [(w.first_iteration, w.iteration, w.iterations) for w in windows] == [
        (0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 3, 1), (4, 7, 4), (8, 9, 2)]
    assert windows[4].iteration_time_max_s == pytest.approx(0.8) and windows[4].iteration_time_s == pytest.approx(0.65)
    assert sent[-1].HasField("worker_exit") and sent[-1].worker_exit.iteration == 10


def test_a_worker_error_is_the_exit_message(tmp_path):
    _, exits = run_job(tmp_path, 'import sys; print(\'{"event": "error", "message": "boom"}\'); sys.exit(1)')
    assert [(e.finished, e.exit_code, e.message) for e in exits] == [(False, 1, "boom")]



def test_reports_the_agent_cannot_read_never_cost_the_job_its_worker_exit(tmp_path):
    """A stray JSON line, a report with a bad field, a migration without its layer: each is skipped, and the
    exit still reaches the planner (without it the job would wait for this worker forever)."""
    script = ("print(5); print('[1, 2]'); print('{\"event\": \"iteration\", \"iteration\": \"x\"}'); "
              "print('{\"event\": \"migration\"}'); print('{\"event\": \"iteration\", \"iteration\": 3}'); "
              "print('{\"event\": \"done\"}')")
    _, exits = run_job(tmp_path, script)
    assert [(e.finished, e.exit_code, e.iteration) for e in exits] == [(True, 0, 3)]

def test_the_worker_config_follows_the_assignment():
    message = assign_message("job-c", ranks=2)
    config = worker_config(message.assign, message.assign.workers[1], "job-c")
    assert (config.rank, config.replica_index, config.num_replicas, config.micro_batch_size) == (1, 1, 2, 1)
    assert config.init_method == "tcp://127.0.0.1:1" and config.device == "cpu"


# A stand-in worker that takes one plan command from stdin and reports it applied, with one migrated layer.
TAKES_A_PLAN = r'''
import json, sys
command = json.loads(sys.stdin.readline())
assert command["command"] == "plan"
print(json.dumps({"event": "migration", "layer_index": 2, "from_stage": 0, "to_stage": 1, "bytes": 4096,
                  "duration_s": 0.01, "iteration": command["not_before"], "plan_version": command["version"]}))
print(json.dumps({"event": "plan_applied", "plan_version": command["version"], "iteration": command["not_before"],
                  "stage_bounds": command["stage_bounds"]}), flush=True)
sys.stdin.readline()  # wait until the agent lets go
print(json.dumps({"event": "done"}))
'''


def test_a_repartition_reaches_the_workers_and_is_acked_once_they_applied_it(tmp_path):
    messages: list[executor_pb2.AgentMessage] = []
    acked = threading.Event()

    def emit(message: executor_pb2.AgentMessage) -> None:
        messages.append(message)
        if message.HasField("ack"):
            acked.set()

    workers = Workers(emit, tmp_path, command=(sys.executable, "-c", TAKES_A_PLAN))
    assert workers.assign(assign_message("job-r")).ok
    plan = plan_pb2.Plan(version=2)
    plan.stages.add(index=0, layer_begin=0, layer_end=2, devices=1)
    plan.stages.add(index=1, layer_begin=2, layer_end=3, devices=1)
    plan.layers.add(layer_index=1, checkpoint=True)
    plan.layers.add(layer_index=2, swap_activations=True)
    message = executor_pb2.PlannerMessage(
        instruction_id="job-r-repartition-v2-h", job_id="job-r", version=2,
        repartition=executor_pb2.RepartitionInstruction(plan=plan, effective_iteration=7))
    assert plan_command(message) == {"command": "plan", "version": 2, "not_before": 7,
                                     "stage_bounds": [[0, 2], [2, 3]], "checkpoint_layers": [1], "swap_layers": [2]}
    assert workers.repartition(message) is None  # acked once applied, not when written
    assert acked.wait(30)
    ack = next(m.ack for m in messages if m.HasField("ack"))
    assert (ack.instruction_id, ack.version, ack.ok) == ("job-r-repartition-v2-h", 2, True)
    assert "after iteration 7" in ack.message
    moved = [m.layer_migrated for m in messages if m.HasField("layer_migrated")]
    assert [(m.migration.layer_index, m.migration.to_stage, m.migration.bytes, m.migration.plan_version)
            for m in moved] == [(2, 1, 4096, 2)]
    assert workers.applied_versions() == {"job-r": 2}
    assert workers.repartition(message).message == "plan version 2 already in force"  # a redelivery
    workers.stop("job-r", "test over")


def test_a_repartition_for_a_job_not_here_is_refused():
    workers = Workers(lambda m: None, Path("/nonexistent"))
    message = executor_pb2.PlannerMessage(instruction_id="x", job_id="job-none", version=2,
                                          repartition=executor_pb2.RepartitionInstruction())
    ack = workers.repartition(message)
    assert not ack.ok and "no worker of job job-none" in ack.message


def test_memory_policies_and_toggles_reach_the_worker_config():
    message = assign_message("job-p")
    message.assign.plan.layers.add(layer_index=0, checkpoint=True, swap_activations=True)  # recompute wins
    message.assign.plan.layers.add(layer_index=1, swap_activations=True)
    message.assign.spec.layer_toggles.add(layer_index=1, iteration=4, active=False)
    config = worker_config(message.assign, message.assign.workers[0], "job-p")
    assert (config.checkpoint_layers, config.swap_layers) == ([0], [1])
    assert config.layer_toggles == [[1, 4, 0]] and config.online is False
    message.assign.spec.online_repartition = True
    assert worker_config(message.assign, message.assign.workers[0], "job-p").online is True
    assert policies(message.assign.plan) == {"checkpoint_layers": [0], "swap_layers": [1]}


REFUSES_A_PLAN = r'''
import json, sys
command = json.loads(sys.stdin.readline())
print(json.dumps({"event": "command_rejected", "iteration": 3, "version": command["version"],
                  "message": "plan command field 'stage_bounds': stages must be contiguous"}), flush=True)
sys.stdin.readline()
'''


def test_a_plan_a_worker_refuses_is_acked_as_failed_with_its_reason(tmp_path):
    acks: list[executor_pb2.InstructionAck] = []
    acked = threading.Event()

    def emit(message: executor_pb2.AgentMessage) -> None:
        if message.HasField("ack"):
            acks.append(message.ack)
            acked.set()

    workers = Workers(emit, tmp_path, command=(sys.executable, "-c", REFUSES_A_PLAN))
    assert workers.assign(assign_message("job-x")).ok
    message = executor_pb2.PlannerMessage(instruction_id="job-x-repartition-v3-h", job_id="job-x", version=3,
                                          repartition=executor_pb2.RepartitionInstruction(plan=plan_pb2.Plan()))
    assert workers.repartition(message) is None
    assert acked.wait(30)
    assert [(a.instruction_id, a.version, a.ok) for a in acks] == [("job-x-repartition-v3-h", 3, False)]
    assert "rejected plan version 3" in acks[0].message and "contiguous" in acks[0].message
    workers.stop("job-x", "test over")
