"""PostgreSQL connections for both paths of a store: one :mod:`psycopg_pool` pool per database.

The hot path's transactions (:class:`~ledger.storage.driver.PgDriver`) and the cold path's
SQLAlchemy engine (admission, reads, audit, recovery, migrations: see
:mod:`ledger.storage.postgres`) take their connections from the same :class:`PgPool`, so one
pool bounds, checks and closes every connection a store holds to its database:

* **bounded**: at most :data:`MAX_SIZE` connections are out at once (blocking callers share
  one :class:`psycopg_pool.ConnectionPool`; asyncio callers one
  :class:`psycopg_pool.AsyncConnectionPool` per event loop, whose connections belong to that
  loop); a checkout past the bound waits up to :data:`CHECKOUT_TIMEOUT_S` for a return, then
  fails as :class:`~ledger.errors.DatabaseUnavailable`;
* **checked before use, cheaply**: a connection used moments ago costs one poll of its socket
  (an idle connection has nothing to read: anything there, a server's goodbye or an end of
  file, means it is gone); one idle longer than :data:`IDLE_CHECK_S` is asked (one round
  trip). A connection found dead (the server was restarted, failed over, or terminated the
  session) is never used: it is closed, the idle ones beside it go too (the server that
  dropped one dropped them all), and the pool opens new ones. So it is with a connection a
  transaction left closed (:meth:`PgPool.lost`), whether psycopg saw the server end it or the
  driver's abort had to close it (a session ended mid-pipeline, reported before psycopg saw
  the end: ``cannot exit pipeline mode while busy``);
* **errors told at once**: psycopg_pool opens connections in its own workers, and a caller
  waiting for one only learns of a timeout. So until a connection has been seen working (at
  the first checkout; after one was found dead or failed, or the pool's worker failed to
  connect; after the pool sat unused for :data:`MAX_IDLE_S`, when it may hold none), a
  checkout connects by itself, in the caller: a server that is away or refuses the URL's
  credentials is the caller's typed error at once (:class:`~ledger.errors.DatabaseUnavailable`,
  :class:`~ledger.errors.DatabaseSetupError`), and a server that answers serves that caller's
  transaction on the connection just made (closed afterwards, outside the pool) while the pool
  takes over for the next ones. Callers already waiting in the pool's queue when the server
  goes away are the one case left to the timeout;
* **closed with what owns them**: :meth:`PgPool.close` closes every pool, for good: a checkout
  after it, or waiting when it came, is :class:`~ledger.errors.InvalidState` (the ledger is
  closed); an event loop's pool is also closed when that loop shuts down (``asyncio.run``
  ending), so a ledger used from one ``asyncio.run`` after another keeps no sessions of loops
  that are gone.

Every connection the pools (and checkouts) open is remembered by database, weakly, while it is
open: :func:`own_pids` are their server backends' pids, whose queue notifications the store's
listener skips (this process woke its waiters itself: :mod:`ledger.storage.wake`).

A pooled connection goes back to its pool when it is released (:func:`release`), which is also
what closing it does: that is how SQLAlchemy gives back what it was lent. psycopg and
psycopg_pool are imported on first use: they are the optional ``postgres`` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import weakref
from typing import Any

from ledger.forking import abandon, in_child, renew_in_child
from ledger.readiness import peer_spoke
from ledger.storage.failure import closed_error

#: Connections out at once, per pool (blocking callers; and per event loop, asyncio ones).
MAX_SIZE = 20
#: How long a checkout waits for a connection when all of them are out.
CHECKOUT_TIMEOUT_S = 30.0
#: A connection idle longer than this is asked (one round trip) before it is used again.
IDLE_CHECK_S = 1.0
#: An idle connection unused this long is closed (one per period, by the pool's worker).
MAX_IDLE_S = 600.0
#: How many times a hot-path connection runs a statement before psycopg prepares it on the
#: server (psycopg's own default): the hot path's few statements, repeated, are planned once.
_HOT_PREPARE = 5
#: The cold path's (SQLAlchemy's reads and writes, lent: :meth:`PgPool.lend`): none is
#: prepared. Its queries are many and seldom the same twice on a connection, so preparing
#: saves little; and a prepared one would be refused once per connection after a migration
#: changed the type of a column it returns (``cached plan must not change result type``) in
#: the middle of a call made of Python code between statements, which cannot be run again
#: from its start as the driver runs a hot-path transaction
#: (:class:`~ledger.storage.driver.PgDriver`). The hot path's prepared statements stay on the
#: connection, unused while it is lent.
_COLD_PREPARE: int | None = None


class _Own:
    """The open connections of this process's pools, by database (a store's ``where``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_where: dict[str, weakref.WeakSet[Any]] = {}

    def add(self, where: str, conn: Any) -> None:
        # Read once, now: the listener's thread must not touch a connection another is using.
        conn._ledger_pid = conn.info.backend_pid
        with self.lock:
            self.by_where.setdefault(where, weakref.WeakSet()).add(conn)

    def pids(self, where: str) -> frozenset[int]:
        with self.lock:
            conns = list(self.by_where.get(where, ()))
        # A closed connection's pid is forgotten: once its backend exits, the server may give
        # the pid to another process's connection, whose notifications must be heard.
        return frozenset(c._ledger_pid for c in conns if not c.closed)


_OWN = _Own()


@in_child
def _forked_own() -> None:
    # A forked child's pools hold none of these (PgPool._forked): the parent's backends are
    # another process's, whose notifications the child's listener must hear.
    global _OWN
    _OWN = _Own()


def own_pids(where: str) -> frozenset[int]:
    """The backend pids of the open connections this process's pools (and checkouts) made to
    the database ``where`` (:attr:`PgPool.where`, the store's waker key): a notification one
    of them sent is this process's own."""
    return _OWN.pids(where)


@functools.cache
def _connection_classes() -> tuple[type[Any], type[Any]]:
    """psycopg's connection classes as the pools serve them (made on first use: psycopg is an
    optional extra). A pooled connection knows its pool (``_ledger_pool``; None: one made by
    a checkout itself) and goes back to it when closed, which is how SQLAlchemy lets go of the
    connections it was lent."""
    import psycopg

    class Conn(psycopg.Connection[Any]):
        _ledger_pool: Any = None
        _ledger_idle_since = 0.0
        _ledger_reads = False  # a read replica's: read-only, and a standby will do
        _ledger_pid = 0  # its server backend's (own_pids)

        def close(self) -> None:
            if self._ledger_pool is None:
                super().close()
            else:
                release(self)

        def add_notice_handler(self, callback: Any) -> None:
            # SQLAlchemy adds its notice logger each time it takes a connection (to it every
            # one it is lent is new): once is enough, or they would pile up on a pooled one.
            seen: set[Any] = self.__dict__.setdefault("_ledger_notices", set())
            if callback not in seen:
                seen.add(callback)
                super().add_notice_handler(callback)

    class AConn(psycopg.AsyncConnection[Any]):
        _ledger_pool: Any = None
        _ledger_idle_since = 0.0
        _ledger_reads = False
        _ledger_pid = 0

        async def close(self) -> None:
            if self._ledger_pool is None:
                await super().close()
            else:
                await arelease(self)

    return Conn, AConn


def on_standby(conn: Any) -> bool:
    """Whether ``conn``'s server is a hot standby (in recovery: it refuses every write), as
    the server last reported (``in_hot_standby``, PostgreSQL 14 and later; no round trip).
    Such a connection is never lent, but by a read replica's pool (``read_url=``): the
    primary is what the ledger writes to."""
    return not getattr(conn, "_ledger_reads", False) and bool(
        conn.info.parameter_status("in_hot_standby") == "on")


#: Asked of the server that refused a write with SQLSTATE 25006, once that transaction ended:
#: whether it is a primary (not in recovery) on which a new transaction of this session is
#: read-only too, by the session's own settings.
_READ_ONLY_SESSION = ("SELECT NOT pg_is_in_recovery() "
                      "AND current_setting('transaction_read_only')::bool")


def read_only_session(conn: Any) -> bool:
    """Whether a write ``conn``'s server refused with SQLSTATE 25006 (read-only transaction)
    was refused because this session may not write there: the server, asked on ``conn`` (out
    of the refused transaction, which the caller has ended), is the primary, and a new
    transaction of the session is read-only too (``default_transaction_read_only`` of the
    role, the database or the URL's ``options``). A set-up problem, which no retry gets past.

    False for a standby's refusal (the server is in recovery: a failover, which a retry that
    reaches the primary gets past), and also when the server was a standby as the refused
    transaction began and is the primary now (promoted since: a new transaction may write),
    or cannot be asked (the connection failed): those are told as a standby's, retry-safe,
    and the connection is dropped. One round trip, on that error only: the callers ask only
    when the server did not report itself in recovery already (``in_hot_standby``,
    :func:`on_standby`; not reported before PostgreSQL 14)."""
    if conn.closed:
        return False
    try:
        row = conn.execute(_READ_ONLY_SESSION).fetchone()
        if not conn.autocommit:
            conn.rollback()  # the question's own transaction: the connection as it was
    except Exception:  # no answer: the refusal cannot be told a set-up problem
        return False
    return bool(row and row[0])


async def aread_only_session(conn: Any) -> bool:
    """:func:`read_only_session` for an asyncio connection (autocommit: the hot path's)."""
    if conn.closed:
        return False
    try:
        cur = await conn.execute(_READ_ONLY_SESSION)
        row = await cur.fetchone()
    except Exception:
        return False
    return bool(row and row[0])


def _fresh(conn: Any) -> None:
    """Made just now by the pool: as good as just used."""
    conn._ledger_idle_since = time.monotonic()


def hard_close(conn: Any) -> None:
    """Close ``conn`` itself rather than give it back (given back closed, it is dropped by its
    pool, which opens another in its place)."""
    import psycopg

    with contextlib.suppress(Exception):  # closing a dead connection is best effort
        psycopg.Connection.close(conn)


async def ahard_close(conn: Any) -> None:
    import psycopg

    with contextlib.suppress(Exception):
        await psycopg.AsyncConnection.close(conn)


def release(conn: Any) -> None:
    """Give back a connection of :meth:`PgPool.checkout` or :meth:`PgPool.lend` (one the
    checkout made by itself is closed)."""
    pool, conn._ledger_pool = conn._ledger_pool, None
    if pool is None or (not conn.closed and on_standby(conn)):
        hard_close(conn)  # given back closed, it is dropped by its pool
    if pool is None:
        return
    if not conn.closed and not conn.autocommit:
        try:
            conn.autocommit = True  # as the hot path takes it; SQLAlchemy ended its own
            conn.prepare_threshold = _HOT_PREPARE
        except Exception:
            hard_close(conn)  # still in a transaction: not fit to go back as it is
    conn._ledger_idle_since = time.monotonic()
    pool.putconn(conn)  # a closed pool closes it


async def arelease(conn: Any) -> None:
    """:func:`release` for a connection of :meth:`PgPool.acheckout`."""
    pool, conn._ledger_pool = conn._ledger_pool, None
    if pool is None or (not conn.closed and on_standby(conn)):
        await ahard_close(conn)
    if pool is None:
        return
    conn._ledger_idle_since = time.monotonic()
    await pool.putconn(conn)


class _Loop:
    """The asyncio side of a :class:`PgPool` on one event loop."""

    def __init__(self, reads: bool, where: str) -> None:
        self.reads = reads
        self.where = where
        self.pool: Any = None
        self.proven = False
        self.used_at = 0.0
        self.lock: asyncio.Lock | None = None
        # Tasks the loop must not lose (it holds tasks weakly): the one that closes the pool
        # when the loop shuts down, and those closing pools replaced meanwhile.
        self.guard: asyncio.Task[None] | None = None
        self.closing: set[asyncio.Task[None]] = set()
        # Every connection its pools made, to close the idle ones when the loop shuts down.
        self.made: weakref.WeakSet[Any] = weakref.WeakSet()

    async def configure(self, conn: Any) -> None:
        """Each new connection of this loop's pools: as good as just used, and known."""
        _fresh(conn)
        conn._ledger_reads = self.reads
        self.made.add(conn)
        _OWN.add(self.where, conn)

    def unprove(self, pool: Any) -> None:
        """:meth:`PgPool._replace` for this loop's pool (called by its worker, on the loop)."""
        self.proven = False
        if self.pool is pool:
            self.pool = None
            task = asyncio.get_running_loop().create_task(pool.close())
            self.closing.add(task)
            task.add_done_callback(self.closing.discard)


class PgPool:
    """The connections of one store to its PostgreSQL database (see the module docstring)."""

    def __init__(self, conninfo: str, *, where: str, max_size: int = MAX_SIZE,
                 timeout: float = CHECKOUT_TIMEOUT_S, reads: bool = False) -> None:
        self.conninfo = conninfo
        self.reads = reads  # a read replica's pool: its connections may be on a standby
        self.where = where
        self.max_size = max_size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._probing = threading.Lock()
        self._pool: Any = None
        self._closed = False
        self._proven = False
        self._used_at = 0.0
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Loop] = (
            weakref.WeakKeyDictionary())
        renew_in_child(self)

    def _forked(self) -> None:
        """In a forked child: every connection of the parent's pools is the parent's (a
        socket both processes wrote to would interleave their messages and hand each the
        other's replies), and the pools' workers do not exist here. They are abandoned,
        never used nor closed (a close sends the server a Terminate over the parent's
        socket, ending the parent's session: :mod:`ledger.forking`); the next checkout
        connects anew, as on a first use, and its pool is this process's own. A closed
        store stays closed."""
        abandon(self._pool, *((side, side.pool, list(side.made))
                              for side in list(self._loops.values())))
        self._pool = None
        self._loops = weakref.WeakKeyDictionary()
        self._proven = False
        self._used_at = 0.0
        self._lock = threading.Lock()
        self._probing = threading.Lock()

    def _settings(self) -> dict[str, Any]:
        return {
            "kwargs": {"autocommit": True}, "min_size": 0, "max_size": self.max_size,
            "timeout": self.timeout, "open": False,
            "max_idle": MAX_IDLE_S, "name": "ledger-postgres", "num_workers": 1,
            # A connection that cannot be made is the checkout's to tell (it connects by
            # itself until one works): the pool's workers do not keep retrying in the dark.
            "reconnect_timeout": 0.0,
        }

    def _configure(self, conn: Any) -> None:
        """Each new connection of the blocking pool: as good as just used, and whose."""
        _fresh(conn)
        conn._ledger_reads = self.reads
        _OWN.add(self.where, conn)

    @staticmethod
    def _doubted(used_at: float, now: float) -> bool:
        """Whether the pool may hold no connection, so that a checkout would wait for one its
        worker cannot make: it closes one connection per :data:`MAX_IDLE_S` left unused."""
        return now - used_at > MAX_IDLE_S

    # -- blocking --------------------------------------------------------------------------

    def _refuse_closed(self) -> None:
        if self._closed:
            raise closed_error(self.where)

    def _sync_pool(self) -> Any:
        pool = self._pool
        if pool is None:
            from psycopg_pool import ConnectionPool

            with self._lock:
                self._refuse_closed()  # a pool made now would outlive the close
                if self._pool is None:
                    pool = ConnectionPool(self.conninfo, connection_class=_connection_classes()[0],
                                          reconnect_failed=self._replace,
                                          configure=self._configure,
                                          **self._settings())
                    pool.open()
                    self._pool = pool
                pool = self._pool
        return pool

    def _replace(self, pool: Any) -> None:
        """The pool's worker could not connect. Checkouts connect by themselves again, and the
        callers waiting in the pool's queue are told at once: the pool is replaced, and
        closing it (on a thread of its own: this is its worker) fails their wait with
        ``PoolClosed``, on which they check out again."""
        self._proven = False
        with self._lock:
            if self._pool is not pool:
                return
            self._pool = None
        threading.Thread(target=pool.close, name="ledger-postgres-replaced",
                         daemon=True).start()

    def checkout(self) -> Any:
        """A working connection in autocommit mode, for one transaction; give it back with
        :func:`release`."""
        from psycopg_pool import PoolClosed

        while True:
            self._refuse_closed()
            now = time.monotonic()
            if not self._proven or self._doubted(self._used_at, now):
                with self._probing:
                    if not self._proven or self._doubted(self._used_at, now):
                        conn = _connection_classes()[0].connect(self.conninfo, autocommit=True)
                        conn._ledger_reads = self.reads
                        _OWN.add(self.where, conn)
                        self._proven, self._used_at = True, time.monotonic()
                        return conn  # a connection of its own, closed after its transaction
            self._used_at = now
            pool = self._sync_pool()
            try:
                conn = pool.getconn()
            except PoolClosed:
                continue  # replaced while this caller waited (or the store closed): again
            conn._ledger_pool = pool
            if self._usable(conn, now):
                return conn
            self.lost(conn)

    def lend(self) -> Any:
        """A connection for SQLAlchemy (the engine's ``creator``): as :meth:`checkout`, out of
        autocommit mode, for SQLAlchemy begins and ends its transactions itself, and preparing
        nothing on the server (:data:`_COLD_PREPARE`). Closing it gives it back."""
        conn = self.checkout()
        conn.autocommit = False
        conn.prepare_threshold = _COLD_PREPARE
        return conn

    def _usable(self, conn: Any, now: float) -> bool:
        if conn.closed or on_standby(conn) or peer_spoke(conn):
            return False
        if now - conn._ledger_idle_since < IDLE_CHECK_S:
            return True
        try:
            conn.execute("")  # an empty query: one round trip, no work on the server
        except Exception:  # any failure to answer: the connection is not used
            return False
        return True

    def lost(self, conn: Any) -> None:
        """``conn`` was found dead, or failed and ended closed (the server or the network
        closed it, or the driver's abort had to: :class:`~ledger.storage.driver.PgDriver`), or
        its server is a standby: it goes, the idle ones beside it go too (the server that
        dropped one dropped them all), and the next checkout connects by itself until a
        connection is seen working again."""
        self._proven = False
        pool = conn._ledger_pool
        if pool is not None and not pool.closed:
            pool.drain()  # the idle ones now, this one when it is given back (made before)
        release(conn)

    # -- asyncio ---------------------------------------------------------------------------

    async def _loop(self) -> _Loop:
        loop = asyncio.get_running_loop()
        side = self._loops.get(loop)
        if side is None:
            with self._lock:
                self._refuse_closed()
                side = self._loops.setdefault(loop, _Loop(self.reads, self.where))
        if side.guard is None:
            side.guard = loop.create_task(self._close_with(loop, side))
        if side.pool is None:
            from psycopg_pool import AsyncConnectionPool

            pool = AsyncConnectionPool(self.conninfo, connection_class=_connection_classes()[1],
                                       reconnect_failed=side.unprove, configure=side.configure,
                                       **self._settings())
            await pool.open()
            if side.pool is None and not self._closed and side.guard is not None \
                    and not side.guard.done():
                side.pool = pool
            else:  # another task of the loop opened one meanwhile, or the store closed
                await pool.close()
        return side

    async def _close_with(self, loop: asyncio.AbstractEventLoop, side: _Loop) -> None:
        """Wait until the loop shuts down (``asyncio.run`` cancels what is left at its end)
        or :meth:`close`, then close the loop's pool: connections of a loop that ended are of
        no use to anyone, and the server would keep their sessions."""
        try:
            await loop.create_future()
        finally:
            with self._lock:
                if self._loops.get(loop) is side:
                    del self._loops[loop]
            pool, side.pool = side.pool, None
            if pool is not None:
                # When the loop is shutting down, the pool's workers were cancelled beside
                # this task, and its close stops short of the idle connections: those (made
                # by the pool, lent to no one: see release) are closed here.
                with contextlib.suppress(asyncio.CancelledError):
                    await pool.close()
            for conn in list(side.made):
                if conn._ledger_pool is None and not conn.closed:
                    await ahard_close(conn)

    async def acheckout(self) -> Any:
        """:meth:`checkout` for an asyncio caller (a connection of the running loop)."""
        from psycopg_pool import PoolClosed

        while True:
            self._refuse_closed()
            side = await self._loop()
            now = time.monotonic()
            if not side.proven or self._doubted(side.used_at, now):
                if side.lock is None:
                    side.lock = asyncio.Lock()
                async with side.lock:
                    self._refuse_closed()  # it may have closed while this caller waited
                    if not side.proven or self._doubted(side.used_at, now):
                        conn = await _connection_classes()[1].connect(self.conninfo,
                                                                      autocommit=True)
                        conn._ledger_reads = self.reads
                        _OWN.add(self.where, conn)
                        side.proven, side.used_at = True, time.monotonic()
                        return conn
            side.used_at = now
            pool = side.pool
            if pool is None:
                continue  # closed or replaced since: refused above, or a new one
            try:
                conn = await pool.getconn()
            except PoolClosed:
                continue
            conn._ledger_pool = pool
            if await self._ausable(conn, now):
                return conn
            await self.alost(conn)

    async def _ausable(self, conn: Any, now: float) -> bool:
        if conn.closed or on_standby(conn) or peer_spoke(conn):
            return False
        if now - conn._ledger_idle_since < IDLE_CHECK_S:
            return True
        try:
            await conn.execute("")
        except Exception:
            return False
        return True

    async def alost(self, conn: Any) -> None:
        """:meth:`lost` for a connection of :meth:`acheckout`."""
        side = await self._loop()
        side.proven = False
        pool = conn._ledger_pool
        if pool is not None and not pool.closed:
            await pool.drain()
        await arelease(conn)

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close every pool (their workers end; the connections still out are closed when
        they come back). A checkout afterwards is refused: nothing reopens what closed."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            loops, self._loops = list(self._loops.items()), weakref.WeakKeyDictionary()
            self._proven = False
        if pool is not None:
            pool.close()
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for loop, side in loops:
            if side.guard is None or loop.is_closed():
                continue  # a loop that ended took its pool's tasks with it
            if loop is current:
                side.guard.cancel()  # it closes the pool once this coroutine yields
            elif loop.is_running():
                closed = asyncio.run_coroutine_threadsafe(_cancelled(side.guard), loop)
                with contextlib.suppress(Exception):  # a loop that does not answer in time
                    closed.result(10)


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it has finished (its ``finally`` included)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


__all__ = ["CHECKOUT_TIMEOUT_S", "IDLE_CHECK_S", "MAX_IDLE_S", "MAX_SIZE", "PgPool",
           "ahard_close", "aread_only_session", "arelease", "hard_close", "on_standby",
           "own_pids", "read_only_session", "release"]
