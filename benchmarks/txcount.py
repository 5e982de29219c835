"""Counting the database transactions a stretch of work costs, from outside the ledger.

Both counters observe the database, not the ledger's code, so they keep counting whatever the
ledger's storage layer becomes:

* **PostgreSQL**: the server's own counters, ``xact_commit + xact_rollback`` of the bench
  database in ``pg_stat_database`` (read after ``pg_stat_clear_snapshot()``), from a monitor
  connection to the ``postgres`` maintenance database, so the monitor's own transactions are
  not counted. A backend publishes its counters at most once a second while busy and at the
  latest 10 s after it goes idle (``PGSTAT_IDLE_INTERVAL``), and always when it exits. So
  :meth:`PgTxCounter.start` waits until every client backend of the database has been idle
  that long, and :meth:`PgTxCounter.finish` is called after the clients were closed and waits
  until their backends are gone. ``sessions`` gives the connections opened in between.
* **SQLite**: a trace callback (``sqlite3.Connection.set_trace_callback``) on every connection
  the process opens to the bench file. The callback is installed by wrapping
  ``sqlite3.connect`` (which SQLAlchemy's pysqlite dialect, aiosqlite and direct use all call)
  for the life of the counter; it is a no-op outside a counting window. A transaction is an
  explicit ``BEGIN`` (``BEGIN IMMEDIATE`` counts as a write, ``BEGIN``/``DEFERRED`` as a read)
  or a statement run outside one (autocommit, each its own transaction: a read if it is a
  ``SELECT``, else a write); ``PRAGMA``
  statements (run when a connection opens) are left out and the connections opened are
  reported instead.

If the SQLite counter saw no statement at all while work was done, the count is reported as
unknown rather than zero: the ledger then opens its connections some other way.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sqlite3.dbapi2
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from benchmarks.common import BenchError

PG_IDLE_FLUSH_S = 10.5  # PGSTAT_IDLE_INTERVAL (10 s) plus a margin
#: How long the counters must stay unchanged before a count starts (an exiting backend's last
#: counters land within a second).
STILL_S = 1.0


@dataclass(frozen=True)
class TxCount:
    """Transactions seen in one counting window. ``reads``/``writes``: SQLite only."""

    transactions: int | None
    reads: int | None
    writes: int | None
    connections: int
    statements: int | None = None

    def per(self, n: int) -> float | None:
        """Transactions per unit of work (``n`` calls or turns)."""
        if self.transactions is None or n <= 0:
            return None
        return self.transactions / n


class TxCounter(Protocol):
    """A counting window around some work on one database."""

    def start(self) -> None:
        """Open the window; the clients must be quiescent (nothing in flight)."""

    def finish(self) -> TxCount:
        """Close the window and return what it saw; on PostgreSQL, after the clients closed."""

    def close(self) -> None:
        """Release what the counter holds (monitor connection, ``sqlite3.connect`` wrapper)."""


# -- SQLite -----------------------------------------------------------------------------------

class _ConnState:
    __slots__ = ("in_tx",)

    def __init__(self) -> None:
        self.in_tx = False


class SqliteTxCounter:
    """Counts transactions on connections to one SQLite file; see the module docstring."""

    _patch_lock = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = os.path.realpath(path)
        self._lock = threading.Lock()
        self._active = False
        self._reads = self._writes = self._statements = self._connections = 0
        self._implicit_reads = self._implicit_writes = 0
        with self._patch_lock:
            self._orig = sqlite3.connect
            self._orig_dbapi = sqlite3.dbapi2.connect
            wrapped = self._wrap(self._orig)
            # The module attribute is what every caller looks up at connect time.
            sqlite3.connect = wrapped  # type: ignore[assignment]
            sqlite3.dbapi2.connect = wrapped  # type: ignore[assignment]

    def _wrap(self, orig: Callable[..., sqlite3.Connection]) -> Callable[..., sqlite3.Connection]:
        def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = orig(*args, **kwargs)
            database = args[0] if args else kwargs.get("database")
            if self._ours(database):
                with self._lock:
                    if self._active:
                        self._connections += 1
                conn.set_trace_callback(self._callback(_ConnState()))
            return conn

        return connect

    def _ours(self, database: Any) -> bool:
        if database is None:
            return False
        name = os.fsdecode(database) if isinstance(database, bytes | os.PathLike) else database
        if not isinstance(name, str):
            return False
        if name.startswith("file:"):
            name = name[5:].split("?", 1)[0]
        return os.path.realpath(name) == self.path

    def _callback(self, state: _ConnState) -> Callable[[str], None]:
        def trace(sql: str) -> None:
            head = sql.lstrip()[:20].upper()
            if head.startswith("--"):
                return  # a statement inside a trigger, reported with a comment prefix
            # A SAVEPOINT outside a transaction opens one, as BEGIN DEFERRED does.
            begin = head.startswith("BEGIN") or (head.startswith("SAVEPOINT")
                                                 and not state.in_tx)
            end = head.startswith(("COMMIT", "END", "ROLLBACK")) and "TO" not in head.split()
            if not self._active:
                # Track transaction state even outside a window, so a window opened between
                # transactions reads the first statement of the next one right.
                if begin:
                    state.in_tx = True
                elif end:
                    state.in_tx = False
                return
            with self._lock:
                self._statements += 1
                if begin:
                    state.in_tx = True
                    if "IMMEDIATE" in head or "EXCLUSIVE" in head:
                        self._writes += 1
                    else:
                        self._reads += 1
                elif end:
                    state.in_tx = False
                elif not state.in_tx and not head.startswith("PRAGMA"):
                    if head.startswith("SELECT"):
                        self._implicit_reads += 1
                    else:
                        self._implicit_writes += 1

        return trace

    def start(self) -> None:
        """Zero the counts and open the window."""
        with self._lock:
            self._reads = self._writes = self._statements = self._connections = 0
            self._implicit_reads = self._implicit_writes = 0
            self._active = True

    def finish(self) -> TxCount:
        """Close the window; unknown transactions if no statement was seen at all."""
        with self._lock:
            self._active = False
            if self._statements == 0:
                return TxCount(None, None, None, self._connections, 0)
            reads = self._reads + self._implicit_reads
            writes = self._writes + self._implicit_writes
            return TxCount(reads + writes, reads, writes, self._connections, self._statements)

    def close(self) -> None:
        """Put ``sqlite3.connect`` back (connections already open keep their callback)."""
        with self._patch_lock:
            sqlite3.connect = self._orig
            sqlite3.dbapi2.connect = self._orig_dbapi


# -- PostgreSQL -------------------------------------------------------------------------------

class PgTxCounter:
    """Counts transactions of one PostgreSQL database from ``pg_stat_database``."""

    def __init__(self, url: str, *, idle_flush_s: float = PG_IDLE_FLUSH_S,
                 timeout_s: float = 120.0) -> None:
        import psycopg

        from benchmarks.floor import pg_connect_args

        args = pg_connect_args(url)
        self.dbname = str(args.get("dbname") or "")
        self.idle_flush_s = idle_flush_s
        self.timeout_s = timeout_s
        try:
            self._mon = psycopg.connect(autocommit=True, **{**args, "dbname": "postgres"})
        except psycopg.Error as e:
            raise BenchError(f"cannot count PostgreSQL transactions: the monitor connection "
                             f"to the 'postgres' database failed ({e}); pass --no-tx-count") from e
        self._s0: tuple[int, int] | None = None

    def _snapshot(self) -> tuple[int, int]:
        with self._mon.transaction():
            self._mon.execute("SELECT pg_stat_clear_snapshot()")
            row = self._mon.execute(
                "SELECT xact_commit + xact_rollback, sessions FROM pg_stat_database "
                "WHERE datname = %s", (self.dbname,)).fetchone()
        if row is None:
            raise BenchError(f"database {self.dbname!r} has no pg_stat_database row")
        return int(row[0]), int(row[1])

    def _backends(self) -> list[tuple[str | None, float]]:
        rows = self._mon.execute(
            "SELECT state, extract(epoch FROM now() - state_change)::float8 "
            "FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend' "
            "AND pid <> pg_backend_pid()", (self.dbname,)).fetchall()
        return [(r[0], float(r[1] or 0.0)) for r in rows]

    def _wait(self, done: Callable[[list[tuple[str | None, float]]], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if done(self._backends()):
                return
            if time.monotonic() > deadline:
                raise BenchError(f"PostgreSQL backends of {self.dbname!r} did not {what} within "
                                 f"{self.timeout_s:.0f}s; is something else using it?")
            time.sleep(0.1)

    def start(self) -> None:
        """Wait until every client backend published its counters, then snapshot them once
        they stop moving: a backend that exited just before (a connection closed by the
        caller, an autovacuum worker) publishes its last counters on its way out, which may
        land after the first look."""
        self._wait(lambda bs: all(state == "idle" and age >= self.idle_flush_s
                                  for state, age in bs), "go idle")
        deadline = time.monotonic() + self.timeout_s
        seen = self._snapshot()
        while True:
            time.sleep(STILL_S)
            now = self._snapshot()
            if now == seen:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"PostgreSQL's counters of {self.dbname!r} kept moving for "
                                 f"{self.timeout_s:.0f}s; is something else using it?")
            seen = now
        self._s0 = seen

    def finish(self) -> TxCount:
        """Wait until the (closed) clients' backends exited, then read the difference."""
        if self._s0 is None:
            raise BenchError("PgTxCounter.finish() without start()")
        self._wait(lambda bs: not bs, "exit")
        x1, s1 = self._snapshot()
        x0, s0 = self._s0
        self._s0 = None
        return TxCount(x1 - x0, None, None, s1 - s0)

    def close(self) -> None:
        """Close the monitor connection."""
        with contextlib.suppress(Exception):
            self._mon.close()


def counter_for(backend: str, url: str, *, idle_flush_s: float = PG_IDLE_FLUSH_S) -> TxCounter:
    """The transaction counter for one bench database."""
    if backend == "sqlite":
        from benchmarks.floor import sqlite_path

        return SqliteTxCounter(sqlite_path(url))
    return PgTxCounter(url, idle_flush_s=idle_flush_s)


@contextlib.contextmanager
def counting(backend: str, url: str, enabled: bool = True,
             idle_flush_s: float = PG_IDLE_FLUSH_S) -> Iterator[TxCounter | None]:
    """A counter for the duration of a benchmark (``None`` when counting is off)."""
    if not enabled:
        yield None
        return
    c = counter_for(backend, url, idle_flush_s=idle_flush_s)
    try:
        yield c
    finally:
        c.close()


__all__ = ["PG_IDLE_FLUSH_S", "PgTxCounter", "SqliteTxCounter", "TxCount", "TxCounter",
           "counter_for", "counting"]
