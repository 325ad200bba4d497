"""ExecutorControl.Connect: agents register and heartbeat; the planner keeps a session per host.

Host state is persisted through the store, so a restarted planner sees which hosts it had and
agents simply reconnect. Instructions (Assign, Repartition, …) are sent through `AgentRegistry.send`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

from ballast.v1 import executor_pb2, fleet_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from services.runtime.store_api import Store
from services.runtime.streams import BidiSession

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


def check_certified(certified_host: str | None) -> None:
    """A token alone no longer registers a host: over TLS the agent must present a client certificate."""
    if certified_host == "":
        raise Unauthenticated("executor agents must prove their host with a client certificate",
                              fix="connect to the planner's agent port (planner_agent_port) with the agent's "
                                  "certificate (tls_cert / tls_key, or the data dir's local CA)")


class AgentRegistry:
    def __init__(self, store: Store, heartbeat_interval_s: float = 2.0,
                 listener: Listener | None = None):
        self._store = store
        self._interval = heartbeat_interval_s
        self._listener = listener
        self._sessions: dict[str, BidiSession] = {}
        self._host_locks: dict[str, threading.RLock] = {}
        self._lock = threading.Lock()

    def connected(self) -> list[str]:
        with self._lock:
            return sorted(self._sessions)

    def close_all(self) -> None:
        """End every agent stream (planner shutdown): agents reconnect to whichever planner comes up."""
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.close()

    def send(self, host_id: str, message: executor_pb2.PlannerMessage) -> None:
        with self._lock:
            session = self._sessions.get(host_id)
        if session is None:
            raise NotFound(f"no agent connected for host {host_id}", field="host_id")
        session.send(message)

    def connect(self, principal: Principal, inbound: Iterator[executor_pb2.AgentMessage],
                active: Callable[[], bool], certified_host: str | None = None) -> Iterator[executor_pb2.PlannerMessage]:
        """One agent's stream. `certified_host` is the CN of the client certificate the agent presented ("" for
        none); None only on a plaintext control plane, where the token alone is trusted."""
        if not principal.admin:
            raise PermissionDenied("executor agents must use a platform token", fix="use the admin token")
        check_certified(certified_host)
        first = next(inbound, None)
        if first is None or first.WhichOneof("body") != "register":
            raise InvalidArgument("the first message must be register", field="body")
        name = first.register.host.name
        if certified_host is not None and name != certified_host:
            raise PermissionDenied(f"host {name!r} registered with a certificate for {certified_host!r}",
                                   field="register.host.name",
                                   fix="register under the name the agent's certificate (tls_cert) was issued to")
        # One agent's registration and its old stream's farewell are serialized: a farewell landing after a
        # reconnect's registration would otherwise mark a connected host OFFLINE.
        with self._host_lock(name):
            host = self._store.register_host(store_pb2.RegisterHostRequest(host=first.register.host))
            host_id = host.id
            session = self._register(host, inbound, name)
        session.send(executor_pb2.PlannerMessage(
            registered=executor_pb2.Registered(host_id=host_id, heartbeat_interval_s=self._interval)))
        if self._listener is not None:  # what the agent's workers run, before any of their later reports
            try:
                self._listener(host_id, first)
            except Exception:  # noqa: BLE001 - a bad registration report must not end the stream
                log.exception("registration not handled", extra={"host_id": host_id})
        session.start()
        log.info("agent connected", extra={"host_id": host_id, "host": host.name})
        try:
            yield from session.outgoing(active)
        finally:
            session.close()

    def _host_lock(self, name: str) -> threading.RLock:
        with self._lock:
            return self._host_locks.setdefault(name, threading.RLock())

    def _register(self, host, inbound: Iterator[executor_pb2.AgentMessage], name: str) -> BidiSession:
        """The new session, replacing (and closing) an older one of the same host."""
        host_id = host.id

        beat = [0.0]

        def on_message(message: executor_pb2.AgentMessage) -> None:
            kind = message.WhichOneof("body")
            # Workers' stats ride on heartbeats, one per iteration: liveness is written once per interval.
            if kind == "heartbeat" and time.monotonic() - beat[0] >= self._interval / 2:
                beat[0] = time.monotonic()
                try:
                    self._store.update_host_state(store_pb2.UpdateHostStateRequest(
                        id=host_id, state=fleet_pb2.HOST_STATE_ONLINE, heartbeat=True))
                except TRANSIENT:  # the store away: the host is no less alive, and the stats it carries count
                    log.warning("host heartbeat not stored", extra={"host_id": host_id})
            elif kind == "ack":
                log.info("ack", extra={"host_id": host_id, "instruction_id": message.ack.instruction_id,
                                       "ok": message.ack.ok, "detail": message.ack.message})
            if self._listener is not None:
                try:
                    self._listener(host_id, message)
                except Exception as exc:  # noqa: BLE001 - one bad report must not end the agent's stream...
                    log.exception("agent message not handled", extra={"host_id": host_id, "kind": kind})
                    if kind in REPLAYED and isinstance(exc, TRANSIENT):  # ...unless that brings the report back
                        raise

        def on_close() -> None:
            with self._host_lock(name):
                with self._lock:
                    current = self._sessions.get(host_id) is session
                    if current:
                        del self._sessions[host_id]
                if not current:
                    return  # replaced by a newer stream from the same agent: the host is still online
                try:
                    self._store.update_host_state(store_pb2.UpdateHostStateRequest(
                        id=host_id, state=fleet_pb2.HOST_STATE_OFFLINE))
                except Exception:  # noqa: BLE001 - the store may be down; the host will look stale instead
                    log.warning("could not mark host offline", extra={"host_id": host_id})

        session = BidiSession(inbound, on_message, on_close, name=f"agent-{host.name}")
        with self._lock:
            old = self._sessions.pop(host_id, None)
            self._sessions[host_id] = session
        if old is not None:
            old.close()
        return session
