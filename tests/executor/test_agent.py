"""The agent's outbound stream: stats that arrive close together travel in one heartbeat, in order, and
nothing a dead stream pulled is lost."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable

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


def on_a_loop(a: Agent, body: Callable[[], Awaitable[None]]) -> None:
    """Run `body` on an event loop, the agent's outbox waking it as Agent.start sets it up."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        a._mail = asyncio.Event()
        a.outbox.on_put = lambda: loop.call_soon_threadsafe(a._mail.set)
        await body()

    asyncio.run(main())


def stats(iteration: int) -> executor_pb2.AgentMessage:
    return executor_pb2.AgentMessage(heartbeat=executor_pb2.Heartbeat(stages=[executor_pb2.StageStats(
        job_id="j", iteration=iteration)]))


def test_stats_are_batched_and_an_exit_still_follows_them() -> None:
    a = agent()
    for i in range(3):
        a.outbox.put(stats(i))
    a.outbox.put(executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(job_id="j", finished=True)))
    a.outbox.put(stats(3))

    async def body() -> None:
        out = a._outbound([5.0], asyncio.Event())
        assert (await anext(out)).HasField("register")
        first = await anext(out)
        assert first.heartbeat.host_id == "host-1" and [s.iteration for s in first.heartbeat.stages] == [0, 1, 2]
        assert (await anext(out)).HasField("worker_exit")  # not overtaken by the stats after it, nor stuck behind
        assert [s.iteration for s in (await anext(out)).heartbeat.stages] == [3]
        await out.aclose()

    on_a_loop(a, body)


def test_a_quiet_outbox_sends_bare_heartbeats_and_a_put_from_a_worker_thread_wakes_the_stream() -> None:
    a = agent()

    async def body() -> None:
        out = a._outbound([0.05], asyncio.Event())
        await anext(out)  # register
        beat = await anext(out)
        assert beat.HasField("heartbeat") and not beat.heartbeat.stages and beat.heartbeat.host_id == "host-1"
        exit_ = executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(job_id="j", finished=True))
        threading.Timer(0.01, a.outbox.put, [exit_]).start()
        a.host_id = "host-1"
        seen = [await anext(out) for _ in range(3)]
        assert exit_ in seen  # among the beats of a 50 ms interval, woken rather than found by chance
        await out.aclose()

    on_a_loop(a, body)


def test_a_message_held_when_the_stream_ends_goes_back_to_the_outbox() -> None:
    a = agent()
    a.outbox.put(stats(0))
    exit_ = executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(job_id="j", finished=True))
    a.outbox.put(exit_)

    async def body() -> None:
        out = a._outbound([5.0], asyncio.Event())
        await anext(out)  # register
        assert [s.iteration for s in (await anext(out)).heartbeat.stages] == [0]  # the exit is held behind it
        await out.aclose()  # the stream ends

    on_a_loop(a, body)
    assert a.outbox.get_nowait() == exit_


def test_what_a_stream_pulls_after_its_call_ended_goes_back_to_the_front() -> None:
    """gRPC pulls one more message after the call ended and drops it: a worker's exit taken then would be
    lost, and the job would never end. The generator hands it back instead, ahead of later messages."""
    ended = asyncio.Event()

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

    async def body() -> None:
        out = a._outbound([5.0], ended)
        assert (await anext(out)).HasField("register")
        assert await anext(out, None) is None  # the dead stream got nothing

    on_a_loop(a, body)
    assert a.outbox._items[0] == exit_ and a.outbox._items[1].heartbeat.stages[0].iteration == 7


def test_the_outbox_is_fifo_and_takes_back_to_the_front() -> None:
    box = Outbox()
    for item in "abc":
        box.put(item)
    box.unget(box.get(timeout=0))
    assert [box.get_nowait() for _ in range(3)] == ["a", "b", "c"] and len(box) == 0
    with pytest.raises(queue.Empty):
        box.get(timeout=0.01)
