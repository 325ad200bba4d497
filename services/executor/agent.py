"""Executor agent: one per host. Registers with the planner over ExecutorControl.Connect, heartbeats,
and reports SERVING on its own health endpoint only while the planner has accepted it.

It launches the workers an Assign names (workers.py), relays their per-iteration stats, checkpoint parts
and exits on the stream, and stops them on Stop; a Stop with `checkpoint` drains them instead (one checkpoint
at an iteration boundary every rank agrees on, then exit). Messages wait in one outbox across reconnects, so
a planner restart loses none; workers keep training while the stream is down. Stats that arrive within
STATS_BATCH_S travel in one heartbeat: fast iterations would otherwise cost the store one write each, CPU
taken from the workers on a host that also runs the control plane. Instructions it does not support
(Checkpoint) are acknowledged as not done, with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from ballast import __version__
from ballast.client import bearer, open_aio_channel
from ballast.config import Settings
from ballast.tls import common_name, tls_files
from ballast.transport import agent_transport, server_credentials
from ballast.v1 import executor_pb2, executor_pb2_grpc, fleet_pb2
from services.executor.inventory import SUPPORTED, devices, host_labels
from services.executor.outbox import Outbox
from services.executor.workers import Launch, Workers
from services.runtime.server import Server, ServerSpec
from services.specs.user_inputs import UserInputs

log = logging.getLogger("ballast.agent")
STATS_BATCH_S = 0.25  # per-iteration stats arriving this close together go in one heartbeat (one store write)


def agent_metrics_port(settings: Settings, port: int) -> int:
    """Agent i (gRPC port executor_port + i) serves its metrics on executor_metrics_port + i (0: none)."""
    return settings.executor_metrics_port + port - settings.executor_port if settings.executor_metrics_port else 0


@dataclass(frozen=True)
class Emulated:
    """What an emulated host (services/executor/emulated.py) says about itself instead of this machine's: its
    devices and the address its peers would reach it on; its workers start through `launch`."""

    devices: Sequence[fleet_pb2.Device]
    address: str
    launch: Launch


class Agent:
    def __init__(self, settings: Settings, name: str, port: int, emulated: Emulated | None = None):
        self.settings = settings
        self.name = name
        self.port = port
        self.emulated = emulated
        # an emulated host has no health endpoint of its own: a thousand of them share one process
        self.server = None if emulated else Server(ServerSpec(
            name=f"executor-{name}", address=f"{settings.host}:{port}", register=lambda s: None, services=[],
            on_stop=[self.stop], credentials=server_credentials(settings),
            metrics_port=agent_metrics_port(settings, port), settings=settings))
        self.transport = agent_transport(settings, name)
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._mail: asyncio.Event  # set (on the loop) when the outbox gets something
        self.host_id = ""
        self.outbox = Outbox()
        self.workers = Workers(self.outbox.put, settings.data_dir / "executor" / name,
                               user_inputs=UserInputs.of_settings(settings),
                               **({"launch": emulated.launch} if emulated else {}))

    def host(self) -> fleet_pb2.Host:
        if self.emulated:
            return fleet_pb2.Host(name=self.name, address=self.emulated.address, devices=self.emulated.devices,
                                  supported_parallelism=SUPPORTED, agent_version=__version__, agent_port=self.port,
                                  labels={"emulated": "true"})
        return fleet_pb2.Host(name=self.name, address=self.settings.advertised_host(),
                              devices=devices(self.settings.executor_cpu_slots),
                              supported_parallelism=SUPPORTED, agent_version=__version__, agent_port=self.port,
                              labels=host_labels())

    def _serving(self, serving: bool) -> None:
        if self.server is not None:
            self.server.set_serving(serving)

    async def _wait_for_mail(self, timeout: float) -> bool:
        """Until the outbox has something or `timeout` passes; False on the timeout."""
        while not len(self.outbox):
            self._mail.clear()
            if len(self.outbox):  # put between the check and the clear: its wake-up is already queued
                break
            try:
                await asyncio.wait_for(self._mail.wait(), timeout)
            except TimeoutError:
                return False
        return True

    async def _outbound(self, interval: list[float], ended: asyncio.Event) -> AsyncIterator[executor_pb2.AgentMessage]:
        """Register, then the outbox's messages (a bare heartbeat when it is quiet) until `ended`; what was
        taken but not handed to the stream goes back to the outbox's front (outbox.py)."""
        yield executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(
            host=self.host(), applied_versions=self.workers.applied_versions()))
        pending: list[executor_pb2.AgentMessage] = []  # taken from the outbox, not yet yielded, in order
        try:
            while not self._stop.is_set() and not ended.is_set():
                if not pending:
                    if not await self._wait_for_mail(interval[0]):
                        beat = executor_pb2.Heartbeat(host_id=self.host_id)
                        beat.sent_at.GetCurrentTime()
                        yield executor_pb2.AgentMessage(heartbeat=beat)
                        continue
                    pending.append(self.outbox.get_nowait())
                message = pending[0]
                if message.HasField("heartbeat"):
                    message.heartbeat.host_id = self.host_id
                    if message.heartbeat.stages and len(pending) == 1 \
                            and (other := await self._gather(message.heartbeat)) is not None:
                        pending.append(other)
                if ended.is_set():  # the call ended while this waited: gRPC would drop what it pulls now
                    break
                yield pending.pop(0)
        finally:
            for message in reversed(pending):
                self.outbox.unget(message)

    async def _gather(self, beat: executor_pb2.Heartbeat) -> executor_pb2.AgentMessage | None:
        """Add the stats that arrive within STATS_BATCH_S to `beat` (one store write for several iterations);
        returns the first other message, which must follow them, if one came."""
        deadline = time.monotonic() + STATS_BATCH_S
        while (left := deadline - time.monotonic()) > 0:
            if not await self._wait_for_mail(left):
                return None
            message = self.outbox.get_nowait()
            if not message.HasField("heartbeat") or not message.heartbeat.stages:
                return message
            beat.stages.extend(message.heartbeat.stages)
        return None

    async def session(self) -> None:
        """One Connect stream: returns when the stream ends."""
        channel = open_aio_channel(self.settings.address("planner_agent"), self.transport)
        stub = executor_pb2_grpc.ExecutorControlStub(channel)
        interval, ended = [2.0], asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            call = stub.Connect(self._outbound(interval, ended), metadata=bearer(self.settings.resolved_token()))
            async for message in call:
                kind = message.WhichOneof("body")
                if kind == "registered":
                    self.host_id = message.registered.host_id
                    interval[0] = message.registered.heartbeat_interval_s or 2.0
                    self._serving(True)
                    # a restarted planner may have missed them: checkpoints ahead of all, exits behind all
                    for replayed in reversed(self.workers.replay_checkpoints()):
                        self.outbox.unget(replayed)
                    for replayed in self.workers.replay():
                        self.outbox.put(replayed)
                    log.info("registered", extra={"host_id": self.host_id})
                    continue
                try:  # off the loop: an Assign starts processes (and a thousand emulated agents share the loop)
                    ack = await loop.run_in_executor(None, self.carry_out, message)
                except Exception:  # noqa: BLE001 - one instruction that breaks is refused, the stream goes on
                    log.exception("instruction not carried out", extra={"kind": kind})
                    ack = executor_pb2.InstructionAck(instruction_id=message.instruction_id, version=message.version,
                                                      ok=False, message=f"the agent failed to carry out {kind}")
                if ack is not None:
                    self.outbox.put(executor_pb2.AgentMessage(ack=ack))
        finally:
            ended.set()
            self._serving(False)
            await channel.close(grace=None)

    def carry_out(self, message: executor_pb2.PlannerMessage) -> executor_pb2.InstructionAck | None:
        kind = message.WhichOneof("body")
        if kind == "assign":
            ack = self.workers.assign(message)
            log.info("assign", extra={"job_id": message.job_id, "ok": ack.ok, "detail": ack.message})
            return ack
        ack = executor_pb2.InstructionAck(instruction_id=message.instruction_id, version=message.version)
        if kind == "repartition":  # acked when the workers applied it (Workers._applied)
            return self.workers.repartition(message)
        if kind == "stop":  # with checkpoint: a drain, so the job resumes from one consistent iteration
            reason = message.stop.reason or "stopped by the planner"
            if message.stop.checkpoint:
                count = self.workers.drain(message.job_id, reason)
                ack.ok, ack.message = True, f"draining {count} worker(s)"
            else:
                count = self.workers.stop(message.job_id, reason)
                ack.ok, ack.message = True, f"stopping {count} worker(s)"
        elif kind == "hold":  # the planner cannot record the job (its store refuses writes): wait at a boundary
            count = self.workers.hold(message.job_id, message.hold.held, message.hold.reason)
            ack.ok, ack.message = True, f"{'holding' if message.hold.held else 'releasing'} {count} worker(s)"
        else:
            ack.ok, ack.message = False, f"{kind} is not supported by this agent yet"
        return ack

    def run(self) -> None:
        assert self.server is not None, "an emulated agent runs with start(loop)"
        self.server.start(serving=False)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name=f"agent-{self.name}", daemon=True).start()
        self.start(loop)
        self.server.wait()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Connect (and reconnect) on `loop`, which runs on another thread (an emulator's agents share one)."""
        self._loop = loop

        def begin() -> None:
            self._mail = asyncio.Event()
            self.outbox.on_put = lambda: loop.call_soon_threadsafe(self._mail.set)
            self._task = loop.create_task(self._connect_forever())

        loop.call_soon_threadsafe(begin)

    def vanish(self) -> None:
        """The host is gone (emulated): the stream drops mid-call and nothing more is sent; its workers are the
        emulator's to end without a word."""
        self._stop.set()
        self._cancel()

    def _cancel(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(lambda: self._task is not None and self._task.cancel())

    async def _connect_forever(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                await self.session()
                backoff = 0.5
            except grpc.RpcError as exc:
                log.warning("control stream ended: %s", exc.code().name)
            except Exception:  # noqa: BLE001 - a bug in one session must not end the agent's reconnects
                log.exception("control stream failed")
            # spread: a planner restart brings every agent of the fleet back at once
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, 10.0)

    def stop(self) -> None:
        self._stop.set()
        self._cancel()
        self.workers.stop_all("the executor agent is shutting down")


def agent_name(settings: Settings, port: int) -> str:
    """The host name this agent registers: the CN of its configured certificate (what the planner checks it
    against), else `<hostname>-<port>` (embedded: the local CA issues a certificate for that name)."""
    files = tls_files(settings)
    if not settings.plaintext and not files.local and files.identity.cert.exists():
        return common_name(files.identity.cert)
    return f"{socket.gethostname()}-{port}"


def main(settings: Settings, index: int = 0) -> int:
    port = settings.executor_port + index
    Agent(settings, agent_name(settings, port), port).run()
    return 0
