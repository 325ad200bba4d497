"""Rows the admission pass keeps in memory, re-read only where they changed.

A pass used to read the whole fleet, every live lease and the whole queue every half second: at 1,024 hosts and
5,000 queued jobs that was most of the planner's and the store reader's CPU. Now the first read of each is whole,
and each later one asks only for rows changed since the previous read began, by the store's own clock (the List
call's `changed_since` and its reply's `read_at`), less OVERLAP_S, so that a change stamped when its transaction
began but committed after that read is still caught. Every RESYNC_S a whole read reconciles anything missed;
it runs on a thread of its own and the next refresh installs it (then reads what changed since it began), so the
pass that falls due never waits the seconds a whole read of a large fleet takes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf import timestamp_pb2

from services.runtime.store_api import every_page

log = logging.getLogger("ballast.scheduler")
OVERLAP_S = 5.0
RESYNC_S = 300.0  # a safety net: the overlap catches late commits; this, anything else missed


class Row(Protocol):
    id: str


T = TypeVar("T", bound=Row)
Read = tuple[Iterable[T], timestamp_pb2.Timestamp]  # the rows and when the store began reading them


def paged(list_method: Callable[[Any], Any], request: Any, rows: str) -> Read:
    """Every page of a List call that answers `read_at`: its `rows` field's items, and when the first page was
    read (a read that keeps rows asks for changes since then next)."""
    pages = list(every_page(list_method, request))
    return [row for page in pages for row in getattr(page, rows)], pages[0].read_at


@dataclass(frozen=True)
class Delta(Generic[T]):
    """What one refresh changed: every row anew (`whole`), or the rows put (with the copy each replaced, None
    for a new one) and the rows dropped. What a reader aggregates is kept from these, not re-counted."""

    whole: bool = False
    put: list[tuple[T | None, T]] = field(default_factory=list)
    gone: list[T] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.whole or bool(self.put or self.gone)


class ChangeReader(Generic[T]):
    """Keeps `rows` (id -> row) current with the store. A subclass says how to read whole and changed rows,
    when a row it holds is the same as a fresh copy, and which rows it keeps. `refresh()` is safe from several
    threads; it answers whether the rows changed."""

    def __init__(self, *, overlap_s: float = OVERLAP_S, resync_s: float = RESYNC_S,
                 clock: Callable[[], float] = time.monotonic, background: bool = True):
        """`background` False: a due resync is read in the refresh that finds it due (tests)."""
        self._overlap_s, self._resync_s, self._clock, self._background = overlap_s, resync_s, clock, background
        self.rows: dict[str, T] = {}
        self._cursor: timestamp_pb2.Timestamp | None = None  # when the last read began, by the store's clock
        self._whole_at: float | None = None
        self._resyncing = False
        self._generation = 0  # bumped by forget(): a resync begun before it is not installed
        self._pending: tuple[dict[str, T], timestamp_pb2.Timestamp, float] | None = None  # a resync's read
        self._lock = threading.Lock()
        self.reads = Counter[str]()  # "whole" / "changed": how the rows were kept (for tests and metrics)

    # --- what a subclass says -----------------------------------------------------------------------------
    def read_whole(self) -> Read[T]:
        raise NotImplementedError

    def read_changed(self, since: timestamp_pb2.Timestamp) -> Read[T]:
        raise NotImplementedError

    def same(self, held: T, fresh: T) -> bool:
        raise NotImplementedError

    def keep(self, row: T) -> bool:
        return True

    # --- keeping --------------------------------------------------------------------------------------------
    def refresh(self) -> Delta[T]:
        with self._lock:
            due = self._whole_at is not None and self._clock() - self._whole_at >= self._resync_s
            if self._whole_at is None or due and not self._background:
                return self._whole()
            if self._pending is not None:
                return self._install()
            if due and not self._resyncing:
                self._resyncing = True
                threading.Thread(target=self._resync, name=f"resync-{type(self).__name__}", daemon=True).start()
            return self._changed()

    def _whole(self) -> Delta[T]:
        started = self._clock()
        rows, self._cursor = self.read_whole()
        self.rows = {r.id: r for r in rows if self.keep(r)}
        self._whole_at = started
        self.reads["whole"] += 1
        return Delta(whole=True)

    def _resync(self) -> None:
        started, generation = self._clock(), self._generation
        try:
            rows, cursor = self.read_whole()
            kept = {r.id: r for r in rows if self.keep(r)}
        except Exception:  # noqa: BLE001 - the store away: the changed reads go on; try again a period later
            log.warning("a whole re-read failed", exc_info=True, extra={"reader": type(self).__name__})
            with self._lock:
                self._resyncing, self._whole_at = False, started
            return
        with self._lock:
            if generation == self._generation:  # not forgotten meanwhile
                self._pending = kept, cursor, started
            self._resyncing = self._pending is not None

    def _install(self) -> Delta[T]:
        """The background resync's rows, with what changed since it began, in place of the kept ones. Nothing
        is replaced unless both reads succeeded: a failure leaves the resync to install next time."""
        assert self._pending is not None
        rows, cursor, started = self._pending
        changed, cursor = self.read_changed(self._since(cursor))
        rows = dict(rows)
        for row in changed:
            if self.keep(row):
                rows[row.id] = row
            else:
                rows.pop(row.id, None)
        self.rows, self._cursor, self._whole_at = rows, cursor, started
        self._pending, self._resyncing = None, False
        self.reads["whole"] += 1
        return Delta(whole=True)

    def forget(self) -> None:
        """Read whole at the next refresh, in it (what the reader keeps no longer covers what is asked)."""
        with self._lock:
            self._whole_at, self._pending = None, None
            self._generation += 1

    def _changed(self) -> Delta[T]:
        assert self._cursor is not None
        rows, self._cursor = self.read_changed(self._since(self._cursor))
        self.reads["changed"] += 1
        held = self.rows
        fresh = [r for r in rows if r.id not in held or not self.same(held[r.id], r)]
        if not fresh:
            return Delta()
        kept, delta = dict(held), Delta[T]()
        for row in fresh:
            old = kept.pop(row.id, None)
            if self.keep(row):
                kept[row.id] = row
                delta.put.append((old, row))
            elif old is not None:
                delta.gone.append(old)
        self.rows = kept  # a new dict: a reader holding the old one sees a consistent set
        return delta

    def _since(self, cursor: timestamp_pb2.Timestamp) -> timestamp_pb2.Timestamp:
        """Where a changed read starts: the last read's start, less the overlap for late commits."""
        since = timestamp_pb2.Timestamp()
        since.FromNanoseconds(cursor.ToNanoseconds() - int(self._overlap_s * 1e9))
        return since

    def prune(self, keep: Callable[[T], bool]) -> Delta[T]:
        """Drop the rows `keep` refuses now (what ages out between reads)."""
        with self._lock:
            gone = [r for r in self.rows.values() if not keep(r)]
            if gone:
                self.rows = {k: r for k, r in self.rows.items() if keep(r)}
            return Delta(gone=gone)
