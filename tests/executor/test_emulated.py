"""Emulated workers (issue 43) under the agent's real `Workers`: what a job's ranks report, in the real events and
checkpoint format, and how they end -- done, drained, stopped, or broken by a lost peer."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from ballast.v1 import executor_pb2, plan_pb2
from services.executor.emulated import PEER_LOSS_S, Behaviour, Emulator
from services.executor.train import checkpoint as ckpt
from services.executor.workers import Workers
from tests.executor.assigns import assign_on_one_host


class Agent:
    """What an agent's outbox would send, in order; `ended` once every rank's exit came."""

    def __init__(self, ranks: int) -> None:
        self.messages: list[executor_pb2.AgentMessage] = []
        self.ranks, self.ended = ranks, threading.Event()

    def emit(self, message: executor_pb2.AgentMessage) -> None:
        self.messages.append(message)
        if len(self.exits()) == self.ranks:
            self.ended.set()

    def exits(self) -> list[executor_pb2.WorkerExit]:
        return [m.worker_exit for m in self.messages if m.HasField("worker_exit")]

    def stats(self) -> list[executor_pb2.StageStats]:
        return [s for m in self.messages if m.HasField("heartbeat") for s in m.heartbeat.stages]

    def checkpoints(self) -> list[executor_pb2.CheckpointWritten]:
        return [m.checkpoint_written for m in self.messages if m.HasField("checkpoint_written")]


def job(tmp_path: Path, stages: int, replicas: int, iterations: int, every: int = 0,
        predicted_s: float = 0.01) -> executor_pb2.PlannerMessage:
    plan = plan_pb2.Plan(micro_batch_size=2, num_micro_batches=2, version=1)
    plan.prediction.iteration_time_s = predicted_s
    for s in range(stages):
        plan.stages.add(index=s, layer_begin=2 * s, layer_end=2 * s + 2, devices=replicas)
    assign = assign_on_one_host(plan, "job-e")
    assign.spec.iterations, assign.spec.checkpoint_every = iterations, every
    assign.checkpoint_dir = str(tmp_path / "ckpt") if every else ""
    return executor_pb2.PlannerMessage(instruction_id="i-1", job_id="job-e", assign=assign)


def start(tmp_path: Path, message: executor_pb2.PlannerMessage, noise: float = 0.0) -> tuple[Agent, Workers, Emulator]:
    world = len(message.assign.workers)
    agent, emulator = Agent(world), Emulator(Behaviour(noise=noise, seed=3))
    workers = Workers(agent.emit, tmp_path / "work", launch=emulator.launcher("host-a"))
    assert workers.assign(message).ok
    return agent, workers, emulator


def test_a_job_runs_to_done_with_every_ranks_iterations_and_real_checkpoints(tmp_path):
    agent, _, _ = start(tmp_path, job(tmp_path, stages=2, replicas=2, iterations=6, every=3))
    assert agent.ended.wait(10)
    assert all(e.finished and e.exit_code == 0 and e.iteration == 6 for e in agent.exits())
    by_rank = {}
    for s in agent.stats():
        by_rank.setdefault(s.rank, []).append(s.iteration)
    assert by_rank == {r: list(range(6)) for r in range(4)}  # every rank, every iteration, numbered from 0
    assert all(s.iteration_time_s == pytest.approx(0.01) and s.plan_version == 1 for s in agent.stats())
    complete = [c.checkpoint for c in agent.checkpoints() if c.checkpoint.complete]
    assert [c.iteration for c in complete] == [3, 6]  # rank 0 vouches for every layer, as a real worker does
    manifest = ckpt.read_manifest(tmp_path / "ckpt" / "iter-00000006")
    assert manifest["complete"] and manifest["num_layers"] == 4 and manifest["next_iteration"] == 6
    assert {int(k) for k in manifest["layers"]} == {0, 1, 2, 3}


def test_a_drain_checkpoints_at_one_boundary_and_every_rank_exits_drained(tmp_path):
    agent, workers, _ = start(tmp_path, job(tmp_path, stages=1, replicas=2, iterations=1000, every=500,
                                            predicted_s=0.02))
    threading.Event().wait(0.1)
    assert workers.drain("job-e", "morph") == 2
    assert agent.ended.wait(10)
    exits = agent.exits()
    assert all(e.drained and not e.finished for e in exits) and len({e.iteration for e in exits}) == 1
    at = exits[0].iteration
    assert ckpt.read_manifest(tmp_path / "ckpt" / f"iter-{at:08d}")["next_iteration"] == at


def test_a_killed_rank_breaks_its_peers_as_an_infrastructure_failure(tmp_path):
    agent, workers, emulator = start(tmp_path, job(tmp_path, stages=2, replicas=1, iterations=1000))
    threading.Event().wait(0.1)
    assert emulator.kill_rank("job-e", 1)
    assert agent.ended.wait(PEER_LOSS_S + 5)
    exits = {e.rank: e for e in agent.exits()}
    assert exits[1].exit_code == -signal.SIGKILL and "SIGKILL" in exits[1].message
    assert exits[0].infrastructure and "rank 1 is gone" in exits[0].message


def test_a_stop_ends_every_rank_and_a_slow_host_slows_the_job(tmp_path):
    emulator = Emulator(Behaviour(noise=0.0, slow={"host-a": 3.0}))
    agent = Agent(2)
    workers = Workers(agent.emit, tmp_path / "work", launch=emulator.launcher("host-a"))
    assert workers.assign(job(tmp_path, stages=1, replicas=2, iterations=1000)).ok
    threading.Event().wait(0.2)
    assert workers.stop("job-e", "cancelled") == 2
    assert agent.ended.wait(10)
    assert all(e.message == "stopped: cancelled" and not e.drained for e in agent.exits())
    assert agent.stats() and all(s.iteration_time_s == pytest.approx(0.03) for s in agent.stats())


def test_a_new_plan_applies_at_one_boundary_and_is_acknowledged(tmp_path):
    agent, workers, _ = start(tmp_path, job(tmp_path, stages=2, replicas=1, iterations=1000))
    plan = plan_pb2.Plan(version=2)
    plan.stages.add(index=0, layer_begin=0, layer_end=1)
    plan.stages.add(index=1, layer_begin=1, layer_end=4)
    message = executor_pb2.PlannerMessage(instruction_id="i-2", job_id="job-e", version=2,
                                          repartition=executor_pb2.RepartitionInstruction(plan=plan))
    assert workers.repartition(message) is None  # acknowledged once applied
    threading.Event().wait(0.2)
    workers.stop("job-e", "done with the test")
    assert agent.ended.wait(10)
    acks = [m.ack for m in agent.messages if m.HasField("ack")]
    assert [(a.instruction_id, a.ok, a.version) for a in acks] == [("i-2", True, 2)]
    after = [s for s in agent.stats() if s.plan_version == 2]
    assert after and {tuple(s.layers) for s in after if s.stage_index == 1} == {(1, 2, 3)}
