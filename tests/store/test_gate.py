"""The store's write gate: one writer at a time, first come first served per lane, callers before background
work, background work never starved (services/store/gate.py); and the lane each real call lands in. The call
gate: a service's own call starts after the callers' calls in flight (or after its max wait), never the reverse."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

from ballast.v1 import store_pb2
from services.runtime import context
from services.runtime.metrics import STORE_BACKGROUND_WAIT_SECONDS, STORE_WRITE_WAIT_SECONDS
from services.runtime.store_client import remote_stores
from services.store import schema
from services.store.db import create_engine
from services.store.gate import BACKGROUND, FOREGROUND, CallGate, WriteGate
from services.store.service import build_server
from tests.harness import make_settings, wait_for
from tests.store_fixtures import ADMIN_TOKEN


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _queue_up(gate: WriteGate, lanes: list[str], order: list[str]) -> list[threading.Thread]:
    """One thread per lane entry, each queued (seen waiting) before the next starts, recording its turn."""
    threads = []
    for i, lane in enumerate(lanes):
        lanes_ahead = {FOREGROUND: lanes[:i].count(FOREGROUND), BACKGROUND: lanes[:i].count(BACKGROUND)}

        def write(name: str = f"{lane}-{i}", lane: str = lane) -> None:
            context.set_call(None, None, background=lane == BACKGROUND)
            with gate():
                order.append(name)

        threads.append(threading.Thread(target=write))
        threads[-1].start()
        expected = dict(lanes_ahead, **{lane: lanes_ahead[lane] + 1})
        wait_for(lambda e=expected: gate.waiting() == e, timeout=10, what=f"writer {i} queued")
    return threads


def test_waiting_writers_go_first_come_first_served_with_callers_before_background_work():
    clock = Clock()
    gate = WriteGate(context.in_background, max_wait_s=0.5, clock=clock)
    order: list[str] = []
    with gate():  # held, so every writer below queues
        threads = _queue_up(gate, [BACKGROUND, FOREGROUND, BACKGROUND, FOREGROUND], order)
    for t in threads:
        t.join(10)
    assert order == ["foreground-1", "foreground-3", "background-0", "background-2"]
    assert gate.waiting() == {FOREGROUND: 0, BACKGROUND: 0}


def test_a_background_writer_waiting_past_max_wait_goes_before_callers():
    clock = Clock()
    gate = WriteGate(context.in_background, max_wait_s=0.5, clock=clock)
    order: list[str] = []
    with gate():
        threads = _queue_up(gate, [BACKGROUND, FOREGROUND, FOREGROUND], order)
        clock.now = 0.5  # the background writer has waited its max
    for t in threads:
        t.join(10)
    assert order == ["background-0", "foreground-1", "foreground-2"]


def test_one_writer_at_a_time_under_many_threads():
    gate = WriteGate(context.in_background)
    inside, most, lock = [0], [0], threading.Lock()

    def write(background: bool) -> None:
        context.set_call(None, None, background=background)
        for _ in range(200):
            with gate():
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=write, args=(i % 2 == 0,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most[0] == 1 and gate.waiting() == {FOREGROUND: 0, BACKGROUND: 0}


def _writes(lane: str) -> float:
    """How many writes of `lane` this process's store gates have let through (the wait histogram's count); lane
    "gated": how many background calls the call gate let start."""
    if lane == "gated":
        return next(sample.value for metric in STORE_BACKGROUND_WAIT_SECONDS.collect() for sample in metric.samples
                    if sample.name.endswith("_count"))
    return next(sample.value for metric in STORE_WRITE_WAIT_SECONDS.collect() for sample in metric.samples
                if sample.name.endswith("_count") and sample.labels == {"lane": lane})


def test_a_services_own_calls_write_in_the_background_lane_and_its_callers_calls_in_the_foreground(
        tmp_path: Path):
    """Over a real store server and the two channels a service opens (store_client.remote_stores)."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    schema.upgrade(url)
    engine = create_engine(url)
    settings = make_settings(tmp_path, token=ADMIN_TOKEN)
    server = build_server(settings, engine, "127.0.0.1:0").start()
    try:
        as_caller, as_platform = remote_stores(dataclasses.replace(settings, store_port=server.port))
        lanes = (FOREGROUND, BACKGROUND, "gated")
        before = {lane: _writes(lane) for lane in lanes}
        as_platform.create_tenant(store_pb2.CreateTenantRequest(name="by-the-platform"))
        after_platform = {lane: _writes(lane) for lane in lanes}
        as_caller.create_tenant(store_pb2.CreateTenantRequest(name="by-a-caller"))  # no incoming call: its token
        after_caller = {lane: _writes(lane) for lane in lanes}
    finally:
        server.stop(0)
        engine.dispose()
    assert after_platform[BACKGROUND] > before[BACKGROUND] and after_platform[FOREGROUND] == before[FOREGROUND]
    assert after_caller[FOREGROUND] == after_platform[FOREGROUND] + 1
    assert after_platform["gated"] == before["gated"] + 1 and after_caller["gated"] == after_platform["gated"]


def _run(gate: CallGate, background: bool, started: list[str], name: str, release: threading.Event,
         waited: dict[str, float] | None = None) -> threading.Thread:
    def call() -> None:
        entered = time.monotonic()
        with gate(background):
            if waited is not None:
                waited[name] = time.monotonic() - entered
            started.append(name)
            release.wait(30)

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_a_background_call_starts_once_the_callers_calls_in_flight_are_served():
    gate, started = CallGate(max_wait_s=1.0, clock=lambda: 0.0), []  # frozen: it waits until notified
    caller_done, background_done = threading.Event(), threading.Event()
    caller = _run(gate, False, started, "caller", caller_done)
    wait_for(lambda: gate.in_flight == 1, timeout=10, what="the caller's call running")
    background = _run(gate, True, started, "background", background_done)
    wait_for(lambda: gate.waiting == 1, timeout=10, what="the background call waiting")
    other = _run(gate, False, started, "another caller", background_done)  # a caller never waits
    wait_for(lambda: "another caller" in started, timeout=10, what="the second caller's call running")
    assert "background" not in started
    caller_done.set()
    caller.join(10)
    assert gate.in_flight == 1 and "background" not in started  # the second caller's call is still in flight
    background_done.set()  # ends the second caller's call; the background call then runs through
    for t in (caller, background, other):
        t.join(10)
    assert started == ["caller", "another caller", "background"] and gate.in_flight == 0


def test_a_background_call_waits_at_most_max_wait_and_one_at_a_time_otherwise():
    gate, started, waited = CallGate(max_wait_s=0.05), [], {}
    caller_done, first_done, second_done = threading.Event(), threading.Event(), threading.Event()
    caller = _run(gate, False, started, "caller", caller_done)
    wait_for(lambda: gate.in_flight == 1, timeout=10, what="the caller's call running")
    first = _run(gate, True, started, "first", first_done, waited)
    wait_for(lambda: "first" in started, timeout=10, what="the background call after its max wait")
    assert gate.in_flight == 1 and waited["first"] >= 0.05  # held back its max, then started beside the caller
    caller_done.set()
    caller.join(10)
    second = _run(gate, True, started, "second", second_done, waited)
    wait_for(lambda: "second" in started, timeout=10, what="the second background call after its max wait")
    assert waited["second"] >= 0.05 and "first" in started and not first_done.is_set()  # it waited behind "first"
    for event, t in ((first_done, first), (second_done, second)):
        event.set()
        t.join(10)
    assert started == ["caller", "first", "second"]
    idle = CallGate(max_wait_s=1.0, clock=lambda: 0.0)  # a frozen clock: any wait here would never end

    def on_idle() -> None:
        with idle(True):
            started.append("on an idle store")

    thread = threading.Thread(target=on_idle, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and started[-1] == "on an idle store"  # nothing in flight: it started at once


def test_no_wait_at_zero_and_a_negative_wait_is_refused():
    gate, started, done = CallGate(max_wait_s=0.0), [], threading.Event()
    caller = _run(gate, False, started, "caller", done)
    wait_for(lambda: gate.in_flight == 1, timeout=10, what="the caller's call running")
    with gate(True):
        started.append("background")
    done.set()
    caller.join(10)
    assert started == ["caller", "background"]
    for bad in (-0.001, 1.001):
        with pytest.raises(ValueError, match="store_background_wait_ms"):
            CallGate(max_wait_s=bad)
