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

from services.runtime.metrics import STORE_BACKGROUND_WAIT_SECONDS, STORE_WRITE_WAIT_SECONDS

FOREGROUND, BACKGROUND = "foreground", "background"
MAX_WAIT_S = 1.0  # the longest a background call may be held back (store_background_wait_ms)


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


class CallGate:
    """A background call starts once neither a caller's call nor another background call is running, or after
    `max_wait_s`, whichever is first.

    The write gate orders the writers; this orders the processor. A service's own work (the worker preparing
    jobs, the scheduler's reads, heartbeats) costs the store's one interpreter as much as a caller's call does,
    and under a burst it is most of what a Submit waits behind. Held back a moment while callers are served,
    a closed loop such as the worker slows down instead of crowding them; open-loop work (a heartbeat) only
    starts later. A waiting call holds no lock (no call can wait on a call that waits here), only its server
    thread, which is why the wait is short and capped at MAX_WAIT_S.
    """

    def __init__(self, max_wait_s: float = 0.05, clock: Callable[[], float] = time.monotonic):
        if not 0 <= max_wait_s <= MAX_WAIT_S:
            raise ValueError(f"store_background_wait_ms: {max_wait_s * 1000!r} must be between 0 (no wait) and "
                             f"{MAX_WAIT_S * 1000:.0f}: a waiting call holds one of the store's server threads")
        self.max_wait_s, self.clock = max_wait_s, clock
        self._idle = threading.Condition()
        self._foreground = self._background = 0  # calls running now, by lane
        self._waiting = 0  # background calls waiting for their turn

    @contextmanager
    def __call__(self, background: bool) -> Iterator[None]:
        started = self.clock()
        with self._idle:
            if background and self.max_wait_s > 0:
                deadline = started + self.max_wait_s
                self._waiting += 1
                while (self._foreground or self._background) and (left := deadline - self.clock()) > 0:
                    self._idle.wait(left)
                self._waiting -= 1
            if background:
                self._background += 1
            else:
                self._foreground += 1
        try:
            if background:
                STORE_BACKGROUND_WAIT_SECONDS.observe(self.clock() - started)
            yield
        finally:
            with self._idle:
                if background:
                    self._background -= 1
                else:
                    self._foreground -= 1
                if not self._foreground and not self._background:
                    self._idle.notify()  # one background call may start; it notifies the next as it ends

    @property
    def in_flight(self) -> int:
        """Callers' calls being served now."""
        with self._idle:
            return self._foreground

    @property
    def waiting(self) -> int:
        """Background calls waiting for their turn now."""
        with self._idle:
            return self._waiting
