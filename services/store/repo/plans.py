"""Parallelization plans: per-layer strategies, the prediction, and the alternatives considered."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, selectinload

from ballast.v1 import fleet_pb2, plan_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from services.store import models as m
from services.store.convert import enum_name, from_json, shared_fields, to_json, ts
from services.store.repo.base import RepositoryBase, fit, new_id

PLAN_LOAD = (selectinload(m.Plan.layers), selectinload(m.Plan.candidates))
PLANS, PLAN_LAYERS, PLAN_CANDIDATES = m.Plan.__table__, m.PlanLayer.__table__, m.PlanCandidate.__table__
# what an alternative's prediction keeps: the plain fields that are columns of plan_candidates
HEADLINE = tuple(f.name for f in plan_pb2.Prediction.DESCRIPTOR.fields
                 if f.name in PLAN_CANDIDATES.c and f.type != f.TYPE_MESSAGE)
CANDIDATE_PLAN_ID = {"plan_id": "candidate_plan_id"}  # PlanCandidate.plan_id is the owning plan
PLAN_SET_BY_STORE = ("id", "tenant_id", "model_id", "version")
VERSION_FIX = "leave version 0 to get the job's next version, or pick one the job has not used"
MAX_PLAN_IDS = 1000  # ListPlans ids: one IN list (SQLite binds 32,766 parameters since 3.32, PostgreSQL 65,535)


def plan_pb(row: m.Plan) -> plan_pb2.Plan:
    out = plan_pb2.Plan(
        **shared_fields(row, plan_pb2.Plan),
        stages=[from_json(s, plan_pb2.Stage) for s in row.stages],
        prediction=from_json(row.prediction, plan_pb2.Prediction),
    )
    if row.fleet:
        out.fleet.CopyFrom(from_json(row.fleet, fleet_pb2.Fleet))
    if row.offload:
        out.offload.CopyFrom(from_json(row.offload, plan_pb2.ChunkOffload))
    if row.harmony:
        out.harmony.CopyFrom(from_json(row.harmony, plan_pb2.HarmonySwap))
    for layer in row.layers:
        out.layers.add(**shared_fields(layer, plan_pb2.LayerStrategy))
    for cand in row.candidates:  # the prediction's headline numbers are columns of the candidate
        out.alternatives.add(
            **shared_fields(cand, plan_pb2.PlanAlternative, rename=CANDIDATE_PLAN_ID),
            prediction=plan_pb2.Prediction(**shared_fields(cand, plan_pb2.Prediction)),
        )
    return out


def candidate_row(alt: plan_pb2.PlanAlternative, pos: int) -> dict[str, object]:
    return {**shared_fields(alt, m.PlanCandidate, rename=CANDIDATE_PLAN_ID, field=f"plan.alternatives[{pos}]"),
            **shared_fields(alt.prediction, m.PlanCandidate, field=f"plan.alternatives[{pos}].prediction"),
            "position": pos}


def check_plan_layer(layer: plan_pb2.LayerStrategy, i: int, seen: set[int], num_stages: int) -> None:
    field = f"plan.layers[{i}]"
    if layer.layer_index in seen:
        raise InvalidArgument(
            f"layer {layer.layer_index} appears twice", field=f"{field}.layer_index", fix="one strategy per layer"
        )
    seen.add(layer.layer_index)
    if num_stages and layer.stage_index >= num_stages:
        raise InvalidArgument(
            f"stage {layer.stage_index} does not exist (plan has {num_stages})",
            field=f"{field}.stage_index",
            fix="use a stage index listed in plan.stages",
        )
    for dim in ("dp", "sdp", "tp"):
        if getattr(layer, dim) < 1:
            raise InvalidArgument(
                "parallel degree must be at least 1",
                field=f"{field}.{dim}",
                fix="use 1 for a dimension the layer is not split along",
            )


class _Clash(Exception):
    """A unique constraint fired at flush; which one is decided after the failed transaction is gone."""


class PlanStore(RepositoryBase):
    """Plan RPCs; a plan made for a job gets the job's next version unless it names one."""

    def create_plan(self, p: Principal, req: store_pb2.CreatePlanRequest) -> plan_pb2.Plan:
        """A job's plan versions are unique (uq_plans_job_version); what-if plans (no job) are all version 1.

        With a request_id the write is idempotent: the tenant's plan already stored under that key is
        returned instead of inserting a second one (uq_plans_tenant_request makes a concurrent insert lose).
        """
        pl = req.plan
        fit(m.Plan.version, pl.version, "plan.version")
        key = fit(m.Plan.request_id, req.request_id, "request_id") or None
        try:
            return self._create_plan(p, pl, key)
        except _Clash as clash:
            if key is not None:  # a concurrent CreatePlan with the same key committed first: return its plan
                with self._tx(write=False) as s:
                    model = self._one(s, m.Model, pl.model_id, p, what="model", field="plan.model_id")
                    if (stored := self._by_request(s, model.tenant_id, key, pl)) is not None:
                        return stored
            raise AlreadyExists(
                f"job {pl.job_id} already has plan version {clash.args[0]}", field="plan.version", fix=VERSION_FIX
            ) from None

    def _create_plan(self, p: Principal, pl: plan_pb2.Plan, key: str | None) -> plan_pb2.Plan:
        # Checked and converted before the writer's turn: on SQLite every other write waits while this one holds it.
        seen: set[int] = set()
        layers = []
        for i, layer in enumerate(pl.layers):
            check_plan_layer(layer, i, seen, len(pl.stages))
            layers.append(shared_fields(layer, m.PlanLayer, field=f"plan.layers[{i}]"))
        candidates = [candidate_row(alt, pos) for pos, alt in enumerate(pl.alternatives)]
        fields = {**shared_fields(pl, m.Plan, skip=PLAN_SET_BY_STORE, field="plan"),
                  **shared_fields(pl.prediction, m.Plan, field="plan.prediction"),
                  "fleet": to_json(pl.fleet), "stages": [to_json(st) for st in pl.stages],
                  "prediction": to_json(pl.prediction),
                  "offload": to_json(pl.offload) if pl.HasField("offload") else None,
                  "harmony": to_json(pl.harmony) if pl.HasField("harmony") else None}
        pipeline_degree = len(pl.stages) or (max((x.stage_index for x in pl.layers), default=0) + 1)
        fit(m.Plan.pipeline_degree, pipeline_degree, "plan.layers")
        with self._tx(write=True) as s:
            model = self._one(s, m.Model, pl.model_id, p, what="model", field="plan.model_id")
            if key is not None and (stored := self._by_request(s, model.tenant_id, key, pl)) is not None:
                return stored
            if pl.profile_id:
                self._one(s, m.Profile, pl.profile_id, p, what="profile", field="plan.profile_id")
            if pl.parent_plan_id:
                self._one(s, m.Plan, pl.parent_plan_id, p, what="plan", field="plan.parent_plan_id")
            version = pl.version
            if pl.job_id:
                job = self._job(s, p, pl.job_id, field="plan.job_id", lock=True)
                if job.model_id != model.id:
                    raise FailedPrecondition(
                        f"job {job.id} trains model {job.model_id}, not {model.id}", field="plan.model_id"
                    )
                if not version:
                    latest = s.scalar(sa.select(sa.func.max(m.Plan.version)).where(m.Plan.job_id == job.id))
                    version = (latest or 0) + 1
                elif self._plan_version_taken(s, job.id, version):  # the job's lock keeps this true to commit
                    raise AlreadyExists(
                        f"job {job.id} already has plan version {version}", field="plan.version", fix=VERSION_FIX
                    )
            # Core statements, not ORM objects (a worker stores a plan per prepared job: the unit of work was most of
            # this call's CPU); the plan row first, so a clash fires before any layer or candidate is written.
            row = {**fields, "id": new_id("pln"), "tenant_id": model.tenant_id, "model_id": model.id,
                   "version": version or 1, "pipeline_degree": pipeline_degree, "created_at": self.now(),
                   "request_id": key}
            conn = s.connection()
            try:
                conn.execute(sa.insert(PLANS), row)
            except sa_exc.IntegrityError:  # a concurrent writer took the version or the key (rare: the job lock,
                raise _Clash(row["version"]) from None  # SQLite's single writer)
            for table, children in ((PLAN_LAYERS, layers), (PLAN_CANDIDATES, candidates)):
                if children:
                    conn.execute(sa.insert(table), [{**child, "plan_id": row["id"]} for child in children])
        # A plan reads back exactly as sent (tests/store/test_plans.py), so the reply is the request with what the
        # store set, not the rows read again
        out = plan_pb2.Plan()
        out.CopyFrom(pl)
        out.id, out.tenant_id, out.model_id, out.version = row["id"], row["tenant_id"], row["model_id"], row["version"]
        out.created_at.CopyFrom(ts(row["created_at"]))
        if any(a.layer_index > b.layer_index for a, b in zip(out.layers, out.layers[1:], strict=False)):
            ordered = sorted(out.layers, key=lambda layer: layer.layer_index)  # as GetPlan reads them back
            del out.layers[:]
            out.layers.extend(ordered)
        for alt in out.alternatives:  # an alternative keeps its prediction's headline numbers (plan_pb)
            alt.prediction.CopyFrom(plan_pb2.Prediction(**{n: getattr(alt.prediction, n) for n in HEADLINE}))
        return out

    @staticmethod
    def _by_request(s: Session, tenant_id: str, key: str, pl: plan_pb2.Plan) -> plan_pb2.Plan | None:
        """The tenant's plan stored under `key`, if any; the same key for a different plan is refused."""
        stmt = sa.select(m.Plan).where(m.Plan.tenant_id == tenant_id, m.Plan.request_id == key).options(*PLAN_LOAD)
        row = s.scalars(stmt).first()
        if row is None:
            return None
        if (row.model_id, row.profile_id or "", row.job_id or "") != (pl.model_id, pl.profile_id, pl.job_id):
            raise AlreadyExists(
                f"request_id {key!r} already stored plan {row.id} for another model, profile or job",
                field="request_id", fix="use a fresh request_id for a different plan",
            )
        return plan_pb(row)

    @staticmethod
    def _plan_version_taken(s: Session, job_id: str, version: int) -> bool:
        stmt = sa.select(m.Plan.id).where(m.Plan.job_id == job_id, m.Plan.version == version)
        return s.scalars(stmt).first() is not None

    def get_plan(self, p: Principal, req: store_pb2.GetRequest) -> plan_pb2.Plan:
        with self._tx(write=False) as s:
            return plan_pb(self._one(s, m.Plan, req.id, p, what="plan", options=PLAN_LOAD))

    def list_plans(self, p: Principal, req: store_pb2.ListPlansRequest) -> store_pb2.ListPlansResponse:
        stmt = self._scoped(sa.select(m.Plan), m.Plan.tenant_id, p).options(*PLAN_LOAD)
        stmt = stmt.order_by(m.Plan.created_at, m.Plan.id)
        stmt = self._where_set(
            stmt,
            (m.Plan.model_id, req.model_id),
            (m.Plan.job_id, req.job_id),
            (m.Plan.engine, req.engine and enum_name(plan_pb2.PlanEngine, req.engine, "engine")),
        )
        if req.ids:
            if len(req.ids) > MAX_PLAN_IDS:
                raise InvalidArgument(f"{len(req.ids)} ids; at most {MAX_PLAN_IDS}", field="ids",
                                      fix=f"ask for at most {MAX_PLAN_IDS} plans per call")
            stmt = stmt.where(m.Plan.id.in_(list(req.ids)))
        items, token = self._page_of(stmt, req.page, plan_pb)
        return store_pb2.ListPlansResponse(plans=items, next_page_token=token)
