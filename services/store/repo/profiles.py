"""Models and their profiles: what is trained, and how fast each layer ran on a device."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, selectinload

from ballast.v1 import common_pb2, fleet_pb2, model_pb2, profile_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import AlreadyExists, InvalidArgument
from services.specs.model import model_signature, validate_model_spec
from services.store import models as m
from services.store.convert import enum_name, from_json, shared_fields, to_json
from services.store.repo.base import RepositoryBase, fit, new_id

PROFILE_LOAD = (selectinload(m.Profile.layers).selectinload(m.ProfileLayer.samples),)
MODEL_IDS_KEPT = 65536  # stored model ids a store process keeps (repo/profiles.py `_stored_model_id`)
PROFILE_SET_BY_STORE = ("id", "tenant_id", "model_id", "model_signature")
LAYER_INDEX = {"index": "layer_index"}  # the proto's LayerProfile.index is ProfileLayer.layer_index


def model_pb(row: m.Model) -> model_pb2.Model:
    return model_pb2.Model(**shared_fields(row, model_pb2.Model), spec=from_json(row.spec, model_pb2.ModelSpec))


def profile_pb(row: m.Profile) -> profile_pb2.Profile:
    out = profile_pb2.Profile(
        **shared_fields(row, profile_pb2.Profile), device=from_json(row.device, fleet_pb2.DeviceSpec)
    )
    if row.comm:
        out.comm.CopyFrom(from_json(row.comm, profile_pb2.CommCalibration))
    out.memory_trace.extend(from_json(point, profile_pb2.MemoryTracePoint) for point in row.memory_trace or ())
    for layer in row.layers:
        out.layers.add(
            **shared_fields(layer, profile_pb2.LayerProfile, rename=LAYER_INDEX),
            samples=[profile_pb2.LayerSample(**shared_fields(smp, profile_pb2.LayerSample)) for smp in layer.samples],
        )
    return out


def profile_layer_row(layer: profile_pb2.LayerProfile, field: str) -> m.ProfileLayer:
    return m.ProfileLayer(
        **shared_fields(layer, m.ProfileLayer, rename=LAYER_INDEX, field=field),
        samples=[
            m.ProfileLayerSample(**shared_fields(smp, m.ProfileLayerSample, field=f"{field}.samples[{j}]"))
            for j, smp in enumerate(layer.samples)
        ],
    )


def check_profile_layer(layer: profile_pb2.LayerProfile, i: int) -> None:
    field = f"profile.layers[{i}]"
    if layer.index != i:
        raise InvalidArgument(
            f"layer index {layer.index} at position {i}", field=f"{field}.index", fix="list layers 0..n-1"
        )
    sizes = [smp.micro_batch_size for smp in layer.samples]
    if any(b <= 0 for b in sizes) or sizes != sorted(set(sizes)):
        raise InvalidArgument(
            "micro-batch sizes must be positive, unique and ascending",
            field=f"{field}.samples",
            fix="one sample per micro-batch size, ascending",
        )


class ModelStore(RepositoryBase):
    """Model and profile RPCs; a model is stored once per tenant and content signature."""

    def _stored_model_id(self, s: Session, tenant_id: str, spec: model_pb2.ModelSpec) -> str | None:
        """The id of the tenant's stored model with this content (None: none yet). Every submit asks, and the
        answer, once found, never changes: it is kept, so a submit of a known model reads no model row."""
        key = (tenant_id, model_signature(spec))
        known = self.model_ids.get(key)
        if known is None:
            row = self._stored_model(s, tenant_id, spec)
            if row is None:
                return None
            if len(self.model_ids) >= MODEL_IDS_KEPT:
                self.model_ids.clear()  # crude, and rare: a fleet with this many distinct models re-reads them
            known = self.model_ids[key] = row.id
        return known

    def _stored_model(self, s: Session, tenant_id: str, spec: model_pb2.ModelSpec) -> m.Model | None:
        return s.scalars(sa.select(m.Model).where(m.Model.tenant_id == tenant_id,
                                                  m.Model.signature == model_signature(spec))).first()

    def _resolve_model(self, s: Session, tenant_id: str, spec: model_pb2.ModelSpec, prefix: str) -> m.Model:
        """The tenant's stored model with this content, stored now if new: under a name the tenant already used
        for another spec, as that name's next version (a model that failed is never a dead end)."""
        existing = self._stored_model(s, tenant_id, spec)
        if existing is not None:
            return existing
        signature = model_signature(spec)
        family = model_pb2.ModelFamily.Name(spec.family).removeprefix("MODEL_FAMILY_").lower()
        name = fit(m.Model.name, spec.name or f"{family}-{signature[:12]}", f"{prefix}.name")
        latest = s.scalar(sa.select(sa.func.max(m.Model.version)).where(m.Model.tenant_id == tenant_id,
                                                                         m.Model.name == name))
        stored = spec.__class__()
        stored.CopyFrom(spec)
        stored.name = name
        row = m.Model(
            id=new_id("mdl"),
            tenant_id=tenant_id,
            name=name,
            version=(latest or 0) + 1,
            family=model_pb2.ModelFamily.Name(spec.family),
            signature=signature,
            parameter_count=0,
            spec=to_json(stored),
            created_at=self.now(),
        )
        s.add(row)
        s.flush()
        return row

    def create_model(self, p: Principal, req: store_pb2.CreateModelRequest) -> model_pb2.Model:
        validate_model_spec(req.spec, self.user_inputs)
        if not req.spec.name:
            raise InvalidArgument("a stored model needs a name", field="spec.name", fix='e.g. name: "gpt-tiny"')
        fit(m.Model.name, req.spec.name, "spec.name")
        try:
            with self._tx(write=True) as s:
                signature = model_signature(req.spec)
                same = s.scalars(
                    sa.select(m.Model).where(m.Model.tenant_id == p.tenant_id, m.Model.signature == signature)
                ).first()
                if same is not None and same.name != req.spec.name:
                    raise AlreadyExists(
                        f"an identical spec is already stored as model {same.name!r} ({same.id})",
                        field="spec",
                        fix=f"use model {same.id}",
                    )
                return model_pb(same or self._resolve_model(s, p.tenant_id, req.spec, "spec"))
        except sa_exc.IntegrityError:
            raise AlreadyExists(f"model {req.spec.name!r} already exists", field="spec.name") from None

    def get_model(self, p: Principal, req: store_pb2.GetRequest) -> model_pb2.Model:
        with self._tx(write=False) as s:
            return model_pb(self._one(s, m.Model, req.id, p, what="model"))

    def list_models(self, p: Principal, req: store_pb2.ListModelsRequest) -> store_pb2.ListModelsResponse:
        stmt = self._scoped(sa.select(m.Model), m.Model.tenant_id, p).order_by(m.Model.created_at, m.Model.id)
        stmt = self._where_set(
            stmt,
            (m.Model.family, req.family and enum_name(model_pb2.ModelFamily, req.family, "family")),
            (m.Model.name, req.name),
            (m.Model.signature, req.signature),
        )
        items, token = self._page_of(stmt, req.page, model_pb)
        return store_pb2.ListModelsResponse(models=items, next_page_token=token)

    def create_profile(self, p: Principal, req: store_pb2.CreateProfileRequest) -> profile_pb2.Profile:
        pr = req.profile
        if not pr.device.kind:
            raise InvalidArgument("device kind is not set", field="profile.device.kind", fix='e.g. "cpu"')
        fit(m.Profile.device_kind, pr.device.kind, "profile.device.kind")
        fit(m.Profile.model_signature, pr.model_signature, "profile.model_signature")
        with self._tx(write=True) as s:
            model = self._one(s, m.Model, pr.model_id, p, what="model", field="profile.model_id", lock=True)
            if pr.source_profile_id:
                self._one(s, m.Profile, pr.source_profile_id, p, what="profile", field="profile.source_profile_id")
            row = m.Profile(
                **shared_fields(pr, m.Profile, skip=PROFILE_SET_BY_STORE, field="profile"),
                id=new_id("prf"),
                tenant_id=model.tenant_id,
                model_id=model.id,
                model_signature=pr.model_signature or model.signature,
                device_kind=pr.device.kind,
                device=to_json(pr.device),
                comm=to_json(pr.comm),
                memory_trace=[to_json(point) for point in pr.memory_trace],
                created_at=self.now(),
            )
            for i, layer in enumerate(pr.layers):
                check_profile_layer(layer, i)
                row.layers.append(profile_layer_row(layer, f"profile.layers[{i}]"))
            s.add(row)
            total = sum(layer.parameter_count for layer in pr.layers)
            if total and not model.parameter_count:
                model.parameter_count = fit(m.Model.parameter_count, total, "profile.layers")  # "0 until profiled"
            s.flush()
            return profile_pb(row)

    def get_profile(self, p: Principal, req: store_pb2.GetRequest) -> profile_pb2.Profile:
        with self._tx(write=False) as s:
            return profile_pb(self._one(s, m.Profile, req.id, p, what="profile", options=PROFILE_LOAD))

    def list_profiles(self, p: Principal, req: store_pb2.ListProfilesRequest) -> store_pb2.ListProfilesResponse:
        stmt = self._scoped(sa.select(m.Profile), m.Profile.tenant_id, p).options(*PROFILE_LOAD)
        stmt = stmt.order_by(m.Profile.created_at, m.Profile.id)
        stmt = self._where_set(
            stmt,
            (m.Profile.model_id, req.model_id),
            (m.Profile.device_kind, req.device_kind),
            (m.Profile.model_signature, req.model_signature),
            (m.Profile.dtype, req.dtype and enum_name(common_pb2.DType, req.dtype, "dtype")),
            (m.Profile.software, req.software),
        )
        if req.HasField("projected"):  # unset means both; False is a filter, so not via _where_set
            stmt = stmt.where(m.Profile.projected == req.projected)
        items, token = self._page_of(stmt, req.page, profile_pb)
        return store_pb2.ListProfilesResponse(profiles=items, next_page_token=token)
