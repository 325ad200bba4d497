"""Hosts and their devices: platform data that anyone reads and only the admin writes."""

from __future__ import annotations

from datetime import UTC

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import selectinload

from ballast.v1 import fleet_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import AlreadyExists, InvalidArgument
from services.store import models as m
from services.store.convert import enum_name, from_json, shared_fields, to_json
from services.store.repo.base import RepositoryBase, fit, new_id, quote

DEVICE_INDEX = {"index": "device_index"}  # the proto's Device.index is the row's device_index
HOST_LOAD = (selectinload(m.Host.devices),)
MAX_TOUCHED = 65_536
TOUCH_CHUNK = 8_192


def host_pb(row: m.Host) -> fleet_pb2.Host:
    return fleet_pb2.Host(
        **shared_fields(row, fleet_pb2.Host),
        devices=[
            fleet_pb2.Device(
                **shared_fields(d, fleet_pb2.Device, rename=DEVICE_INDEX), spec=from_json(d.spec, fleet_pb2.DeviceSpec)
            )
            for d in row.devices
        ],
    )


def device_row(d: fleet_pb2.Device, field: str) -> m.Device:
    """The spec is kept whole as JSON; kind, memory and flops are also columns so SQL can filter on them."""
    return m.Device(
        **shared_fields(d, m.Device, rename=DEVICE_INDEX, field=field),
        **shared_fields(d.spec, m.Device, field=f"{field}.spec"),
        spec=to_json(d.spec),
    )


def check_host(h: fleet_pb2.Host) -> None:
    if not h.name:
        raise InvalidArgument("host name is not set", field="host.name", fix="set the agent's host name")
    fit(m.Host.name, h.name, "host.name")
    indexes = [d.index for d in h.devices]
    if len(set(indexes)) != len(indexes):
        raise InvalidArgument("duplicate device index", field="host.devices", fix="one entry per device index")
    for i, d in enumerate(h.devices):
        if not d.spec.kind:
            raise InvalidArgument("device kind is not set", field=f"host.devices[{i}].spec.kind", fix='e.g. "cpu"')


class HostStore(RepositoryBase):
    """Host RPCs; a host registers by name, so re-registering replaces what it reported before."""

    def register_host(self, p: Principal, req: store_pb2.RegisterHostRequest) -> fleet_pb2.Host:
        self._require_admin(p, "registering hosts")
        h = req.host
        check_host(h)
        state = enum_name(fleet_pb2.HostState, h.state or fleet_pb2.HOST_STATE_ONLINE, "host.state")
        # The degraded mark is the store's, cleared only by ClearHostDegraded: an agent re-registering says
        # nothing about it (its empty degraded_reason would otherwise erase the mark).
        values = shared_fields(h, m.Host, skip=("id", "name", "state", "degraded_reason"), field="host")
        for attempt in range(2):  # a concurrent first registration of the same name: retry as an update
            try:
                with self._tx(write=True) as s:
                    now = self.now()
                    row = s.scalars(
                        sa.select(m.Host).where(m.Host.name == h.name).options(*HOST_LOAD).with_for_update()
                    ).first()
                    if row is None:
                        row = m.Host(id=new_id("hst"), name=h.name, registered_at=now)
                        s.add(row)
                    else:
                        row.devices.clear()
                        s.flush()
                    for key, value in values.items():
                        setattr(row, key, value)
                    row.state, row.last_heartbeat_at, row.changed_at = state, now, now
                    row.devices.extend(device_row(d, f"host.devices[{i}]") for i, d in enumerate(h.devices))
                    s.flush()
                    return host_pb(row)
            except sa_exc.IntegrityError:
                if attempt:
                    raise AlreadyExists(
                        f"host {quote(h.name)} is being registered concurrently", field="host.name"
                    ) from None
        raise AssertionError("unreachable")

    def update_host_state(self, p: Principal, req: store_pb2.UpdateHostStateRequest) -> fleet_pb2.Host:
        self._require_admin(p, "changing host state")
        if not req.state:
            raise InvalidArgument("state is not set", field="state", fix="e.g. HOST_STATE_ONLINE")
        state = enum_name(fleet_pb2.HostState, req.state, "state")
        with self._tx(write=True) as s:
            row = self._one(s, m.Host, req.id, None, what="host", lock=True, options=HOST_LOAD)
            row.state, row.changed_at = state, self.now()
            if req.heartbeat:
                row.last_heartbeat_at = row.changed_at
            s.flush()
            return host_pb(row)

    def touch_hosts(self, p: Principal, req: store_pb2.TouchHostsRequest) -> store_pb2.TouchHostsResponse:
        """Liveness for every connected host in one UPDATE: a heartbeat each, per host, would cost the store a
        call per host per interval (4,096 hosts at 2 s: 2,048 calls a second). The state is left alone: a host's
        registration sets ONLINE and its stream's end OFFLINE, and a touch that lands after that end must not
        undo it."""
        self._require_admin(p, "recording host liveness")
        if len(req.host_ids) > MAX_TOUCHED:
            raise InvalidArgument(f"{len(req.host_ids)} host ids in one touch; at most {MAX_TOUCHED}",
                                  field="host_ids", fix=f"split the ids into touches of {MAX_TOUCHED}")
        ids = sorted(set(req.host_ids))
        if not ids:
            return store_pb2.TouchHostsResponse()
        with self._tx(write=True) as s:
            now, touched = self.now(), 0
            for start in range(0, len(ids), TOUCH_CHUNK):  # SQLite binds at most 32,766 parameters
                touched += s.execute(sa.update(m.Host).where(m.Host.id.in_(ids[start:start + TOUCH_CHUNK]))
                                     .values(last_heartbeat_at=now)).rowcount
        return store_pb2.TouchHostsResponse(touched=touched)

    def get_host(self, p: Principal, req: store_pb2.GetRequest) -> fleet_pb2.Host:
        with self._tx(write=False) as s:
            return host_pb(self._one(s, m.Host, req.id, None, what="host", options=HOST_LOAD))

    def list_hosts(self, p: Principal, req: store_pb2.ListHostsRequest) -> store_pb2.ListHostsResponse:
        stmt = sa.select(m.Host).options(*HOST_LOAD).order_by(m.Host.name)
        if req.state:
            stmt = stmt.where(m.Host.state == enum_name(fleet_pb2.HostState, req.state, "state"))
        if req.device_kind:
            stmt = stmt.where(m.Host.id.in_(sa.select(m.Device.host_id).where(m.Device.kind == req.device_kind)))
        if req.HasField("changed_since"):  # by its index, not a walk of every host in name order
            since = req.changed_since.ToDatetime(UTC)
            stmt = stmt.where(m.Host.id.in_(sa.select(m.Host.id).where(m.Host.changed_at >= since)))
        read_at = self.now()
        items, token = self._page_of(stmt, req.page, host_pb)
        reply = store_pb2.ListHostsResponse(hosts=items, next_page_token=token)
        reply.read_at.FromDatetime(read_at)
        return reply
