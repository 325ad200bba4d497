"""Executor agent: one per host. Registers with the planner over ExecutorControl.Connect, heartbeats,
and reports SERVING on its own health endpoint only while the planner has accepted it.

Running stages on instruction arrives with the executor issue; until then instructions are
acknowledged as not carried out, with the reason.
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

    def host(self) -> fleet_pb2.Host:
        return fleet_pb2.Host(name=self.name, address=self.settings.advertised_host(), devices=devices(),
                              supported_parallelism=SUPPORTED, agent_version=__version__, agent_port=self.port)

    def _outbound(self, outbox: queue.Queue, interval: list[float]) -> Iterator[executor_pb2.AgentMessage]:
        yield executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(host=self.host()))
        while not self._stop.is_set():
            try:
                yield outbox.get(timeout=interval[0])
            except queue.Empty:
                beat = executor_pb2.Heartbeat(host_id=self.host_id)
                beat.sent_at.GetCurrentTime()
                yield executor_pb2.AgentMessage(heartbeat=beat)

    def session(self) -> None:
        """One Connect stream: returns when the stream ends."""
        channel = open_channel(self.settings.address("planner"), self.settings.resolved_token(), timeout=None)
        stub = executor_pb2_grpc.ExecutorControlStub(channel)
        outbox: queue.Queue = queue.Queue(maxsize=64)
        interval = [2.0]
        try:
            for message in stub.Connect(self._outbound(outbox, interval)):
                kind = message.WhichOneof("body")
                if kind == "registered":
                    self.host_id = message.registered.host_id
                    interval[0] = message.registered.heartbeat_interval_s or 2.0
                    self.server.set_serving(True)
                    log.info("registered", extra={"host_id": self.host_id})
                else:
                    outbox.put(executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(
                        instruction_id=message.instruction_id, version=message.version, ok=False,
                        message=f"{kind} is not supported by this agent yet (executor issue)")))
        finally:
            self.server.set_serving(False)
            channel.close()

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


def main(settings: Settings, index: int = 0) -> int:
    port = settings.executor_port + index
    Agent(settings, f"{socket.gethostname()}-{port}", port).run()
    return 0
