"""Transactions written once, run by a sync or an async driver on the database's own driver.

A hot-path transaction is a generator (sans-I/O) that yields what it needs executed — one
:class:`Q`, or a tuple of them to be sent together — and is sent back the rows. It never touches
a connection, so the same function runs on SQLite (:mod:`sqlite3`), on PostgreSQL through a
blocking :mod:`psycopg` connection, and on PostgreSQL through an asyncio one::

    def begin_tx(...) -> Tx[AttemptRecord]:
        [run] = yield Q(LOCK_RUN, {"run_id": ...})
        ...
        yield Flush((Q(INSERT_ATTEMPT, values), Q(UPDATE_RUN, params)), commit=True)
        return record

The drivers open the transaction (``BEGIN IMMEDIATE`` on SQLite, so writers serialize up front;
``BEGIN`` on PostgreSQL, sent in the same round trip as the first statements), feed the
generator, and commit — on PostgreSQL the last writes and the ``COMMIT`` go as one pipeline, so
a begin or a settle costs two round trips. Driver errors become ledger errors here, in one
place: a lost or refused connection is :class:`~ledger.errors.DatabaseUnavailable` (retry-safe:
the transaction was rolled back, or its commit outcome is unknown and every write is idempotent
per id), anything else :class:`~ledger.errors.StorageError`. Statements are plain SQL strings
executed through each driver's public API; psycopg prepares the repeated ones on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import weakref
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from ledger.errors import DatabaseUnavailable, StorageError

T = TypeVar("T")
Row = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Q:
    """One statement and its parameters; ``many``: run once per parameter set (no rows)."""

    sql: str
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]] = ()
    many: bool = False

    @property
    def mapping(self) -> Mapping[str, Any]:
        """The parameters of a single execution."""
        return self.params  # type: ignore[return-value]

    @property
    def batch(self) -> Sequence[Mapping[str, Any]]:
        """The parameter sets of a ``many`` execution."""
        return self.params  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Flush:
    """Statements sent together (one round trip on PostgreSQL); ``commit`` ends the
    transaction with them. The generator is sent one list of rows per statement."""

    items: tuple[Q, ...]
    commit: bool = False


Step = Q | Flush
Tx = Generator[Step, Any, T]


def _sql(sql: str, dialect: str) -> tuple[str, tuple[str, ...]]:
    """``:name`` placeholders as the driver wants them, and the names in order.

    SQLite takes ``:name`` and a mapping as they are; for psycopg they become positional
    ``%s`` (a sequence of values costs the driver less than a mapping to reorder)."""
    if dialect != "postgresql":
        return sql, ()
    out = []
    names: list[str] = []
    i = 0
    while i < len(sql):
        ch = sql[i]
        if ch == ":" and i + 1 < len(sql) and (sql[i + 1].isalpha() or sql[i + 1] == "_") and (
                i == 0 or sql[i - 1] != ":"):
            j = i + 1
            while j < len(sql) and (sql[j].isalnum() or sql[j] == "_"):
                j += 1
            names.append(sql[i + 1:j])
            out.append("%s")
            i = j
            continue
        out.append("%%" if ch == "%" else ch)
        i += 1
    return "".join(out), tuple(names)


class Statements:
    """The SQL of one dialect, converted once: ``stmts.get(sql)`` is what the driver executes,
    the parameter names in order (positional drivers), and whether it returns rows (only those
    are fetched: describing a result costs the client work)."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        self._cache: dict[str, tuple[str, tuple[str, ...], bool]] = {}
        self._lock = threading.Lock()

    def get(self, sql: str) -> tuple[str, tuple[str, ...], bool]:
        out = self._cache.get(sql)
        if out is None:
            head = sql.lstrip()[:6].upper().rstrip()
            text, names = _sql(sql, self.dialect)
            out = (text, names, head in ("SELECT", "WITH") or head.startswith("WITH ")
                   or " RETURNING " in sql.upper())
            with self._lock:
                if len(self._cache) < 4096:  # a bound: shapes are few, but never unbounded
                    self._cache[sql] = out
        return out

    def __getitem__(self, sql: str) -> str:
        return self.get(sql)[0]


# -- SQLite ------------------------------------------------------------------------------------

SQLITE_BUSY_TIMEOUT_S = 30.0


class SqliteDriver:
    """One :mod:`sqlite3` connection per thread (WAL, ``synchronous=FULL``), transactions
    opened with ``BEGIN IMMEDIATE`` for writes. Async callers run transactions inline on the
    event loop's thread: a SQLite transaction has no network wait to overlap, and a hop to a
    worker thread costs more than the statements (``docs/benchmarks.md``)."""

    dialect = "sqlite"

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self.stmts = Statements("sqlite")

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(self.path, timeout=SQLITE_BUSY_TIMEOUT_S,
                                       isolation_level=None, check_same_thread=False,
                                       cached_statements=256)
                conn.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = FULL")
                conn.execute("PRAGMA foreign_keys = ON")
            except sqlite3.Error as e:
                raise _mapped(e, self.path) from e
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def run(self, tx: Tx[T], *, write: bool) -> T:
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = self._feed(conn, tx)
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            if conn.in_transaction:
                conn.execute("COMMIT")
            return result
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise _mapped(e, self.path) from e

    def _feed(self, conn: sqlite3.Connection, tx: Tx[T]) -> T:
        stmts = self.stmts
        value: Any = None
        while True:
            try:
                step = tx.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(step, Q):
                value = _sqlite_exec(conn, stmts[step.sql], step)
            else:
                value = [_sqlite_exec(conn, stmts[q.sql], q) for q in step.items]
                if step.commit:
                    conn.execute("COMMIT")

    async def arun(self, tx: Tx[T], *, write: bool) -> T:
        return self.run(tx, write=write)

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            with contextlib.suppress(sqlite3.Error):  # closing is best effort
                c.close()
        self._local = threading.local()


def _sqlite_exec(conn: sqlite3.Connection, sql: str, q: Q) -> list[Row]:
    if q.many:
        conn.executemany(sql, q.params)
        return []
    return conn.execute(sql, q.params).fetchall()


def _mapped(e: BaseException, where: str) -> StorageError:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, sqlite3.OperationalError) and ("locked" in text or "unable to open" in text
                                                    or "disk" in text or "busy" in text):
        return DatabaseUnavailable(
            f"database {where} is unavailable ({text}); the transaction was rolled back and is "
            "safe to retry", url=where)
    return StorageError(f"database error: {text}", url=where)


# -- PostgreSQL --------------------------------------------------------------------------------


class PgDriver:
    """psycopg 3 connections from a small pool, blocking and asyncio, in autocommit mode with
    the transaction's ``BEGIN`` and ``COMMIT`` pipelined with its statements."""

    dialect = "postgresql"

    def __init__(self, conninfo: str, *, where: str, max_size: int = 10) -> None:
        self.conninfo = conninfo
        self.where = where
        self.max_size = max_size
        self.stmts = Statements("postgresql")
        self._idle: list[Any] = []
        self._aidle: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Any]] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    # -- blocking

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        import psycopg

        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            try:
                conn = psycopg.connect(self.conninfo, autocommit=True)
            except psycopg.Error as e:
                raise self._mapped(e) from e
        try:
            yield conn
        finally:
            # Only a connection outside any transaction goes back (errors were rolled back).
            if not conn.closed and conn.info.transaction_status == 0:
                with self._lock:
                    if len(self._idle) < self.max_size:
                        self._idle.append(conn)
                        conn = None
            if conn is not None and not conn.closed:
                conn.close()

    def run(self, tx: Tx[T], *, write: bool) -> T:
        import psycopg

        with self._connection() as conn:
            try:
                return self._feed(conn, tx)
            except BaseException as e:
                _abort(conn)
                if isinstance(e, psycopg.Error):
                    raise self._mapped(e) from e
                raise

    def _feed(self, conn: Any, tx: Tx[T]) -> T:
        stmts = self.stmts
        value: Any = None
        first = True
        committed = False
        while True:
            try:
                step = tx.send(value)
            except StopIteration as stop:
                if not first and not committed:
                    conn.execute("COMMIT")
                return stop.value  # type: ignore[no-any-return]
            items = (step,) if isinstance(step, Q) else step.items
            commit = isinstance(step, Flush) and step.commit
            with conn.pipeline():
                cursors = []
                if first:
                    conn.execute("BEGIN")
                for q in items:
                    cur = conn.cursor()
                    text, names, fetch = stmts.get(q.sql)
                    if q.many:
                        cur.executemany(text, [[r[n] for n in names] for r in q.batch])
                    else:
                        cur.execute(text, [q.mapping[n] for n in names])
                    cursors.append((cur, fetch and not q.many))
                if commit:
                    conn.execute("COMMIT")
            first = False
            committed = committed or commit
            rows = [cur.fetchall() if fetch else [] for cur, fetch in cursors]
            value = rows[0] if isinstance(step, Q) else rows

    # -- asyncio

    @asynccontextmanager
    async def _aconnection(self) -> AsyncIterator[Any]:
        import psycopg

        # Async connections belong to the event loop that made them.
        idle = self._aidle.setdefault(asyncio.get_running_loop(), [])
        conn = idle.pop() if idle else None
        if conn is None:
            try:
                conn = await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True)
            except psycopg.Error as e:
                raise self._mapped(e) from e
        try:
            yield conn
        finally:
            if not conn.closed and conn.info.transaction_status == 0 and \
                    len(idle) < self.max_size:
                idle.append(conn)
            elif not conn.closed:
                await conn.close()

    async def arun(self, tx: Tx[T], *, write: bool) -> T:
        import psycopg

        async with self._aconnection() as conn:
            try:
                return await self._afeed(conn, tx)
            except BaseException as e:
                await _aabort(conn)
                if isinstance(e, psycopg.Error):
                    raise self._mapped(e) from e
                raise

    async def _afeed(self, conn: Any, tx: Tx[T]) -> T:
        stmts = self.stmts
        value: Any = None
        first = True
        committed = False
        while True:
            try:
                step = tx.send(value)
            except StopIteration as stop:
                if not first and not committed:
                    await conn.execute("COMMIT")
                return stop.value  # type: ignore[no-any-return]
            items = (step,) if isinstance(step, Q) else step.items
            commit = isinstance(step, Flush) and step.commit
            async with conn.pipeline():
                cursors = []
                if first:
                    await conn.execute("BEGIN")
                for q in items:
                    cur = conn.cursor()
                    text, names, fetch = stmts.get(q.sql)
                    if q.many:
                        await cur.executemany(text, [[r[n] for n in names] for r in q.batch])
                    else:
                        await cur.execute(text, [q.mapping[n] for n in names])
                    cursors.append((cur, fetch and not q.many))
                if commit:
                    await conn.execute("COMMIT")
            first = False
            committed = committed or commit
            rows = [await cur.fetchall() if fetch else [] for cur, fetch in cursors]
            value = rows[0] if isinstance(step, Q) else rows

    def _mapped(self, e: BaseException) -> StorageError:
        import psycopg

        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, psycopg.OperationalError | psycopg.errors.AdminShutdown
                      | psycopg.errors.CannotConnectNow):
            return DatabaseUnavailable(
                f"database {self.where} is unavailable ({text}); the transaction was rolled "
                "back (or its commit outcome is unknown) and is safe to retry", url=self.where)
        return StorageError(f"database error: {text}", url=self.where)

    def close(self) -> None:
        with self._lock:
            conns, self._idle = self._idle, []
        for c in conns:
            c.close()
        # Async connections belong to the loop that made them; dropping them lets the loop's
        # shutdown close their sockets.
        self._aidle = weakref.WeakKeyDictionary()


def _abort(conn: Any) -> None:
    """Leave no transaction open on a connection going back to the pool (or close it)."""
    import psycopg
    from psycopg.pq import TransactionStatus

    if conn.closed:
        return
    status = conn.info.transaction_status
    if status == TransactionStatus.IDLE:
        return
    if status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        try:
            conn.execute("ROLLBACK")
            return
        except psycopg.Error:
            pass
    conn.close()


async def _aabort(conn: Any) -> None:
    import psycopg
    from psycopg.pq import TransactionStatus

    if conn.closed:
        return
    status = conn.info.transaction_status
    if status == TransactionStatus.IDLE:
        return
    if status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        try:
            await conn.execute("ROLLBACK")
            return
        except psycopg.Error:
            pass
    await conn.close()


__all__ = ["Flush", "PgDriver", "Q", "SqliteDriver", "Statements", "Tx"]
