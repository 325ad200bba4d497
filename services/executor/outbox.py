"""The agent's outbox: a FIFO that outlives its streams, and takes back what a dead stream did not send.

gRPC keeps pulling from a stream's request iterator for a moment after the call ended and drops what it
pulled; a message taken in that moment (a worker's exit, a checkpoint part) would be lost for good. The
stream's generator puts such a message back at the front, so the next stream sends it first, in order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class Outbox:
    """Filled by worker threads; emptied by a thread (`get`) or by a coroutine that `on_put` wakes."""

    def __init__(self, on_put: Callable[[], None] = lambda: None) -> None:
        self._items: deque[Any] = deque()
        self._ready = threading.Condition()
        self.on_put = on_put

    def put(self, item: Any) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()
        self.on_put()

    def unget(self, item: Any) -> None:
        """Back to the front: it goes out before everything queued after it was taken."""
        with self._ready:
            self._items.appendleft(item)
            self._ready.notify()
        self.on_put()

    def get(self, timeout: float | None = None) -> Any:
        """The oldest item; raises queue.Empty after `timeout` seconds without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            while not self._items:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise queue.Empty
                self._ready.wait(left)
            return self._items.popleft()

    def get_nowait(self) -> Any:
        return self.get(timeout=0)

    def __len__(self) -> int:
        with self._ready:
            return len(self._items)
