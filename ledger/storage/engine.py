"""Opening a database: URL normalization, engine settings per backend, driver-error mapping.

SQLite runs in WAL mode with ``synchronous=FULL`` (an Attempt row must survive power loss before
its request leaves the process), a busy timeout, and ``BEGIN IMMEDIATE`` for every write
transaction so that writers serialize up front instead of failing on lock upgrade.
PostgreSQL uses psycopg 3; writes serialize on row locks (``SELECT ... FOR UPDATE``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
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
