"""Calibrations (issue 17): the planner's cost-model corrections, one version per fit of a host class.

The planner fits a calibration from stored runs and plans with the latest one fitted on enough iterations, so
the store keeps every version (how a class's fit moved is itself worth reading in `ballast sql`). Versions are
numbered by the store: there is no parent row to lock as plans lock their job, so the unique (host_class,
version) constraint decides a race and the loser retries here with the next number. Every RPC is the
platform admin's: a calibration's provenance names the jobs of every tenant.
"""

from __future__ import annotations

import math
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from ballast.v1 import plan_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import InvalidArgument, NotFound, Unavailable
from services.store import models as m
from services.store.convert import shared_fields
from services.store.repo.base import RepositoryBase, fit, new_id, quote

SCALES = ("forward_scale", "backward_scale", "allreduce_scale", "update_scale", "memory_scale")
FIXED_COSTS = ("forward_fixed_s", "backward_fixed_s", "iteration_fixed_s")
OFFLOAD_SCALES = ("harmony_scale", "chunks_scale")  # 0: none fitted yet
RESIDUALS = ("residual", "residual_before")
SET_BY_STORE = ("id", "version", "fitted_at")
# Each lost race means another recorder of the class committed, so this many writers at once all get through.
VERSION_ATTEMPTS = 8
HOST_CLASS_FIX = "run a job on hosts of that class: the planner fits a calibration from its measured iterations"


def host_class_key(device_kind: str, cores: int, colocated: int) -> str:
    """The key the planner's HostClass builds (services/planner/cost/calibration.py)."""
    return f"{device_kind}/{cores}c/{colocated}w"


def calibration_pb(row: m.Calibration) -> plan_pb2.Calibration:
    return plan_pb2.Calibration(**shared_fields(row, plan_pb2.Calibration))


def _check_number(cal: plan_pb2.Calibration, name: str, *, positive: bool, fix: str) -> None:
    value = getattr(cal, name)
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        bound = "> 0" if positive else ">= 0"
        raise InvalidArgument(f"{value} is not a finite number {bound}", field=f"calibration.{name}", fix=fix)


def _check_host_class(cal: plan_pb2.Calibration) -> None:
    if not cal.device_kind:
        raise InvalidArgument("device_kind is not set", field="calibration.device_kind",
                              fix='send the device kind of the class\'s hosts, e.g. "cpu"')
    key = host_class_key(cal.device_kind, cal.cores, cal.colocated)
    if cal.host_class != key:
        raise InvalidArgument(f"host_class {quote(cal.host_class)} is not the key of its device_kind, cores and "
                              "colocated", field="calibration.host_class", fix=f"send {quote(key)}")


def check_calibration(cal: plan_pb2.Calibration) -> None:
    """Request-shape checks, before any write: a calibration the planner could not apply is refused."""
    _check_host_class(cal)
    for name in SCALES:
        _check_number(cal, name, positive=True, fix="send a finite factor > 0 (1 leaves the cost as predicted)")
    for name in FIXED_COSTS:
        _check_number(cal, name, positive=False, fix="send finite seconds >= 0 (0 adds nothing)")
    for name in OFFLOAD_SCALES:
        _check_number(cal, name, positive=False, fix="send a finite factor > 0, or 0 where none was fitted")
    for name in RESIDUALS:
        _check_number(cal, name, positive=False, fix="send the mean absolute relative error, finite and >= 0")
    if cal.iterations < 1:
        raise InvalidArgument("iterations is 0", field="calibration.iterations",
                              fix="send the number of measured iterations it was fitted on, at least 1")
    for i, job_id in enumerate(cal.job_ids):
        if not job_id:
            raise InvalidArgument("empty job id", field=f"calibration.job_ids[{i}]", fix="name each run by its id")
        fit(m.Job.id, job_id, f"calibration.job_ids[{i}]")


class _VersionTaken(Exception):
    """A concurrent recorder of the same host class committed the version this one was about to take."""


class CalibrationStore(RepositoryBase):
    """RecordCalibration, GetCalibration and ListCalibrations, all for the platform admin (the planner)."""

    def record_calibration(self, p: Principal, req: store_pb2.RecordCalibrationRequest) -> plan_pb2.Calibration:
        """Stored as its host class's next version; a lost race for a version is retried with the next one."""
        self._require_admin(p, "recording a calibration")
        cal = req.calibration
        check_calibration(cal)
        values = shared_fields(cal, m.Calibration, skip=SET_BY_STORE, field="calibration")
        for _ in range(VERSION_ATTEMPTS):
            try:
                return self._insert_next_version(values)
            except _VersionTaken:
                continue
        raise Unavailable(f"host class {quote(cal.host_class)} got {VERSION_ATTEMPTS} other calibrations while "
                          "this one was being stored", fix="retry the call; nothing was written")

    def _insert_next_version(self, values: dict[str, Any]) -> plan_pb2.Calibration:
        with self._tx(write=True) as s:
            latest = s.scalar(sa.select(sa.func.max(m.Calibration.version))
                              .where(m.Calibration.host_class == values["host_class"]))
            row = m.Calibration(**values, id=new_id("cal"), version=(latest or 0) + 1, fitted_at=self.now())
            s.add(row)
            try:
                s.flush()
            except sa_exc.IntegrityError:  # PostgreSQL: a concurrent writer committed that version first
                raise _VersionTaken from None
            return calibration_pb(row)

    def get_calibration(self, p: Principal, req: store_pb2.GetCalibrationRequest) -> plan_pb2.Calibration:
        """The highest version fitted on at least min_iterations; an older one qualifies if the latest does not."""
        self._require_reader(p, "reading calibrations")
        if not req.host_class:
            raise InvalidArgument("host_class is not set", field="host_class",
                                  fix='send a host class key, e.g. "cpu/16c/2w"')
        stmt = (sa.select(m.Calibration)
                .where(m.Calibration.host_class == req.host_class, m.Calibration.iterations >= req.min_iterations)
                .order_by(m.Calibration.version.desc()).limit(1))
        with self._tx(write=False) as s:
            row = s.scalars(stmt).first()
            if row is None:
                raise NotFound(f"no calibration of host class {quote(req.host_class)} fitted on at least "
                               f"{req.min_iterations} iterations", field="host_class", fix=HOST_CLASS_FIX)
            return calibration_pb(row)

    def list_calibrations(
        self, p: Principal, req: store_pb2.ListCalibrationsRequest
    ) -> store_pb2.ListCalibrationsResponse:
        self._require_reader(p, "listing calibrations")
        stmt = self._where_set(sa.select(m.Calibration), (m.Calibration.host_class, req.host_class))
        stmt = stmt.order_by(m.Calibration.fitted_at.desc(), m.Calibration.id.desc())
        items, token = self._page_of(stmt, req.page, calibration_pb)
        return store_pb2.ListCalibrationsResponse(calibrations=items, next_page_token=token)
