"""The audit log's writer on each server: finished state-changing calls go to the store in batches.

Recording sits beside the call, not in it: a call never waits on the audit log, and a store that is down
delays records rather than failing calls. Records wait in a bounded buffer and are sent again until the store
takes them; each has a uid, so a batch sent twice is stored once. Only a full buffer (the store down for long
under load) or a process killed within one flush interval loses records, and a full buffer says so in the log.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable

from google.protobuf.message import Message

from ballast.v1 import store_pb2
from services.runtime.metrics import DROPPED

log = logging.getLogger("ballast.audit")

Sink = Callable[[list[store_pb2.AuditRecord]], None]
# Fields that name what a call acts on, most specific first; a created resource's id comes from the reply.
TARGET_FIELDS = ("job_id", "tenant_id", "plan_id", "profile_id", "model_id", "host_id", "id")
NESTED = ("tenant", "job", "host", "plan", "profile", "morph", "checkpoint", "migration", "event", "request")
FLUSH_S = 0.2
BATCH = 500
MAX_PENDING = 20_000
RETRY_MAX_S = 5.0


def target_of(request: object, reply: object = None) -> str:
    """The id a call named, else the id of what it created (a Submit's job), else the name it gave, else ''."""
    return (_field(request, TARGET_FIELDS) or _nested(reply, ("id",)) or _field(request, ("name",))
            or _nested(request, TARGET_FIELDS + ("name",)))


def _field(message: object, names: tuple[str, ...]) -> str:
    if isinstance(message, Message):
        fields = message.DESCRIPTOR.fields_by_name
        for name in names:
            if name in fields and fields[name].type == fields[name].TYPE_STRING and getattr(message, name):
                return getattr(message, name)[:200]
    return ""


def _nested(message: object, names: tuple[str, ...]) -> str:
    """`names` on the message itself, else on its first set sub-message among NESTED (a Submit's spec, ...)."""
    found = _field(message, names)
    if found or not isinstance(message, Message):
        return found
    fields = message.DESCRIPTOR.fields_by_name
    for nested in (*NESTED, "spec"):
        field = fields.get(nested)
        if field is not None and field.message_type is not None and not field.is_repeated \
                and message.HasField(nested):
            found = _field(getattr(message, nested), names)
            if found:
                return found
    return ""


class AuditLog:
    """A bounded buffer of records and one daemon thread that hands them to `sink` in batches."""

    def __init__(self, sink: Sink, server: str, flush_s: float = FLUSH_S, max_pending: int = MAX_PENDING):
        self._sink, self.server, self._flush_s = sink, server, flush_s
        self._pending: deque[store_pb2.AuditRecord] = deque()
        self._max = max_pending
        self.dropped = 0
        self._cv = threading.Condition()
        self._sending = threading.Lock()  # one batch in flight, so what is popped is what was sent
        self._closed = False
        self._thread: threading.Thread | None = None

    def record(self, record: store_pb2.AuditRecord) -> None:
        record.server, record.uid = self.server, record.uid or uuid.uuid4().hex
        with self._cv:
            if len(self._pending) >= self._max:
                self.dropped += 1
                DROPPED.labels("audit_records").inc()
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.error("audit buffer full: records dropped", extra={"dropped": self.dropped})
                return
            self._pending.append(record)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=f"audit-{self.server}", daemon=True)
                self._thread.start()
            if len(self._pending) >= BATCH:
                self._cv.notify()

    def flush(self) -> bool:
        """Send one batch of what is buffered; False if the store refused it (the records stay)."""
        with self._sending:
            with self._cv:
                batch = [self._pending[i] for i in range(min(BATCH, len(self._pending)))]
            if not batch:
                return True
            try:
                self._sink(batch)
            except Exception:  # noqa: BLE001 - the store down or slow: keep the records, try again later
                log.warning("audit records not stored yet; will retry", exc_info=True)
                return False
            with self._cv:
                for _ in batch:
                    self._pending.popleft()
            return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after one last attempt to send everything (server shutdown)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        while self.pending and self.flush():
            pass

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._pending)

    def _run(self) -> None:
        delay = self._flush_s
        while True:
            with self._cv:
                if self._closed:
                    return
                self._cv.wait(delay)
                if self._closed:
                    return
            delay = self._flush_s if self._drain() else min(RETRY_MAX_S, delay * 2)

    def _drain(self) -> bool:
        while self.pending:
            if not self.flush():
                return False
        return True


def audit_to(store: object, server: str) -> AuditLog:
    """An audit log whose records go to `store.record_audit` (a RemoteStore as the platform, or the store's
    own repository bound to the platform)."""
    return AuditLog(lambda records: store.record_audit(store_pb2.RecordAuditRequest(records=records)), server)
