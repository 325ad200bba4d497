"""The planner's side of an agent stream: what happens to a report it cannot handle."""

from __future__ import annotations

from ballast.v1 import executor_pb2, fleet_pb2, store_pb2
from services.planner.jobs.control import AgentRegistry
from services.runtime.auth import Principal
from services.runtime.errors import NotFound, Unavailable


class Store:
    """The two store calls a session makes (a stand-in: this tests the registry's own logic)."""

    def register_host(self, request: store_pb2.RegisterHostRequest) -> fleet_pb2.Host:
        return fleet_pb2.Host(id="hst-1", name=request.host.name)

    def update_host_state(self, request: store_pb2.UpdateHostStateRequest) -> fleet_pb2.Host:
        return fleet_pb2.Host(id=request.id)


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

    inbound = iter([
        executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(host=fleet_pb2.Host(name="h"))),
        executor_pb2.AgentMessage(heartbeat=executor_pb2.Heartbeat(stages=[executor_pb2.StageStats(job_id="j")])),
        executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(job_id="j", rank=0, finished=True)),
        executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(instruction_id="i", ok=True)),
    ])
    registry = AgentRegistry(Store(), listener=listener)
    sent = list(registry.connect(Principal("t", "t", True), inbound, active=lambda: True))
    return handled, sent


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


class AwayStore(Store):
    """The store restarting: a host's heartbeat cannot be written."""

    def update_host_state(self, request: store_pb2.UpdateHostStateRequest) -> fleet_pb2.Host:
        raise Unavailable("failed to connect to all addresses")


def test_a_heartbeat_the_store_cannot_write_still_hands_its_stats_on_and_keeps_the_stream() -> None:
    """The stats ride on the heartbeat: a store that is away must cost neither them nor the agent's stream."""
    handled: list[str] = []
    inbound = iter([
        executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(host=fleet_pb2.Host(name="h"))),
        executor_pb2.AgentMessage(heartbeat=executor_pb2.Heartbeat(stages=[executor_pb2.StageStats(job_id="j")])),
        executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(instruction_id="i", ok=True)),
    ])
    registry = AgentRegistry(AwayStore(), listener=lambda host_id, message: handled.append(
        message.WhichOneof("body")))
    list(registry.connect(Principal("t", "t", True), inbound, active=lambda: True))
    assert handled == ["register", "heartbeat", "ack"]
