"""What every part of the Repository shares: transactions, tenant scoping, lookups by id and paging.

Every write is one transaction, so nothing is ever half-written; reads run in read transactions,
which on SQLite take no lock and so never wait behind a writer. Tenant isolation lives here:
a non-admin principal sees only its own tenant's rows, and another tenant's id answers NotFound
exactly like an unknown id, so ids leak nothing. The clock is injected so tests control time.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import UTC, datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ballast.v1 import common_pb2
from services.runtime import context
from services.runtime.auth import Principal, PrincipalCache
from services.runtime.disk import DiskFull, disk_full
from services.runtime.errors import (
    BallastError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SchemaOutOfDate,
    Unavailable,
)
from services.runtime.metrics import STORE_TRANSACTION_SECONDS
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.store import models as m
from services.store.convert import check_column, column_of
from services.store.db import session_factory
from services.store.gate import WriteGate

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
ADMIN_FIX = "use the platform admin token"
MAX_INT64 = (1 << 63) - 1
# Longest duration a request may name (leases, windows): ten years keeps `now ± d` a valid datetime.
MAX_DURATION_S = 10 * 365 * 86400.0
QUOTE_CHARS = 64  # of a client-supplied id echoed in an error; gRPC metadata is size-limited

T = TypeVar("T")


def utc_now() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def page_size(page: common_pb2.PageRequest) -> int:
    return min(page.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def encode_token(position: int) -> str:
    """Page tokens are opaque to clients but only an offset (or a seq) inside."""
    return base64.urlsafe_b64encode(json.dumps({"o": position}).encode()).decode()


def quote(text: str) -> str:
    """`text` for an error message: repr'd, and cut short so a huge id cannot bloat the status."""
    return repr(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "…")


def int64(value: int, field: str) -> int:
    """A uint64 request value compared against a BIGINT column; above 2**63-1 it can match nothing."""
    if value > MAX_INT64:
        raise InvalidArgument(f"{value} is out of range", field=field, fix=f"send a value at most {MAX_INT64}")
    return value


def seconds(value: float, field: str, *, positive: bool = False) -> float:
    """A duration from a request: finite, not negative (positive when asked) and at most MAX_DURATION_S."""
    low_ok = value > 0 if positive else value >= 0
    if not (math.isfinite(value) and low_ok and value <= MAX_DURATION_S):
        bound = "> 0" if positive else ">= 0"
        raise InvalidArgument(
            f"{value} is not a valid duration", field=field, fix=f"send seconds {bound} and <= {MAX_DURATION_S:.0f}"
        )
    return value


def fit(attr: Any, value: T, field: str) -> T:
    """`value` checked against the column of mapped attribute `attr`, for values set outside shared_fields."""
    return check_column(column_of(attr), value, field)


def decode_token(token: str) -> int:
    if not token:
        return 0
    try:
        value = json.loads(base64.urlsafe_b64decode(token.encode()))["o"]
    except (ValueError, KeyError, TypeError, binascii.Error):
        value = None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT64:
        raise InvalidArgument(
            "malformed page token",
            field="page.page_token",
            fix="pass next_page_token from the previous response unchanged, or empty for the first page",
        )
    return value


def encode_key(created_at: datetime, row_id: str) -> str:
    """A keyset page token: the last row's (created_at, id). A page after it starts below that key whatever
    rows left the list meanwhile, where an offset would skip as many rows as had left."""
    return base64.urlsafe_b64encode(json.dumps({"k": [created_at.isoformat(), row_id]}).encode()).decode()


def decode_key(token: str) -> tuple[datetime, str] | None:
    if not token:
        return None
    try:
        stamp, row_id = json.loads(base64.urlsafe_b64decode(token.encode()))["k"]
        key = datetime.fromisoformat(stamp), row_id
    except (ValueError, KeyError, TypeError, binascii.Error):
        key = None
    if key is None or not isinstance(key[1], str):
        raise InvalidArgument(
            "malformed page token",
            field="page.page_token",
            fix="pass next_page_token from the previous response unchanged, or empty for the first page",
        )
    return key


class RepositoryBase:
    """The plumbing the per-entity parts build on; methods take the caller's Principal and the request."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        now: Callable[[], datetime] = utc_now,
        user_inputs: UserInputs = NO_USER_INPUTS,
        sql_engine: sa.Engine | None = None,
    ):
        self.engine = engine
        self.sql_engine = sql_engine or engine  # what the admin's read-only SQL runs on
        self.now = now
        self.user_inputs = user_inputs
        self._writes = session_factory(engine)
        self._reads = session_factory(engine, read_only=True)
        # SQLite has one writer at a time, and a writer waiting in its busy handler sleeps in growing steps
        # (1, 2, 5, 10 ... 100 ms) however soon the lock frees: this process's writers queue on a lock
        # instead, woken the moment the last one commits. Other processes still meet the busy timeout.
        # Waiting writers are served first come, first served, those a caller waits on before background work
        # (services/store/gate.py).
        self._write_gate: Callable[[], AbstractContextManager] = (
            WriteGate(context.in_background) if engine.dialect.name == "sqlite" else nullcontext)
        self.principals = PrincipalCache()  # bearer tokens resolved lately (services/store/repo/tenants.py)
        self.policies: dict[int, bytes] = {}  # fleet policy versions, parsed once: a version never changes
        # (tenant id, model signature) -> stored model id; a stored model is never deleted or changed, so a hit
        # stays true in every process (repo/profiles.py `_stored_model_id`)
        self.model_ids: dict[tuple[str, str], str] = {}

    @contextmanager
    def _tx(self, *, write: bool) -> Iterator[Session]:
        """One transaction; database connectivity failures become Unavailable.

        Every caller says whether it writes: on SQLite a write takes the lock at BEGIN (so it queues
        behind other writers), while a read takes none and sees its snapshot beside a writer.
        """
        started = time.monotonic()
        try:
            with self._write_gate() if write else nullcontext(), \
                    (self._writes if write else self._reads)() as session, session.begin():
                yield session
            STORE_TRANSACTION_SECONDS.labels("write" if write else "read").observe(time.monotonic() - started)
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError) as err:
            if "no such table" in str(err.orig if isinstance(err, sa_exc.DBAPIError) else err):
                raise self._schema_error() from err
            if disk_full(err):
                raise DiskFull() from err
            raise Unavailable(
                f"database unavailable: {err.orig if isinstance(err, sa_exc.DBAPIError) else err}",
                fix="check BALLAST_DATABASE_URL and that the database is running",
            ) from err
        except sa_exc.ProgrammingError as err:
            if "UndefinedTable" in type(err.orig).__name__:
                raise self._schema_error() from err
            raise

    def _schema_error(self) -> BallastError:
        from services.store import schema

        try:
            current = schema.current_revision(self.engine)
        except sa_exc.SQLAlchemyError:
            current = None
        return SchemaOutOfDate(current, schema.head_revision())

    @staticmethod
    def _require_admin(p: Principal, what: str) -> None:
        if not p.admin:
            raise PermissionDenied(f"{what} is for the platform admin", fix=ADMIN_FIX)

    @staticmethod
    def _require_reader(p: Principal, what: str) -> None:
        """Reads of every tenant's data: the admin's, and viewers' (who change nothing)."""
        if not p.reads_all:
            raise PermissionDenied(f"{what} is for the platform admin or a viewer", fix=ADMIN_FIX)

    @staticmethod
    def _scoped(stmt: sa.Select, tenant_col: Any, p: Principal) -> sa.Select:
        return stmt if p.reads_all else stmt.where(tenant_col == p.tenant_id)

    def _one(
        self,
        s: Session,
        cls: Any,
        id_: str,
        p: Principal | None,
        *,
        what: str,
        field: str = "id",
        lock: bool = False,
        options: tuple = (),
    ) -> Any:
        """Fetch by id within the principal's tenant (p=None: platform data, no scoping)."""
        stmt = sa.select(cls).where(cls.id == id_).options(*options)
        if p is not None:
            stmt = self._scoped(stmt, cls.tenant_id, p)
        if lock:
            stmt = stmt.with_for_update()
        row = s.scalars(stmt).first() if id_ else None
        if row is None:
            raise NotFound(f"{what} {quote(id_)} not found", field=field)
        return row

    def _job(self, s: Session, p: Principal, job_id: str, *, field: str = "job_id", lock: bool = False) -> m.Job:
        return self._one(s, m.Job, job_id, p, what="job", field=field, lock=lock)

    @staticmethod
    def _where_set(stmt: sa.Select, *filters: tuple[Any, Any]) -> sa.Select:
        """`column == value` for each (column, value) filter the request set; proto3's unset is falsy."""
        for column, value in filters:
            if value:
                stmt = stmt.where(column == value)
        return stmt

    @staticmethod
    def _page(s: Session, stmt: sa.Select, page: common_pb2.PageRequest, *,
              core: bool = False) -> tuple[list[Any], str]:
        """One page of `stmt` and the next page's token; `core`: a select of columns, whose result rows are
        the page (no mapped objects)."""
        size, offset = page_size(page), decode_token(page.page_token)
        window = stmt.offset(offset).limit(size + 1)
        rows = list(s.connection().execute(window).all() if core else s.scalars(window).all())
        more = len(rows) > size
        return rows[:size], encode_token(offset + size) if more else ""

    def _page_of(
        self, stmt: sa.Select, page: common_pb2.PageRequest, convert: Callable[[Any], T]
    ) -> tuple[list[T], str]:
        """One page of `stmt`, converted to protos inside the transaction that read it."""
        with self._tx(write=False) as s:
            rows, token = self._page(s, stmt, page)
            return [convert(r) for r in rows], token

    def _insert(self, table: Any) -> Any:
        """The dialect's INSERT, which has ON CONFLICT on both PostgreSQL and SQLite."""
        return (postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert)(table)
