"""The planner's side of an agent stream: what happens to a report it cannot handle, how the session's outbox and
its end behave, and liveness written for many hosts in one store call."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterable

import pytest

from ballast.v1 import executor_pb2, fleet_pb2, store_pb2
from services.planner.jobs.control import AgentRegistry
from services.runtime.auth import Principal
from services.runtime.errors import NotFound, PermissionDenied, ResourceExhausted, Unavailable


class Store:
    """The two store calls a session makes (a stand-in: this tests the registry's own logic)."""

    def register_host(self, request: store_pb2.RegisterHostRequest) -> fleet_pb2.Host:
        return fleet_pb2.Host(id="hst-1", name=request.host.name)

    def update_host_state(self, request: store_pb2.UpdateHostStateRequest) -> fleet_pb2.Host:
        self.states.append((request.id, request.state))
        return fleet_pb2.Host(id=request.id)

    def touch_hosts(self, request: store_pb2.TouchHostsRequest) -> store_pb2.TouchHostsResponse:
        self.touched.append(list(request.host_ids))
        return store_pb2.TouchHostsResponse(touched=len(request.host_ids))

    def __init__(self) -> None:
        self.states: list[tuple[str, int]] = []
        self.touched: list[list[str]] = []


async def agent(messages: Iterable[executor_pb2.AgentMessage]) -> AsyncIterator[executor_pb2.AgentMessage]:
    for message in messages:
        yield message


ADMIN = Principal("t", "t", True)


def run(registry: AgentRegistry, messages: Iterable[executor_pb2.AgentMessage],
        principal: Principal = ADMIN) -> list[executor_pb2.PlannerMessage]:
    """One agent's stream to its end (the agent closes its side after `messages`): what the planner sent."""
    async def connect() -> list[executor_pb2.PlannerMessage]:
        return [m async for m in registry.connect(principal, agent(messages))]

    return asyncio.run(connect())


def stream(failing: str, error: Exception) -> tuple[list[str], list[executor_pb2.PlannerMessage]]:
    """Run one session whose listener raises `error` on the first message of kind `failing`; returns the kinds
    it handled and what the planner sent."""
    handled: list[str] = []

    def listener(host_id: str, message: executor_pb2.AgentMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == failing and failing not in handled:
            handled.append(failing)
            raise error
        handled.append(kind)

    inbound = [
        executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(host=fleet_pb2.Host(name="h"))),
        executor_pb2.AgentMessage(heartbeat=executor_pb2.Heartbeat(stages=[executor_pb2.StageStats(job_id="j")])),
        executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(job_id="j", rank=0, finished=True)),
        executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(instruction_id="i", ok=True)),
    ]
    return handled, run(AgentRegistry(Store(), listener=listener), inbound)


def test_an_exit_the_store_was_away_for_ends_the_stream_so_the_agent_replays_it() -> None:
    handled, sent = stream("worker_exit", Unavailable("database unavailable; retry later"))
    assert sent[0].HasField("registered")
    assert handled == ["register", "heartbeat", "worker_exit"]  # nothing after it: the stream ended there


def test_other_failures_are_logged_and_the_stream_goes_on() -> None:
    """A report that fails for good (a bug, an unknown job) would fail again after every reconnect."""
    everything = ["register", "heartbeat", "worker_exit", "ack"]
    assert stream("heartbeat", Unavailable("database unavailable"))[0] == everything
    assert stream("worker_exit", NotFound("no job job-x", field="job_id"))[0] == everything
    assert stream("worker_exit", RuntimeError("a bug"))[0] == everything


def hello(name: str = "h") -> executor_pb2.AgentMessage:
    return executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(host=fleet_pb2.Host(name=name)))


def beat(*stages: executor_pb2.StageStats) -> executor_pb2.AgentMessage:
    return executor_pb2.AgentMessage(heartbeat=executor_pb2.Heartbeat(stages=stages))


def test_bare_heartbeats_are_noted_for_one_liveness_write_and_only_stats_reach_the_listener() -> None:
    store, handled = Store(), []
    registry = AgentRegistry(store, listener=lambda host_id, message: handled.append(message.WhichOneof("body")))
    run(registry, [hello(), beat(), beat(), beat(executor_pb2.StageStats(job_id="j"))])
    assert handled == ["register", "heartbeat"]  # the bare beats cost the scheduler nothing
    assert registry.liveness.flush() == 1 and store.touched == [["hst-1"]]  # three beats, one host, one write
    assert registry.liveness.flush() == 0 and store.touched == [["hst-1"]]  # nothing heard since
    deadline = time.monotonic() + 5.0  # the farewell is written off the loop, after the stream ended
    while not store.states and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.states == [("hst-1", fleet_pb2.HOST_STATE_OFFLINE)]  # the stream's end, written once


class AwayStore(Store):
    """The store restarting: liveness cannot be written."""

    def touch_hosts(self, request: store_pb2.TouchHostsRequest) -> store_pb2.TouchHostsResponse:
        raise Unavailable("failed to connect to all addresses")


def test_a_heartbeat_the_store_cannot_write_still_hands_its_stats_on_and_keeps_the_stream() -> None:
    """The stats ride on the heartbeat: a store that is away must cost neither them nor the agent's stream."""
    handled: list[str] = []
    registry = AgentRegistry(AwayStore(), listener=lambda host_id, message: handled.append(
        message.WhichOneof("body")))
    run(registry, [hello(), beat(executor_pb2.StageStats(job_id="j")),
                   executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(instruction_id="i", ok=True))])
    assert handled == ["register", "heartbeat", "ack"]
    assert registry.liveness.flush() == 0  # not written, not raised


def test_a_tenant_token_and_a_stream_without_register_are_refused() -> None:
    with pytest.raises(PermissionDenied, match="platform token"):
        run(AgentRegistry(Store()), [hello()], Principal("t1", "team-a"))
    with pytest.raises(Exception, match="first message must be register") as info:
        run(AgentRegistry(Store()), [beat()])
    assert info.value.field == "body"


def test_instructions_reach_the_agent_in_order_and_a_full_outbox_refuses_the_next() -> None:
    """The scheduler sends from its own thread while the stream lives on the loop; an agent that stops reading
    fills its outbox, and the sender hears so (ResourceExhausted) rather than the planner holding it all."""
    registry = AgentRegistry(Store(), outbox=2, send_timeout_s=0.2)
    opened, release = threading.Event(), asyncio.Event()
    got: list[str] = []

    async def quiet_agent() -> AsyncIterator[executor_pb2.AgentMessage]:
        yield hello()
        await release.wait()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stream = registry.connect(ADMIN, quiet_agent())
        assert (await anext(stream)).HasField("registered")
        opened.set()

        def instruct() -> list[str]:
            outcomes = []
            for i in range(3):
                try:
                    registry.send("hst-1", executor_pb2.PlannerMessage(instruction_id=f"i{i}"))
                    outcomes.append("sent")
                except ResourceExhausted as exc:
                    outcomes.append(str(exc))
            return outcomes

        outcomes = await loop.run_in_executor(None, instruct)  # nothing drains the outbox yet
        assert outcomes[:2] == ["sent", "sent"] and "outbox full (2)" in outcomes[2]
        got.extend([(await anext(stream)).instruction_id for _ in range(2)])
        registry.close_all()
        assert [m async for m in stream] == []  # the planner ended the stream
        release.set()

    asyncio.run(main())
    assert opened.is_set() and got == ["i0", "i1"]
    assert registry.connected() == []
    with pytest.raises(NotFound):
        registry.send("hst-1", executor_pb2.PlannerMessage(instruction_id="late"))


def test_liveness_writes_a_large_fleet_in_batches() -> None:
    store = Store()
    registry = AgentRegistry(store)
    registry.liveness.stop()  # flushed by hand here
    for i in range(20_000):
        registry.liveness.heard(f"hst-{i:05d}")
    assert registry.liveness.flush() == 20_000
    assert [len(ids) for ids in store.touched] == [16_384, 3_616]


def test_a_heartbeat_interval_that_is_not_positive_is_refused_naming_the_setting() -> None:
    with pytest.raises(Exception, match="must be positive") as info:
        AgentRegistry(Store(), 0.0)
    assert info.value.field == "agent_heartbeat_s" and "BALLAST_AGENT_HEARTBEAT_S" in info.value.fix
