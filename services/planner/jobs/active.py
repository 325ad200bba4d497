"""The jobs that wait or hold devices and the leases fair share counts, as the admission pass keeps them: read
whole once, then only where they changed (changes.py), so a pass costs the same with 50 or 5,000 jobs queued."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from google.protobuf import timestamp_pb2

from ballast.v1 import fleet_pb2, job_pb2, store_pb2
from services.planner.jobs.changes import ChangeReader, Delta, Read, paged
from services.runtime.store_api import Store

S = job_pb2.JobState
WAITING = (S.JOB_STATE_SCHEDULED, S.JOB_STATE_QUEUED)
HOLDING = (S.JOB_STATE_RUNNING, S.JOB_STATE_REPARTITIONING, S.JOB_STATE_MORPHING, S.JOB_STATE_CANCELLING)
ACTIVE = frozenset(WAITING + HOLDING)


class JobReader(ChangeReader[job_pb2.Job]):
    """The jobs in a waiting or holding state. A job's progress (its iteration) is no change: a held row's
    iteration is as of its last state change; the scheduler knows the live one."""

    def __init__(self, store: Store, **timing: Any):
        super().__init__(**timing)
        self._store = store

    def read_whole(self) -> Read[job_pb2.Job]:
        jobs: list[job_pb2.Job] = []
        began: timestamp_pb2.Timestamp | None = None
        for state in sorted(ACTIVE):
            rows, read_at = paged(self._store.list_jobs, store_pb2.ListJobsRequest(state=state), "jobs")
            began = began or read_at  # the earliest: a change after it is read next time
            jobs.extend(rows)
        assert began is not None
        return jobs, began

    def read_changed(self, since: timestamp_pb2.Timestamp) -> Read[job_pb2.Job]:
        return paged(self._store.list_jobs, store_pb2.ListJobsRequest(changed_since=since), "jobs")

    def same(self, held: job_pb2.Job, fresh: job_pb2.Job) -> bool:
        return held.updated_at == fresh.updated_at and held.state == fresh.state

    def keep(self, row: job_pb2.Job) -> bool:
        return row.state in ACTIVE


class LeaseReader(ChangeReader[fleet_pb2.DeviceLease]):
    """Live leases and those that ended after `horizon()` (epoch seconds: how far back fair share looks)."""

    def __init__(self, store: Store, horizon: Callable[[], float], **timing: Any):
        super().__init__(**timing)
        self._store, self._horizon = store, horizon

    def read_whole(self) -> Read[fleet_pb2.DeviceLease]:
        request = store_pb2.ListLeasesRequest()
        request.since.FromMicroseconds(int(self._horizon() * 1e6))
        return paged(self._store.list_leases, request, "leases")

    def read_changed(self, since: timestamp_pb2.Timestamp) -> Read[fleet_pb2.DeviceLease]:
        return paged(self._store.list_leases, store_pb2.ListLeasesRequest(changed_since=since), "leases")

    def same(self, held: fleet_pb2.DeviceLease, fresh: fleet_pb2.DeviceLease) -> bool:
        return held.HasField("ended_at") == fresh.HasField("ended_at") and held.ended_at == fresh.ended_at

    def keep(self, row: fleet_pb2.DeviceLease) -> bool:
        return not row.HasField("ended_at") or row.ended_at.ToMicroseconds() >= self._horizon() * 1e6


def _epoch(ts: timestamp_pb2.Timestamp) -> float:
    return ts.ToMicroseconds() / 1e6


Interval = tuple[str, float, float | None]  # tenant, start, end (None while live), as fair share counts them


def interval(lease: fleet_pb2.DeviceLease) -> Interval:
    return (lease.tenant_id, _epoch(lease.started_at),
            _epoch(lease.ended_at) if lease.HasField("ended_at") else None)


class LeaseBook:
    """The live leases by job, the devices they hold and fair share's intervals (counted: a job's leases share
    one), kept from a LeaseReader's deltas so a pass does not walk every lease of the last hours."""

    def __init__(self) -> None:
        self.live: dict[str, dict[str, fleet_pb2.DeviceLease]] = {}  # job id -> lease id -> live lease
        self.leased: set[tuple[str, int]] = set()  # (host id, device index) of every live lease
        self.held_on: Counter[str] = Counter()  # host id -> its devices under a live lease
        self.intervals: Counter[Interval] = Counter()
        self.moved: set[str] = set()  # jobs whose live leases changed since the last `take_moved`
        self._ends: list[tuple[float, Interval]] = []  # ended intervals by end (a heap; stale entries skipped)

    def oldest_end(self) -> float:
        """When the earliest-ended lease still counted ended (inf: none): pruning is due once it falls behind
        the horizon, so a pass does not look at every lease to find out."""
        ends = self._ends
        while ends and self.intervals.get(ends[0][1], 0) <= 0:
            heapq.heappop(ends)
        return ends[0][0] if ends else math.inf

    def apply(self, delta: Delta[fleet_pb2.DeviceLease], rows: dict[str, fleet_pb2.DeviceLease]) -> None:
        if delta.whole:
            self.moved.update(self.live)
            self.live, self.leased, self.held_on, self.intervals, self._ends = {}, set(), Counter(), Counter(), []
            for lease in rows.values():
                self._add(lease)
            return
        # every old copy out before any new one in: a device's lease that ended and the one that follows it on
        # the same device arrive in one delta
        for old in [old for old, _ in delta.put if old is not None] + delta.gone:
            self._remove(old)
        for _, new in delta.put:
            self._add(new)

    def take_moved(self) -> set[str]:
        moved, self.moved = self.moved, set()
        return moved

    def _add(self, lease: fleet_pb2.DeviceLease) -> None:
        key = interval(lease)
        self.intervals[key] += 1
        if key[2] is not None:
            if self.intervals[key] == 1:
                heapq.heappush(self._ends, (key[2], key))
            return
        self.live.setdefault(lease.job_id, {})[lease.id] = lease
        self.leased.add((lease.device.host_id, lease.device.device_index))
        self.held_on[lease.device.host_id] += 1
        self.moved.add(lease.job_id)

    def _remove(self, lease: fleet_pb2.DeviceLease) -> None:
        key = interval(lease)
        self.intervals[key] -= 1
        if self.intervals[key] <= 0:
            del self.intervals[key]
        if not lease.HasField("ended_at"):
            held = self.live.get(lease.job_id, {})
            held.pop(lease.id, None)
            if not held:
                self.live.pop(lease.job_id, None)
            self.leased.discard((lease.device.host_id, lease.device.device_index))
            self.held_on[lease.device.host_id] -= 1
            if self.held_on[lease.device.host_id] <= 0:
                del self.held_on[lease.device.host_id]
            self.moved.add(lease.job_id)
