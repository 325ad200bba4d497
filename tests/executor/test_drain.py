"""Drain (preemption): a drain delivered to ONE rank stops every rank at the same agreed iteration boundary after
one complete checkpoint there, and resuming from it gives the uninterrupted run's losses. Also the one-rank
trainer path in this process, and the agent side (SIGUSR2, WorkerExit.drained) with a stand-in worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from google.protobuf.json_format import MessageToDict, ParseDict

from ballast.v1 import executor_pb2, model_pb2
from services.executor.agent import Agent
from services.executor.train.checkpoint import checkpoint_path, read_manifest
from services.executor.train.config import WorkerConfig
from services.executor.train.launch import plan_configs, run_local
from services.executor.train.reference import train_single
from services.executor.train.worker import STOPPED_EXIT, Stopped, run
from services.executor.workers import Workers
from services.runtime.allocator import STEADY_ALLOCATOR
from services.runtime.ports import free_port
from tests.executor.test_workers import assign_message
from tests.harness import losses, of, torch_threads

SPEC = ParseDict({"name": "gpt-drain", "family": "MODEL_FAMILY_GPT", "transformer": {
    "num_layers": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 64, "seq_length": 16,
    "tie_embeddings": True}}, model_pb2.ModelSpec())  # embed, block.0-1, head (tied to the embedding): 4 layers
ADAM = {"name": "adam", "learning_rate": 3e-3, "weight_decay": 0.01}
DATA = {}
SEED, MICRO, NUM_MICRO, MORE = 7, 2, 2, 3  # MORE: iterations the resumed run trains past the drain
BOUNDS = [[0, 2], [2, 4]]


def template(tmp_path: Path, **changes) -> WorkerConfig:
    return WorkerConfig(**{
        "job_id": "job-drain", "model": MessageToDict(SPEC, preserving_proto_field_name=True), "stage_bounds": [[0, 4]],
        "num_replicas": 1, "stage_index": 0, "replica_index": 0, "rank": 0, "world_size": 1,
        "micro_batch_size": MICRO, "num_micro_batches": NUM_MICRO, "iterations": 5,
        "init_method": f"tcp://127.0.0.1:{free_port()}", "optimizer": ADAM, "seed": SEED, "data": DATA,
        "checkpoint_dir": str(tmp_path), "timeout_s": 60, **changes})


# --- one rank, in this process: the agreement is the local flag -------------------------------------------


def drain_after(events: list[dict], iterations: int):
    return lambda: len(of(events, "iteration")) >= iterations


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("every", [0, 3], ids=["drain-saves", "cadence-saved"])
def test_one_rank_drains_at_the_next_boundary_with_one_checkpoint(tmp_path, every):
    events: list[dict] = []
    with pytest.raises(Stopped) as stopped:
        run(template(tmp_path, checkpoint_every=every), events.append, should_drain=drain_after(events, 2))
    # the flag is read as iteration 3 starts (with the plan version) and acted on at its end
    assert (stopped.value.iteration, stopped.value.drained, stopped.value.between_iterations) == (3, True, True)
    assert [e["event"] for e in events] == ["started", "iteration", "iteration", "iteration", "checkpoint"]
    assert events[-1]["iteration"] == 3 and read_manifest(str(checkpoint_path(tmp_path, 3)))["next_iteration"] == 3
    assert not dist.is_initialized()


@pytest.mark.usefixtures("one_thread")
def test_no_boundary_follows_the_last_iteration_so_a_late_drain_finishes_the_job(tmp_path):
    events: list[dict] = []
    run(template(tmp_path, iterations=3), events.append, should_drain=drain_after(events, 2))
    assert [e["event"] for e in events][-2:] == ["iteration", "done"]


@pytest.mark.usefixtures("one_thread")
def test_a_drain_without_a_checkpoint_dir_is_a_clear_error(tmp_path):
    events: list[dict] = []
    try:
        with pytest.raises(RuntimeError, match="checkpoint_dir"):
            run(template(tmp_path, checkpoint_dir=""), events.append, should_drain=lambda: True)
    finally:
        if dist.is_initialized():  # a failure leaves the group (a peer may be mid-collective)
            dist.destroy_process_group()


# --- real workers: pp x dp over gloo, SIGUSR2 to one rank -------------------------------------------------


def drain_one_rank(configs: list[WorkerConfig], folder: Path, target: int,
                   after: int) -> tuple[list[list[dict]], list[int]]:
    """Start every rank as `python -m services.executor.train.worker`; once rank `target` reported `after`
    iterations, SIGUSR2 it alone; return each rank's events and exit code."""
    env = {**os.environ, **STEADY_ALLOCATOR, "OMP_NUM_THREADS": "1"}
    procs, outs = [], []
    for config in configs:
        path = folder / f"rank-{config.rank}.json"
        path.write_text(config.to_json())
        outs.append(path.with_suffix(".out"))
        with open(outs[-1], "w") as out, open(path.with_suffix(".err"), "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", "services.executor.train.worker", str(path)],
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env))
    try:
        deadline = time.monotonic() + 120  # a hang guard, not a timing assert
        while not any(e.get("event") == "iteration" and e["iteration"] >= after for e in read_events(outs[target])):
            assert time.monotonic() < deadline and procs[target].poll() is None, read_events(outs[target])[-1:]
            time.sleep(0.05)
        procs[target].send_signal(signal.SIGUSR2)
        codes = [proc.wait(timeout=max(deadline - time.monotonic(), 1)) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    return [read_events(out) for out in outs], codes


def read_events(path: Path) -> list[dict]:
    """The complete lines so far (a worker may be mid-write)."""
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def check_drain_and_resume(tmp_path: Path, replicas: int) -> None:
    configs = plan_configs(template(tmp_path, iterations=100_000), BOUNDS, replicas)
    events, codes = drain_one_rank(configs, tmp_path, target=len(configs) - 1, after=2)
    assert codes == [STOPPED_EXIT] * len(configs)
    stops = [e[-1] for e in events]
    assert all(s["event"] == "stopped" and s["drained"] is True for s in stops), stops
    done = stops[0]["iteration"]
    assert done >= 2 and all(s["iteration"] == done for s in stops)  # one agreed boundary
    for rank_events in events:
        assert [e["iteration"] for e in of(rank_events, "iteration")] == list(range(1, done + 1))
        assert [e["iteration"] for e in of(rank_events, "checkpoint")] == [done]
    written = sorted(x["layer_index"] for e in events for c in of(e, "checkpoint") for x in c["layers"])
    assert written == [0, 1, 2, 3]  # each layer once, by one replica of its stage
    manifest = read_manifest(str(checkpoint_path(tmp_path, done)))
    assert manifest["complete"] is True and manifest["next_iteration"] == done

    resumed = run_local(plan_configs(template(tmp_path, iterations=done + MORE,
                                              resume_from=str(checkpoint_path(tmp_path, done))), BOUNDS, replicas),
                        env=STEADY_ALLOCATOR, timeout_s=120)
    assert [e["iteration"] for e in of(resumed[-1], "iteration")] == list(range(done + 1, done + MORE + 1))
    with torch_threads(1):
        uninterrupted = train_single(SPEC, DATA, SEED, MICRO * NUM_MICRO * replicas, done + MORE, ADAM)
    assert losses(events) == pytest.approx(uninterrupted[:done], rel=1e-5)
    assert losses(resumed) == pytest.approx(uninterrupted[done:], rel=1e-5)


@pytest.mark.slow  # two runs of two worker processes: over the everyday suite's budget on a loaded 2-core machine
def test_two_stages_drain_together_and_resume_with_the_uninterrupted_losses(tmp_path):
    check_drain_and_resume(tmp_path, replicas=1)


@pytest.mark.slow  # several worker processes on the 2 cores: over 10 s even on a quiet machine
def test_a_2x2_job_drains_together_and_resumes_with_the_uninterrupted_losses(tmp_path):
    check_drain_and_resume(tmp_path, replicas=2)


# --- the agent: Stop{checkpoint} drains, WorkerExit.drained -----------------------------------------------

# A stand-in worker: reports an iteration once SIGUSR2 is blocked, waits for it, reports a drained stop.
DRAINS = r'''
import json, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
print(json.dumps({"event": "iteration", "iteration": 3}), flush=True)
signal.sigwait({signal.SIGUSR2})
print(json.dumps({"event": "stopped", "iteration": 4, "message": "drained after 4", "drained": True}), flush=True)
sys.exit(143)
'''


def test_a_drain_sends_sigusr2_and_the_exit_says_drained_at_its_iteration(tmp_path):
    exits: list[executor_pb2.WorkerExit] = []
    running, ended = threading.Event(), threading.Event()

    def emit(message: executor_pb2.AgentMessage) -> None:
        if message.HasField("heartbeat"):
            running.set()
        if message.HasField("worker_exit"):
            exits.append(message.worker_exit)
            ended.set()

    workers = Workers(emit, tmp_path, command=(sys.executable, "-c", DRAINS))
    assert workers.assign(assign_message("job-d")).ok
    assert running.wait(30)
    assert workers.drain("job-d", "preempted") == 1
    assert ended.wait(30)
    assert [(e.drained, e.iteration, e.exit_code, e.finished, e.message) for e in exits] == [
        (True, 4, 143, False, "stopped: preempted")]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def stop(self, job_id: str, reason: str) -> int:
        self.calls.append(("stop", job_id, reason))
        return 2

    def drain(self, job_id: str, reason: str) -> int:
        self.calls.append(("drain", job_id, reason))
        return 2


@pytest.mark.parametrize("checkpoint, call", [(True, "drain"), (False, "stop")])
def test_a_stop_with_checkpoint_is_a_drain(checkpoint, call):
    agent = Agent.__new__(Agent)  # carry_out only: no server, no planner
    agent.workers = Recorder()  # type: ignore[assignment]
    ack = agent.carry_out(executor_pb2.PlannerMessage(instruction_id="i", job_id="j", stop=executor_pb2.StopInstruction(
        reason="preempted", checkpoint=checkpoint)))
    assert ack is not None and ack.ok and "2 worker(s)" in ack.message
    assert agent.workers.calls == [(call, "j", "preempted")]  # type: ignore[attr-defined]
