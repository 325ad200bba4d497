"""A change reader's background resync: the refresh that finds it due never waits for the whole read, and the
refresh after it installs the whole read and what changed since it began."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from google.protobuf import timestamp_pb2

from services.planner.jobs.changes import ChangeReader, Read


@dataclass(frozen=True)
class Row:
    id: str
    version: int
    stamp: int  # when it changed, by the table's clock (seconds)


def ts(seconds: int) -> timestamp_pb2.Timestamp:
    out = timestamp_pb2.Timestamp()
    out.FromSeconds(seconds)
    return out


class Table(ChangeReader[Row]):
    """An in-memory table whose whole read can be held mid-way."""

    def __init__(self, **kw):
        super().__init__(overlap_s=0.0, **kw)
        self.table: dict[str, Row] = {}
        self.now = 0
        self.hold = threading.Event()
        self.hold.set()
        self.whole_began = threading.Event()

    def put(self, row_id: str) -> None:
        self.now += 1
        old = self.table.get(row_id)
        self.table[row_id] = Row(row_id, old.version + 1 if old else 1, self.now)

    def read_whole(self) -> Read[Row]:
        began, rows = ts(self.now), list(self.table.values())
        self.whole_began.set()
        assert self.hold.wait(10)
        return rows, began

    def read_changed(self, since: timestamp_pb2.Timestamp) -> Read[Row]:
        return [r for r in self.table.values() if r.stamp >= since.seconds], ts(self.now)

    def same(self, held: Row, fresh: Row) -> bool:
        return held.version == fresh.version


def test_a_due_resync_reads_in_the_background_and_is_installed_by_the_next_refresh() -> None:
    clock = [0.0]
    table = Table(resync_s=60.0, clock=lambda: clock[0])
    table.put("a")
    assert table.refresh().whole and set(table.rows) == {"a"}

    table.put("b")
    clock[0] = 61.0
    table.hold.clear()  # the whole read, once begun, takes its time
    delta = table.refresh()
    assert not delta.whole and [new.id for _, new in delta.put] == ["b"]  # the pass got its changes at once
    assert table.whole_began.wait(10)
    table.put("c")  # lands while the whole read is under way
    assert not table.refresh().whole and set(table.rows) == {"a", "b", "c"}
    table.hold.set()
    deadline = time.monotonic() + 10
    while table._pending is None and time.monotonic() < deadline:
        time.sleep(0.01)
    table.put("a")
    delta = table.refresh()
    assert delta.whole and table.reads["whole"] == 2
    assert {r.id: r.version for r in table.rows.values()} == {"a": 2, "b": 1, "c": 1}  # whole, then since it began


def test_a_resync_whose_catch_up_read_fails_replaces_nothing_and_installs_next_time() -> None:
    clock = [0.0]
    table = Table(resync_s=60.0, clock=lambda: clock[0])
    table.put("a")
    table.refresh()
    clock[0] = 61.0
    table.refresh()  # the resync starts in the background
    deadline = time.monotonic() + 10
    while table._pending is None and time.monotonic() < deadline:
        time.sleep(0.01)
    table.put("b")
    reads = table.read_changed
    table.read_changed = lambda since: (_ for _ in ()).throw(ConnectionError("the store is away"))
    try:
        table.refresh()
        raise AssertionError("the refresh should have failed")
    except ConnectionError:
        pass
    assert set(table.rows) == {"a"} and table.reads["whole"] == 1  # nothing half-replaced
    table.read_changed = reads
    assert table.refresh().whole and set(table.rows) == {"a", "b"} and table.reads["whole"] == 2


def test_a_forgotten_reader_reads_whole_at_once_and_drops_a_resync_begun_before() -> None:
    clock = [0.0]
    table = Table(resync_s=60.0, clock=lambda: clock[0])
    table.put("a")
    table.refresh()
    clock[0] = 61.0
    table.hold.clear()
    table.whole_began.clear()
    table.refresh()
    assert table.whole_began.wait(10)
    table.forget()
    table.hold.set()
    assert table.refresh().whole and table.reads["whole"] == 2  # read whole in the refresh itself
    time.sleep(0.2)
    assert table._pending is None  # the older resync was not kept to install
