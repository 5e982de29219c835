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
commit outcome is unknown and every write is idempotent per id). Such an error raised once a
write's ``COMMIT`` was handed to the connection is told with ``fields["commit"] = "unknown"``,
for the store to resolve under the Run's row lock, unless it is the server's answer to a
statement of the transaction on a connection it still serves (a SQLSTATE of severity
``ERROR``: a serialization failure, a deadlock): a lost connection, and also a session the
server terminated while psycopg had not yet seen the connection end (a ``FATAL``, or
``cannot exit pipeline mode while busy``), since the ``COMMIT`` may have been carried out
before it. An exception that is not the driver's raised while the ``COMMIT``'s answer is
awaited (an interruption: ``KeyboardInterrupt``, ``asyncio.CancelledError``) is raised
unchanged, never swallowed nor turned into a ledger error, with a note saying that the write's
outcome is unknown and that the same call again (the same ids) learns it: no resolution runs
before an interruption reaches its caller. Statements are compiled once
per database from the schema (:mod:`ledger.storage.statements`) and executed through each
driver's public API, with named parameters on SQLite and positional ones on psycopg, which
prepares the repeated ones on the server. What differs between the databases is the driver
object itself: how it gets a connection, how it opens a transaction, how it sends statements.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ledger.errors import DatabaseUnavailable, LedgerError
from ledger.forking import abandon, renew_in_child
from ledger.storage.failure import closed_error, driver_error, stale_plan, standby_error
from ledger.storage.groupcommit import GroupWriter

if TYPE_CHECKING:
    from ledger.storage.pgpool import PgPool

T = TypeVar("T")
Row = tuple[Any, ...]
log = logging.getLogger("ledger.storage")


class Statement(Protocol):
    """What a driver needs of a statement (:class:`~ledger.storage.statements.Stmt` is one):
    said here, so that the statements depend on the driver's steps and not the other way."""

    @property
    def text(self) -> str:
        """The SQL, in the driver's parameter style."""

    @property
    def rows(self) -> bool:
        """Whether it returns rows (only those are fetched)."""

    def args(self, params: Any) -> list[Any]:
        """The positional values of ``params``."""


@dataclass(frozen=True, slots=True)
class Q:
    """One statement and its parameters by name (a mapping); ``many``: a sequence of them,
    the statement run once per mapping (no rows). A fused statement
    (:class:`~ledger.storage.statements.Fused`) takes the writes it fuses instead."""

    stmt: Statement
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

    def run(self, tx: Tx[T], *, write: bool, again: Callable[[], Tx[T]] | None = None) -> T:
        """Run the transaction function ``tx`` on a blocking connection; returns its value.
        ``again``: the same transaction made anew, for a run from its start once more
        (:class:`PgDriver`)."""
        ...

    async def arun(self, tx: Tx[T], *, write: bool,
                   again: Callable[[], Tx[T]] | None = None) -> T:
        """Run ``tx`` for an asyncio caller."""
        ...

    def close(self) -> None:
        """Close every connection the driver holds."""
        ...


# -- SQLite ------------------------------------------------------------------------------------

SQLITE_BUSY_TIMEOUT_S = 30.0
# A transaction's wait for the write lock shortened by less than this waits the whole busy
# timeout: on an uncontended database a queued transaction has lost a few milliseconds, and
# setting the busy timeout around its BEGIN would cost two statements per group (each value
# its own text, crowding the connection's statement cache) for nothing a caller could see.
SQLITE_WAIT_SLACK_MS = 50


class SqliteDriver:
    """One :mod:`sqlite3` connection per live thread (WAL, ``synchronous=FULL``), transactions
    opened with ``BEGIN IMMEDIATE`` for writes. A thread's connection is closed once the thread
    has ended, when another opens one (:meth:`connection`) or at :meth:`close` (one a
    transaction runs on then: by its thread, when the transaction ends).

    Async callers' writes run on one dedicated thread of this database, never on the event
    loop: a write waits for another process's write lock for up to the busy timeout, and the
    loop must keep running meanwhile. One thread is enough (SQLite serializes writers), its
    connection stays warm, and the transactions that queue on it while it is busy commit
    together (:mod:`ledger.storage.groupcommit`). The busy timeout there counts from when the
    caller submitted its transaction, its time queued behind others included: one queued
    behind a write stuck on the lock does not start a busy timeout of its own.

    Async callers' reads (``write=False``) run on that thread when it is idle (its connection
    is warm), else on a second thread of this database with its own connection, where those
    queued together share one read transaction: in WAL mode a read takes no write lock, so it
    never waits behind a write stuck on another process's lock, nor is told ``database is
    locked`` with it. A caller that awaited its write sees it in its next
    read (the write's future is done once committed).
    """

    def __init__(self, path: str, *, busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._busy_ms = int(busy_timeout_s * 1000)
        self._local = threading.local()
        # Each connection with the thread it is that thread's own: one of a thread that has
        # ended is closed when the next thread opens one (see connection()).
        self._all: list[tuple[threading.Thread, sqlite3.Connection]] = []
        self._lock = threading.Lock()
        self._writer: GroupWriter | None = None
        self._reader: GroupWriter | None = None
        self._closed = False
        # The connections a transaction runs on now: close() leaves each to its thread, which
        # closes it when the transaction ends (closing a connection another thread is
        # executing on can crash the process).
        self._using: set[sqlite3.Connection] = set()
        renew_in_child(self)

    def _forked(self) -> None:
        """In a forked child: SQLite forbids using a connection opened before the fork, and
        closing one may roll back or checkpoint under the parent's, so each is abandoned
        (:mod:`ledger.forking`) with the parent's writer and reader threads; this process
        opens its own connections, and starts its own threads, on first use."""
        abandon(self._all, self._writer, self._reader, getattr(self._local, "conn", None))
        self._local = threading.local()
        self._all = []
        self._writer = self._reader = None
        self._using = set()
        self._lock = threading.Lock()

    def connection(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use (never once the driver closed).

        Opening one closes those of the threads that have ended since: a process that serves
        each request on a thread of its own holds one connection per live thread (plus those
        ended since the last one was opened), not one per thread it ever ran."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise closed_error(self.path)
            try:
                conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s,
                                       isolation_level=None, check_same_thread=False,
                                       cached_statements=256)
            except sqlite3.Error as e:
                raise driver_error(e, self.path) from e
            try:
                conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
                switch_to_wal(conn, self.busy_timeout_s)
                conn.execute("PRAGMA synchronous = FULL")
                conn.execute("PRAGMA foreign_keys = ON")
            except sqlite3.Error as e:
                conn.close()
                raise driver_error(e, self.path) from e
            ended: list[sqlite3.Connection] = []
            with self._lock:
                # A close() between the check above and here took the list already: a
                # connection added now would be closed by nobody.
                closed = self._closed
                if not closed:
                    # An ended thread's thread-local is gone with it, so nothing can use its
                    # connection again; left here it would hold its file descriptors until
                    # close(). A thread that is not alive never runs again (its object is
                    # kept, not its ident, which a new thread may reuse).
                    kept = [(threading.current_thread(), conn)]
                    for t, c in self._all:
                        if t.is_alive():
                            kept.append((t, c))
                        else:
                            ended.append(c)
                    self._all = kept
            for c in ended:  # opened with check_same_thread=False: any thread may close it
                with contextlib.suppress(sqlite3.Error):
                    c.close()
            if closed:
                conn.close()
                raise closed_error(self.path)
            self._local.conn = conn
        return conn

    def begin(self, conn: sqlite3.Connection, *, write: bool, wait_s: float | None = None
              ) -> None:
        """Open a transaction on ``conn`` (``BEGIN IMMEDIATE`` when it writes), waiting for
        another connection's write lock at most ``wait_s`` seconds (the busy timeout when
        ``None``, never longer; within :data:`SQLITE_WAIT_SLACK_MS` of it, the busy timeout);
        raises :mod:`sqlite3`'s error, ``database is locked`` when the wait runs out."""
        sql = "BEGIN IMMEDIATE" if write else "BEGIN"
        # Rounded up: the wait ends at its deadline, not a millisecond before it.
        ms = self._busy_ms if wait_s is None else min(self._busy_ms, math.ceil(wait_s * 1000))
        # A deferred BEGIN takes no lock to wait for.
        if not write or ms > self._busy_ms - SQLITE_WAIT_SLACK_MS:
            conn.execute(sql)
            return
        conn.execute(f"PRAGMA busy_timeout = {ms}")
        try:
            conn.execute(sql)
        finally:
            # The shorter wait is the BEGIN's only: what the connection runs outside a
            # transaction (past a commit point) waits the busy timeout as always. Failing here,
            # the connection is broken and the BEGIN's own error (if any) is the one told.
            with contextlib.suppress(sqlite3.Error):
                conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")

    def run(self, tx: Tx[T], *, write: bool, again: Callable[[], Tx[T]] | None = None,
            wait_s: float | None = None) -> T:
        """Run ``tx`` in one transaction (``BEGIN IMMEDIATE`` when it writes), waiting for
        another connection's write lock at most ``wait_s`` (:meth:`begin`). ``again`` is not
        needed: SQLite prepares nothing that a migration can leave stale."""
        conn = self.connection()
        with self._lock:
            if self._closed:  # its connection is closed, or about to be
                raise closed_error(self.path)
            self._using.add(conn)
        try:
            try:
                self.begin(conn, write=write, wait_s=wait_s)
                result = _feed(conn, tx, None)
                if conn.in_transaction:
                    conn.execute("COMMIT")
            except BaseException:
                # Whatever cuts the transaction short, an interruption landing after its BEGIN
                # or as its COMMIT is sent included, ends it here: left open, the thread's
                # connection would hold the write lock every other writer waits for, and its
                # next BEGIN would be refused.
                _rollback(conn)
                raise
            return result
        except sqlite3.Error as e:
            raise driver_error(e, self.path) from e
        finally:
            with self._lock:
                self._using.discard(conn)
                orphaned = self._closed
            if orphaned:  # the close left it to this thread
                with contextlib.suppress(sqlite3.Error):
                    conn.close()

    def finish(self, conn: sqlite3.Connection, tx: Tx[T], value: Any) -> T:
        """Feed ``tx`` from ``value`` to its end outside a transaction of this driver (a group
        member past its commit point), its SQLite errors told as the ledger's."""
        try:
            return _feed(conn, tx, value)
        except sqlite3.Error as e:
            raise driver_error(e, self.path) from e

    @staticmethod
    def advance(conn: sqlite3.Connection, tx: Tx[Any], value: Any) -> tuple[bool, Any]:
        """Feed ``tx`` from ``value`` until it ends, ``(True, its result)``, or has run a
        committing flush, ``(False, that flush's rows)``: the commit is the caller's."""
        return _advance(conn, tx, value)

    @staticmethod
    def rollback(conn: sqlite3.Connection) -> None:
        """End a failed transaction, if one is open (the first error is the one told)."""
        _rollback(conn)

    def told(self, e: BaseException) -> BaseException:
        """``e`` as a caller hears it: a SQLite error as the ledger error it means."""
        if not isinstance(e, sqlite3.Error):
            return e
        err = driver_error(e, self.path)
        err.__cause__ = e
        return err

    async def arun(self, tx: Tx[T], *, write: bool,
                   again: Callable[[], Tx[T]] | None = None) -> T:
        """Run ``tx`` on the database's own thread, grouped with the transactions queued with
        it there (:mod:`ledger.storage.groupcommit`), or a read on its reading thread when the
        own one is busy; the event loop waits without blocking."""
        with self._lock:
            if self._closed:
                raise closed_error(self.path)
            if self._writer is None:
                self._writer = GroupWriter(self)
            writer = self._writer
            if not write and self._reader is None:
                self._reader = GroupWriter(self, name="ledger-sqlite-read")
            reader = self._reader
        try:
            if write:
                future = writer.submit(tx, write)
            else:
                assert reader is not None
                # On the idle writer's thread a read runs at once on a warm connection (one of
                # its own finds its page cache stale after every write); behind a busy one it
                # would wait for the write lock the writer waits for, though a WAL reader
                # needs none: then it goes to the reading thread.
                future = writer.submit_if_idle(tx, write) or reader.submit(tx, write)
        except RuntimeError:  # the thread was shut down by a close meanwhile
            if self._closed:
                raise closed_error(self.path) from None
            raise
        result: T = await asyncio.wrap_future(future, loop=asyncio.get_running_loop())
        return result

    def close(self) -> None:
        """Close every connection, for good; one a transaction runs on now is closed by its
        own thread when the transaction ends (:meth:`run`)."""
        with self._lock:
            self._closed = True
            conns, self._all = self._all, []
            writer, self._writer = self._writer, None
            reader, self._reader = self._reader, None
        if writer is not None:
            writer.close()  # waits for its thread: its connection is idle after
        if reader is not None:
            reader.close()
        with self._lock:
            idle = [c for _, c in conns if c not in self._using]
        for c in idle:
            with contextlib.suppress(sqlite3.Error):  # closing is best effort
                c.close()
        self._local = threading.local()


# How often a first connection asks for WAL when the switch meets another (:func:`switch_to_wal`).
_WAL_ASKS = 6


def switch_to_wal(conn: sqlite3.Connection, busy_timeout_s: float) -> None:
    """Put the file in WAL mode (a no-op read once it is), for a new connection whose busy
    timeout is ``busy_timeout_s``.

    The switch reads the file's header under a shared lock, then takes the exclusive one.
    Connections of a file not yet in WAL that switch at once each hold the shared lock and
    wait for the other's: SQLite answers one of them "database is locked" at once, without
    its busy wait (it would never end). By then another is switching the file, so asked
    again the connection waits for that switch (it holds no lock now) and finds WAL. A few
    asks, not one, each after a pause of up to a millisecond or two drawn at random: of four at
    once, asked again in step, one met the others three times in a row (once in 600 first
    connections, on a loaded machine). Only an answer that came back before half the busy
    timeout is asked again: one that waited it out is a lock held that long, which the caller
    is told of after one timeout, not several.
    """
    for left in range(_WAL_ASKS - 1, -1, -1):
        started = time.monotonic()
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            waited = time.monotonic() - started
            if left == 0 or getattr(e, "sqlite_errorname", "") != "SQLITE_BUSY" \
                    or waited >= busy_timeout_s / 2:
                raise
        time.sleep(random.uniform(0, 0.002))  # out of step with the others switching


def _advance(conn: sqlite3.Connection, tx: Tx[Any], value: Any) -> tuple[bool, Any]:
    while True:
        try:
            step = tx.send(value)
        except StopIteration as stop:
            return True, stop.value
        if isinstance(step, Q):
            value = _sqlite_exec(conn, step)
        else:
            value = [_sqlite_exec(conn, q) for q in step.items]
            if step.commit:
                return False, value


def _feed(conn: sqlite3.Connection, tx: Tx[T], value: Any) -> T:
    while True:
        done, value = _advance(conn, tx, value)
        if done:
            return value  # type: ignore[no-any-return]
        conn.execute("COMMIT")


def _sqlite_exec(conn: sqlite3.Connection, q: Q) -> list[Row]:
    # Named parameters: sqlite3 reads them from the transaction's own mapping.
    if q.many:
        conn.executemany(q.stmt.text, q.params)
        return []
    return conn.execute(q.stmt.text, q.params).fetchall()


def _rollback(conn: sqlite3.Connection) -> None:
    """End a failed transaction; a rollback that fails too (the file went away) leaves the
    connection to SQLite, which rolls back on its own, and the first error is the one told."""
    # A closed connection raises on reading in_transaction too, which would hide the first.
    with contextlib.suppress(sqlite3.Error):
        if conn.in_transaction:
            conn.execute("ROLLBACK")


# -- PostgreSQL --------------------------------------------------------------------------------


class PgDriver:
    """psycopg 3 connections of the store's pool (:class:`~ledger.storage.pgpool.PgPool`),
    blocking and asyncio, in autocommit mode with the transaction's ``BEGIN`` and ``COMMIT``
    pipelined with its statements.

    A transaction that fails leaves no transaction open on its connection (it is rolled back)
    or closes it; a connection that ends closed, whether the server or the network closed it
    or the abort had to, goes back as a dropped one (:meth:`PgPool.lost
    <ledger.storage.pgpool.PgPool.lost>`: its idle neighbours are drained), read in one place
    for both drivers (:class:`_Failed`). A transaction refused for a statement prepared before a
    migration changed what it returns runs once more from its start on its own connection,
    which let go of what it had prepared (:class:`_Start`)."""

    def __init__(self, pool: PgPool) -> None:
        self.pool = pool
        self.where = pool.where

    def run(self, tx: Tx[T], *, write: bool, again: Callable[[], Tx[T]] | None = None) -> T:
        import psycopg

        from ledger.storage.pgpool import release

        start = _Start(again)
        try:
            conn = self.pool.checkout()
        except psycopg.Error as e:
            raise driver_error(e, self.where) from e
        dropped = False
        try:
            while True:
                committing = _Committing(write)
                try:
                    return self._feed(conn, tx, committing, start)
                except BaseException as e:
                    failed = _Failed(e, conn, committing)  # before the abort ends what it reads
                    _abort(conn, forget=failed.stale)
                    failed.ask(conn)
                    dropped = failed.dropped(conn)
                    told = failed.told(conn, self.where)
                    if not dropped and start.again(told, self.where):
                        tx = start.restart(tx)
                        continue
                    if told is e:
                        raise
                    raise told from e
        finally:
            if dropped:
                self.pool.lost(conn)  # the idle ones beside it are as suspect
            else:
                release(conn)

    def _feed(self, conn: Any, tx: Tx[T], committing: _Committing, start: _Start) -> T:
        value: Any = None
        first = True
        committed = False
        while True:
            try:
                step = start.step_of(tx, value, first)
            except StopIteration as stop:
                if not first and not committed:
                    committing.sent = True
                    conn.execute("COMMIT")
                return stop.value  # type: ignore[no-any-return]
            items = (step,) if isinstance(step, Q) else step.items
            commit = isinstance(step, Flush) and step.commit
            committing.sent, committing.done = commit, False
            kept = _kept_cursors(conn)
            # The cancels stop once the pipeline's exit returned (it exits first).
            with _Cancels(conn) as cancels, conn.pipeline():
                cursors: list[tuple[Any, bool]] = []
                try:
                    if first:
                        _cursor(conn, kept, _BEGIN, cursors).execute(_BEGIN)
                    for q in items:
                        stmt = q.stmt
                        cur = _cursor(conn, kept, stmt, cursors)
                        if q.many:
                            cur.executemany(stmt.text, [stmt.args(r) for r in q.params])
                        else:
                            cur.execute(stmt.text, stmt.args(q.params))
                        cursors.append((cur, stmt.rows and not q.many))
                    if commit:
                        _cursor(conn, kept, _COMMIT, cursors).execute(_COMMIT)
                except BaseException:
                    cancels.start()
                    raise
            committing.done = commit  # the pipeline's end read the COMMIT's answer
            first = False
            committed = start.committed = committed or commit
            rows = [cur.fetchall() if fetch else [] for cur, fetch in cursors]
            value = rows[0] if isinstance(step, Q) else rows
            start.fed = True

    # -- asyncio

    async def arun(self, tx: Tx[T], *, write: bool,
                   again: Callable[[], Tx[T]] | None = None) -> T:
        import psycopg

        from ledger.storage.pgpool import arelease

        start = _Start(again)
        try:
            conn = await self.pool.acheckout()
        except psycopg.Error as e:
            raise driver_error(e, self.where) from e
        dropped = False
        try:
            while True:
                committing = _Committing(write)
                try:
                    return await self._afeed(conn, tx, committing, start)
                except BaseException as e:
                    failed = _Failed(e, conn, committing)
                    await _aabort(conn, forget=failed.stale)
                    await failed.aask(conn)
                    dropped = failed.dropped(conn)
                    told = failed.told(conn, self.where)
                    if not dropped and start.again(told, self.where):
                        tx = start.restart(tx)
                        continue
                    if told is e:
                        raise
                    raise told from e
        finally:
            if dropped:
                await self.pool.alost(conn)
            else:
                await arelease(conn)

    async def _afeed(self, conn: Any, tx: Tx[T], committing: _Committing, start: _Start
                     ) -> T:
        value: Any = None
        first = True
        committed = False
        while True:
            try:
                step = start.step_of(tx, value, first)
            except StopIteration as stop:
                if not first and not committed:
                    committing.sent = True
                    await conn.execute("COMMIT")
                return stop.value  # type: ignore[no-any-return]
            items = (step,) if isinstance(step, Q) else step.items
            commit = isinstance(step, Flush) and step.commit
            committing.sent, committing.done = commit, False
            kept = _kept_cursors(conn)
            async with _ACancels(conn) as cancels, conn.pipeline():
                cursors: list[tuple[Any, bool]] = []
                try:
                    if first:
                        await _cursor(conn, kept, _BEGIN, cursors).execute(_BEGIN)
                    for q in items:
                        stmt = q.stmt
                        cur = _cursor(conn, kept, stmt, cursors)
                        if q.many:
                            await cur.executemany(stmt.text, [stmt.args(r) for r in q.params])
                        else:
                            await cur.execute(stmt.text, stmt.args(q.params))
                        cursors.append((cur, stmt.rows and not q.many))
                    if commit:
                        await _cursor(conn, kept, _COMMIT, cursors).execute(_COMMIT)
                except BaseException:
                    await cancels.start()
                    raise
            committing.done = commit  # the pipeline's end read the COMMIT's answer
            first = False
            committed = start.committed = committed or commit
            rows = [await cur.fetchall() if fetch else [] for cur, fetch in cursors]
            value = rows[0] if isinstance(step, Q) else rows
            start.fed = True

    def close(self) -> None:
        self.pool.close()


_BEGIN = "BEGIN"
_COMMIT = "COMMIT"


def _kept_cursors(conn: Any) -> dict[Any, Any]:
    """The cursors kept on ``conn`` for the hot path, one per statement (and for ``BEGIN``
    and ``COMMIT``): making a cursor, and the adaptation state psycopg builds for it, costs
    the client more than executing a prepared statement on one that ran it before (psycopg
    keeps that state while a cursor runs the same query). They live and die with the
    connection."""
    kept: dict[Any, Any] | None = getattr(conn, "_ledger_cursors", None)
    if kept is None:
        kept = conn._ledger_cursors = {}
    return kept


def _cursor(conn: Any, kept: dict[Any, Any], key: Any, busy: list[tuple[Any, bool]]) -> Any:
    """The kept cursor of ``key`` on ``conn``; a new one when this flush already uses it (a
    cursor holds one statement's result until the flush's rows are read)."""
    cur = kept.get(key)
    if cur is None:
        cur = kept[key] = conn.cursor()
    elif any(c is cur for c, _fetch in busy):
        return conn.cursor()
    return cur


class _Start:
    """What a PostgreSQL transaction needs to run once more from its start.

    The one rule: a transaction the server refused for a statement prepared before a migration
    changed what it returns (``schema_changed``) was rolled back whole, the server answering a
    statement of it (a ``COMMIT`` whose outcome is unknown is not this), and the abort let go
    of what its connection had prepared (:func:`_abort`). So unless an earlier step of it
    committed, nothing of it happened, and it runs once more from its start on that same
    connection, now clean: every transaction function is written to have no effect outside the
    database between its steps (it only yields statements and computes on their rows), so
    running it again is sound. Until the function has been sent rows it waits at its first
    ``yield`` as it did when that step was first sent, so the step itself is sent again;
    past that the function is made anew (``again``, which the runner gives for every
    transaction of a flow). Once only: a refusal on the clean connection is told
    (:class:`~ledger.errors.DatabaseUnavailable`, retry-safe), as is one of a transaction
    that cannot be made anew (a caller of the driver itself, past the first step).
    """

    __slots__ = ("committed", "fed", "remake", "replayed", "step")

    def __init__(self, remake: Callable[[], Tx[Any]] | None) -> None:
        self.remake = remake
        self.step: Step | None = None
        self.fed = False
        self.committed = False
        self.replayed = False

    def step_of(self, tx: Tx[Any], value: Any, first: bool) -> Step:
        """The step to send next: ``tx``'s, sent ``value``, or its first one again."""
        if first and self.step is not None:
            return self.step
        step = tx.send(value)
        if first:
            self.step = step
        return step

    def again(self, err: BaseException, where: str) -> bool:
        """Whether the transaction is to run once more after ``err`` (see the class)."""
        if self.replayed or self.committed or self.step is None \
                or (self.fed and self.remake is None) \
                or not isinstance(err, DatabaseUnavailable) \
                or not err.fields.get("schema_changed") or err.fields.get("commit"):
            return False
        self.replayed = True
        log.warning("a migration changed the schema under a statement prepared on a "
                    "connection to %s; the transaction runs again from its start on that "
                    "connection, which let go of what it had prepared", where)
        return True

    def restart(self, tx: Tx[T]) -> Tx[T]:
        """The transaction to run again: ``tx`` itself when it was sent no rows yet (its first
        step is sent again), else the one made anew."""
        if not self.fed:
            return tx
        assert self.remake is not None  # again() said so
        tx.close()
        self.step, self.fed = None, False
        return self.remake()


class _Committing:
    """Whether a writing transaction's ``COMMIT`` was handed to the connection (``sent``), and
    whether its answer was read since (``done``: it committed).

    An error after that leaves the outcome unknown — the server may have received the
    ``COMMIT`` and made it durable, or not, and only a read under the Run's row lock, once the
    server has finished with the old connection, can tell (:mod:`ledger.storage.store`) —
    unless the server itself answered it for a statement of the transaction on a connection
    it still serves (:func:`_answered`), and the connection came out of the abort open: then
    nothing of it was committed (a serialization failure, a deadlock, a lock timeout). A
    read's outcome needs no telling.
    """

    __slots__ = ("done", "sent", "write")

    def __init__(self, write: bool) -> None:
        self.write = write
        self.sent = False
        self.done = False

    def told(self, err: LedgerError, answered: bool, conn: Any) -> LedgerError:
        """``err``, marked ``commit="unknown"`` when the ``COMMIT`` was sent and the error was
        not ``answered`` by the server (:func:`_answered`, read before the abort), or the
        abort had to close ``conn`` (it could not end the transaction on it)."""
        known = answered and not conn.closed
        if self.write and self.sent and not known and isinstance(err, DatabaseUnavailable):
            err.fields["commit"] = "unknown"
        return err

    def interrupted(self, e: BaseException, where: str) -> None:
        """Note on ``e``, an exception not of the driver (an interruption such as
        ``KeyboardInterrupt`` or ``asyncio.CancelledError``, or any other), that it came while
        the write's ``COMMIT`` had been sent and its answer not yet read, so the outcome is
        unknown; ``e`` itself is raised unchanged, never swallowed. (psycopg asks the server to
        cancel the statement it is interrupted in; the request may come after the ``COMMIT``
        was carried out.) One raised once the answer was read comes after a commit: it is the
        caller's, as anything raised past a commit point is.

        No resolution runs here: resolving is another transaction, which waits for the Run's
        row lock (up to the lock timeout, or for a database that is away) before the
        interruption would reach its caller. The turn and a Run session learn the outcome of
        their own writes themselves (the same write again, or shielded); a host's own call
        learns it by making the same call again (:data:`INTERRUPTED_NOTE`).
        """
        if not (self.write and self.sent) or self.done:
            return
        log.warning("a write's COMMIT was sent when %s interrupted it, on %s: whether it "
                    "committed is unknown", type(e).__name__, where)
        e.add_note(INTERRUPTED_NOTE)


#: The note an exception that is not the driver's carries when it came while a write's
#: ``COMMIT`` had been sent and its answer not yet read (:meth:`_Committing.interrupted`).
INTERRUPTED_NOTE = (
    "ledger: commit unknown: this write's COMMIT had been sent to PostgreSQL when the "
    "interruption came, so it may have committed or not. The ledger's turn and Run session "
    "resolve their own writes before the interruption reaches you; for a call of your own "
    "(begin_attempt, settle_attempt, acquire_lease, renew_lease, release_lease, finish_run, "
    "...) make the same call again with the same ids (the same attempt_id for a begin): it is "
    "the same write, found done or done now")


class _Failed:
    """A PostgreSQL transaction's error as the sync and the async driver read it, once: what
    it says is read before the abort ends what it reads, where the connection goes after it.
    """

    __slots__ = ("answered", "committing", "error", "read_only", "stale", "standby")

    def __init__(self, e: BaseException, conn: Any, committing: _Committing) -> None:
        import psycopg

        self.error = e
        self.committing = committing
        self.standby = isinstance(e, psycopg.Error) and _standby_refusal(e, conn)
        # A statement prepared before a migration changed its result: the abort lets go of
        # everything the connection prepared (the server keeps it past the transaction).
        self.stale = isinstance(e, psycopg.Error) and stale_plan(e)
        # A read-only transaction the server did not say it is a standby for: asked once the
        # abort has ended the transaction (ask, aask), whether it is a primary refusing this
        # role's writes (a set-up problem) or a failover's (retry-safe, as a standby's).
        self.read_only = not self.standby and getattr(e, "sqlstate", None) == "25006"
        self.answered = _answered(e, conn)

    def ask(self, conn: Any) -> None:
        """After the abort: tell a read-only transaction's refusal a standby's unless the
        server says this session may not write on the primary
        (:func:`~ledger.storage.pgpool.read_only_session`)."""
        from ledger.storage.pgpool import read_only_session

        if self.read_only and not read_only_session(conn):
            self.standby, self.read_only = True, False

    async def aask(self, conn: Any) -> None:
        """:meth:`ask` for an asyncio connection."""
        from ledger.storage.pgpool import aread_only_session

        if self.read_only and not await aread_only_session(conn):
            self.standby, self.read_only = True, False

    def dropped(self, conn: Any) -> bool:
        """Whether ``conn``, after the abort, goes as a dropped connection does
        (:meth:`~ledger.storage.pgpool.PgPool.lost`: the idle ones beside it are drained, the
        next checkout connects by itself): it ended closed, whether the server or the network
        closed it or the abort had to (``cannot exit pipeline mode while busy``, a connection
        still busy with a pipeline: the same server restart or termination may have ended its
        idle neighbours too), or its server is a standby.

        Not one that held a statement prepared before a migration changed what it returns: the
        abort let go of what it had prepared, and it serves on. Its neighbours are left be:
        each lets go of its own when the server refuses it such a statement, once, and
        draining the pool for each would close the fresh connections made since, once per
        connection that was in use when the schema changed."""
        return bool(self.standby or conn.closed)

    def told(self, conn: Any, where: str) -> BaseException:
        """What the caller is told (after the abort): a standby's refusal, the ledger error a
        driver error means (:meth:`_Committing.told`), or the exception itself, noted when it
        came while a write's ``COMMIT`` awaited its answer (:meth:`_Committing.interrupted`)."""
        import psycopg

        e = self.error
        if self.standby:
            return standby_error(e, where)
        if isinstance(e, psycopg.Error):
            return self.committing.told(driver_error(e, where), self.answered, conn)
        self.committing.interrupted(e, where)
        return e


# SQLSTATEs that end the session rather than answer a statement: a connection exception
# (class 08), and an administrator's or a shutdown's termination, a database dropped, an idle
# session timed out (57P01-57P05; not 57014, a cancelled statement).
_SESSION_ENDED = ("08", "57P")


def _answered(e: BaseException, conn: Any) -> bool:
    """Whether ``e`` is the server's answer to a statement of the transaction on ``conn``,
    which it still serves: an error with a SQLSTATE and severity ``ERROR``, the connection
    open and idle, in the transaction or in its failed one. Only such an error says that a
    ``COMMIT`` sent before it did not commit.

    Anything else leaves that unknown, also on a connection not yet seen closed: an error
    without a SQLSTATE (the connection lost, psycopg's own — with pipeline mode, a backend
    terminated around the ``COMMIT`` can surface as ``cannot exit pipeline mode while busy``
    while libpq has not yet read the end of the connection), a ``FATAL`` or ``PANIC`` (a
    terminated session, a shutdown: it may come after the ``COMMIT`` was carried out, in place
    of the answer to the pipeline's ``Sync``), one of the SQLSTATEs that end a session
    (:data:`_SESSION_ENDED`) whatever its severity says, and a connection still busy with the
    pipeline. A cancelled statement (``57014``, a statement timeout) is an answer: it is of
    severity ``ERROR``, and the transaction it ended was rolled back.
    """
    from psycopg.pq import TransactionStatus

    if conn.closed or not statement_answer(e):
        return False
    return conn.info.transaction_status in (
        TransactionStatus.IDLE, TransactionStatus.INTRANS, TransactionStatus.INERROR)


def statement_answer(e: BaseException) -> bool:
    """Whether ``e`` itself reads as the server's answer to a statement: a SQLSTATE that does
    not end the session (:data:`_SESSION_ENDED`), of severity ``ERROR``. What :func:`_answered`
    asks of the error; the state of the connection it came on is the caller's to add."""
    state = getattr(e, "sqlstate", None)
    if not state or state.startswith(_SESSION_ENDED):
        return False
    diag = getattr(e, "diag", None)
    severity = getattr(diag, "severity_nonlocalized", None) or getattr(diag, "severity", None)
    return severity == "ERROR"


def _standby_refusal(e: Any, conn: Any) -> bool:
    """Whether ``e`` is a write refused because ``conn``'s server is a standby (SQLSTATE
    25006 on a server in recovery), not because the database or the role is read-only."""
    from ledger.storage.pgpool import on_standby

    return getattr(e, "sqlstate", None) == "25006" and not conn.closed and on_standby(conn)


#: How long a cancel request may take (a new connection to the server) before it is given up.
CANCEL_TIMEOUT_S = 5.0
#: How long after a cancel request the next one is sent, while the pipeline has not ended;
#: doubled each time, up to :data:`CANCEL_AGAIN_MAX_S`.
CANCEL_AGAIN_S = 0.05
CANCEL_AGAIN_MAX_S = 1.0


def _cancel(conn: Any) -> None:
    """Ask the server to cancel what ``conn`` runs. Best effort: the transaction is aborted
    after it anyway, and a ``COMMIT`` already sent may still have been carried out (its
    outcome is unknown, as for any interruption of it)."""
    with contextlib.suppress(Exception):
        conn.cancel_safe(timeout=CANCEL_TIMEOUT_S)


async def _acancel(conn: Any) -> None:
    """:func:`_cancel` for an asyncio connection."""
    with contextlib.suppress(Exception):
        await conn.cancel_safe(timeout=CANCEL_TIMEOUT_S)


def _cancel_waits() -> Generator[float, None, None]:
    wait = CANCEL_AGAIN_S
    while True:
        yield wait
        wait = min(wait * 2, CANCEL_AGAIN_MAX_S)


class _Cancels:
    """Cancel requests for a pipeline left by an exception raised while it was being filled
    (an interruption landing in Python code, not in psycopg's wait, which would cancel it
    itself): its exit otherwise waits for every statement already sent, behind whatever lock
    holds one. :meth:`start` sends one at once, then sends them again, further and further
    apart, until the context (entered around the pipeline) exits.

    Once is not enough: a server that has not yet read the statements when the request
    comes finds its session idle, and ignores it; it reads them after and waits on the lock.
    A request still on its way once the pipeline has ended finds the session idle too, so
    none can cancel a later statement of the connection: the exit waits for the last one."""

    # Entered around every pipeline: nothing is made until an exception asks for it.
    _thread: threading.Thread | None = None

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def __enter__(self) -> _Cancels:
        return self

    def start(self) -> None:
        """Cancel now, and again until the exit."""
        _cancel(self.conn)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._again, name="ledger-cancel", daemon=True)
        self._thread.start()

    def _again(self) -> None:
        for wait in _cancel_waits():
            if self._stop.wait(wait):
                return
            _cancel(self.conn)

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()


class _ACancels:
    """:class:`_Cancels` for an asyncio connection (a task of its loop sends them again)."""

    _task: asyncio.Task[None] | None = None

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def __aenter__(self) -> _ACancels:
        return self

    async def start(self) -> None:
        """Cancel now, and again until the exit."""
        await _acancel(self.conn)
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._again())

    async def _again(self) -> None:
        for wait in _cancel_waits():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)
                return
            await _acancel(self.conn)

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            # Stopped between two requests, never in one (a request cut short may still
            # reach the server, later): waited for, as :class:`_Cancels` joins its thread.
            self._stop.set()
            await asyncio.wait({self._task})


def _abort(conn: Any, *, forget: bool = False) -> None:
    """Leave no transaction open on a connection going back to the pool (or close it);
    ``forget``: and nothing it prepared, through psycopg's own rollback, which always lets go
    of its statements, on the server too (``DEALLOCATE ALL``). A ``ROLLBACK`` statement lets go
    of them only when psycopg happens to read it as one (its cache counts it as a query), and
    the server keeps prepared statements past the transaction: a stale one would be refused
    again on the next transaction of the connection."""
    import psycopg
    from psycopg.pq import TransactionStatus

    from ledger.storage.pgpool import hard_close

    if conn.closed:
        return
    status = conn.info.transaction_status
    if status == TransactionStatus.IDLE and not forget:
        return
    if status in (TransactionStatus.IDLE, TransactionStatus.INTRANS,
                  TransactionStatus.INERROR):
        try:
            if not forget:
                conn.execute("ROLLBACK")
                return
            if status == TransactionStatus.IDLE:
                conn.execute("BEGIN")  # psycopg's rollback does nothing out of a transaction
            conn.rollback()
            return
        except psycopg.Error:
            pass
    hard_close(conn)


async def _aabort(conn: Any, *, forget: bool = False) -> None:
    """:func:`_abort` for an asyncio connection."""
    import psycopg
    from psycopg.pq import TransactionStatus

    from ledger.storage.pgpool import ahard_close

    if conn.closed:
        return
    status = conn.info.transaction_status
    if status == TransactionStatus.IDLE and not forget:
        return
    if status in (TransactionStatus.IDLE, TransactionStatus.INTRANS,
                  TransactionStatus.INERROR):
        try:
            if not forget:
                await conn.execute("ROLLBACK")
                return
            if status == TransactionStatus.IDLE:
                await conn.execute("BEGIN")
            await conn.rollback()
            return
        except psycopg.Error:
            pass
    await ahard_close(conn)


__all__ = ["Driver", "Flush", "PgDriver", "Q", "SqliteDriver", "Statement", "Tx",
           "statement_answer"]
