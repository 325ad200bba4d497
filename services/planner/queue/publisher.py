"""Request ids put on the broker from a thread of their own.

Why: a request is durable once the store holds it (queue/durable.py); the broker message only wakes a
worker. Publishing inside the RPC put the broker's commit (a second fsync on the embedded SQLite broker) and
its single-writer wait on every Submit's latency. Here the RPC returns once the store has the request, and this
thread publishes in order. A publish that fails (the broker restarting) is retried with backoff until it goes
through, so a job waits for the broker rather than failing; ids this process never got to publish (it died)
are the sweeper's to send again (requeue of unclaimed requests).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("ballast.publisher")

BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # between tries of one publish; the last repeats


class Publisher(threading.Thread):
    """`publisher(request_id)` returns at once; the id is published by this thread, retried until it is."""

    def __init__(self, publish: Callable[[str], None], backoff_s: tuple[float, ...] = BACKOFF_S):
        super().__init__(name="broker-publisher", daemon=True)
        self._publish, self._backoff = publish, backoff_s
        self._pending: deque[str] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        self.published = 0
        self.retries = 0

    def __call__(self, request_id: str) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError("the broker publisher has stopped")
            self._pending.append(request_id)
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + self._busy

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if not self._pending:
                    return
                request_id, self._busy = self._pending[0], True
            ok = self._publish_one(request_id)
            with self._cond:
                if ok:
                    self._pending.popleft()
                self._busy = False
                self._cond.notify_all()
                if not ok:  # stopped while the broker was away: the sweeper sends the rest again
                    return

    def _publish_one(self, request_id: str) -> bool:
        tries = 0
        while True:
            try:
                self._publish(request_id)
                self.published += 1
                return True
            except Exception as exc:  # noqa: BLE001 - the broker away must not lose the id
                wait = self._backoff[min(tries, len(self._backoff) - 1)]
                tries += 1
                self.retries += 1
                log.warning("could not publish a request; trying again", extra={
                    "request_id": request_id, "error": str(exc)[:200], "retry_in_s": wait})
                with self._cond:
                    if self._cond.wait_for(lambda: self._stopped, timeout=wait):
                        log.warning("stopped with requests unpublished: the sweeper sends them again",
                                    extra={"unpublished": len(self._pending)})
                        return False

    def flush(self, timeout_s: float) -> bool:
        """Wait until every id handed in so far is published; False if some are still pending after `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout=timeout_s)

    def stop(self, flush_s: float = 5.0) -> None:
        """Publish what is pending for up to `flush_s`, then stop."""
        self.flush(flush_s)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
