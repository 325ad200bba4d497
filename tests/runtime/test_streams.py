"""BidiSession: inbound read on its own thread, bounded outbox, clean close."""

from __future__ import annotations

import queue
import threading

import pytest

from services.runtime.errors import ResourceExhausted
from services.runtime.streams import BidiSession


def test_reader_consumes_inbound_while_nobody_drains_the_outbox() -> None:
    seen: list[int] = []
    closed = threading.Event()
    session = BidiSession(iter(range(5)), seen.append, closed.set, maxsize=2).start()
    assert closed.wait(5), "the session closes when the inbound stream ends"
    assert seen == [0, 1, 2, 3, 4]
    assert session.closed.is_set()


def test_full_outbox_is_an_error_not_unbounded_memory() -> None:
    inbound: queue.Queue = queue.Queue()
    session = BidiSession(iter(inbound.get, None), lambda m: None, maxsize=2).start()
    session.send("a", timeout=0.1)
    session.send("b", timeout=0.1)
    with pytest.raises(ResourceExhausted, match="outbox full"):
        session.send("c", timeout=0.1)
    drained = session.outgoing(lambda: True)
    assert [next(drained), next(drained)] == ["a", "b"]
    inbound.put(None)  # peer hangs up
    assert list(drained) == []
    with pytest.raises(ResourceExhausted, match="closed"):
        session.send("d")
