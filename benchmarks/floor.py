"""The physical floor of one Attempt: the raw driver, prepared statements, autocommit.

Per attempt, the least durable work an Attempt needs: one single-row ``INSERT`` committed (the
record before the send), then one single-row ``UPDATE`` of that row committed (the outcome).
Each statement is its own autocommitted transaction, so each is one commit (and, on
PostgreSQL, one round trip), through the driver directly, with no SQLAlchemy in between:

* **PostgreSQL**: psycopg 3, ``autocommit=True``, every statement executed with
  ``prepare=True`` (a server-side prepared statement from the first execution on);
* **SQLite**: the ``sqlite3`` module, ``isolation_level=None`` (autocommit), WAL with
  ``synchronous=FULL`` and the ledger's busy timeout; the module's statement cache prepares
  each statement once per connection.

The durability is the ledger's: SQLite gets the pragmas :mod:`ledger.storage.engine` sets, and
PostgreSQL commits under the server's own ``fsync``/``synchronous_commit`` settings, which
apply to both. The table lives outside the ledger's declared schema; the benchmarks create it
before measuring and drop it afterwards.
"""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from typing import Any, Protocol

from sqlalchemy.engine import make_url

from ledger.errors import InvalidArgument
from ledger.storage.engine import SQLITE_BUSY_TIMEOUT_MS, normalize_url, redact_url
from ledger.storage.failure import mapped

TABLE = "ledger_bench_floor"

_DDL = (f"CREATE TABLE {TABLE} (attempt_id TEXT PRIMARY KEY, worker TEXT NOT NULL, "
        "state TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL, "
        "settled_at DOUBLE PRECISION)")


class FloorWriter(Protocol):
    """One worker's floor: :meth:`attempt` = INSERT commit + UPDATE commit."""

    def attempt(self, attempt_id: str, now: float) -> None:
        """Record one attempt the cheapest durable way: two autocommitted statements."""

    def close(self) -> None:
        """Close the driver connection."""


def backend(url: str) -> str:
    """``"sqlite"`` or ``"postgresql"`` for a ledger URL or SQLite path."""
    name = make_url(normalize_url(url)).get_backend_name()
    if name not in ("sqlite", "postgresql"):
        raise InvalidArgument(f"the floor runs on SQLite or PostgreSQL, not {name!r}",
                              field="url")
    return name


def sqlite_path(url: str) -> str:
    """The file of a SQLite ledger URL."""
    db = make_url(normalize_url(url)).database
    if not db:
        raise InvalidArgument("the floor needs a SQLite file path", field="url")
    return db


def pg_connect_args(url: str, dbname: str | None = None) -> dict[str, Any]:
    """psycopg ``connect()`` keyword arguments for a ``postgresql+psycopg://`` URL."""
    u = make_url(normalize_url(url))
    args: dict[str, Any] = {k: v for k, v in u.query.items() if isinstance(v, str)}
    for key, value in (("host", u.host), ("port", u.port), ("user", u.username),
                       ("password", u.password), ("dbname", dbname or u.database)):
        if value is not None:
            args[key] = value
    return args


def _mapped(url: str) -> AbstractContextManager[None]:
    """Driver errors as ledger errors, as everywhere in storage (:mod:`ledger.storage.failure`)."""
    return mapped(redact_url(url))


def _sqlite_connect(url: str) -> sqlite3.Connection:
    conn = sqlite3.connect(sqlite_path(url), isolation_level=None,
                           timeout=SQLITE_BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    return conn


class _SqliteFloor:
    def __init__(self, url: str, worker: str) -> None:
        self.url = url
        self.worker = worker
        with _mapped(url):
            self.conn = _sqlite_connect(url)

    def attempt(self, attempt_id: str, now: float) -> None:
        with _mapped(self.url):
            self.conn.execute(f"INSERT INTO {TABLE} (attempt_id, worker, state, created_at) "
                              "VALUES (?, ?, 'dispatching', ?)", (attempt_id, self.worker, now))
            self.conn.execute(f"UPDATE {TABLE} SET state = 'succeeded', settled_at = ? "
                              "WHERE attempt_id = ?", (now, attempt_id))

    def close(self) -> None:
        self.conn.close()

    @staticmethod
    def ddl(url: str, statements: list[str]) -> None:
        conn = _sqlite_connect(url)
        try:
            for stmt in statements:
                conn.execute(stmt)
        finally:
            conn.close()

    @staticmethod
    def table_exists(url: str) -> bool:
        conn = _sqlite_connect(url)
        try:
            row = conn.execute("SELECT count(*) FROM sqlite_master WHERE name = ?",
                               (TABLE,)).fetchone()
        finally:
            conn.close()
        return bool(row and row[0])


class _PgFloor:
    def __init__(self, url: str, worker: str) -> None:
        import psycopg

        self.url = url
        self.worker = worker
        with _mapped(url):
            self.conn = psycopg.connect(autocommit=True, prepare_threshold=0,
                                        **pg_connect_args(url))

    def attempt(self, attempt_id: str, now: float) -> None:
        with _mapped(self.url):
            self.conn.execute(f"INSERT INTO {TABLE} (attempt_id, worker, state, created_at) "
                              "VALUES (%s, %s, 'dispatching', %s)",
                              (attempt_id, self.worker, now), prepare=True)
            self.conn.execute(f"UPDATE {TABLE} SET state = 'succeeded', settled_at = %s "
                              "WHERE attempt_id = %s", (now, attempt_id), prepare=True)

    def close(self) -> None:
        self.conn.close()

    @staticmethod
    def ddl(url: str, statements: list[str]) -> None:
        import psycopg

        with psycopg.connect(autocommit=True, **pg_connect_args(url)) as pg:
            for stmt in statements:
                pg.execute(stmt)

    @staticmethod
    def table_exists(url: str) -> bool:
        import psycopg

        with psycopg.connect(autocommit=True, **pg_connect_args(url)) as pg:
            got = pg.execute("SELECT to_regclass(%s) IS NOT NULL", (TABLE,)).fetchone()
        return bool(got and got[0])


def _floor(url: str) -> type[_SqliteFloor] | type[_PgFloor]:
    """The floor of ``url``'s backend: the one place the two are told apart."""
    return _SqliteFloor if backend(url) == "sqlite" else _PgFloor


def open_writer(url: str, worker: str) -> FloorWriter:
    """A floor writer for ``url`` (its own driver connection)."""
    return _floor(url)(url, worker)


def _ddl(url: str, statements: list[str]) -> None:
    with _mapped(url):
        _floor(url).ddl(url, statements)


def create_table(url: str) -> None:
    """Create the floor's table (dropping any leftover of an interrupted run)."""
    _ddl(url, [f"DROP TABLE IF EXISTS {TABLE}", _DDL])


def drop_table(url: str) -> None:
    """Drop the floor's table."""
    _ddl(url, [f"DROP TABLE IF EXISTS {TABLE}"])


def table_exists(url: str) -> bool:
    """Whether the floor's table is present (it should not be after a benchmark)."""
    with _mapped(url):
        return _floor(url).table_exists(url)


__all__ = [
    "TABLE",
    "FloorWriter",
    "backend",
    "create_table",
    "drop_table",
    "open_writer",
    "pg_connect_args",
    "sqlite_path",
    "table_exists",
]
