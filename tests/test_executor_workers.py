"""The agent's worker processes (workers.py) with stand-in worker commands: what an exit reports, and that
exits are remembered and replayed to a planner that reconnects."""

from __future__ import annotations

import sys
import threading

from ballast.v1 import executor_pb2, plan_pb2
from services.executor.workers import Workers, worker_config


def assign_message(job_id: str, ranks: int = 1) -> executor_pb2.PlannerMessage:
    plan = plan_pb2.Plan(micro_batch_size=2, num_micro_batches=2)
    plan.stages.add(index=0, layer_begin=0, layer_end=3, devices=ranks)
    assign = executor_pb2.AssignInstruction(plan=plan, world_size=ranks, rendezvous="127.0.0.1:1", backend="gloo")
    for r in range(ranks):
        assign.workers.add(rank=r, stage_index=0, replica_index=r, device_index=r)
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


def test_a_worker_error_is_the_exit_message(tmp_path):
    _, exits = run_job(tmp_path, 'import sys; print(\'{"event": "error", "message": "boom"}\'); sys.exit(1)')
    assert [(e.finished, e.exit_code, e.message) for e in exits] == [(False, 1, "boom")]


def test_the_worker_config_follows_the_assignment():
    message = assign_message("job-c", ranks=2)
    config = worker_config(message.assign, message.assign.workers[1], "job-c")
    assert (config["rank"], config["replica_index"], config["num_replicas"], config["micro_batch_size"]) == (1, 1, 2, 1)
    assert config["init_method"] == "tcp://127.0.0.1:1" and config["device"] == "cpu"
