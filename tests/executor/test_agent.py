"""The agent's outbound stream: stats that arrive close together travel in one heartbeat, in order, and
nothing a dead stream pulled is lost."""

from __future__ import annotations

import queue
import threading

import pytest

from ballast.v1 import executor_pb2, fleet_pb2
from services.executor.agent import Agent
from services.executor.outbox import Outbox


class NoWorkers:
    def applied_versions(self) -> dict[str, int]:
        return {}


def agent() -> Agent:
    a = Agent.__new__(Agent)  # the stream logic only: no server, no planner
    a.outbox, a._stop, a.host_id, a.workers = Outbox(), threading.Event(), "host-1", NoWorkers()
    a.host = lambda: fleet_pb2.Host(name="h")  # type: ignore[method-assign]
    return a


def stats(iteration: int) -> executor_pb2.AgentMessage:
    return executor_pb2.AgentMessage(heartbeat=executor_pb2.Heartbeat(stages=[executor_pb2.StageStats(
        job_id="j", iteration=iteration)]))


def test_stats_are_batched_and_an_exit_still_follows_them() -> None:
    a = agent()
    for i in range(3):
        a.outbox.put(stats(i))
    a.outbox.put(executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(job_id="j", finished=True)))
    a.outbox.put(stats(3))
    out = a._outbound([5.0])
    assert next(out).HasField("register")
    first = next(out)
    assert first.heartbeat.host_id == "host-1" and [s.iteration for s in first.heartbeat.stages] == [0, 1, 2]
    assert next(out).HasField("worker_exit")  # not overtaken by the stats after it, nor stuck behind them
    assert [s.iteration for s in next(out).heartbeat.stages] == [3]
    out.close()


def test_a_message_held_when_the_stream_ends_goes_back_to_the_outbox() -> None:
    a = agent()
    a.outbox.put(stats(0))
    exit_ = executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(job_id="j", finished=True))
    a.outbox.put(exit_)
    out = a._outbound([5.0])
    next(out)  # register
    assert [s.iteration for s in next(out).heartbeat.stages] == [0]  # the exit is held behind it
    out.close()  # the stream ends
    assert a.outbox.get_nowait() == exit_



def test_what_a_stream_pulls_after_its_call_ended_goes_back_to_the_front() -> None:
    """gRPC pulls one more message after the call ended and drops it: a worker's exit taken then would be
    lost, and the job would never end. The generator hands it back instead, ahead of later messages."""
    ended = threading.Event()

    class EndsWhileWaiting(Outbox):  # the call ends while the stream waits in the outbox
        def get(self, timeout: float | None = None) -> object:
            item = super().get(timeout)
            ended.set()
            return item

    a = agent()
    a.outbox = EndsWhileWaiting()
    exit_ = executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(job_id="j", rank=1, finished=True))
    a.outbox.put(exit_)
    a.outbox.put(stats(7))
    out = a._outbound([5.0], ended)
    assert next(out).HasField("register")
    assert next(out, None) is None  # the dead stream got nothing
    assert a.outbox._items[0] == exit_ and a.outbox._items[1].heartbeat.stages[0].iteration == 7


def test_the_outbox_is_fifo_and_takes_back_to_the_front() -> None:
    box = Outbox()
    for item in "abc":
        box.put(item)
    box.unget(box.get(timeout=0))
    assert [box.get_nowait() for _ in range(3)] == ["a", "b", "c"] and len(box) == 0
    with pytest.raises(queue.Empty):
        box.get(timeout=0.01)
