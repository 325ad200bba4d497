"""What a running job reports: per-iteration metrics, layer migrations, evaluations and checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import sqlalchemy as sa
from sqlalchemy.orm import Session, selectinload

from ballast.v1 import job_pb2, store_pb2
from ballast.windows import time_quantiles
from services.runtime.auth import Principal
from services.runtime.errors import InvalidArgument, NotFound
from services.store import models as m
from services.store.convert import shared_fields, to_datetime
from services.store.repo.base import RepositoryBase, fit, new_id, quote

T = TypeVar("T")

METRICS_CHUNK = 200  # rows per INSERT; keeps bound parameters far below SQLite's limit


def metric_pb(row: m.IterationMetric) -> job_pb2.IterationMetric:
    return job_pb2.IterationMetric(**shared_fields(row, job_pb2.IterationMetric), has_loss=row.loss is not None)


def window_of(row: job_pb2.IterationMetric, field: str) -> dict[str, Any]:
    """The window columns of a row: a row without `iterations` (a writer from before windows) is one iteration;
    a window is consecutive iterations, first_iteration .. iteration, and its times are ordered."""
    if not row.iterations:
        p50, p95, longest = time_quantiles(row)
        return {"first_iteration": row.iteration, "iterations": 1, "iteration_time_p50_s": p50,
                "iteration_time_p95_s": p95, "iteration_time_max_s": longest}
    if row.first_iteration > row.iteration or row.iterations != row.iteration - row.first_iteration + 1:
        raise InvalidArgument(f"{field} covers iterations {row.first_iteration}..{row.iteration} but says "
                              f"{row.iterations}", field=f"{field}.iterations",
                              fix="a window is consecutive iterations: iterations = iteration - first_iteration + 1")
    if not row.iteration_time_p50_s <= row.iteration_time_p95_s <= row.iteration_time_max_s:
        raise InvalidArgument(f"{field}'s iteration times are not ordered (p50 {row.iteration_time_p50_s}, p95 "
                              f"{row.iteration_time_p95_s}, max {row.iteration_time_max_s})",
                              field=f"{field}.iteration_time_p95_s", fix="send p50 <= p95 <= max")
    return {}


def _after_morphs(s: Session, rows: list[dict[str, Any]], jobs: set[str]) -> list[dict[str, Any]]:
    """The rows a recorded morph has not superseded: a row of a plan version before the morph's, at or after its
    checkpoint, is from the incarnation the morph replaced (trained again since), arriving late (a survivor's
    last window, a lost host's agent back); storing it would give those iterations two lineages."""
    t = m.JobMorph
    morphs = s.execute(sa.select(t.job_id, t.to_plan_version, t.checkpoint_iteration).where(t.job_id.in_(jobs))).all()
    if not morphs:
        return rows
    by_job: dict[str, list[tuple[int, int]]] = {}
    for job_id, version, checkpoint in morphs:
        by_job.setdefault(job_id, []).append((version, checkpoint))
    return [r for r in rows if not any(r["plan_version"] < version and r["iteration"] >= checkpoint
                                       for version, checkpoint in by_job.get(r["job_id"], ()))]


def migration_pb(row: m.LayerMigration) -> job_pb2.LayerMigration:
    return job_pb2.LayerMigration(**shared_fields(row, job_pb2.LayerMigration))


def evaluation_pb(row: m.Evaluation) -> job_pb2.Evaluation:
    return job_pb2.Evaluation(**shared_fields(row, job_pb2.Evaluation))


def own_file(uri: str, job_id: str, iteration: int, layer: int, field: str) -> None:
    """A layer file lies where the job's workers write it, `.../<job>/iter-<iteration>/layer-<layer>.pt`: an
    absolute path (or file:// URI) without `..`, so no checkpoint names another job's files or any other file."""
    path = unquote(urlparse(uri).path) if uri.startswith("file://") else uri
    tail = f"/{job_id}/iter-{iteration:08d}/layer-{layer:05d}.pt"
    if not path.startswith("/") or ".." in path.split("/") or not path.endswith(tail):
        raise InvalidArgument(f"{uri[:200]!r} is not the job's own checkpoint file", field=field,
                              fix=f"checkpoint files are written by the job's workers, as ...{tail}")


def checkpoint_pb(row: m.Checkpoint) -> job_pb2.Checkpoint:
    return job_pb2.Checkpoint(
        **shared_fields(row, job_pb2.Checkpoint),
        layers=[job_pb2.LayerCheckpoint(**shared_fields(c, job_pb2.LayerCheckpoint)) for c in row.layers],
    )


class ProgressStore(RepositoryBase):
    """Metric, migration and checkpoint RPCs; each row belongs to a job the caller can see."""

    def write_iteration_metrics(
        self, p: Principal, req: store_pb2.WriteIterationMetricsRequest
    ) -> store_pb2.WriteIterationMetricsResponse:
        """Bulk insert; rows already stored (same job, plan version, iteration, stage, replica) skip."""
        if not req.metrics:
            return store_pb2.WriteIterationMetricsResponse(written=0)
        now = self.now()
        rows: list[dict[str, Any]] = [
            {
                **shared_fields(row, m.IterationMetric, skip=("loss",), field=f"metrics[{i}]"),
                "loss": fit(m.IterationMetric.loss, row.loss, f"metrics[{i}].loss") if row.has_loss else None,
                "recorded_at": to_datetime(row.recorded_at, f"metrics[{i}].recorded_at")
                if row.HasField("recorded_at")
                else now,
                **window_of(row, f"metrics[{i}]"),
            }
            for i, row in enumerate(req.metrics)
        ]
        written = 0
        with self._tx(write=True) as s:
            ids = {r["job_id"] for r in rows}
            owned = set(s.scalars(self._scoped(sa.select(m.Job.id).where(m.Job.id.in_(ids)), m.Job.tenant_id, p)))
            for i, r in enumerate(rows):
                if r["job_id"] not in owned:
                    raise NotFound(f"job {quote(r['job_id'] or '')} not found", field=f"metrics[{i}].job_id")
            rows = _after_morphs(s, rows, owned)
            for start in range(0, len(rows), METRICS_CHUNK):
                stmt = self._insert(m.IterationMetric).values(rows[start : start + METRICS_CHUNK])
                # RETURNING yields only rows actually inserted (rowcount is unreliable for multi-row inserts).
                written += len(s.execute(stmt.on_conflict_do_nothing().returning(m.IterationMetric.id)).all())
            for job_id in {r["job_id"] for r in rows}:  # Job.iteration: last iteration reported
                top = max(r["iteration"] for r in rows if r["job_id"] == job_id)
                s.execute(sa.update(m.Job).where(m.Job.id == job_id, m.Job.iteration < top).values(iteration=top))
        return store_pb2.WriteIterationMetricsResponse(written=written)

    def _job_page(self, p: Principal, job_id: str, stmt: sa.Select, page: Any, convert: Callable[[Any], T]
                  ) -> tuple[list[T], str]:
        """One page of `stmt`'s rows about a job the caller may see (NOT_FOUND otherwise), converted to messages
        inside the read transaction."""
        with self._tx(write=False) as s:
            self._job(s, p, job_id)
            rows, token = self._page(s, stmt, page)
            return [convert(r) for r in rows], token

    def list_iteration_metrics(
        self, p: Principal, req: store_pb2.ListIterationMetricsRequest
    ) -> store_pb2.ListIterationMetricsResponse:
        t = m.IterationMetric
        stmt = sa.select(t).where(t.job_id == req.job_id, t.iteration >= req.from_iteration)
        if req.to_iteration:
            stmt = stmt.where(t.iteration < req.to_iteration)
        if req.HasField("stage_index"):
            stmt = stmt.where(t.stage_index == req.stage_index)
        stmt = stmt.order_by(t.iteration, t.stage_index, t.replica_index, t.plan_version, t.id)
        metrics, token = self._job_page(p, req.job_id, stmt, req.page, metric_pb)
        return store_pb2.ListIterationMetricsResponse(metrics=metrics, next_page_token=token)

    def record_layer_migration(
        self, p: Principal, req: store_pb2.RecordLayerMigrationRequest
    ) -> job_pb2.LayerMigration:
        mg = req.migration
        values = shared_fields(mg, m.LayerMigration, skip=("id",), field="migration")
        with self._tx(write=True) as s:
            self._job(s, p, mg.job_id, field="migration.job_id")
            row = m.LayerMigration(**values, id=new_id("mig"), created_at=self.now())
            s.add(row)
            s.flush()
            return migration_pb(row)

    def list_layer_migrations(
        self, p: Principal, req: store_pb2.ListLayerMigrationsRequest
    ) -> store_pb2.ListLayerMigrationsResponse:
        t = m.LayerMigration
        stmt = sa.select(t).where(t.job_id == req.job_id).order_by(t.created_at, t.id)
        migrations, token = self._job_page(p, req.job_id, stmt, req.page, migration_pb)
        return store_pb2.ListLayerMigrationsResponse(migrations=migrations, next_page_token=token)

    def record_evaluation(self, p: Principal, req: store_pb2.RecordEvaluationRequest) -> job_pb2.Evaluation:
        """One row per (job, iteration): a repeat (an agent's replay, a resumed job evaluating again) answers the
        stored row."""
        ev = req.evaluation
        values = shared_fields(ev, m.Evaluation, skip=("id", "created_at"), field="evaluation")
        with self._tx(write=True) as s:
            self._job(s, p, ev.job_id, field="evaluation.job_id")
            stmt = self._insert(m.Evaluation).values(**values, id=new_id("evl"), created_at=self.now())
            s.execute(stmt.on_conflict_do_nothing())
            row = s.scalars(sa.select(m.Evaluation).where(m.Evaluation.job_id == ev.job_id,
                                                          m.Evaluation.iteration == ev.iteration)).one()
            return evaluation_pb(row)

    def list_evaluations(
        self, p: Principal, req: store_pb2.ListEvaluationsRequest
    ) -> store_pb2.ListEvaluationsResponse:
        t = m.Evaluation
        stmt = sa.select(t).where(t.job_id == req.job_id).order_by(t.iteration, t.id)
        evaluations, token = self._job_page(p, req.job_id, stmt, req.page, evaluation_pb)
        return store_pb2.ListEvaluationsResponse(evaluations=evaluations, next_page_token=token)

    def create_checkpoint(self, p: Principal, req: store_pb2.CreateCheckpointRequest) -> job_pb2.Checkpoint:
        ck = req.checkpoint
        indexes = [layer.layer_index for layer in ck.layers]
        if len(set(indexes)) != len(indexes):
            raise InvalidArgument("duplicate layer index", field="checkpoint.layers", fix="one file per layer")
        for i, layer in enumerate(ck.layers):
            own_file(layer.uri, ck.job_id, ck.iteration, layer.layer_index, f"checkpoint.layers[{i}].uri")
        if ck.HasField("deleted_at") or ck.HasField("exported_at"):
            raise InvalidArgument("a new checkpoint is neither deleted nor exported", field="checkpoint.deleted_at",
                                  fix="leave deleted_at and exported_at unset (UpdateCheckpoints marks them)")
        values = shared_fields(ck, m.Checkpoint, skip=("id",), field="checkpoint")
        layers = [shared_fields(c, m.CheckpointLayer, field=f"checkpoint.layers[{i}]") for i, c in enumerate(ck.layers)]
        with self._tx(write=True) as s:
            self._job(s, p, ck.job_id, field="checkpoint.job_id")
            if (same := self._same_checkpoint(s, ck)) is not None:
                return checkpoint_pb(same)  # a replayed report (the agent resends after a reconnect): one row
            row = m.Checkpoint(
                **values, id=new_id("ckp"), created_at=self.now(), layers=[m.CheckpointLayer(**c) for c in layers]
            )
            s.add(row)
            s.flush()
            return checkpoint_pb(row)

    @staticmethod
    def _same_checkpoint(s: Session, ck: job_pb2.Checkpoint) -> m.Checkpoint | None:
        """The recorded checkpoint of the job's iteration with the same plan version, completeness and files."""
        files = sorted((layer.layer_index, layer.uri, layer.bytes, layer.sha256) for layer in ck.layers)
        rows = s.scalars(sa.select(m.Checkpoint).options(selectinload(m.Checkpoint.layers)).where(
            m.Checkpoint.job_id == ck.job_id, m.Checkpoint.iteration == ck.iteration,
            m.Checkpoint.plan_version == ck.plan_version, m.Checkpoint.complete == ck.complete))
        return next((r for r in rows
                     if sorted((x.layer_index, x.uri, x.bytes, x.sha256) for x in r.layers) == files), None)

    def _checkpoints(self, p: Principal) -> sa.Select:
        """Checkpoints have no tenant column; a non-admin sees those of its own tenant's jobs."""
        stmt = sa.select(m.Checkpoint).options(selectinload(m.Checkpoint.layers))
        if not p.reads_all:
            stmt = stmt.join(m.Job, m.Job.id == m.Checkpoint.job_id).where(m.Job.tenant_id == p.tenant_id)
        return stmt

    def get_checkpoint(self, p: Principal, req: store_pb2.GetRequest) -> job_pb2.Checkpoint:
        with self._tx(write=False) as s:
            row = s.scalars(self._checkpoints(p).where(m.Checkpoint.id == req.id)).first()
            if row is None:
                raise NotFound(f"checkpoint {quote(req.id)} not found", field="id")
            return checkpoint_pb(row)

    def update_checkpoints(
        self, p: Principal, req: store_pb2.UpdateCheckpointsRequest
    ) -> store_pb2.ListCheckpointsResponse:
        """Mark a job's checkpoints deleted (their files are gone) or exported; the first mark of each kind stays."""
        self._require_admin(p, "marking checkpoints")
        marks = [(i, "deleted_at", f"deleted_ids[{n}]") for n, i in enumerate(req.deleted_ids)]
        marks += [(i, "exported_at", f"exported_ids[{n}]") for n, i in enumerate(req.exported_ids)]
        with self._tx(write=True) as s:
            self._job(s, p, req.job_id, lock=True)
            rows = {r.id: r for r in s.scalars(sa.select(m.Checkpoint).where(m.Checkpoint.job_id == req.job_id))}
            for checkpoint_id, column, field in marks:
                row = rows.get(checkpoint_id)
                if row is None:
                    raise NotFound(f"checkpoint {quote(checkpoint_id)} of job {quote(req.job_id)} not found",
                                   field=field)
                if getattr(row, column) is None:
                    setattr(row, column, self.now())
        return self.list_checkpoints(p, store_pb2.ListCheckpointsRequest(job_id=req.job_id))

    def list_checkpoints(
        self, p: Principal, req: store_pb2.ListCheckpointsRequest
    ) -> store_pb2.ListCheckpointsResponse:
        t = m.Checkpoint
        stmt = self._checkpoints(p).where(t.job_id == req.job_id)
        if req.complete_only:
            stmt = stmt.where(t.complete.is_(True))
        stmt = stmt.order_by(t.iteration.desc(), t.created_at.desc(), t.id)
        checkpoints, token = self._job_page(p, req.job_id, stmt, req.page, checkpoint_pb)
        return store_pb2.ListCheckpointsResponse(checkpoints=checkpoints, next_page_token=token)
