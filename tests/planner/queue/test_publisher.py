"""The planner's broker publisher: Submit does not wait for the broker, and no id is dropped while it is away."""

from __future__ import annotations

import threading

import pytest

from services.planner.queue.publisher import Publisher

FAST = (0.001, 0.002)


def test_a_send_returns_before_the_broker_has_it_and_ids_go_out_in_order():
    gate, published = threading.Event(), []

    def publish(request_id: str) -> None:
        gate.wait(5)
        published.append(request_id)

    publisher = Publisher(publish, FAST)
    publisher.start()
    for i in range(5):
        publisher(f"req-{i}")  # returns although the broker holds every publish
    assert published == [] and publisher.pending == 5
    gate.set()
    assert publisher.flush(5)
    assert published == [f"req-{i}" for i in range(5)] and publisher.pending == 0
    publisher.stop()
    publisher.join(5)
    assert not publisher.is_alive()


def test_a_broker_away_is_waited_for_not_a_lost_id():
    failures, published = iter([ConnectionError("broker down")] * 3), []

    def publish(request_id: str) -> None:
        error = next(failures, None)
        if error is not None:
            raise error
        published.append(request_id)

    publisher = Publisher(publish, FAST)
    publisher.start()
    publisher("req-a")
    publisher("req-b")
    assert publisher.flush(5)
    assert published == ["req-a", "req-b"] and publisher.retries == 3 and publisher.published == 2
    publisher.stop()


def test_stopping_while_the_broker_is_away_ends_the_thread_and_refuses_new_ids():
    def publish(request_id: str) -> None:
        raise ConnectionError("broker down")

    publisher = Publisher(publish, (0.05,))
    publisher.start()
    publisher("req-a")
    publisher.stop(flush_s=0.2)  # the sweeper's requeue of unclaimed requests sends req-a again
    publisher.join(5)
    assert not publisher.is_alive() and publisher.pending == 1
    with pytest.raises(RuntimeError, match="stopped"):
        publisher("req-b")
