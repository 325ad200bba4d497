"""A full disk under the store's database, told apart from a database that is down: nothing was written, the
call can be repeated once there is room, and the caller is told so (RESOURCE_EXHAUSTED naming the disk)."""

from __future__ import annotations

import sqlalchemy.exc

from services.runtime.errors import ResourceExhausted

MESSAGE = "the store's database disk is full: nothing was written"


class DiskFull(ResourceExhausted):
    """The store's database cannot grow: its disk is full. Nothing was written; the same call succeeds once there
    is room again (the database itself is intact: SQLite and PostgreSQL roll the transaction back)."""

    def __init__(self) -> None:
        super().__init__(MESSAGE,
                         fix="free space on the disk of the store's data dir (old checkpoints: --keep-checkpoints; "
                             "logs) and retry; `ballast status` warns before it fills")


def refused_for_disk(error: BaseException | None) -> bool:
    """The store refused a call because its disk is full: DiskFull in process, or its status over gRPC (a remote
    store's client rebuilds it as a plain ResourceExhausted with the same message)."""
    return isinstance(error, ResourceExhausted) and error.message == MESSAGE


def disk_full(exc: BaseException) -> bool:
    """A database error that says its disk is full (SQLite's SQLITE_FULL, PostgreSQL's 53100 disk_full)."""
    if not isinstance(exc, sqlalchemy.exc.DBAPIError):
        return False
    orig = exc.orig
    return (getattr(orig, "sqlite_errorname", "") == "SQLITE_FULL" or getattr(orig, "sqlstate", "") == "53100"
            or "database or disk is full" in str(orig))
