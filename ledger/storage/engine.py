"""Opening a database: URL normalization, engine settings per backend, driver-error mapping.

SQLite runs in WAL mode with ``synchronous=FULL`` (an Attempt row must survive power loss before
its request leaves the process), a busy timeout, and ``BEGIN IMMEDIATE`` for every write
transaction so that writers serialize up front instead of failing on lock upgrade.
PostgreSQL uses psycopg 3; writes serialize on row locks (``SELECT ... FOR UPDATE``).
"""

from __future__ import annotations

import os
import re
from collections import namedtuple
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError

from ledger.errors import DatabaseUnavailable, InvalidArgument, StorageError

SQLITE_BUSY_TIMEOUT_MS = 30_000


def normalize_url(url: str) -> str:
    """Accept a SQLite file path or an SQLAlchemy URL; PostgreSQL URLs use psycopg 3."""
    if not url or not url.strip():
        raise InvalidArgument(
            "empty database URL; pass a SQLite file path or a postgresql+psycopg:// URL",
            field="url",
        )
    url = url.strip()
    if "://" not in url:
        return "sqlite:///" + os.path.abspath(url)
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def backend_of(engine: Engine) -> str:
    return engine.dialect.name


def create(url: str) -> Engine:
    """Create an engine for ``url`` with the ledger's per-backend settings."""
    norm = normalize_url(url)
    try:
        parsed = make_url(norm)
    except ArgumentError as e:
        raise InvalidArgument(
            f"cannot parse database URL {redact_url(url)!r}: use a SQLite file path or "
            "postgresql+psycopg://user:pass@host:port/dbname",
            field="url",
        ) from e
    name = parsed.get_backend_name()
    if name == "sqlite":
        db = parsed.database
        if not db or db == ":memory:":
            raise InvalidArgument(
                "the ledger needs a SQLite *file* (several connections share it); "
                "pass a path such as ./ledger.db",
                field="url",
            )
        parent = os.path.dirname(os.path.abspath(db))
        if not os.path.isdir(parent):
            raise DatabaseUnavailable(
                f"cannot open SQLite database {db!r}: folder {parent!r} does not exist; "
                "create it or choose another path",
                url=redact_url(norm),
            )
        engine = create_engine(
            norm,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "isolation_level": None},
            pool_pre_ping=False,
        )
        _install_sqlite_hooks(engine)
        return engine
    if name == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            raise InvalidArgument(
                f"unsupported PostgreSQL driver {parsed.get_driver_name()!r}; "
                "use postgresql+psycopg://",
                field="url",
            )
        _require_psycopg(norm)
        # No pre-ping: it costs a round trip per transaction. A connection that died (server
        # restart) fails its next statement with DatabaseUnavailable, the pool drops it, and the
        # caller's retry gets a fresh one; every write is idempotent per id, so that is safe.
        return create_engine(norm, pool_pre_ping=False, pool_size=5, max_overflow=10)
    raise InvalidArgument(
        f"unsupported database backend {name!r}; use SQLite (a file path) or "
        "postgresql+psycopg://",
        field="url",
    )


POSTGRES_EXTRA_HINT = "pip install 'failover-ledger[postgres]'"


def _require_psycopg(url: str) -> None:
    """PostgreSQL needs the optional ``postgres`` extra (psycopg 3); say so before SQLAlchemy
    fails on the missing module with a bare ImportError."""
    try:
        import psycopg  # noqa: F401
    except ImportError as e:
        raise InvalidArgument(
            f"{redact_url(url)} is a PostgreSQL ledger, but the PostgreSQL driver (psycopg 3) "
            f"is not installed; install the extra: {POSTGRES_EXTRA_HINT}",
            field="url", extra="postgres",
        ) from e


def _install_sqlite_hooks(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = FULL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # pysqlite's own transaction handling is off (isolation_level=None); we emit BEGIN
        # ourselves so that writes take the write lock up front.
        if conn.get_execution_options().get("ledger_write"):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


@contextmanager
def mapped_errors(url: str) -> Iterator[None]:
    """Turn driver errors into typed ledger errors (the transaction has been rolled back)."""
    try:
        yield
    except OperationalError as e:
        raise DatabaseUnavailable(
            f"database {redact_url(url)} is unavailable ({_first_line(e)}); the transaction "
            "was rolled back and is safe to retry once the database is back",
            url=redact_url(url),
        ) from e
    except DBAPIError as e:
        if e.connection_invalidated:
            raise DatabaseUnavailable(
                f"lost the connection to {redact_url(url)} ({_first_line(e)}); safe to retry",
                url=redact_url(url),
            ) from e
        raise StorageError(f"database error: {_first_line(e)}", url=redact_url(url)) from e


def _first_line(e: BaseException) -> str:
    orig = getattr(e, "orig", None)
    text = str(orig if orig is not None else e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- the write path's prebuilt statements, executed on the DBAPI cursor ------------------------
# SQLAlchemy's execute costs tens of microseconds of client CPU per statement (execution context,
# parameter and result processing, result metadata), several times what the driver itself costs.
# The begin/settle hot path runs prebuilt statements, so each is compiled once per dialect and
# parameter shape here and sent on the cursor of the Connection's own DBAPI connection, inside
# the transaction the Store opened. Driver errors go through the Connection's own error handling
# (``_handle_dbapi_exception``): the same wrapping into SQLAlchemy exceptions (so
# ``mapped_errors`` maps them as before), the same disconnect detection and invalidation.


class _Plan:
    """One statement compiled for one dialect and one set of parameter names."""

    __slots__ = ("consts", "names", "positional", "procs", "result_procs", "result_types",
                 "row_type", "sql", "stmt")

    def __init__(self, stmt: Any, sql: str, names: tuple[str, ...], consts: dict[str, Any],
                 procs: dict[str, Any], positional: bool, row_type: Any,
                 result_types: list[Any]) -> None:
        self.stmt = stmt  # keeps the statement alive, so its id() stays its own
        self.sql = sql
        self.names = names
        self.consts = consts
        self.procs = procs
        self.positional = positional
        self.row_type = row_type
        self.result_types = result_types
        # Result processors depend on the column types the driver reports (cursor.description):
        # computed at the first execution, as SQLAlchemy does. False: not yet computed.
        self.result_procs: list[Any] | bool | None = False


_PLANS: dict[tuple[int, str, tuple[str, ...]], _Plan | None] = {}
_ROW_TYPES: dict[tuple[str, ...], Any] = {}


def _row_type(fields: tuple[str, ...]) -> Any:
    """A tuple with attribute access and ``_mapping``, as the code reads SQLAlchemy rows."""
    rt = _ROW_TYPES.get(fields)
    if rt is None:
        base = namedtuple("FastRow", fields)  # type: ignore[misc]

        class FastRow(base):
            __slots__ = ()

            @property
            def _mapping(self) -> dict[str, Any]:
                return dict(zip(self._fields, self, strict=True))

        rt = _ROW_TYPES[fields] = FastRow
    return rt


def _plan(conn: Connection, stmt: Any, keys: tuple[str, ...]) -> _Plan | None:
    """Compile ``stmt``; None when it needs anything of SQLAlchemy's execution beyond the
    driver call (column defaults, expanding or escaped parameters, unknown parameters)."""
    dialect = conn.dialect
    compiled: Any = stmt.compile(dialect=dialect, column_keys=list(keys))
    if (compiled.insert_prefetch or compiled.update_prefetch or compiled.escaped_bind_names
            or compiled.literal_execute_params or compiled.post_compile_params):
        return None
    binds = compiled.bind_names  # BindParameter -> name
    by_name = {name: bp for bp, name in binds.items()}
    names = (tuple(compiled.positiontup) if compiled.positional
             else tuple(dict.fromkeys(by_name)))
    consts: dict[str, Any] = {}
    keyset = set(keys)
    for name in names:
        if name in keyset:
            continue
        bp = by_name[name]
        if bp.callable is not None or bp.required:
            return None
        consts[name] = bp.value
    procs = {n: p for n, p in compiled._bind_processors.items() if n in names}
    for name in list(consts):
        if name in procs:
            consts[name] = procs.pop(name)(consts[name])
    row_type = None
    result_types: list[Any] = []
    cols = compiled._result_columns
    if cols:
        fields = tuple(c[0] for c in cols)
        if len(set(fields)) != len(fields) or not all(f.isidentifier() for f in fields):
            return None
        row_type = _row_type(fields)
        result_types = [c[3] for c in cols]
    return _Plan(stmt, compiled.string, names, consts, procs, bool(compiled.positional),
                 row_type, result_types)


def _prepare(conn: Connection, stmt: Any, params: Mapping[str, Any]
             ) -> tuple[_Plan, Any] | None:
    """The plan and driver arguments of one execution; None: use SQLAlchemy's execute."""
    key = (id(stmt), conn.dialect.name, tuple(params))
    plan = _PLANS.get(key, False)
    if plan is False:
        plan = _PLANS[key] = _plan(conn, stmt, key[2])
    dispatch = conn.dispatch
    if plan is None or dispatch.before_cursor_execute or dispatch.after_cursor_execute:
        return None
    assert isinstance(plan, _Plan)
    procs = plan.procs
    consts = plan.consts
    if plan.positional:
        args: Any = tuple(
            consts[n] if n in consts else (procs[n](params[n]) if n in procs else params[n])
            for n in plan.names
        )
    else:
        args = {
            n: consts[n] if n in consts else (procs[n](params[n]) if n in procs else params[n])
            for n in plan.names
        }
    return plan, args


def _fetch(cursor: Any, plan: _Plan) -> tuple[Any, list[Any]]:
    """(description or None, raw rows) of an executed statement (driver calls only).

    Only a statement with result columns is fetched; its description (costly to build on
    psycopg) is only read at the first execution, for the result processors."""
    desc = cursor.description if plan.result_procs is False else None
    raw = cursor.fetchall() if plan.row_type is not None else []
    cursor.close()
    return desc, raw


def _rows(conn: Connection, plan: _Plan, desc: Any, raw: list[Any]) -> list[Any]:
    if plan.row_type is None:
        return []
    make = plan.row_type._make
    rprocs = plan.result_procs
    if rprocs is False:
        if desc is None or len(desc) != len(plan.result_types):
            raise StorageError(f"unexpected result shape for {plan.sql!r}")
        rp = [t._cached_result_processor(conn.dialect, d[1])
              for t, d in zip(plan.result_types, desc, strict=True)]
        rprocs = plan.result_procs = rp if any(p is not None for p in rp) else None
    if rprocs is None:
        return [make(r) for r in raw]
    assert isinstance(rprocs, list)
    return [make(p(v) if p is not None and v is not None else v
                 for p, v in zip(rprocs, r, strict=True)) for r in raw]


def run_prebuilt(conn: Connection, stmt: Any, params: Mapping[str, Any]) -> list[Any]:
    """Execute a prebuilt statement in ``conn``'s transaction; its rows (attribute access)."""
    prepared = _prepare(conn, stmt, params)
    if prepared is None:
        return list(conn.execute(stmt, dict(params)))
    plan, args = prepared
    dbapi_conn: Any = conn.connection.dbapi_connection
    cursor = None
    try:
        cursor = dbapi_conn.cursor()
        cursor.execute(plan.sql, args)
        desc, raw = _fetch(cursor, plan)
    except BaseException as e:
        conn._handle_dbapi_exception(e, plan.sql, args, cursor, None)
    return _rows(conn, plan, desc, raw)


def run_prebuilt_batch(conn: Connection, batch: Sequence[tuple[Any, Mapping[str, Any]]]
                       ) -> list[list[Any]]:
    """Execute prebuilt statements in order in ``conn``'s transaction; the rows of each.

    On PostgreSQL they are sent in one round trip (psycopg pipeline mode), together with the
    transaction's ``BEGIN`` when they are its first statements: the server still runs them one
    after the other, each with its own snapshot, exactly as if sent one by one, but a later
    one runs even when an earlier one's rows make the caller stop (so only reads belong after
    the first). The first error aborts the rest and is raised as for a single statement."""
    prepared = [_prepare(conn, stmt, params) for stmt, params in batch]
    if conn.dialect.name != "postgresql" or any(p is None for p in prepared):
        return [run_prebuilt(conn, stmt, params) for stmt, params in batch]
    dbapi_conn: Any = conn.connection.dbapi_connection
    fetched: list[tuple[Any, list[Any]]] = []
    cursor = None
    try:
        cursors = []
        with dbapi_conn.pipeline():
            for item in prepared:
                assert item is not None
                cursor = dbapi_conn.cursor()
                cursor.execute(item[0].sql, item[1])
                cursors.append(cursor)
        for cursor, item in zip(cursors, prepared, strict=True):
            assert item is not None
            fetched.append(_fetch(cursor, item[0]))
    except BaseException as e:
        conn._handle_dbapi_exception(e, ";\n".join(p[0].sql for p in prepared if p),
                                     [p[1] for p in prepared if p], cursor, None)
    out = []
    for (desc, raw), item in zip(fetched, prepared, strict=True):
        assert item is not None
        out.append(_rows(conn, item[0], desc, raw))
    return out
