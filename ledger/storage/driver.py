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
a begin or a settle costs two round trips. A driver's error leaves as the ledger error that
:mod:`ledger.storage.failure` names for it (a lost or refused connection is
:class:`~ledger.errors.DatabaseUnavailable`: retry-safe, the transaction was rolled back, or its
commit outcome is unknown and every write is idempotent per id; a connection lost once its
``COMMIT`` may have reached the server is told with ``fields["commit"] = "unknown"``, for the
store to resolve under the Run's row lock). Statements are plain SQL
strings executed through each driver's public API; psycopg prepares the repeated ones on the
server. What differs between the databases is the driver object itself: how it opens a
transaction, how it spells a parameter (:class:`Statements`), how it sends statements.
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
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ledger.errors import DatabaseUnavailable, LedgerError
from ledger.storage.failure import driver_error

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


def named(sql: str) -> tuple[str, tuple[str, ...]]:
    """``:name`` placeholders as :mod:`sqlite3` takes them: unchanged, with a mapping."""
    return sql, ()


def positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """``:name`` placeholders as positional ``%s`` for psycopg (a sequence of values costs the
    driver less than a mapping to reorder), and the names in order."""
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
    """The SQL of one driver, converted once by ``convert`` (:func:`named` or
    :func:`positional`): ``stmts.get(sql)`` is what the driver executes, the parameter names in
    order (positional drivers), and whether it returns rows (only those are fetched: describing
    a result costs the client work)."""

    def __init__(self, convert: Callable[[str], tuple[str, tuple[str, ...]]]) -> None:
        self._convert = convert
        self._cache: dict[str, tuple[str, tuple[str, ...], bool]] = {}
        self._lock = threading.Lock()

    def get(self, sql: str) -> tuple[str, tuple[str, ...], bool]:
        """The driver's text of ``sql``, its parameter names in order, whether it has rows."""
        out = self._cache.get(sql)
        if out is None:
            head = sql.lstrip()[:6].upper().rstrip()
            text, names = self._convert(sql)
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
        self.stmts = Statements(named)

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


def _sqlite_exec(conn: sqlite3.Connection, sql: str, q: Q) -> list[Row]:
    if q.many:
        conn.executemany(sql, q.params)
        return []
    return conn.execute(sql, q.params).fetchall()


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
        self.stmts = Statements(positional)
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

        committing = _Committing(write)
        with self._connection() as conn:
            try:
                return self._feed(conn, tx, committing)
            except BaseException as e:
                lost = conn.closed
                _abort(conn)
                if isinstance(e, psycopg.Error):
                    self._after_error(conn)
                    raise committing.told(driver_error(e, self.where), lost) from e
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

    def _feed(self, conn: Any, tx: Tx[T], committing: _Committing) -> T:
        stmts = self.stmts
        value: Any = None
        first = True
        committed = False
        while True:
            try:
                step = tx.send(value)
            except StopIteration as stop:
                if not first and not committed:
                    committing.sent = True
                    conn.execute("COMMIT")
                return stop.value  # type: ignore[no-any-return]
            items = (step,) if isinstance(step, Q) else step.items
            commit = isinstance(step, Flush) and step.commit
            committing.sent = commit
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

        committing = _Committing(write)
        async with self._aconnection() as conn:
            try:
                return await self._afeed(conn, tx, committing)
            except BaseException as e:
                lost = conn.closed
                await _aabort(conn)
                if isinstance(e, psycopg.Error):
                    self._after_error(conn)
                    raise committing.told(driver_error(e, self.where), lost) from e
                raise

    async def _afeed(self, conn: Any, tx: Tx[T], committing: _Committing) -> T:
        stmts = self.stmts
        value: Any = None
        first = True
        committed = False
        while True:
            try:
                step = tx.send(value)
            except StopIteration as stop:
                if not first and not committed:
                    committing.sent = True
                    await conn.execute("COMMIT")
                return stop.value  # type: ignore[no-any-return]
            items = (step,) if isinstance(step, Q) else step.items
            commit = isinstance(step, Flush) and step.commit
            committing.sent = commit
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

    def close(self) -> None:
        with self._lock:
            conns, self._idle = self._idle, []
        for c in conns:
            c.close()
        # Async connections belong to the loop that made them; dropping them lets the loop's
        # shutdown close their sockets.
        self._aidle = weakref.WeakKeyDictionary()


class _Committing:
    """Whether a writing transaction's ``COMMIT`` was handed to the connection (``sent``).

    A connection lost after that leaves the outcome unknown: the server may have received the
    ``COMMIT`` and made it durable, or not, and only a read under the Run's row lock, once the
    server has finished with the old connection, can tell (:mod:`ledger.storage.store`). A
    read's outcome needs no telling.
    """

    __slots__ = ("sent", "write")

    def __init__(self, write: bool) -> None:
        self.write = write
        self.sent = False

    def told(self, err: LedgerError, lost: bool) -> LedgerError:
        """``err``, marked ``commit="unknown"`` when the connection was lost mid-COMMIT."""
        if self.write and self.sent and lost and isinstance(err, DatabaseUnavailable):
            err.fields["commit"] = "unknown"
        return err


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


__all__ = ["Driver", "Flush", "PgDriver", "Q", "SqliteDriver", "Statements", "Tx", "named",
           "positional"]
