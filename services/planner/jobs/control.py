"""ExecutorControl.Connect: agents register and heartbeat; the planner keeps a session per host.

Streams live on the agent port's event loop (services/runtime/aio_port.py): a session is a queue and two
coroutines, not two threads, so one planner holds thousands of hosts. What a report asks of the store or the
scheduler runs on a bounded pool of report threads, one report of a host at a time and in its order (the reader
awaits each); a bare heartbeat is only noted, and `Liveness` writes every host heard from in one store call per
interval. Host state is persisted through the store, so a restarted planner sees which hosts it had and agents
simply reconnect. Instructions (Assign, Repartition, …) are sent through `AgentRegistry.send`, from any thread
but the loop's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent import futures

from ballast.v1 import executor_pb2, fleet_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from services.runtime.store_api import Store

log = logging.getLogger("ballast.control")


Listener = Callable[[str, executor_pb2.AgentMessage], None]
# Reports an agent sends again when it reconnects (its workers' exits): one the planner could not handle for
# a passing reason (the store away or overloaded) ends the stream instead of being dropped, so the reconnect
# brings it back; a job whose last exit was dropped would never end. Other failures are logged: a report that
# always fails must not make its agent reconnect in a loop. (A checkpoint the store refused is kept and
# written later by the scheduler instead: checkpoints are frequent, and a stream ended for each would look
# like a lost host while the store is away.)
REPLAYED = frozenset({"worker_exit"})
TRANSIENT = (Unavailable, DeadlineExceeded, ResourceExhausted, Cancelled)
REPORT_THREADS = 16  # reports handled at once, across every host (each host's one at a time)
TOUCH_BATCH = 16_384  # host ids per TouchHosts call
_CLOSED = object()


def check_certified(certified_host: str | None) -> None:
    """A token alone no longer registers a host: over TLS the agent must present a client certificate."""
    if certified_host == "":
        raise Unauthenticated("executor agents must prove their host with a client certificate",
                              fix="connect to the planner's agent port (planner_agent_port) with the agent's "
                                  "certificate (tls_cert / tls_key, or the data dir's local CA)")


def refuse_off_the_agent_port(plaintext: bool) -> None:
    """Connect on the planner's public port: agents are served on the agent port only (its own event loop, and
    over TLS its own client-certificate check), so this says where to go instead."""
    if not plaintext:
        check_certified("")
    raise FailedPrecondition("executor agents connect on the planner's agent port, not its public port",
                             fix="point the agent at planner_agent_port (BALLAST_PLANNER_AGENT_PORT)")


class Session:
    """One agent's stream: a bounded outbox on the port's loop, filled from any other thread."""

    def __init__(self, host_id: str, name: str, loop: asyncio.AbstractEventLoop, maxsize: int = 64):
        self.host_id, self.name, self._loop = host_id, name, loop
        self.outbox: asyncio.Queue[object] = asyncio.Queue(maxsize)
        self.closed = threading.Event()

    def send(self, message: executor_pb2.PlannerMessage, timeout: float = 5.0) -> None:
        """Queue a message for the agent; ResourceExhausted if it does not drain in time or the stream ended."""
        if self.closed.is_set():
            raise ResourceExhausted("stream is closed")
        try:
            asyncio.run_coroutine_threadsafe(asyncio.wait_for(self.outbox.put(message), timeout),
                                             self._loop).result(timeout + 1.0)
        except TimeoutError:
            raise ResourceExhausted(f"peer is not reading; outbox full ({self.outbox.maxsize})") from None
        except RuntimeError:  # the loop is gone: the planner is stopping
            raise ResourceExhausted("stream is closed") from None

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        try:
            self._loop.call_soon_threadsafe(self._end)
        except RuntimeError:
            pass  # the loop is closed, and the stream with it

    def _end(self) -> None:
        """On the loop: what is still queued goes with the stream; the writer stops at the mark."""
        while True:
            try:
                self.outbox.put_nowait(_CLOSED)
                return
            except asyncio.QueueFull:
                self.outbox.get_nowait()

    async def outgoing(self) -> AsyncIterator[executor_pb2.PlannerMessage]:
        while (message := await self.outbox.get()) is not _CLOSED:
            yield message  # type: ignore[misc]


class Liveness:
    """Heartbeats written for the whole fleet in one store call per interval: one call per host per interval
    would be 2,048 store calls a second at 4,096 hosts. The store keeps each host's last_heartbeat_at for
    people and SQL; the planner itself judges a host by its stream (`AgentRegistry.connected`)."""

    def __init__(self, store: Store, interval_s: float):
        self._store, self._interval = store, interval_s
        self._heard: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def heard(self, host_id: str) -> None:
        with self._lock:
            self._heard.add(host_id)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="host-liveness", daemon=True)
                self._thread.start()

    def flush(self) -> int:
        """Write the hosts heard from since the last flush; returns how many."""
        with self._lock:
            ids, self._heard = sorted(self._heard), set()
        for start in range(0, len(ids), TOUCH_BATCH):
            try:
                self._store.touch_hosts(store_pb2.TouchHostsRequest(host_ids=ids[start:start + TOUCH_BATCH]))
            except TRANSIENT:  # the store away: the hosts are no less alive; the next interval writes them
                log.warning("host heartbeats not stored", extra={"hosts": len(ids)})
                return 0
        return len(ids)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - liveness must outlive one bad write
                log.exception("host heartbeats not stored")

    def stop(self) -> None:
        self._stop.set()


class AgentRegistry:
    def __init__(self, store: Store, heartbeat_interval_s: float = 2.0,
                 listener: Listener | None = None, report_threads: int = REPORT_THREADS,
                 outbox: int = 64, send_timeout_s: float = 5.0):
        if not heartbeat_interval_s > 0:
            raise InvalidArgument(f"heartbeat interval {heartbeat_interval_s} s must be positive",
                                  field="agent_heartbeat_s", fix="set BALLAST_AGENT_HEARTBEAT_S to e.g. 2")
        self._store = store
        self._interval = heartbeat_interval_s
        self._listener = listener
        self._outbox, self._send_timeout = outbox, send_timeout_s  # per host: instructions queued, and for how long
        self._sessions: dict[str, Session] = {}
        self._host_locks: dict[str, threading.RLock] = {}
        self._lock = threading.Lock()
        self._reports = futures.ThreadPoolExecutor(report_threads, thread_name_prefix="agent-report")
        self.liveness = Liveness(store, heartbeat_interval_s)

    def connected(self) -> list[str]:
        with self._lock:
            return sorted(self._sessions)

    def close_all(self) -> None:
        """End every agent stream (planner shutdown): agents reconnect to whichever planner comes up."""
        self.liveness.stop()
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.close()

    def send(self, host_id: str, message: executor_pb2.PlannerMessage) -> None:
        with self._lock:
            session = self._sessions.get(host_id)
        if session is None:
            raise NotFound(f"no agent connected for host {host_id}", field="host_id")
        session.send(message, self._send_timeout)

    async def connect(self, principal: Principal, inbound: AsyncIterator[executor_pb2.AgentMessage],
                      certified_host: str | None = None) -> AsyncIterator[executor_pb2.PlannerMessage]:
        """One agent's stream. `certified_host` is the CN of the client certificate the agent presented ("" for
        none); None only on a plaintext control plane, where the token alone is trusted."""
        if not principal.admin:
            raise PermissionDenied("executor agents must use a platform token", fix="use the admin token")
        check_certified(certified_host)
        try:
            first = await anext(aiter(inbound))
        except StopAsyncIteration:
            first = None
        if first is None or first.WhichOneof("body") != "register":
            raise InvalidArgument("the first message must be register", field="body")
        name = first.register.host.name
        if certified_host is not None and name != certified_host:
            raise PermissionDenied(f"host {name!r} registered with a certificate for {certified_host!r}",
                                   field="register.host.name",
                                   fix="register under the name the agent's certificate (tls_cert) was issued to")
        loop = asyncio.get_running_loop()
        session = await loop.run_in_executor(self._reports, self._open, first.register, loop)
        session.outbox.put_nowait(executor_pb2.PlannerMessage(
            registered=executor_pb2.Registered(host_id=session.host_id, heartbeat_interval_s=self._interval)))
        if self._listener is not None:  # what the agent's workers run, before any of their later reports
            await loop.run_in_executor(self._reports, self._report, session.host_id, "register", first, False)
        reader = loop.create_task(self._read(session, inbound))
        log.info("agent connected", extra={"host_id": session.host_id, "host": name})
        try:
            async for message in session.outgoing():
                yield message
        finally:
            reader.cancel()
            session.close()
            loop.run_in_executor(self._reports, self._farewell, session)

    def _host_lock(self, name: str) -> threading.RLock:
        with self._lock:
            return self._host_locks.setdefault(name, threading.RLock())

    def _open(self, register: executor_pb2.RegisterAgent, loop: asyncio.AbstractEventLoop) -> Session:
        """The host stored and its new session, replacing (and closing) an older one of the same host. One
        agent's registration and its old stream's farewell are serialized: a farewell landing after a
        reconnect's registration would otherwise mark a connected host OFFLINE."""
        with self._host_lock(register.host.name):
            host = self._store.register_host(store_pb2.RegisterHostRequest(host=register.host))
            session = Session(host.id, host.name, loop, self._outbox)
            with self._lock:
                old = self._sessions.pop(host.id, None)
                self._sessions[host.id] = session
        if old is not None:
            old.close()
        return session

    def _farewell(self, session: Session) -> None:
        with self._host_lock(session.name):
            with self._lock:
                current = self._sessions.get(session.host_id) is session
                if current:
                    del self._sessions[session.host_id]
            if not current:
                return  # replaced by a newer stream from the same agent: the host is still online
            try:
                self._store.update_host_state(store_pb2.UpdateHostStateRequest(
                    id=session.host_id, state=fleet_pb2.HOST_STATE_OFFLINE))
            except Exception:  # noqa: BLE001 - the store may be down; the host will look stale instead
                log.warning("could not mark host offline", extra={"host_id": session.host_id})

    async def _read(self, session: Session, inbound: AsyncIterator[executor_pb2.AgentMessage]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for message in inbound:
                kind = message.WhichOneof("body")
                if kind == "heartbeat":
                    self.liveness.heard(session.host_id)
                    if not message.heartbeat.stages:  # nothing for the scheduler: workers' stats ride on beats
                        continue
                elif kind == "ack":
                    log.info("ack", extra={"host_id": session.host_id, "instruction_id": message.ack.instruction_id,
                                           "ok": message.ack.ok, "detail": message.ack.message})
                if self._listener is not None:
                    await loop.run_in_executor(self._reports, self._report, session.host_id, kind, message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken peer ends its session, not the server
            log.info("stream reader ended: %s", exc, extra={"host_id": session.host_id})
        finally:
            session.close()

    def _report(self, host_id: str, kind: str, message: executor_pb2.AgentMessage, replay: bool = True) -> None:
        """Hand one report to the listener. One that fails is logged and the stream goes on (it would fail again
        after a reconnect)... unless it is replayed on reconnect and failed for a passing reason: then it
        ends the stream, so that the reconnect brings it back."""
        assert self._listener is not None
        try:
            self._listener(host_id, message)
        except Exception as exc:  # noqa: BLE001
            log.exception("agent message not handled", extra={"host_id": host_id, "kind": kind})
            if replay and kind in REPLAYED and isinstance(exc, TRANSIENT):
                raise
