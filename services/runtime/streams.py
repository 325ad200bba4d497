"""Bidirectional streams without thread starvation: a reader thread per stream and a bounded outbox.

The gRPC handler thread only drains the outbox; inbound messages are consumed by the session's own
reader, so a slow or silent peer never blocks the sender, and a full outbox is an explicit error
instead of unbounded memory.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from services.runtime.errors import ResourceExhausted

log = logging.getLogger("ballast.stream")
_CLOSED = object()


class BidiSession:
    def __init__(self, inbound: Iterator[Any], on_message: Callable[[Any], None],
                 on_close: Callable[[], None] = lambda: None, maxsize: int = 64, name: str = "stream"):
        self._outbox: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
        self._on_message = on_message
        self._on_close = on_close
        self._inbound = inbound
        self.closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)

    def start(self) -> BidiSession:
        self._reader.start()
        return self

    def _read(self) -> None:
        try:
            for message in self._inbound:
                self._on_message(message)
        except Exception as exc:  # noqa: BLE001 - a broken peer ends the session, not the server
            log.info("stream reader ended: %s", exc)
        finally:
            self.close()

    def send(self, message: Any, timeout: float = 5.0) -> None:
        """Queue a message for the peer; raises ResourceExhausted if the peer does not drain in time."""
        if self.closed.is_set():
            raise ResourceExhausted("stream is closed")
        try:
            self._outbox.put(message, timeout=timeout)
        except queue.Full:
            raise ResourceExhausted(f"peer is not reading; outbox full ({self._outbox.maxsize})") from None

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        try:
            self._outbox.put_nowait(_CLOSED)
        except queue.Full:
            pass
        try:
            self._on_close()
        except Exception:  # noqa: BLE001
            log.exception("on_close failed")

    def outgoing(self, is_active: Callable[[], bool]) -> Iterator[Any]:
        """Messages for the peer, until the session closes or the call ends."""
        while is_active():
            try:
                item = self._outbox.get(timeout=0.5)
            except queue.Empty:
                if self.closed.is_set():
                    return
                continue
            if item is _CLOSED:
                return
            yield item
