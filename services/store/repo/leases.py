"""Device leases and the fleet policy: who may hold which device, and who holds it now.

A lease is only ever made here, in one transaction that also checks the job, the devices and the tenant's
quota; the partial unique index `uq_device_leases_live` makes the database refuse a second live lease on a
device even if two schedulers race. Quota checks lock the tenant's row, so two admissions of one tenant's
jobs serialize on PostgreSQL as they do on SQLite (which serializes every write).
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from ballast.v1 import fleet_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from services.specs import placement as placement_spec
from services.specs import policy as fleet_policy
from services.store import job_states
from services.store import models as m
from services.store.convert import enum_name, from_json, to_datetime, to_json, ts
from services.store.repo.base import RepositoryBase, new_id, quote

LEASE_FIX = "wait for the device to be released, or pick devices no live lease holds"

LATEST_POLICY_VERSION = sa.select(sa.func.max(m.FleetPolicyVersion.version))


def lease_pb(row: m.DeviceLease) -> fleet_pb2.DeviceLease:
    return fleet_pb2.DeviceLease(
        id=row.id, job_id=row.job_id, tenant_id=row.tenant_id, device_kind=row.device_kind,
        device=fleet_pb2.DeviceRef(host_id=row.host_id, device_index=row.device_index),
        started_at=ts(row.started_at), ended_at=ts(row.ended_at),
        end_reason=fleet_pb2.LeaseEndReason.Value(row.end_reason) if row.end_reason else 0,
        rank=row.rank or 0, placement_id=row.placement_id or "")


def placement_pb(row: m.JobPlacement) -> fleet_pb2.JobPlacement:
    out = from_json(row.body, fleet_pb2.JobPlacement)
    out.id = row.id
    out.created_at.CopyFrom(ts(row.created_at))
    return out


def policy_pb(row: m.FleetPolicyVersion | None) -> fleet_pb2.FleetPolicy:
    if row is None:
        return fleet_policy.default_policy()
    out = from_json(row.policy, fleet_pb2.FleetPolicy)
    out.version, out.created_by = row.version, row.created_by
    out.created_at.CopyFrom(ts(row.created_at))
    return out


class LeaseStore(RepositoryBase):
    """Lease and policy RPCs."""

    # --- policy -----------------------------------------------------------------------------------------
    @staticmethod
    def _policy_row(s: Session, version: int = 0) -> m.FleetPolicyVersion | None:
        stmt = sa.select(m.FleetPolicyVersion)
        stmt = stmt.where(m.FleetPolicyVersion.version == version) if version else stmt.order_by(
            m.FleetPolicyVersion.version.desc())
        return s.scalars(stmt.limit(1)).first()

    def current_policy(self, s: Session) -> fleet_pb2.FleetPolicy:
        """The latest policy version. Every submit reads it: only the version number comes from the database,
        the version's parsed policy from `self.policies` (a stored version is never rewritten)."""
        version = s.connection().scalar(LATEST_POLICY_VERSION)  # Core: a number, no row to map
        if not version:
            return policy_pb(None)
        known = self.policies.get(version)
        if known is None:
            known = policy_pb(self._policy_row(s, version)).SerializeToString()
            self.policies[version] = known
        return fleet_pb2.FleetPolicy.FromString(known)

    def get_fleet_policy(self, p: Principal, req: store_pb2.GetFleetPolicyRequest) -> fleet_pb2.FleetPolicy:
        with self._tx(write=False) as s:
            row = self._policy_row(s, req.version)
            if row is None and req.version:
                raise NotFound(f"fleet policy version {req.version} not found", field="version",
                               fix="pass 0 for the current policy")
            return policy_pb(row)

    def set_fleet_policy(self, p: Principal, req: store_pb2.SetFleetPolicyRequest) -> fleet_pb2.FleetPolicy:
        self._require_admin(p, "changing the fleet policy")
        with self._tx(write=True) as s:
            names = s.scalars(sa.select(m.Tenant.name)).all()
            fleet_policy.check_policy(req.policy, names)
            current = self._policy_row(s)
            version = current.version if current else 0
            if req.expected_version and req.expected_version != version:
                raise FailedPrecondition(f"the policy in force is version {version}, not {req.expected_version}",
                                         field="expected_version", fix="read the policy again and re-apply")
            body = fleet_pb2.FleetPolicy()
            body.CopyFrom(req.policy)
            for name in ("version", "created_at", "created_by"):
                body.ClearField(name)
            row = m.FleetPolicyVersion(version=version + 1, policy=to_json(body), created_by=p.tenant_name,
                                       created_at=self.now())
            s.add(row)
            try:
                s.flush()
            except sa_exc.IntegrityError:  # another admin stored that version first
                raise FailedPrecondition("the policy changed concurrently", field="expected_version",
                                         fix="read the policy again and re-apply") from None
            return policy_pb(row)

    # --- leases -----------------------------------------------------------------------------------------
    def acquire_leases(self, p: Principal, req: store_pb2.AcquireLeasesRequest) -> store_pb2.AcquireLeasesResponse:
        self._require_admin(p, "leasing devices")
        wanted = [(d.host_id, d.device_index) for d in req.devices]
        if not wanted:
            raise InvalidArgument("no devices named", field="devices", fix="name at least one (host_id, index)")
        if len(set(wanted)) != len(wanted):
            raise InvalidArgument("a device is named twice", field="devices", fix="name each device once")
        try:
            with self._tx(write=True) as s:
                job = self._job(s, p, req.job_id, lock=True)
                if job.state in job_states.TERMINAL:
                    raise FailedPrecondition(f"job {job.id} is {job.state}", field="job_id",
                                             fix="only a job that is not finished can lease devices")
                kinds = self._device_kinds(s, wanted)
                self._check_quota(s, job, len(wanted))
                start = self._start_after_last_lease(s, wanted)
                placed = self._placement(s, job, req.placement, wanted, start) if req.HasField("placement") else None
                ranks = {(r.host_id, r.device_index): r.rank for r in req.placement.ranks}
                rows = [m.DeviceLease(id=new_id("lse"), job_id=job.id, tenant_id=job.tenant_id, host_id=h,
                                      device_index=i, device_kind=kinds[(h, i)], started_at=start,
                                      placement_id=placed.id if placed else None,
                                      rank=ranks[(h, i)] if placed else None)
                        for h, i in wanted]
                s.add_all(rows)
                s.flush()
                return store_pb2.AcquireLeasesResponse(leases=[lease_pb(r) for r in rows],
                                                       placement=placement_pb(placed) if placed else None)
        except sa_exc.IntegrityError:
            raise self._busy(wanted) from None

    @staticmethod
    def _placement(s: Session, job: m.Job, placement: fleet_pb2.JobPlacement, wanted: list[tuple[str, int]],
                   at: datetime) -> m.JobPlacement:
        """The placement's row, added in the leases' transaction (checked first: INVALID_ARGUMENT names the field)."""
        placement_spec.check(placement, job.id, wanted)
        body = fleet_pb2.JobPlacement()
        body.CopyFrom(placement)
        body.ClearField("id")
        body.ClearField("created_at")
        row = m.JobPlacement(
            id=new_id("plc"), job_id=job.id, tenant_id=job.tenant_id, plan_id=body.plan_id,
            plan_version=body.plan_version, stages=body.stages, replicas=body.replicas, world_size=body.world_size,
            micro_batch_size=body.micro_batch_size, num_micro_batches=body.num_micro_batches,
            global_batch_size=body.global_batch_size, rendezvous=body.rendezvous, backend=body.backend,
            body=to_json(body), created_at=at)
        s.add(row)
        s.flush()
        return row

    def get_placement(self, p: Principal, req: store_pb2.GetPlacementRequest) -> fleet_pb2.JobPlacement:
        with self._tx(write=False) as s:
            job = self._job(s, p, req.job_id)
            row = s.scalars(sa.select(m.JobPlacement).where(m.JobPlacement.job_id == job.id).order_by(
                m.JobPlacement.created_at.desc(), m.JobPlacement.id.desc()).limit(1)).first()
            if row is None:
                raise NotFound(f"job {job.id} was never started on a placement", field="job_id",
                               fix="a job has one once the planner starts it (state RUNNING)")
            return placement_pb(row)

    @staticmethod
    def _device_kinds(s: Session, wanted: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
        hosts = {h for h, _ in wanted}
        rows = s.execute(sa.select(m.Device.host_id, m.Device.device_index, m.Device.kind)
                         .where(m.Device.host_id.in_(hosts))).all()
        kinds = {(h, i): k for h, i, k in rows}
        for n, key in enumerate(wanted):
            if key not in kinds:
                raise NotFound(f"device {key[1]} of host {quote(key[0])} is not registered", field=f"devices[{n}]",
                               fix="lease devices of registered hosts (ballast fleet)")
        return kinds

    def _check_quota(self, s: Session, job: m.Job, adding: int) -> None:
        tenant = s.scalars(sa.select(m.Tenant).where(m.Tenant.id == job.tenant_id).with_for_update()).one()
        quota = fleet_policy.tenant_policy(self.current_policy(s), tenant.name).device_quota
        if not quota:
            return
        held = s.scalar(sa.select(sa.func.count()).select_from(m.DeviceLease).where(
            m.DeviceLease.tenant_id == job.tenant_id, m.DeviceLease.ended_at.is_(None))) or 0
        if held + adding > quota:
            raise FailedPrecondition(
                f"tenant {tenant.name!r} holds {held} device(s) of its quota {quota}; {adding} more would exceed it",
                field="devices", fix="wait for the tenant's jobs to finish, or raise its device_quota")

    def _start_after_last_lease(self, s: Session, wanted: list[tuple[str, int]]) -> datetime:
        """Now, or the latest end of a past lease on these devices if a clock (another planner's) ran ahead:
        leases of one device never overlap in time, whoever wrote them."""
        now = self.now()
        pairs = sa.tuple_(m.DeviceLease.host_id, m.DeviceLease.device_index).in_(wanted)
        last = s.scalar(sa.select(sa.func.max(m.DeviceLease.ended_at)).where(pairs))
        return max(now, last) if last is not None else now

    def _busy(self, wanted: list[tuple[str, int]]) -> FailedPrecondition:
        with self._tx(write=False) as s:
            pairs = sa.tuple_(m.DeviceLease.host_id, m.DeviceLease.device_index).in_(wanted)
            row = s.scalars(sa.select(m.DeviceLease).where(pairs, m.DeviceLease.ended_at.is_(None)).limit(1)).first()
        held = f"device {row.device_index} of host {row.host_id} is leased to job {row.job_id}" if row else \
            "a device was leased concurrently"
        return FailedPrecondition(held, field="devices", fix=LEASE_FIX)

    def end_leases(self, p: Principal, req: store_pb2.EndLeasesRequest) -> store_pb2.EndLeasesResponse:
        self._require_admin(p, "ending leases")
        if not req.reason:
            raise InvalidArgument("reason is not set", field="reason", fix="e.g. LEASE_END_REASON_FINISHED")
        reason = enum_name(fleet_pb2.LeaseEndReason, req.reason, "reason")
        with self._tx(write=True) as s:
            self._job(s, p, req.job_id)
            return store_pb2.EndLeasesResponse(ended=self._end_live(s, req.job_id, reason, req.host_id))

    def _end_live(self, s: Session, job_id: str, reason: str, host_id: str = "") -> int:
        """End the job's live leases in the caller's transaction (a job's end ends its leases with it). Core, on
        every job's end: neither caller holds lease rows in its session for the ORM to keep in step."""
        leases = m.DeviceLease.__table__.c
        stmt = sa.update(m.DeviceLease.__table__).where(leases.job_id == job_id, leases.ended_at.is_(None))
        if host_id:
            stmt = stmt.where(leases.host_id == host_id)
        return s.connection().execute(stmt.values(ended_at=self.now(), end_reason=reason)).rowcount or 0

    def list_leases(self, p: Principal, req: store_pb2.ListLeasesRequest) -> store_pb2.ListLeasesResponse:
        stmt = self._scoped(sa.select(m.DeviceLease), m.DeviceLease.tenant_id, p)
        stmt = self._where_set(stmt, (m.DeviceLease.job_id, req.job_id), (m.DeviceLease.host_id, req.host_id))
        if req.live_only:
            stmt = stmt.where(m.DeviceLease.ended_at.is_(None))
        if req.HasField("since"):
            since = to_datetime(req.since, "since")
            stmt = stmt.where(sa.or_(m.DeviceLease.ended_at.is_(None), m.DeviceLease.ended_at >= since))
        if req.HasField("changed_since"):
            # Two index searches by id, not an OR: with the list's ORDER BY, the database would rather walk every
            # lease ever made in started_at order (SQLite does), and this is asked every admission pass.
            changed, lease = to_datetime(req.changed_since, "changed_since"), m.DeviceLease
            stmt = stmt.where(lease.id.in_(sa.union(sa.select(lease.id).where(lease.started_at >= changed),
                                                    sa.select(lease.id).where(lease.ended_at >= changed))))
        stmt = stmt.order_by(m.DeviceLease.started_at.desc(), m.DeviceLease.id)
        read_at = self.now()
        items, token = self._page_of(stmt, req.page, lease_pb)
        reply = store_pb2.ListLeasesResponse(leases=items, next_page_token=token)
        reply.read_at.FromDatetime(read_at)
        return reply
