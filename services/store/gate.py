"""The store's one writer on SQLite, handed over in lane order.

SQLite lets one transaction write at a time, so under load every write waits its turn; a plain lock hands the
turn to whichever thread the OS wakes first. Most writes have nobody waiting on them (the worker preparing jobs,
heartbeats, audit records, the scheduler's passes) while a Submit or a Cancel has a person or a client on the
other end. The gate serves waiting writers first come, first served within two lanes, the caller-facing lane
before the background one, the way Kubernetes' API Priority and Fairness puts interactive requests ahead of
controllers. A background writer that has waited `max_wait_s` goes next anyway, so background work is slowed
under a burst, never starved.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.runtime.metrics import STORE_WRITE_WAIT_SECONDS

FOREGROUND, BACKGROUND = "foreground", "background"


class _Waiter:
    __slots__ = ("since", "turn")

    def __init__(self, since: float):
        self.since = since
        self.turn = threading.Lock()
        self.turn.acquire()  # released by the writer that hands the gate over


class WriteGate:
    """Mutual exclusion with first-come order per lane and the foreground lane first (see the module doc)."""

    def __init__(self, background: Callable[[], bool], max_wait_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        self.background, self.max_wait_s, self.clock = background, max_wait_s, clock
        self._lock = threading.Lock()
        self._held = False
        self._queues: dict[str, deque[_Waiter]] = {FOREGROUND: deque(), BACKGROUND: deque()}

    @contextmanager
    def __call__(self) -> Iterator[None]:
        lane = BACKGROUND if self.background() else FOREGROUND
        started = self.clock()
        with self._lock:
            if not self._held:
                self._held, waiter = True, None
            else:
                waiter = _Waiter(started)
                self._queues[lane].append(waiter)
        if waiter is not None:
            waiter.turn.acquire()  # the gate is ours when this returns: the last holder handed it over
        STORE_WRITE_WAIT_SECONDS.labels(lane).observe(self.clock() - started)
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            waiter = self._next()
            if waiter is None:
                self._held = False
        if waiter is not None:
            waiter.turn.release()  # still held: ownership passes straight to the waiter

    def _next(self) -> _Waiter | None:
        background, foreground = self._queues[BACKGROUND], self._queues[FOREGROUND]
        if background and (not foreground or self.clock() - background[0].since >= self.max_wait_s):
            return background.popleft()
        return foreground.popleft() if foreground else None

    def waiting(self) -> dict[str, int]:
        with self._lock:
            return {lane: len(queue) for lane, queue in self._queues.items()}
