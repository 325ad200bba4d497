"""Checkpoint retention (JobSpec.keep_checkpoints, default 3): a job keeps its newest complete checkpoints and any
it exported; the files of the others are deleted and their rows marked (the rows stay, as history).

The newest complete checkpoint is always kept: a morph or a resume starts from it. A directory on disk that no
kept checkpoint owns and that is older than the oldest kept one (an incomplete write a lost worker left, one the
store never took) goes too, so a job leaves at most keep + 1 checkpoint directories: those kept and the one being
written. Files are removed only inside the job's own checkpoint directory."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

from ballast.v1 import job_pb2, store_pb2
from services.runtime.store_api import Store, every_page

log = logging.getLogger("ballast.retention")
DEFAULT_KEEP = 3
ITERATION_DIR = re.compile(r"^iter-(\d{8})$")


def retired(checkpoints: list[job_pb2.Checkpoint], keep: int) -> list[job_pb2.Checkpoint]:
    """The job's recorded checkpoints whose files go: complete ones past the newest `keep`, incomplete ones older
    than the newest complete; never one exported, never one already deleted."""
    live = [c for c in checkpoints if not c.HasField("deleted_at")]
    complete = sorted((c for c in live if c.complete), key=lambda c: c.iteration, reverse=True)
    kept = {c.id for c in complete[:max(keep, 1)]}
    newest = complete[0].iteration if complete else None
    return [c for c in live if c.id not in kept and not c.HasField("exported_at")
            and (c.complete or (newest is not None and c.iteration < newest))]


class Retention:
    """Applies a job's retention to its files and rows (the scheduler's tick, for jobs with a new checkpoint)."""

    def __init__(self, store: Store, root: Path) -> None:
        self._store, self._root = store, root

    def apply(self, job: job_pb2.Job) -> int:
        """Delete what the job no longer keeps; returns how many checkpoint directories went."""
        rows = [c for page in every_page(self._store.list_checkpoints, store_pb2.ListCheckpointsRequest(
            job_id=job.id)) for c in page.checkpoints]
        gone = retired(rows, job.spec.keep_checkpoints or DEFAULT_KEEP)
        gone_ids = {c.id for c in gone}
        kept = [c for c in rows if c.id not in gone_ids and not c.HasField("deleted_at")]
        own = self._root / job.id
        removed = 0
        for c in gone:
            for directory in {Path(_path(layer.uri)).parent for layer in c.layers}:
                removed += self._remove(own, directory)
        oldest = min((c.iteration for c in kept if c.complete), default=None)
        if oldest is not None and own.is_dir():
            held = {c.iteration for c in kept}
            for entry in own.iterdir():
                match = ITERATION_DIR.match(entry.name)
                if match and int(match.group(1)) < oldest and int(match.group(1)) not in held:
                    removed += self._remove(own, entry)
        if gone:
            self._store.update_checkpoints(store_pb2.UpdateCheckpointsRequest(job_id=job.id,
                                                                              deleted_ids=sorted(gone_ids)))
        return removed

    @staticmethod
    def _remove(own: Path, directory: Path) -> int:
        """Remove a checkpoint directory if it lies inside the job's own (1), else leave it (0)."""
        real = directory.resolve()
        if real.parent != own.resolve() or not ITERATION_DIR.match(real.name) or not real.is_dir():
            return 0
        shutil.rmtree(real, ignore_errors=True)
        log.info("checkpoint removed", extra={"directory": str(real)})
        return 1


def _path(uri: str) -> str:
    return unquote(urlparse(uri).path) if uri.startswith("file://") else uri


def checkpoint_directory(checkpoint: job_pb2.Checkpoint) -> Path | None:
    """The one directory a checkpoint's layer files lie in (None: no files, or in several)."""
    folders = {Path(_path(layer.uri)).parent for layer in checkpoint.layers}
    return folders.pop() if len(folders) == 1 else None
