"""Group commit for SQLite's asyncio callers: the writes that queued on the database's own
thread while it was busy run as one SQLite transaction with one ``COMMIT``.

Every asyncio write of a SQLite ledger runs on one thread of the database
(:meth:`~ledger.storage.driver.SqliteDriver.arun`), one after another, since SQLite has one
writer anyway. With many turns on one event loop, transactions queue behind the one running, and
each of them then paid its own ``COMMIT``: the WAL frames of the pages it touched and an
``fsync``, most of the database's CPU and wall time per transaction. Here the thread takes
every transaction waiting when it gets free and runs them in one transaction:

* each member runs inside its own ``SAVEPOINT``, in arrival order, so each sees the writes of
  those before it, exactly as if they had run one after another; a member that fails before its
  commit point is rolled back to its savepoint and told its error, and the others go on;
* a member stops at its commit point (``Flush(commit=True)``, or its end) and waits; the group
  commits once; only then is each member sent the rows of its last statements and finished, so
  the code after a commit point (``begin.after_commit``, a refusal returned once the refused
  Attempt is recorded) runs after a real commit, as it does alone, and no caller hears of a
  write before it is durable;
* if the ``COMMIT`` fails, or a failure ends SQLite's transaction under the group (a full disk,
  an I/O error), the members it held are told that error and none of their writes stay;
* a transaction whose caller was cancelled before the thread took it never runs (as with an
  executor's work item), and one taken runs to its end: a commit is never cancelled;
* a transaction waits for another process's write lock until the busy timeout has passed since
  it was submitted, not since the thread took it: queued behind a group stuck on the lock, it
  has already waited most of its time. So a group's ``BEGIN IMMEDIATE`` waits only as long as
  its oldest member has left; when that runs out, the members whose time is up are told
  SQLite's own ``database is locked`` (:class:`~ledger.errors.DatabaseUnavailable`, as alone)
  and the others wait on for theirs. One whose time was up before the thread took it still
  gets one try, without waiting: the lock may be free by then.

Alone in the queue, a transaction runs as it always did (no savepoints). Blocking callers
(:meth:`~ledger.storage.driver.SqliteDriver.run`) are not grouped: each thread has its own
connection and its own transactions.

Asyncio reads (``write=False``) are never queued behind writes. A read the database's thread
can take at once (nothing queued, every transaction it took done) runs there, next, in a group
of its own kind, on the warm connection (a connection of its own would find its page cache
stale after every write). Otherwise the driver runs it on a second group, a reading thread of
the database with its own connection, where the reads queued together run as one read
transaction (a deferred ``BEGIN``, a ``SAVEPOINT`` each, one ``COMMIT``: one snapshot). Queued
with the writes, a read would wait behind a group stuck on another process's write lock and,
grouped with writes, be told ``database is locked`` with them, though in WAL mode a reader
takes no write lock and reads the last commit. A group is of one kind: reads or writes. A
caller still reads its own writes: a write's future is done only once its ``COMMIT`` (the
group's, or its own alone) has returned, and a flow awaits it before it submits its next
transaction; a read group is taken off the queue before its ``BEGIN``, and its snapshot is
taken at its first statement, after that, so after every commit its members' callers awaited.
A read in flight beside another caller's write may see the database from before that write or
after it, as it could when it queued with the writes (that write was not acknowledged yet).
The busy timeout above does not concern reads: a deferred ``BEGIN`` waits for no lock. The
reading thread and its connection close with the driver, once what was queued on it has
finished.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import sqlite3
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_GROUP = 64  # bounds how long the first member of a group waits for the others

Tx = Generator[Any, Any, Any]


class Members(Protocol):
    """What the group needs of the SQLite driver (:class:`~ledger.storage.driver.SqliteDriver`
    is one): said here, so that the driver depends on the group and not the other way."""

    @property
    def busy_timeout_s(self) -> float:
        """How long a transaction may wait for another connection's write lock."""
        ...

    def connection(self) -> sqlite3.Connection:
        """The calling thread's connection."""
        ...

    def begin(self, conn: sqlite3.Connection, *, write: bool, wait_s: float | None = None
              ) -> None:
        """Open a transaction, waiting for the write lock ``wait_s`` at most, raw errors."""
        ...

    def run(self, tx: Tx, *, write: bool, wait_s: float | None = None) -> Any:
        """Run ``tx`` alone, in its own transaction, waiting for the write lock ``wait_s`` at
        most."""
        ...

    def advance(self, conn: sqlite3.Connection, tx: Tx, value: Any) -> tuple[bool, Any]:
        """Feed ``tx`` to its end or its commit point, raw errors."""
        ...

    def finish(self, conn: sqlite3.Connection, tx: Tx, value: Any) -> Any:
        """Feed ``tx`` from its commit point to its end, errors told."""
        ...

    def told(self, e: BaseException) -> BaseException:
        """``e`` as the caller hears it."""
        ...

    def rollback(self, conn: sqlite3.Connection) -> None:
        """End a failed transaction, if one is open."""
        ...


@dataclass(slots=True)
class _Job:
    tx: Tx
    write: bool
    future: concurrent.futures.Future[Any]
    deadline: float  # on the writer's clock: its wait for the write lock ends then
    # Held at its commit point: its result (done) or the rows of its committing flush, sent to
    # it once the group has committed.
    carry: Any = None
    done: bool = False


@dataclass(slots=True)
class GroupWriter:
    """A thread of the database, running queued transactions in groups (see the module): the
    writes' (``name`` ``ledger-sqlite``), or the reads' (``ledger-sqlite-read``)."""

    driver: Members
    clock: Callable[[], float] = time.monotonic  # seconds, for the members' deadlines
    name: str = "ledger-sqlite"  # its thread's
    _queue: collections.deque[_Job] = field(default_factory=collections.deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _draining: bool = False
    _taken: list[_Job] = field(default_factory=list)  # the group the thread runs (or ran last)
    _thread: concurrent.futures.ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=self.name)

    def submit(self, tx: Tx, write: bool) -> concurrent.futures.Future[Any]:
        """Queue ``tx``; its future is done once it is committed (or failed). Its wait for
        another connection's write lock ends the busy timeout from now (see the module)."""
        future = self._put(tx, write, only_if_idle=False)
        assert future is not None
        return future

    def submit_if_idle(self, tx: Tx, write: bool) -> concurrent.futures.Future[Any] | None:
        """:meth:`submit` ``tx`` if the thread runs and holds nothing, so that it runs next,
        alone of its kind; ``None`` (nothing queued) otherwise."""
        return self._put(tx, write, only_if_idle=True)

    def _put(self, tx: Tx, write: bool, *, only_if_idle: bool
             ) -> concurrent.futures.Future[Any] | None:
        job = _Job(tx, write, concurrent.futures.Future(),
                   self.clock() + self.driver.busy_timeout_s)
        with self._lock:
            # Idle: nothing queued, and every transaction the thread took is done (it may not
            # have looped back yet: its caller hears of a commit first).
            if only_if_idle and (self._queue or not all(j.future.done() for j in self._taken)):
                return None
            self._queue.append(job)
            start, self._draining = not self._draining, True
        if start:
            try:
                self._thread.submit(self._drain)
            except BaseException:
                with self._lock:
                    self._draining = False
                    self._queue.remove(job)
                raise
        return job.future

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        self._thread.shutdown(wait=True)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._draining = False
                    return
                # A group is of one kind: a read taken while the thread was idle must not
                # open a write's transaction (and wait for its lock) with a write queued
                # after it.
                kind = self._queue[0].write
                jobs: list[_Job] = []
                while self._queue and len(jobs) < MAX_GROUP and self._queue[0].write == kind:
                    jobs.append(self._queue.popleft())
                self._taken = jobs
            live = [j for j in jobs if j.future.set_running_or_notify_cancel()]
            try:
                if len(live) == 1:
                    _settle(live[0], functools.partial(self.driver.run, live[0].tx,
                                                       write=live[0].write,
                                                       wait_s=self._left(live)))
                elif live:
                    self._group(live)
            except BaseException as e:  # no caller may be left waiting
                _fail([j for j in live if not j.future.done()], e, self.driver.told)

    def _group(self, jobs: list[_Job]) -> None:
        conn = self.driver.connection()
        try:
            while jobs:
                jobs = self._one_transaction(conn, jobs)
        except BaseException:
            self.driver.rollback(conn)
            raise

    def _one_transaction(self, conn: sqlite3.Connection, jobs: list[_Job]) -> list[_Job]:
        """Run ``jobs`` in one transaction; returns those left for another one (SQLite ended
        this one under them)."""
        driver = self.driver
        jobs = self._begin(conn, jobs)
        if not jobs:
            return []
        held: list[_Job] = []
        for n, job in enumerate(jobs):
            conn.execute(f"SAVEPOINT m{n}")
            try:
                job.done, job.carry = driver.advance(conn, job.tx, None)
            except BaseException as e:
                if not conn.in_transaction:  # SQLite rolled back the whole transaction
                    _fail([*held, job], e, driver.told)
                    return jobs[n + 1:]
                conn.execute(f"ROLLBACK TO m{n}")
                conn.execute(f"RELEASE m{n}")
                job.future.set_exception(driver.told(e))
                continue
            conn.execute(f"RELEASE m{n}")
            held.append(job)
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            driver.rollback(conn)
            _fail(held, e, driver.told)
            return []
        for job in held:
            if job.done:
                job.future.set_result(job.carry)
            else:
                # Past its commit point a member finishes as it does alone: anything it still
                # runs runs outside the transaction.
                _settle(job, functools.partial(driver.finish, conn, job.tx, job.carry))
        return []

    def _left(self, jobs: list[_Job]) -> float:
        """How long the oldest of ``jobs`` may still wait for the write lock (seconds)."""
        return max(0.0, min(j.deadline for j in jobs) - self.clock())

    def _begin(self, conn: sqlite3.Connection, jobs: list[_Job]) -> list[_Job]:
        """Open the transaction of ``jobs``; returns those it is open for (none: no
        transaction), the others told their error (see the module)."""
        while jobs:
            try:
                self.driver.begin(conn, write=any(j.write for j in jobs),
                                  wait_s=self._left(jobs))
                return jobs
            except sqlite3.Error as e:
                if not _busy(e):
                    _fail(jobs, e, self.driver.told)
                    return []
                # The oldest's time is up whatever the clock says (SQLite waited it): each
                # wait ends at least one member, so this ends.
                up = max(self.clock(), min(j.deadline for j in jobs))
                _fail([j for j in jobs if j.deadline <= up], e, self.driver.told)
                jobs = [j for j in jobs if j.deadline > up]
        return []


def _busy(e: sqlite3.Error) -> bool:
    """Whether ``e`` is SQLite's ``SQLITE_BUSY`` (another connection holds the lock)."""
    return (getattr(e, "sqlite_errorcode", 0) & 0xFF) == _SQLITE_BUSY


_SQLITE_BUSY = 5  # the primary result code, without its extended bits


def _settle(job: _Job, call: Callable[[], Any]) -> None:
    try:
        job.future.set_result(call())
    except BaseException as e:  # the caller's, as an executor does
        job.future.set_exception(e)


def _fail(jobs: list[_Job], error: BaseException, told: Callable[[BaseException], BaseException]
          ) -> None:
    """Tell each of ``jobs`` ``error`` (each its own ledger error) and close its
    transaction."""
    for j in jobs:
        j.future.set_exception(told(error))
        with contextlib.suppress(Exception):  # the caller has been told; nothing more to do
            j.tx.close()


__all__ = ["MAX_GROUP", "GroupWriter", "Members"]
