"""Job morphs (Varuna §4): a job reshaped onto other devices, resumed from its last complete checkpoint.

Recording a morph also deletes the job's iteration metrics from the checkpoint on, in the same transaction:
those iterations are trained again on the new layout, and keeping both runs would leave two lineages of the
same iterations in `iteration_metrics` (double-counted throughput, two losses per step). The store computes
lost_iterations and recovery_s itself so every reader (the planner, `ballast sql`) agrees on them.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from google.protobuf import timestamp_pb2

from ballast.v1 import job_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import InvalidArgument, NotFound
from services.store import models as m
from services.store.convert import shared_fields, to_datetime
from services.store.repo.base import RepositoryBase, new_id, quote

MORPH_CAUSES = ("worker_lost", "host_lost", "straggler", "grow", "resize")
SERVER_SET = ("id", "lost_iterations", "first_iteration_at", "recovery_s")


def morph_pb(row: m.JobMorph) -> job_pb2.Morph:
    return job_pb2.Morph(**shared_fields(row, job_pb2.Morph))


def _when(value: timestamp_pb2.Timestamp, has: bool, field: str) -> datetime:
    if not has:
        raise InvalidArgument(f"{field} is not set", field=field, fix="send the time, in UTC")
    return to_datetime(value, field)


def _check_morph(mp: job_pb2.Morph) -> tuple[datetime, datetime]:
    """Request-shape checks, before any read: (detected_at, resumed_at)."""
    if mp.cause not in MORPH_CAUSES:
        raise InvalidArgument(f"unknown cause {quote(mp.cause)}", field="morph.cause",
                              fix=f"use one of {', '.join(MORPH_CAUSES)}")
    if mp.checkpoint_iteration > mp.failed_iteration:
        raise InvalidArgument(
            f"checkpoint_iteration {mp.checkpoint_iteration} is past failed_iteration {mp.failed_iteration}",
            field="morph.checkpoint_iteration", fix="resume from a checkpoint taken before the loss")
    for name in ("to_stages", "to_replicas"):
        if getattr(mp, name) < 1:
            raise InvalidArgument(f"{name} is 0", field=f"morph.{name}", fix="the new layout needs at least 1")
    detected = _when(mp.detected_at, mp.HasField("detected_at"), "morph.detected_at")
    resumed = _when(mp.resumed_at, mp.HasField("resumed_at"), "morph.resumed_at")
    if resumed < detected:
        raise InvalidArgument("resumed_at is before detected_at", field="morph.resumed_at",
                              fix="a job resumes after its loss was detected")
    return detected, resumed


class MorphStore(RepositoryBase):
    """Morph RPCs: the admin (the planner) records them; tenants read their own jobs' morphs."""

    def record_morph(self, p: Principal, req: store_pb2.RecordMorphRequest) -> job_pb2.Morph:
        self._require_admin(p, "recording a morph")
        mp = req.morph
        detected, resumed = _check_morph(mp)
        values = shared_fields(mp, m.JobMorph, skip=SERVER_SET, field="morph")
        with self._tx(write=True) as s:
            job = self._job(s, p, mp.job_id, field="morph.job_id", lock=True)
            # The planner counts what reached it; stats in flight from a survivor may have arrived since.
            top = s.scalar(sa.select(sa.func.max(m.IterationMetric.iteration)).where(
                m.IterationMetric.job_id == job.id))
            values["failed_iteration"] = max(mp.failed_iteration, top + 1 if top is not None else 0)
            row = m.JobMorph(**values, id=new_id("mph"), tenant_id=job.tenant_id, detected_at=detected,
                             resumed_at=resumed, lost_iterations=values["failed_iteration"] - mp.checkpoint_iteration,
                             created_at=self.now())
            s.add(row)
            s.execute(sa.delete(m.IterationMetric).where(m.IterationMetric.job_id == job.id,
                                                         m.IterationMetric.iteration >= mp.checkpoint_iteration))
            job.iteration = min(job.iteration or 0, max(mp.checkpoint_iteration - 1, 0))  # the last one kept
            s.flush()
            return morph_pb(row)

    def morph_resumed(self, p: Principal, req: store_pb2.MorphResumedRequest) -> job_pb2.Morph:
        """Sets first_iteration_at and recovery_s once; a repeat (a retried report) returns the row as is."""
        self._require_admin(p, "recording a morph's first iteration")
        first = _when(req.first_iteration_at, req.HasField("first_iteration_at"), "first_iteration_at")
        with self._tx(write=True) as s:
            row = s.scalars(sa.select(m.JobMorph).where(m.JobMorph.id == req.id).with_for_update()).first()
            if row is None:
                raise NotFound(f"morph {quote(req.id)} not found", field="id")
            if row.first_iteration_at is None:
                if first < row.detected_at:
                    raise InvalidArgument("first_iteration_at is before the morph's detected_at",
                                          field="first_iteration_at", fix="send the time the iteration was reported")
                row.first_iteration_at = first
                row.recovery_s = (first - row.detected_at).total_seconds()
                s.flush()
            return morph_pb(row)

    def list_morphs(self, p: Principal, req: store_pb2.ListMorphsRequest) -> store_pb2.ListMorphsResponse:
        stmt = self._scoped(sa.select(m.JobMorph), m.JobMorph.tenant_id, p)
        stmt = self._where_set(stmt, (m.JobMorph.job_id, req.job_id))
        stmt = stmt.order_by(m.JobMorph.detected_at, m.JobMorph.id)
        items, token = self._page_of(stmt, req.page, morph_pb)
        return store_pb2.ListMorphsResponse(morphs=items, next_page_token=token)
