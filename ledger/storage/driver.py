"""Transactions written once, run by a sync or an async driver on the database's own driver.

A hot-path transaction is a generator (sans-I/O) that yields what it needs executed — one
:class:`Q`, or a tuple of them to be sent together — and is sent back the rows. It never touches
a connection, so the same function runs on SQLite (:mod:`sqlite3`), on PostgreSQL through a
blocking :mod:`psycopg` connection, and on PostgreSQL through an asyncio one::

    def begin_tx(sql, ...) -> Tx[AttemptRecord]:
        [run] = yield Q(sql.lock_run, {"run_id": ...})
        ...
        yield Flush((Q(sql.insert_attempt, values), Q(sql.begin_run, params)), commit=True)
        return record

The drivers open the transaction (``BEGIN IMMEDIATE`` on SQLite, so writers serialize up front;
``BEGIN`` on PostgreSQL, sent in the same round trip as the first statements), feed the
generator, and commit — on PostgreSQL the last writes and the ``COMMIT`` go as one pipeline, so
a begin or a settle costs two round trips. A driver's error leaves as the ledger error that
:mod:`ledger.storage.failure` names for it (a lost or refused connection is
:class:`~ledger.errors.DatabaseUnavailable`: retry-safe, the transaction was rolled back, or its
commit outcome is unknown and every write is idempotent per id). Statements are compiled once
per database from the schema (:mod:`ledger.storage.statements`) and executed through each
driver's public API, with named parameters on SQLite and positional ones on psycopg, which
prepares the repeated ones on the server. What differs between the databases is the driver
object itself: how it opens a transaction, how it sends statements.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import select
import sqlite3
import threading
import time
import weakref
from collections.abc import AsyncIterator, Generator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ledger.storage.failure import driver_error

if TYPE_CHECKING:
    from ledger.storage.statements import Stmt

T = TypeVar("T")
Row = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Q:
    """One statement and its parameters by name (a mapping); ``many``: a sequence of them,
    the statement run once per mapping (no rows). A fused statement
    (:class:`~ledger.storage.statements.Fused`) takes the writes it fuses instead."""

    stmt: Stmt
    params: Any = ()
    many: bool = False


@dataclass(frozen=True, slots=True)
class Flush:
    """Statements sent together (one round trip on PostgreSQL); ``commit`` ends the
    transaction with them. The generator is sent one list of rows per statement."""

    items: tuple[Q, ...]
    commit: bool = False


Step = Q | Flush
Tx = Generator[Step, Any, T]


class Driver(Protocol):
    """What a store needs of its hot-path driver (:class:`SqliteDriver`, :class:`PgDriver`)."""

    def run(self, tx: Tx[T], *, write: bool) -> T:
        """Run the transaction function ``tx`` on a blocking connection; returns its value."""
        ...

    async def arun(self, tx: Tx[T], *, write: bool) -> T:
        """Run ``tx`` for an asyncio caller."""
        ...

    def close(self) -> None:
        """Close every connection the driver holds."""
        ...


# -- SQLite ------------------------------------------------------------------------------------

SQLITE_BUSY_TIMEOUT_S = 30.0


class SqliteDriver:
    """One :mod:`sqlite3` connection per thread (WAL, ``synchronous=FULL``), transactions
    opened with ``BEGIN IMMEDIATE`` for writes.

    Async callers' transactions run on one dedicated thread of this database, never on the
    event loop: a write waits for another process's write lock for up to the busy timeout, and
    the loop must keep running meanwhile. One thread is enough (SQLite serializes writers), and
    its connection stays warm.
    """

    def __init__(self, path: str, *, busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s,
                                       isolation_level=None, check_same_thread=False,
                                       cached_statements=256)
            except sqlite3.Error as e:
                raise driver_error(e, self.path) from e
            try:
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = FULL")
                conn.execute("PRAGMA foreign_keys = ON")
            except sqlite3.Error as e:
                conn.close()
                raise driver_error(e, self.path) from e
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def run(self, tx: Tx[T], *, write: bool) -> T:
        """Run ``tx`` in one transaction (``BEGIN IMMEDIATE`` when it writes)."""
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = self._feed(conn, tx)
            except BaseException:
                _rollback(conn)
                raise
            if conn.in_transaction:
                conn.execute("COMMIT")
            return result
        except sqlite3.Error as e:
            _rollback(conn)
            raise driver_error(e, self.path) from e

    def _feed(self, conn: sqlite3.Connection, tx: Tx[T]) -> T:
        value: Any = None
        while True:
            try:
                step = tx.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(step, Q):
                value = _sqlite_exec(conn, step)
            else:
                value = [_sqlite_exec(conn, q) for q in step.items]
                if step.commit:
                    conn.execute("COMMIT")

    async def arun(self, tx: Tx[T], *, write: bool) -> T:
        """Run ``tx`` on the database's own thread; the event loop waits without blocking."""
        with self._lock:
            if self._writer is None:
                self._writer = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="ledger-sqlite")
            writer = self._writer
        return await asyncio.get_running_loop().run_in_executor(
            writer, functools.partial(self.run, tx, write=write))

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)
        for c in conns:
            with contextlib.suppress(sqlite3.Error):  # closing is best effort
                c.close()
        self._local = threading.local()


def _sqlite_exec(conn: sqlite3.Connection, q: Q) -> list[Row]:
    # Named parameters: sqlite3 reads them from the transaction's own mapping.
    if q.many:
        conn.executemany(q.stmt.text, q.params)
        return []
    return conn.execute(q.stmt.text, q.params).fetchall()


def _rollback(conn: sqlite3.Connection) -> None:
    """End a failed transaction; a rollback that fails too (the file went away) leaves the
    connection to SQLite, which rolls back on its own, and the first error is the one told."""
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


# -- PostgreSQL --------------------------------------------------------------------------------


class PgDriver:
    """psycopg 3 connections from a small pool, blocking and asyncio, in autocommit mode with
    the transaction's ``BEGIN`` and ``COMMIT`` pipelined with its statements."""

    def __init__(self, conninfo: str, *, where: str, max_size: int = 10) -> None:
        self.conninfo = conninfo
        self.where = where
        self.max_size = max_size
        self._idle: list[Any] = []
        self._aidle: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Any]] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    # -- blocking

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        import psycopg

        conn = None
        while conn is None:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                try:
                    conn = psycopg.connect(self.conninfo, autocommit=True)
                except psycopg.Error as e:
                    raise driver_error(e, self.where) from e
            elif not _alive(conn):
                conn = None  # the server dropped it while it was idle: take another
        try:
            yield conn
        finally:
            # Only a connection outside any transaction goes back (errors were rolled back).
            if not conn.closed and conn.info.transaction_status == 0:
                with self._lock:
                    if len(self._idle) < self.max_size:
                        conn._ledger_idle_since = time.monotonic()
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
                    self._after_error(conn)
                    raise driver_error(e, self.where) from e
                raise

    def _after_error(self, conn: Any) -> None:
        """A connection the server dropped: the idle ones are as suspect, so they go too."""
        if not conn.closed:
            return
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            with contextlib.suppress(Exception):  # closing a dead connection is best effort
                c.close()
        # Async connections belong to their loops; they are dropped the same way.
        self._aidle = weakref.WeakKeyDictionary()

    def _feed(self, conn: Any, tx: Tx[T]) -> T:
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
                    stmt = q.stmt
                    if q.many:
                        cur.executemany(stmt.text, [stmt.args(r) for r in q.params])
                    else:
                        cur.execute(stmt.text, stmt.args(q.params))
                    cursors.append((cur, stmt.rows and not q.many))
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
        conn = None
        while conn is None:
            conn = idle.pop() if idle else None
            if conn is None:
                try:
                    conn = await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True)
                except psycopg.Error as e:
                    raise driver_error(e, self.where) from e
            elif not await _aalive(conn):
                conn = None  # the server dropped it while it was idle: take another
        try:
            yield conn
        finally:
            if not conn.closed and conn.info.transaction_status == 0 and \
                    len(idle) < self.max_size:
                conn._ledger_idle_since = time.monotonic()
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
                    self._after_error(conn)
                    raise driver_error(e, self.where) from e
                raise

    async def _afeed(self, conn: Any, tx: Tx[T]) -> T:
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
                    stmt = q.stmt
                    if q.many:
                        await cur.executemany(stmt.text, [stmt.args(r) for r in q.params])
                    else:
                        await cur.execute(stmt.text, stmt.args(q.params))
                    cursors.append((cur, stmt.rows and not q.many))
                if commit:
                    await conn.execute("COMMIT")
            first = False
            committed = committed or commit
            rows = [await cur.fetchall() if fetch else [] for cur, fetch in cursors]
            value = rows[0] if isinstance(step, Q) else rows

    def close(self) -> None:
        with self._lock:
            conns, self._idle = self._idle, []
        for c in conns:
            c.close()
        # Async connections belong to the loop that made them; dropping them lets the loop's
        # shutdown close their sockets.
        self._aidle = weakref.WeakKeyDictionary()


# A connection idle longer than this is checked (one round trip) before it is used again: a
# dropped socket shows up there, not as a failed transaction. One used more recently (a busy
# worker's) costs one poll of its socket: an idle connection has nothing to read, so anything
# there (a server's goodbye, an end of file) means it is gone.
IDLE_CHECK_S = 1.0


def _told_goodbye(conn: Any) -> bool:
    """Whether the server wrote to, or closed, a connection nobody is using."""
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _alive(conn: Any) -> bool:
    """Whether a pooled connection still works (checked only after it idled a while)."""
    import psycopg

    if conn.closed or _told_goodbye(conn):
        with contextlib.suppress(Exception):
            conn.close()
        return False
    if time.monotonic() - getattr(conn, "_ledger_idle_since", 0.0) < IDLE_CHECK_S:
        return True
    try:
        conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        with contextlib.suppress(Exception):
            conn.close()
        return False


async def _aalive(conn: Any) -> bool:
    """:func:`_alive` for an asyncio connection."""
    import psycopg

    if conn.closed or _told_goodbye(conn):
        with contextlib.suppress(Exception):
            await conn.close()
        return False
    if time.monotonic() - getattr(conn, "_ledger_idle_since", 0.0) < IDLE_CHECK_S:
        return True
    try:
        await conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        with contextlib.suppress(Exception):
            await conn.close()
        return False


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


__all__ = ["Driver", "Flush", "PgDriver", "Q", "SqliteDriver", "Tx"]
