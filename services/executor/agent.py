"""Executor agent: one per host. Registers with the planner over ExecutorControl.Connect, heartbeats,
and reports SERVING on its own health endpoint only while the planner has accepted it.

It launches the workers an Assign names (workers.py), relays their per-iteration stats, checkpoint parts
and exits on the stream, and stops them on Stop. Messages wait in one outbox across reconnects, so a
planner restart loses none; workers keep training while the stream is down. Instructions this agent does
not carry out yet (Repartition, Checkpoint) are acknowledged as not done, with the reason.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Iterator

import grpc

from ballast import __version__
from ballast.client import open_channel
from ballast.config import Settings
from ballast.v1 import executor_pb2, executor_pb2_grpc, fleet_pb2
from services.executor.inventory import SUPPORTED, devices
from services.executor.workers import Workers
from services.runtime.server import Server, ServerSpec

log = logging.getLogger("ballast.agent")


class Agent:
    def __init__(self, settings: Settings, name: str, port: int):
        self.settings = settings
        self.name = name
        self.port = port
        self.server = Server(ServerSpec(name=f"executor-{name}", address=f"{settings.host}:{port}",
                                        register=lambda s: None, services=[], on_stop=[self.stop]))
        self._stop = threading.Event()
        self.host_id = ""
        self.outbox: queue.Queue = queue.Queue()
        self.workers = Workers(self.outbox.put, settings.data_dir / "executor" / name)

    def host(self) -> fleet_pb2.Host:
        return fleet_pb2.Host(name=self.name, address=self.settings.advertised_host(), devices=devices(),
                              supported_parallelism=SUPPORTED, agent_version=__version__, agent_port=self.port)

    def _outbound(self, interval: list[float]) -> Iterator[executor_pb2.AgentMessage]:
        yield executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(
            host=self.host(), applied_versions=self.workers.applied_versions()))
        while not self._stop.is_set():
            try:
                message = self.outbox.get(timeout=interval[0])
                if message.HasField("heartbeat"):
                    message.heartbeat.host_id = self.host_id
                yield message
            except queue.Empty:
                beat = executor_pb2.Heartbeat(host_id=self.host_id)
                beat.sent_at.GetCurrentTime()
                yield executor_pb2.AgentMessage(heartbeat=beat)

    def session(self) -> None:
        """One Connect stream: returns when the stream ends."""
        channel = open_channel(self.settings.address("planner"), self.settings.resolved_token(), timeout=None)
        stub = executor_pb2_grpc.ExecutorControlStub(channel)
        interval = [2.0]
        try:
            for message in stub.Connect(self._outbound(interval)):
                kind = message.WhichOneof("body")
                if kind == "registered":
                    self.host_id = message.registered.host_id
                    interval[0] = message.registered.heartbeat_interval_s or 2.0
                    self.server.set_serving(True)
                    for replayed in self.workers.replay():  # a restarted planner may have missed them
                        self.outbox.put(replayed)
                    log.info("registered", extra={"host_id": self.host_id})
                elif (ack := self.carry_out(message)) is not None:
                    self.outbox.put(executor_pb2.AgentMessage(ack=ack))
        finally:
            self.server.set_serving(False)
            channel.close()

    def carry_out(self, message: executor_pb2.PlannerMessage) -> executor_pb2.InstructionAck | None:
        kind = message.WhichOneof("body")
        if kind == "assign":
            ack = self.workers.assign(message)
            log.info("assign", extra={"job_id": message.job_id, "ok": ack.ok, "detail": ack.message})
            return ack
        ack = executor_pb2.InstructionAck(instruction_id=message.instruction_id, version=message.version)
        if kind == "repartition":  # acked when the workers applied it (Workers._applied)
            return self.workers.repartition(message)
        if kind == "stop":
            count = self.workers.stop(message.job_id, message.stop.reason or "stopped by the planner")
            ack.ok, ack.message = True, f"stopping {count} worker(s)"
        else:
            ack.ok, ack.message = False, f"{kind} is not supported by this agent yet"
        return ack

    def run(self) -> None:
        self.server.start(serving=False)
        threading.Thread(target=self._loop, name="agent-connect", daemon=True).start()
        self.server.wait()

    def _loop(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.session()
                backoff = 0.5
            except grpc.RpcError as exc:
                log.warning("control stream ended: %s", exc.code().name)
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 10.0)

    def stop(self) -> None:
        self._stop.set()
        self.workers.stop_all("the executor agent is shutting down")


def main(settings: Settings, index: int = 0) -> int:
    port = settings.executor_port + index
    Agent(settings, f"{socket.gethostname()}-{port}", port).run()
    return 0
