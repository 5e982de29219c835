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
  dropped one dropped them all), and the pool opens new ones;
* **errors told at once**: psycopg_pool opens connections in its own workers, and a caller
  waiting for one only learns of a timeout. So until a connection has been seen working (at
  the first checkout, and after one was found dead or failed), a checkout connects by itself,
  in the caller: a server that is away or refuses the URL's credentials is the caller's typed
  error at once (:class:`~ledger.errors.DatabaseUnavailable`,
  :class:`~ledger.errors.DatabaseSetupError`), and a server that answers serves that caller's
  transaction on the connection just made (closed afterwards, outside the pool) while the pool
  takes over for the next ones.

A pooled connection goes back to its pool when it is released (:func:`release`), which is also
what closing it does: that is how SQLAlchemy gives back what it was lent. psycopg and
psycopg_pool are imported on first use: they are the optional ``postgres`` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import select
import threading
import time
import weakref
from typing import Any

#: Connections out at once, per pool (blocking callers; and per event loop, asyncio ones).
MAX_SIZE = 20
#: How long a checkout waits for a connection when all of them are out.
CHECKOUT_TIMEOUT_S = 30.0
#: A connection idle longer than this is asked (one round trip) before it is used again.
IDLE_CHECK_S = 1.0


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

        async def close(self) -> None:
            if self._ledger_pool is None:
                await super().close()
            else:
                await arelease(self)

    return Conn, AConn


def _told_goodbye(conn: Any) -> bool:
    """Whether the server wrote to, or closed, a connection nobody is using."""
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _fresh(conn: Any) -> None:
    """Made just now by the pool: as good as just used."""
    conn._ledger_idle_since = time.monotonic()


async def _afresh(conn: Any) -> None:
    _fresh(conn)


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
    if pool is None:
        hard_close(conn)
        return
    if not conn.closed and not conn.autocommit:
        try:
            conn.autocommit = True  # as the hot path takes it; SQLAlchemy ended its own
        except Exception:
            hard_close(conn)  # still in a transaction: not fit to go back as it is
    conn._ledger_idle_since = time.monotonic()
    pool.putconn(conn)  # a closed pool closes it


async def arelease(conn: Any) -> None:
    """:func:`release` for a connection of :meth:`PgPool.acheckout`."""
    pool, conn._ledger_pool = conn._ledger_pool, None
    if pool is None:
        await ahard_close(conn)
        return
    conn._ledger_idle_since = time.monotonic()
    await pool.putconn(conn)


class _Loop:
    """The asyncio side of a :class:`PgPool` on one event loop."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.opened = False
        self.proven = False
        self.lock: asyncio.Lock | None = None


class PgPool:
    """The connections of one store to its PostgreSQL database (see the module docstring)."""

    def __init__(self, conninfo: str, *, where: str, max_size: int = MAX_SIZE,
                 timeout: float = CHECKOUT_TIMEOUT_S) -> None:
        self.conninfo = conninfo
        self.where = where
        self.max_size = max_size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._probing = threading.Lock()
        self._pool: Any = None
        self._proven = False
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Loop] = (
            weakref.WeakKeyDictionary())

    def _settings(self, *, asyncio: bool) -> dict[str, Any]:
        return {
            "kwargs": {"autocommit": True}, "min_size": 0, "max_size": self.max_size,
            "timeout": self.timeout, "configure": _afresh if asyncio else _fresh, "open": False,
            "name": "ledger-postgres", "num_workers": 1,
            # A connection that cannot be made is the checkout's to tell (it connects by
            # itself until one works): the pool's workers do not keep retrying in the dark.
            "reconnect_timeout": 0.0,
        }

    # -- blocking --------------------------------------------------------------------------

    def _sync_pool(self) -> Any:
        pool = self._pool
        if pool is None:
            from psycopg_pool import ConnectionPool

            with self._lock:
                if self._pool is None:
                    pool = ConnectionPool(self.conninfo, connection_class=_connection_classes()[0],
                                          **self._settings(asyncio=False))
                    pool.open()
                    self._pool = pool
                pool = self._pool
        return pool

    def checkout(self) -> Any:
        """A working connection in autocommit mode, for one transaction; give it back with
        :func:`release`."""
        pool = self._sync_pool()
        while True:
            if not self._proven:
                with self._probing:
                    if not self._proven:
                        conn = _connection_classes()[0].connect(self.conninfo, autocommit=True)
                        self._proven = True
                        return conn  # a connection of its own, closed after its transaction
            conn = pool.getconn()
            conn._ledger_pool = pool
            if self._usable(conn):
                return conn
            self.lost(conn)

    def lend(self) -> Any:
        """A connection for SQLAlchemy (the engine's ``creator``): as :meth:`checkout`, out of
        autocommit mode, for SQLAlchemy begins and ends its transactions itself. Closing it
        gives it back."""
        conn = self.checkout()
        conn.autocommit = False
        return conn

    def _usable(self, conn: Any) -> bool:
        if conn.closed or _told_goodbye(conn):
            return False
        if time.monotonic() - conn._ledger_idle_since < IDLE_CHECK_S:
            return True
        try:
            conn.execute("")
        except Exception:  # any failure to answer: the connection is not used
            return False
        return True

    def lost(self, conn: Any) -> None:
        """``conn`` was found dead, or failed: it goes, the idle ones beside it go too (the
        server that dropped one dropped them all), and the next checkout connects by itself
        until a connection is seen working again."""
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
            from psycopg_pool import AsyncConnectionPool

            with self._lock:
                side = self._loops.get(loop)
                if side is None:
                    side = self._loops[loop] = _Loop(AsyncConnectionPool(
                        self.conninfo, connection_class=_connection_classes()[1],
                        **self._settings(asyncio=True)))
        if not side.opened:
            await side.pool.open()
            side.opened = True
        return side

    async def acheckout(self) -> Any:
        """:meth:`checkout` for an asyncio caller (a connection of the running loop)."""
        side = await self._loop()
        while True:
            if not side.proven:
                if side.lock is None:
                    side.lock = asyncio.Lock()
                async with side.lock:
                    if not side.proven:
                        conn = await _connection_classes()[1].connect(self.conninfo,
                                                                      autocommit=True)
                        side.proven = True
                        return conn
            conn = await side.pool.getconn()
            conn._ledger_pool = side.pool
            if await self._ausable(conn):
                return conn
            await self.alost(conn)

    async def _ausable(self, conn: Any) -> bool:
        if conn.closed or _told_goodbye(conn):
            return False
        if time.monotonic() - conn._ledger_idle_since < IDLE_CHECK_S:
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
        """Close both pools (their workers end; the connections still out are closed when
        they come back). A store used again afterwards opens new ones."""
        with self._lock:
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
            if not side.opened or loop.is_closed():
                continue  # a loop that ended took its pool's tasks with it
            if loop is current:
                # Called from a coroutine of that loop: it cannot be waited for here.
                loop.create_task(side.pool.close())
            elif loop.is_running():
                with contextlib.suppress(Exception):  # a loop that does not answer in time
                    asyncio.run_coroutine_threadsafe(side.pool.close(), loop).result(10)


__all__ = ["CHECKOUT_TIMEOUT_S", "IDLE_CHECK_S", "MAX_SIZE", "PgPool", "ahard_close", "arelease",
           "hard_close", "release"]
