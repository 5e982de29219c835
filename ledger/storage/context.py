"""The SQL context: one database's engine, its transactions and what differs between databases.

Every query object of storage (:class:`~ledger.storage.runs.RunQueries`,
:class:`~ledger.storage.recovery.RecoveryQueries`, :class:`~ledger.storage.audit.AuditQueries`,
:class:`~ledger.storage.series.SeriesQueries`) is built on a :class:`SqlContext` and asks it for
a read or a write transaction and for the few statements each database spells its own way
(an ``INSERT ... ON CONFLICT``, a claim that skips locked rows, a time bucket, a label). The
hot path's store (:class:`~ledger.storage.store.Store`) holds one as ``store.context``, which is
how the facade, ops, the dashboard and the tools reach it.

The two implementations are :class:`~ledger.storage.sqlite.SqliteContext` and
:class:`~ledger.storage.postgres.PostgresContext`; :func:`ledger.storage.open_store` picks one.
No query asks which database it runs on.
"""

from __future__ import annotations

import abc
import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar

from sqlalchemy import URL, Connection, Engine, Select, event

from ledger.domain.bounds import DEFAULT_LEASE_MARGIN_S
from ledger.errors import DatabaseUnavailable
from ledger.forking import abandon, renew_in_child
from ledger.storage import schema as s
from ledger.storage.encode import event_json
from ledger.storage.engine import redact_url
from ledger.storage.failure import closed_error, mapped

#: A clock read inside a transaction, once it holds its locks.
ClockFn = Callable[[], float]
#: One row of a read query, by column name.
RowMap = Mapping[str, Any]

#: Ids bound in one statement's ``IN (...)`` at most: a SQLite built before 3.32 takes at most
#: 999 bound values in a statement.
IDS_PER_STATEMENT = 500


def id_chunks(ids: Sequence[str], n: int = IDS_PER_STATEMENT) -> Iterator[list[str]]:
    """``ids`` in order, ``n`` at a time: one statement's ``IN (...)`` each."""
    for i in range(0, len(ids), n):
        yield list(ids[i:i + n])


class SqlContext(abc.ABC):
    """One database for the queries built on it: an engine, its transactions and the hooks
    where the databases differ. Errors of the driver leave as :class:`~ledger.errors.LedgerError`
    (:mod:`ledger.storage.failure`)."""

    #: ``"sqlite"`` or ``"postgresql"``.
    backend: ClassVar[str]
    #: Whether the history (``attempts``, ``events``) is partitioned by month
    #: (:mod:`ledger.storage.partitions`): retention drops partitions, not rows.
    partitioned: ClassVar[bool] = False

    def __init__(self, engine: Engine, where: str, *,
                 lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> None:
        self.engine = engine
        #: The database's URL without its password, for messages.
        self.where = where
        #: How long before its end a lease stops starting work (seconds).
        self.lease_margin_s = lease_margin_s
        # Where the engine makes a connection of its own (a PostgreSQL engine's come from the
        # store's pool, which refuses them itself once closed). The listener is kept by the
        # engine's dialect, which SQLAlchemy may keep long after the ledger's close (a
        # reflection cache of the dialect's class, such as Alembic's migration fills): it holds
        # neither this context nor its engine, which would stay in memory with it.
        self._refusal = _Refusal(where)
        event.listen(engine, "do_connect", self._refusal)
        # A connection never goes back to the pool, nor is closed, with a statement of its own
        # still live (_keep_cursor). Plain functions: they hold nothing of the context.
        event.listen(engine, "before_cursor_execute", _keep_cursor)
        event.listen(engine.pool, "reset", _close_cursors_on_reset)
        event.listen(engine.pool, "close", _close_cursors_on_close)
        renew_in_child(self)

    def _forked(self) -> None:
        """In a forked child: the engine lets go of the parent's connections without closing
        them (SQLAlchemy's ``dispose(close=False)``; its old pool is abandoned, so that not
        even a finalizer touches them: :mod:`ledger.forking`) and makes its own on first
        use. A PostgreSQL engine holds none (NullPool: each is lent by the store's pool,
        renewed itself)."""
        abandon(self.engine.pool)
        self.engine.dispose(close=False)

    # -- what differs between the databases ------------------------------------------------

    def holds_schema(self) -> bool:
        """Whether the schema's revision may be read here without writing: a server's
        database may always be."""
        return True

    def write_refusal(self) -> str | None:
        """Why this connection's writes (an operator's action: an event, a Run, an Attempt, its
        debit, a health key, a group) would be refused for good, asked without writing; ``None``
        when nothing says so. Its refusals are :class:`~ledger.errors.DatabaseReadOnly`; this
        tells it before the first one (the dashboard started with actions)."""
        return None

    @abc.abstractmethod
    def has_table(self, conn: Connection, name: str) -> bool:
        """Whether table (or view) ``name`` is where the ledger's unqualified queries find it,
        read on ``conn`` from the database's catalog.

        Not with SQLAlchemy's ``inspect(conn).has_table``: PostgreSQL's dialect caches its
        reflection queries per dialect instance in caches of its class (the last 128), and
        every ledger opened would stay reachable from there after its close."""

    @abc.abstractmethod
    def refuse_foreign(self) -> None:
        """Before the schema is created or upgraded, without writing: refuse a database that
        belongs to another application (:class:`~ledger.errors.DatabaseSetupError`,
        ``problem="not_a_ledger"``)."""

    @abc.abstractmethod
    def migration_lock(self) -> AbstractContextManager[Connection]:
        """A connection whose work is serialized against every other migrating process."""

    @abc.abstractmethod
    def insert_for(self, table: Any) -> Any:
        """The database's INSERT (with ON CONFLICT support) for ``table``."""

    @abc.abstractmethod
    def claiming(self, query: Select[Any]) -> Select[Any]:
        """``query`` as a claim of work items: rows another transaction holds are skipped
        (PostgreSQL), not waited for; budget and capacity checks never use it."""

    @abc.abstractmethod
    def lock_hour(self, conn: Connection, hour: int, *, wait: bool = True) -> bool:
        """Hold hour ``hour`` of the history against writes to its attempts until the write
        transaction on ``conn`` ends (a roll-up's, :mod:`ledger.storage.rollups`); without
        ``wait``, only if no writer holds it now. Returns whether it is held."""

    def lock_hours(self, conn: Connection, hours: list[int]) -> set[int]:
        """:meth:`lock_hour` without waiting for each of ``hours``; the ones now held."""
        return {h for h in hours if self.lock_hour(conn, h, wait=False)}

    def bounded_locks(self, conn: Connection, timeout: str) -> bool:
        """Make the write transaction on ``conn`` wait at most ``timeout`` (``'10s'``) for a
        lock another session holds, where the database waits per lock; ``False`` where it
        does not (SQLite: ``BEGIN IMMEDIATE``'s busy timeout bounds the whole write)."""
        return False

    @abc.abstractmethod
    def consistent(self, conn: Connection) -> None:
        """Make the read transaction just begun on ``conn`` one snapshot of the whole ledger."""

    @abc.abstractmethod
    def aggregating(self, conn: Connection) -> None:
        """Give the read transaction just begun on ``conn`` the memory for an aggregate over a
        day of history (its sorts and hash tables), where the database has such a setting."""

    @abc.abstractmethod
    def bucket(self, col: Any, since: float, width: float) -> Any:
        """The 0-based index of the ``width``-wide time bucket from ``since`` of ``col``."""

    @abc.abstractmethod
    def label(self, key: str, labels: Any = None) -> Any:
        """The value of label ``key`` (checked) of a run, as SQL: in ``runs.labels``, or in
        ``labels`` (a column of the same JSON text) when given."""

    @abc.abstractmethod
    def json_text(self, col: Any, *path: str) -> Any:
        """The member at ``path`` (object keys) of the JSON text in ``col``, as text (NULL
        where it is absent)."""

    def group_key(self, col: Any) -> Any:
        """``col`` as the GROUP BY key of a read of a time window's rows (the totals, spend,
        /metrics; with roll-ups, the rows they leave: ranges ORed together,
        :meth:`~ledger.storage.hours.Split.unrolled`): the same groups; a database whose
        planner would rather walk an index in the key's order than read those ranges
        (SQLite) is told not to."""
        return col

    @abc.abstractmethod
    def percentiles(self, conn: Connection, values: Sequence[Any], keys: Mapping[str, Any],
                    where: Sequence[Any], fractions: Sequence[float]) -> list[RowMap]:
        """Read on ``conn``, for each of ``keys`` (by name): per value of it (column ``key``,
        its name in column ``by``) over the rows of ``attempts`` where every condition of
        ``where`` holds, for the ``j``-th of ``values``: how many of them have it (column
        ``n<j>``, 0 where none has) and its continuous percentiles at ``fractions`` (columns
        ``p<j>_0``, ``p<j>_1``, ...; NULL where none has it). One pass over the rows; the keys
        must not be NULL.

        Both databases give the same answers, :func:`percentile_cont`'s: PostgreSQL's
        aggregate of that name, and on SQLite, which has none, the rows' values sorted here.
        """

    @classmethod
    def database_key(cls, norm: str, parsed: URL) -> str:
        """Which database the normalized URL ``norm`` names, as one string per database
        wherever that can be told: here the URL, redacted (another host name for the same
        server is another key; nothing short of asking the server tells them apart)."""
        return redact_url(norm)

    # -- transactions ---------------------------------------------------------------------

    def commit_unknown(self, error: BaseException) -> bool:
        """Whether ``error``, raised by a write transaction's ``COMMIT`` (SQLAlchemy's
        exception, the driver's as its ``orig``), leaves that ``COMMIT``'s outcome unknown.

        ``False`` here: SQLite's ``COMMIT`` is a call into the library in this process, which
        returns only once it is decided, and an error it returns is a commit that did not
        happen; no connection can be lost between sending it and hearing its answer. A server
        database says otherwise (:class:`~ledger.storage.postgres.PostgresContext`)."""
        return False

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        """One write transaction (``BEGIN IMMEDIATE`` on SQLite).

        A :class:`~ledger.errors.DatabaseUnavailable` its ``COMMIT`` raised whose outcome is
        unknown (:meth:`commit_unknown`) is told ``fields["commit"] = "unknown"``, as the hot
        path's drivers tell theirs (:mod:`ledger.storage.driver`): the write may have landed.
        """
        committing = False
        try:
            with mapped(self.where), self._transaction(ledger_write=True) as conn:
                yield conn
                # The block is done: what raises from here on is the COMMIT's.
                committing = True
        except DatabaseUnavailable as e:
            if committing and self.commit_unknown(e.__cause__ or e):
                e.fields["commit"] = "unknown"
            raise

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """One read transaction."""
        with mapped(self.where), self._transaction() as conn:
            yield conn

    @contextmanager
    def _transaction(self, **options: Any) -> Iterator[Connection]:
        """One transaction on a connection of the engine (``options``: its execution options).

        One that an interruption ends (a :class:`BaseException` that is no
        :class:`Exception`: ``KeyboardInterrupt``, ``SystemExit``, a cancellation delivered to
        the thread) is rolled back and its connection is invalidated, not given back to the
        pool as it is: the interruption may have landed anywhere, in the driver's call or in
        SQLAlchemy's rollback itself, and a host that catches it goes on using the ledger.
        Its cursors are closed first (:func:`_close_cursors`): a SQLite connection closed with
        a statement still live stays open underneath, holding its transaction's locks for as
        long as the traceback holds the cursor (for good in a REPL or a notebook, which keep
        the last one), and every later write waits out the busy timeout.
        """
        with self.engine.connect() as conn:
            if options:
                conn = conn.execution_options(**options)
            try:
                with conn.begin():
                    yield conn
            except BaseException as e:
                if not isinstance(e, Exception) and not conn.invalidated:
                    conn.invalidate()  # its cursors are closed first (_close_cursors_on_close)
                raise

    def add_event(self, conn: Connection, run_id: str | None, attempt_id: str | None, kind: str,
                  data: Mapping[str, Any], now: float) -> None:
        """Insert one event on ``conn``, inside a write transaction of this context."""
        conn.execute(s.events.insert().values(
            run_id=run_id, attempt_id=attempt_id, kind=kind, data=event_json(data),
            created_at=now,
        ))

    def close(self) -> None:
        """Close the engine's connections, for good: a connection asked of it afterwards is
        :class:`~ledger.errors.InvalidState` (it would outlive the close)."""
        self._refusal.closed = True
        with mapped(self.where):
            self.engine.dispose()


#: Where a connection's pool record keeps the cursors its statements ran on (weakly).
_CURSORS = "ledger_cursors"


def _keep_cursor(conn: Connection, cursor: Any, *_execute: Any) -> None:
    """A ``before_cursor_execute`` listener: remember the cursor a statement runs on, so that
    one whose result was never read to its end can be closed before its connection is reused
    or closed (:func:`_close_cursors`). Weakly: a result read to its end lets go of it."""
    cursors = conn.info.get(_CURSORS)
    if cursors is None:
        cursors = conn.info[_CURSORS] = weakref.WeakSet()
    cursors.add(cursor)


def _close_cursors(record: Any) -> None:
    """Close the cursors still open on the connection of pool record ``record``.

    A result left unread holds a live statement: an interruption that lands between a
    statement and the read of its rows (SQLAlchemy invalidates the connection for one that
    lands in the driver's call) leaves it in the traceback, which a host that catches the
    interruption may keep for good (``sys.last_traceback``). On SQLite, such a statement keeps
    the connection's read snapshot after a ``ROLLBACK``, so its next ``BEGIN IMMEDIATE`` is
    refused ``database is locked``; closed with it, the connection is not closed at all (a
    "zombie" until the statement is finalized) and keeps its write transaction, whose lock
    every other connection, of any process, then waits for. Closing the cursor resets the
    statement; on PostgreSQL (rows fetched as the statement ran) it frees the rows only."""
    cursors = record.info.pop(_CURSORS, None)
    for cursor in list(cursors or ()):
        with contextlib.suppress(Exception):  # one of a closed connection: nothing to let go
            cursor.close()


def _close_cursors_on_reset(_dbapi_conn: Any, record: Any, _state: Any) -> None:
    """A pool ``reset`` listener: a connection goes back to the pool with no cursor open."""
    _close_cursors(record)


def _close_cursors_on_close(_dbapi_conn: Any, record: Any) -> None:
    """A pool ``close`` listener (invalidation included): a connection is closed, for good,
    with no cursor open."""
    _close_cursors(record)


class _Refusal:
    """A ``do_connect`` listener: refuses a connection once its context is closed."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.closed = False

    def __call__(self, *_connect: Any) -> None:
        if self.closed:
            raise closed_error(self.where)


def percentile_cont(ordered: Sequence[float], fraction: float) -> float:
    """PostgreSQL's ``percentile_cont(fraction)`` of the non-empty ``ordered`` (ascending):
    the values at ranks ``floor(pos)`` and ``ceil(pos)`` for ``pos = fraction * (n - 1)``,
    interpolated as ``lo + (hi - lo) * (pos - floor(pos))`` in double precision, the very
    arithmetic of its ``float8`` implementation, so both databases answer the same bits."""
    pos = fraction * (len(ordered) - 1)
    low = math.floor(pos)
    lo, hi = ordered[low], ordered[math.ceil(pos)]
    return lo + (hi - lo) * (pos - low)


__all__ = ["IDS_PER_STATEMENT", "ClockFn", "RowMap", "SqlContext", "id_chunks", "percentile_cont"]
