"""Read-only SQL for the platform admin (`ballast sql`).

Read-only is enforced by the database, never by parsing the SQL: a parser can always be fooled
(data-modifying CTEs, `setval()`, functions with side effects), the database cannot.

* PostgreSQL: queries run on their own connection, logged in as `ballast_readonly` (a role holding
  only SELECT grants, created by migration 0002) or another login that is only its member, inside a
  READ ONLY transaction with `SET LOCAL statement_timeout`. Logging in as the role matters: a session
  whose login is privileged can always switch back (`RESET ROLE`, `set_config('role', …)`), so every
  query first checks that the session user is no superuser, cannot act as the tables' owner and holds
  none of the server-file/program roles, and refuses to run otherwise. The transaction is always
  rolled back and the connection discarded, because some session state (advisory locks, prepared
  statements) survives a rollback.
* SQLite: a separate connection per query opened with `mode=ro`, plus `PRAGMA query_only` and an
  authorizer that refuses anything but reads; a progress handler enforces the timeout.

The only parsing done here is a tokenizer that splits statements, so several statements in one call
are refused before anything runs, and one that keeps quoted text from looking like a keyword when an
error is explained.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from services.runtime import context
from services.runtime.errors import (
    BallastError,
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)

READONLY_ROLE = "ballast_readonly"
DEFAULT_ROW_LIMIT = 1000
MAX_ROW_LIMIT = 10_000
DEFAULT_TIMEOUT_S = 10.0
# The longest a query may run: an admin's mistake (a recursive CTE without end) must not hold the store's CPU for
# hours. A longer analysis belongs on a replica of the database, not on the live store.
MAX_TIMEOUT_S = 300.0
# SQLite calls the progress handler every this many VM instructions (a few microseconds).
_PROGRESS_STEPS = 1000


class ReadOnlyViolation(BallastError):
    """The database refused a statement because `ballast sql` is read-only."""

    code = "PERMISSION_DENIED"


class QueryTimeout(BallastError):
    """The query ran longer than its timeout and was cancelled by the database."""

    code = "DEADLINE_EXCEEDED"


@dataclass
class QueryResult:
    """Column names and JSON-safe rows; `truncated` is set when more rows existed than the limit."""

    columns: list[str]
    rows: list[list[Any]]
    truncated: bool


def run_readonly_query(
    engine: sa.Engine, sql: str, *, row_limit: int = 1000, timeout_s: float = 10.0
) -> QueryResult:
    """Run one statement read-only against the store's database and return at most `row_limit` rows.

    `row_limit` 0 means 1000 and is capped at 10000; `timeout_s` 0 means 10 seconds, at most 300, and never past
    the incoming call's deadline. A query stops when its caller goes away (context.on_cancel).
    Raises ReadOnlyViolation, QueryTimeout, Cancelled, or InvalidArgument(field="sql") for SQL the database rejects.
    """
    statement = single_statement(sql, dialect=engine.dialect.name)
    limit = _row_limit(row_limit)
    timeout = _timeout(timeout_s)
    if engine.dialect.name == "sqlite":
        columns, raw_rows = _run_sqlite(engine.url, statement, limit, timeout)
    elif engine.dialect.name == "postgresql":
        columns, raw_rows = _run_postgres(engine, statement, limit, timeout)
    else:
        raise Unimplemented(f"`ballast sql` does not support the {engine.dialect.name} database")
    truncated = len(raw_rows) > limit
    rows = [[json_safe(value) for value in row] for row in raw_rows[:limit]]
    return QueryResult(columns=columns, rows=rows, truncated=truncated)


def _row_limit(row_limit: int) -> int:
    if row_limit < 0:
        raise InvalidArgument("must not be negative", field="row_limit", fix="use 0 for the default of 1000")
    return min(row_limit or DEFAULT_ROW_LIMIT, MAX_ROW_LIMIT)


def _timeout(timeout_s: float) -> float:
    if not 0 <= timeout_s <= MAX_TIMEOUT_S:  # also catches NaN and infinity
        raise InvalidArgument(f"must be between 0 and {MAX_TIMEOUT_S:g} seconds, got {timeout_s!r}", field="timeout_s",
                              fix=f"use 0 for the default of {DEFAULT_TIMEOUT_S:g} s; a longer analysis belongs on a "
                                  "replica of the database")
    timeout = timeout_s or DEFAULT_TIMEOUT_S
    remaining = context.remaining_time()
    return timeout if remaining is None else max(0.001, min(timeout, remaining))


# --- JSON-safe values ---------------------------------------------------------------------------


def json_safe(value: Any) -> Any:
    """Convert a database value to something `json.dumps` renders faithfully and portably.

    Datetimes become ISO 8601 strings, Decimal becomes float, bytes become hex, non-finite floats
    become "NaN"/"Infinity"/"-Infinity" strings (JSON has no literal for them), and dicts and lists
    (PostgreSQL JSONB, arrays) are converted element by element.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _non_finite(value)
    if isinstance(value, Decimal):
        return float(value) if value.is_finite() else _non_finite(float(value))
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [json_safe(item) for item in value]
    if isinstance(value, uuid.UUID):
        return str(value)
    return str(value)  # inet, ranges, enums...: their text form is what psql would show


def _non_finite(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


# --- statement splitting ----------------------------------------------------------------------------

_DOLLAR_TAG = re.compile(r"\$([A-Za-z_][A-Za-z_0-9]*)?\$")
_WRITE_KEYWORD = re.compile(
    r"\b(INSERT|UPDATE|DELETE|REPLACE\s+INTO|UPSERT|MERGE|DROP|CREATE|ALTER|TRUNCATE|ATTACH|DETACH"
    r"|VACUUM|REINDEX|ANALYZE|GRANT|REVOKE)\b",
    re.IGNORECASE,
)


@dataclass
class _Scan:
    statements: list[str]
    code: str  # the SQL with comments removed and quoted text blanked


def _scan(sql: str, dialect: str) -> _Scan:
    """Split `sql` on semicolons outside quotes, identifiers, comments and (PostgreSQL) dollar quotes."""
    pg = dialect == "postgresql"
    statements: list[str] = []
    code: list[str] = []
    start = 0
    has_code = False
    i, n = 0, len(sql)

    def close(end: int) -> None:
        nonlocal start, has_code
        if has_code:
            statements.append(sql[start:end].strip())
        start, has_code = end + 1, False

    while i < n:
        ch = sql[i]
        nxt = sql[i + 1] if i + 1 < n else ""
        if ch == "-" and nxt == "-":
            end = sql.find("\n", i)
            i = n if end < 0 else end
            code.append(" ")
            continue
        if ch == "/" and nxt == "*":
            i = _skip_block_comment(sql, i, nested=pg)
            code.append(" ")
            continue
        has_code = has_code or not ch.isspace()
        if ch in "'\"`" or (ch == "[" and not pg):
            backslashes = pg and ch == "'" and i > 0 and sql[i - 1] in "eE" and not _ident_char(sql, i - 2)
            i = _skip_quoted(sql, i, "]" if ch == "[" else ch, backslashes)
            code.append(" '' ")
            continue
        if ch == "$" and pg and not _ident_char(sql, i - 1):
            tag = _DOLLAR_TAG.match(sql, i)
            if tag:
                end = sql.find(tag.group(0), tag.end())
                i = n if end < 0 else end + len(tag.group(0))
                code.append(" '' ")
                continue
        if ch == ";":
            close(i)
            code.append(" ; ")
        else:
            code.append(ch)
        i += 1
    close(n)
    return _Scan(statements=statements, code="".join(code))


def _ident_char(sql: str, i: int) -> bool:
    return i >= 0 and (sql[i].isalnum() or sql[i] in "_$")


def _skip_block_comment(sql: str, i: int, *, nested: bool) -> int:
    depth, i = 1, i + 2
    while i < len(sql) and depth:
        if sql.startswith("*/", i):
            depth, i = depth - 1, i + 2
        elif nested and sql.startswith("/*", i):
            depth, i = depth + 1, i + 2
        else:
            i += 1
    return i


def _skip_quoted(sql: str, i: int, quote: str, backslashes: bool) -> int:
    i += 1
    while i < len(sql):
        ch = sql[i]
        if backslashes and ch == "\\":
            i += 2
            continue
        if ch == quote:
            if sql.startswith(quote * 2, i) and quote != "]":
                i += 2
                continue
            return i + 1
        i += 1
    return i


def single_statement(sql: str, *, dialect: str) -> str:
    """The one statement in `sql` (trailing semicolon and comments dropped); refuse zero or several.

    Checked up front so that nothing at all runs when a second statement is present, whatever the
    driver would have done with it.
    """
    statements = _scan(sql, dialect).statements
    if not statements:
        raise InvalidArgument("no SQL statement given", field="sql")
    if len(statements) > 1:
        raise InvalidArgument(
            f"{len(statements)} statements given; `ballast sql` runs exactly one",
            field="sql",
            fix="send one statement per call",
        )
    return statements[0]


# --- SQLite ---------------------------------------------------------------------------------------

_SQLITE_ALLOWED = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_RECURSIVE,
}
# The functions a read-only query may call: SQLite's core scalar, aggregate, window, date, math and JSON functions.
# Anything else is refused, first of all those that take or expose a pointer (fts3_tokenizer registers a tokenizer
# from an address it is given and returns one), load code (load_extension), write the log (sqlite_log), or poke at
# FTS/R-tree internals (fts5, matchinfo, rtreenode...), and any a later SQLite build adds.
_SQLITE_FUNCTIONS = frozenset("""
    -> ->> abs changes char coalesce concat concat_ws format glob hex ifnull iif instr last_insert_rowid length like
    likelihood likely lower ltrim max min nullif octet_length printf quote random randomblob replace round rtrim sign
    soundex sqlite_compileoption_get sqlite_compileoption_used sqlite_offset sqlite_source_id sqlite_version substr
    substring total_changes trim typeof unhex unicode unlikely upper zeroblob
    date time datetime julianday unixepoch strftime timediff current_date current_time current_timestamp
    avg count group_concat string_agg sum total median percentile percentile_cont percentile_disc
    row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value nth_value
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10 log2 mod pi pow power
    radians sin sinh sqrt tan tanh trunc
    json json_array json_array_length json_error_position json_extract json_group_array json_group_object json_insert
    json_object json_patch json_pretty json_quote json_remove json_replace json_set json_type json_valid json_each
    json_tree jsonb jsonb_array jsonb_extract jsonb_group_array jsonb_group_object jsonb_insert jsonb_object
    jsonb_patch jsonb_remove jsonb_replace jsonb_set
""".split())
# Introspection pragmas whose argument names a table or index instead of setting a value.
_SQLITE_READ_PRAGMAS = {
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
    "foreign_key_list", "foreign_key_check", "integrity_check", "quick_check",
}  # fmt: skip
_SQLITE_ACTION_NAMES = {
    getattr(sqlite3, name): name.removeprefix("SQLITE_").replace("_", " ")
    for name in (
        "SQLITE_CREATE_INDEX", "SQLITE_CREATE_TABLE", "SQLITE_CREATE_TEMP_INDEX",
        "SQLITE_CREATE_TEMP_TABLE", "SQLITE_CREATE_TEMP_TRIGGER", "SQLITE_CREATE_TEMP_VIEW",
        "SQLITE_CREATE_TRIGGER", "SQLITE_CREATE_VIEW", "SQLITE_DELETE", "SQLITE_DROP_INDEX",
        "SQLITE_DROP_TABLE", "SQLITE_DROP_TEMP_INDEX", "SQLITE_DROP_TEMP_TABLE",
        "SQLITE_DROP_TEMP_TRIGGER", "SQLITE_DROP_TEMP_VIEW", "SQLITE_DROP_TRIGGER",
        "SQLITE_DROP_VIEW", "SQLITE_INSERT", "SQLITE_PRAGMA", "SQLITE_TRANSACTION", "SQLITE_UPDATE",
        "SQLITE_ATTACH", "SQLITE_DETACH", "SQLITE_ALTER_TABLE", "SQLITE_REINDEX", "SQLITE_ANALYZE",
        "SQLITE_CREATE_VTABLE", "SQLITE_DROP_VTABLE", "SQLITE_SAVEPOINT",
    )
    if hasattr(sqlite3, name)
}  # fmt: skip


_Authorizer = Callable[[int, str | None, str | None, str | None, str | None], int]


def _sqlite_authorizer(denied: list[str]) -> _Authorizer:
    """An authorizer that allows reads only and records what it refused, for the error message."""

    def authorize(action: int, arg1: str | None, arg2: str | None, _db: str | None, _src: str | None) -> int:
        if action in _SQLITE_ALLOWED:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in _SQLITE_FUNCTIONS:
                return sqlite3.SQLITE_OK
            denied.append(f"the function {arg2}(), which `ballast sql` does not allow (it takes or exposes memory "
                          "addresses, loads code or reaches into SQLite's internals; core SQL, date, math and JSON "
                          "functions are allowed)")
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_PRAGMA and (arg2 is None or (arg1 or "").lower() in _SQLITE_READ_PRAGMAS):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_UPDATE and arg1 in ("sqlite_master", "sqlite_schema"):
            # SQLite itself asks this when a table-valued pragma (pragma_table_info) is first used;
            # a real UPDATE of the schema table is refused by SQLite anyway (and by mode=ro).
            return sqlite3.SQLITE_OK
        what = _SQLITE_ACTION_NAMES.get(action, f"action {action}")
        target = " ".join(part for part in (arg1, arg2) if part)
        if arg1 in ("sqlite_master", "sqlite_schema", "sqlite_temp_master"):
            what, target = "a schema change", f"({what} {target})"  # CREATE/DROP write the schema table
        denied.append(f"{what} {target}".strip())
        return sqlite3.SQLITE_DENY

    return authorize


def _sqlite_readonly_uri(url: sa.URL) -> str:
    """A `mode=ro` URI for the engine's database file, so this connection can never write."""
    database = url.database or ""
    in_memory = database in ("", ":memory:") or url.query.get("mode") == "memory"
    if in_memory:
        raise FailedPrecondition(
            "`ballast sql` needs a SQLite database file; an in-memory database cannot be opened read-only "
            "by a second connection"
        )
    if database.startswith("file:"):  # already a URI (sqlite:///file:...?uri=true)
        return database + "?mode=ro"
    return Path(database).absolute().as_uri() + "?mode=ro"


MAX_RESULT_BYTES = 32 * 1024 * 1024


def _row_bytes(row: Any) -> int:
    return sum(len(v) if isinstance(v, str | bytes | bytearray | memoryview) else 16 for v in row)


def _check_size(total: int) -> None:
    """A result must fit one reply: refuse it instead of exhausting the store's memory."""
    if total > MAX_RESULT_BYTES:
        raise ResourceExhausted(
            f"the result exceeds {MAX_RESULT_BYTES // 2**20} MiB",
            fix="select fewer or narrower columns, or lower the row limit",
        )


def _run_sqlite(url: sa.URL, statement: str, limit: int, timeout_s: float) -> tuple[list[str], list[Any]]:
    uri = _sqlite_readonly_uri(url)
    try:
        conn = sqlite3.connect(
            uri, uri=True, timeout=timeout_s, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as exc:
        raise FailedPrecondition(
            f"cannot open the SQLite database {url.database} read-only: {exc}",
            fix="check the path and run `ballast db upgrade`",
        ) from exc
    denied: list[str] = []
    timed_out = False
    deadline = time.monotonic() + timeout_s

    def progress() -> int:
        nonlocal timed_out
        timed_out = time.monotonic() > deadline
        return int(timed_out or context.cancelled())

    try:
        conn.execute("PRAGMA query_only = ON")
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_RESULT_BYTES)  # randomblob(1e9) fails, not the store
        conn.set_authorizer(_sqlite_authorizer(denied))
        conn.set_progress_handler(progress, _PROGRESS_STEPS)
        cursor = conn.execute(statement)
        if cursor.description is None:
            return [], []
        columns = [column[0] for column in cursor.description]
        rows = cursor.fetchmany(limit + 1)
        _check_size(sum(_row_bytes(row) for row in rows))
        return columns, rows
    except (sqlite3.Error, sqlite3.Warning) as exc:  # Python < 3.12 raises Warning for several statements
        raise _sqlite_error(exc, statement, denied, timed_out, timeout_s) from exc
    finally:
        conn.close()


def _sqlite_error(
    exc: Exception, statement: str, denied: list[str], timed_out: bool, timeout_s: float
) -> BallastError:
    message = str(exc)
    name = getattr(exc, "sqlite_errorname", "")
    if timed_out:
        return _timeout_error(timeout_s)
    if context.cancelled():
        return _cancelled_error()
    functions = [d for d in denied if d.startswith("the function ")]
    if functions:
        return ReadOnlyViolation(f"statement rejected: it calls {'; '.join(dict.fromkeys(functions))}",
                                 fix="remove the call; `ballast sql` reads the tables with core SQL")
    if denied or name == "SQLITE_AUTH":
        needs = ", ".join(dict.fromkeys(denied)) or "a write"
        return ReadOnlyViolation(
            f"read-only: statement rejected because `ballast sql` is read-only and it needs: {needs} "
            f"(SQLite: {message})"
        )
    if name == "SQLITE_READONLY" or "readonly database" in message:
        return ReadOnlyViolation(
            f"read-only: statement rejected because `ballast sql` is read-only (SQLite: {message})"
        )
    if name in ("SQLITE_BUSY", "SQLITE_LOCKED"):
        return Unavailable(f"the SQLite database is busy: {message}", fix="retry shortly")
    if isinstance(exc, sqlite3.Warning | sqlite3.ProgrammingError):
        return InvalidArgument(f"SQLite rejected the statement: {message}", field="sql")
    keyword = _WRITE_KEYWORD.search(_scan(statement, "sqlite").code)
    if keyword and "syntax error" in message:
        # E.g. SQLite does not accept DML inside WITH at all; the statement was a write attempt, so say
        # so, and quote SQLite's own words rather than pretend it reported a read-only violation.
        return ReadOnlyViolation(
            f"read-only: statement rejected because `ballast sql` is read-only and it contains "
            f"{keyword.group(1).upper()}; SQLite did not accept it either (SQLite: {message})"
        )
    return InvalidArgument(f"SQLite rejected the statement: {message}", field="sql")


def _cancelled_error() -> Cancelled:
    return Cancelled("query stopped: its caller went away (cancelled, or its deadline passed)")


def _timeout_error(timeout_s: float) -> QueryTimeout:
    return QueryTimeout(
        f"query cancelled after its {timeout_s:g} s timeout",
        fix="narrow it with WHERE/LIMIT or pass a longer timeout",
    )


# --- PostgreSQL -----------------------------------------------------------------------------------


def _run_postgres(
    engine: sa.Engine, statement: str, limit: int, timeout_s: float
) -> tuple[list[str], list[Any]]:
    with engine.connect() as conn:
        # An explicit isolation level forces a real transaction even on an AUTOCOMMIT engine, where
        # SET TRANSACTION / SET LOCAL would silently do nothing.
        conn.execution_options(isolation_level="REPEATABLE READ")
        try:
            _enter_readonly(conn, timeout_s)
            dbapi_conn = conn.connection.driver_connection
            cancel = getattr(dbapi_conn, "cancel_safe", None) or dbapi_conn.cancel
            try:
                with context.on_cancel(cancel):  # the server stops the query when its caller goes away
                    return _pg_fetch(dbapi_conn, statement, limit)
            except engine.dialect.loaded_dbapi.Error as exc:
                raise _pg_error(exc, timeout_s) from exc
        finally:
            try:
                conn.rollback()
            except sa.exc.DBAPIError:
                pass  # the session is closed just below, which aborts the transaction server-side
            # Advisory locks and prepared statements survive a rollback: never pool this session.
            conn.invalidate()


SQL_LOGIN_FIX = (
    "point BALLAST_SQL_DATABASE_URL at a login that is only a member of ballast_readonly (migration 0002 "
    "creates ballast_readonly with LOGIN and no password; give it one with ALTER ROLE ... PASSWORD)"
)

_GUARD = """
SELECT current_setting('transaction_read_only') AS read_only,
       session_user::text AS login,
       r.rolsuper AS superuser,
       COALESCE(pg_has_role(session_user, t.tableowner, 'MEMBER'), false) AS acts_as_owner,
       pg_has_role(session_user, 'pg_read_server_files', 'MEMBER')
         OR pg_has_role(session_user, 'pg_write_server_files', 'MEMBER')
         OR pg_has_role(session_user, 'pg_execute_server_program', 'MEMBER') AS server_files
FROM pg_roles r
LEFT JOIN pg_tables t ON t.schemaname = current_schema() AND t.tablename = 'alembic_version'
WHERE r.rolname = session_user
"""


def readonly_url(database_url: str) -> str:
    """The store's database URL, logged in as the read-only role instead (no password: trust/peer
    authentication, or set BALLAST_SQL_DATABASE_URL with credentials)."""
    from services.store.db import normalize_url

    url = sa.make_url(normalize_url(database_url)).set(username=READONLY_ROLE, password=None)
    return url.render_as_string(hide_password=False)


def _enter_readonly(conn: sa.Connection, timeout_s: float) -> None:
    """Make the transaction read-only and arm the timeout; then refuse a login that could escape."""
    timeout_ms = max(1, math.ceil(timeout_s * 1000))
    try:
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        conn.exec_driver_sql(f"SET LOCAL statement_timeout = {timeout_ms}")
        guard = conn.exec_driver_sql(_GUARD).mappings().one()
    except sa.exc.DBAPIError as exc:
        raise FailedPrecondition(f"cannot prepare a read-only session: {exc.orig}", fix=SQL_LOGIN_FIX) from exc
    if guard["read_only"] != "on":
        raise BallastError(f"read-only guard not in effect (transaction_read_only={guard['read_only']})")
    why = [reason for key, reason in (("superuser", "is a superuser"),
                                      ("acts_as_owner", "can act as the owner of the tables"),
                                      ("server_files", "may read or write server files or run programs"))
           if guard[key]]
    if why:
        raise FailedPrecondition(
            f"`ballast sql` refuses to run as {guard['login']}: it {' and '.join(why)}, so it could leave "
            "the read-only role", fix=SQL_LOGIN_FIX)


def _pg_fetch(dbapi_conn: Any, statement: str, limit: int) -> tuple[list[str], list[Any]]:
    """Fetch at most limit+1 rows without holding the whole result in memory (psycopg 3 streaming)."""
    cursor = dbapi_conn.cursor()
    try:
        if not hasattr(cursor, "stream"):  # another driver: plain execute, still only limit+1 rows kept
            cursor.execute(statement)
            if cursor.description is None:
                return [], []
            return [col[0] for col in cursor.description], cursor.fetchmany(limit + 1)
        import psycopg

        rows: list[Any] = []
        size = min(limit + 1, 500) if psycopg.capabilities.has_stream_chunked() else 1
        stream = cursor.stream(statement, size=size)
        try:
            total = 0
            for row in stream:
                rows.append(row)
                total += _row_bytes(row)
                _check_size(total)
                if len(rows) > limit:
                    break
        except psycopg.ProgrammingError as exc:
            if getattr(exc, "sqlstate", None) is None and "didn't produce a result" in str(exc):
                return [], []  # a statement without a result set (SET, LISTEN...)
            raise
        finally:
            stream.close()  # cancels the rest of the query when we stopped early
        if cursor.description is not None:
            return [col.name for col in cursor.description], rows
        return _pg_describe(dbapi_conn, statement), rows
    finally:
        cursor.close()


def _pg_describe(dbapi_conn: Any, statement: str) -> list[str]:
    """Column names of a statement that returned no rows (psycopg only records them from a row)."""
    from psycopg import pq

    encoding = dbapi_conn.info.encoding
    pgconn = dbapi_conn.pgconn
    # Parse and describe only; the unnamed statement is replaced by the next query anyway.
    prepared = pgconn.prepare(b"", statement.encode(encoding))
    if prepared.status != pq.ExecStatus.COMMAND_OK:
        return []
    described = pgconn.describe_prepared(b"")
    if described.status != pq.ExecStatus.COMMAND_OK:
        return []
    return [(described.fname(i) or b"").decode(encoding) for i in range(described.nfields)]


def _pg_error(exc: Exception, timeout_s: float) -> BallastError:
    """Map a driver error to the Ballast error the admin should see, keeping PostgreSQL's message."""
    sqlstate = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None) or ""
    diag = getattr(exc, "diag", None)
    message = (getattr(diag, "message_primary", None) or str(exc)).strip()
    if sqlstate == "25006":  # read_only_sql_transaction
        return ReadOnlyViolation(
            f"read-only: statement rejected because `ballast sql` runs in a read-only transaction "
            f"(PostgreSQL: {message})"
        )
    if sqlstate == "42501":  # insufficient_privilege
        return ReadOnlyViolation(
            f"read-only: statement rejected because `ballast sql` runs as the SELECT-only role "
            f"{READONLY_ROLE} (PostgreSQL: {message})"
        )
    if sqlstate == "57014":  # query_canceled: statement_timeout, or our cancel when the caller went away
        return _cancelled_error() if context.cancelled() else _timeout_error(timeout_s)
    if sqlstate.startswith(("08", "57P")) or not sqlstate:  # no SQLSTATE: the connection itself failed
        return Unavailable(f"lost the database connection: {message}", fix="retry shortly")
    if sqlstate.startswith("53"):
        return ResourceExhausted(f"the database ran out of resources: {message}")
    return InvalidArgument(f"PostgreSQL rejected the statement: {message}", field="sql")
