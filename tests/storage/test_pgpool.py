"""One pool to a PostgreSQL database: the hot path and the cold path (SQLAlchemy) take their
connections from the store's psycopg_pool, checkouts are bounded, a server that went away is
the caller's error at once (not a wait for the checkout timeout), an event loop that ends
takes its connections with it, and closing the store leaves no pool thread and no connection
behind."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.face import storage_of
from ledger.clock import ManualClock
from ledger.errors import DatabaseUnavailable, InvalidState
from ledger.storage.audit import AuditQueries
from ledger.storage.pgpool import PgPool, release
from ledger.testing.pgserver import PgServer, start_server

from ._readonly import driver_cause
from .helpers import budget, grant, routes

pytestmark = pytest.mark.postgres

T0 = 1_700_000_000.0


def _backends(server: PgServer, url: str) -> int:
    """The clients' sessions on ``url``'s database (the psql asking is on another one). Only
    client backends: an autovacuum worker that visits the database is listed there too, and
    a busy suite's counts were off by one while it ran."""
    db = url.rsplit("/", 1)[1]
    return int(server.psql("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                           f"'{db}' AND backend_type = 'client backend'"))


def _settled(server: PgServer, url: str, expected: int) -> int:
    """:func:`_backends`, once the sessions just closed have left the server (a closed
    connection's server process takes a moment to exit; waited for, up to 10 s). Garbage is
    collected first: a connection the pool was still making when its loop shut down is
    cancelled mid-way, and its socket closes when it is freed (what is counted is what the
    process still holds, not what it has let go of)."""
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        n = _backends(server, url)
        if n == expected or time.monotonic() > deadline:
            return n


def _pool_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ledger-postgres")]


def _pid_cold(store: Any) -> int:
    with store.context.engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _pid_hot(pool: PgPool) -> int:
    conn = pool.checkout()
    try:
        return int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])
    finally:
        release(conn)


def test_the_cold_path_and_the_hot_path_share_one_pool_and_close_leaves_nothing(
        pg_server: PgServer, pg_url: str) -> None:
    assert _pool_threads() == []
    led = Ledger.open(pg_url, clock=ManualClock(T0), migrate_schema=False)
    store = storage_of(led)
    pool = store.driver.pool
    led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())  # cold
    lease = led.acquire_lease("r1", ttl_s=30)  # hot
    led.get_run("r1")
    # One connection idle in the one pool: SQLAlchemy is lent the hot path's connection.
    assert _pid_hot(pool) == _pid_cold(store) == _pid_hot(pool)
    assert _backends(pg_server, pg_url) == 1
    assert _pool_threads()  # the pool's worker runs while the store is open

    async def asyncio_side() -> None:
        aled = AsyncLedger(led)
        att = await aled.begin_attempt(lease, route="a", envelope_hash="sha256:e",
                                       reserve="0.01")
        await aled.settle_attempt(lease, att.attempt_id, outcome="succeeded")
        await aled.renew_lease(lease, ttl_s=30)
        assert _backends(pg_server, pg_url) == 2  # and one of this event loop's own
        await aled.close()  # closes both pools, this loop's included

    asyncio.run(asyncio_side())
    assert _pool_threads() == []
    assert _backends(pg_server, pg_url) == 0
    led.close()  # twice is harmless


def test_checkouts_are_bounded(pg_url: str) -> None:
    led = Ledger.open(pg_url, clock=ManualClock(T0), migrate_schema=False)
    store = storage_of(led)
    small = PgPool(store.driver.pool.conninfo, where="small", max_size=2, timeout=0.2)
    try:
        held = [small.checkout() for _ in range(3)]  # the first is its own; two are pooled
        with pytest.raises(Exception) as caught:
            small.checkout()
        assert "couldn't get a connection" in str(caught.value)
        release(held.pop())
        held.append(small.checkout())  # a connection given back serves the next caller
        for conn in held:
            release(conn)
        # Through the driver, a pool that stays exhausted is a typed, retry-safe error.
        store.driver.pool, original = small, store.driver.pool
        held = [small.checkout() for _ in range(2)]
        try:
            with pytest.raises(DatabaseUnavailable, match="couldn't get a connection"):
                led.acquire_lease("r-none")
        finally:
            for conn in held:
                release(conn)
            store.driver.pool = original
    finally:
        small.close()
        led.close()


def test_an_event_loop_that_ends_takes_its_connections_with_it(
        pg_server: PgServer, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger used from one ``asyncio.run`` after another keeps no sessions of the loops
    that are gone (each loop has its own pool: asyncio connections belong to their loop)."""
    # A connection the pool was still making when its loop shut down is cancelled mid-way;
    # psycopg_pool logs that with the exception, whose traceback holds the half-made
    # connection. pytest's log capture keeps every record to the end of the test (a program's
    # logging does not), which would keep that session open: the pool's log stays out of it.
    monkeypatch.setattr(logging.getLogger("psycopg.pool"), "disabled", True)
    led = Ledger.open(pg_url, clock=ManualClock(T0), migrate_schema=False)
    try:
        led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r1", ttl_s=30)
        blocking = _backends(pg_server, pg_url)
        aled = AsyncLedger(led)

        async def burst() -> int:
            await asyncio.gather(*[aled.renew_lease(lease, ttl_s=30) for _ in range(4)])
            await asyncio.gather(*[aled.renew_lease(lease, ttl_s=30) for _ in range(4)])
            return _backends(pg_server, pg_url)

        for _ in range(3):
            assert asyncio.run(burst()) > blocking  # the loop's own connections, in use
            assert _settled(pg_server, pg_url, blocking) == blocking
    finally:
        led.close()
    assert _settled(pg_server, pg_url, 0) == 0


@pytest.fixture
def own_server() -> Iterator[PgServer]:
    """A server of this test's own, to stop without disturbing the others."""
    srv = start_server()
    try:
        yield srv
    finally:
        srv.cleanup()


def _told_at_once(err: DatabaseUnavailable) -> None:
    """The caller learnt of the server's absence from a connection attempt of its own, not
    from a wait for a connection the pool's worker could not make (``PoolTimeout``)."""
    from psycopg_pool import PoolTimeout

    cause = driver_cause(err)
    assert cause is not None and not isinstance(cause, PoolTimeout), repr(cause)
    assert "couldn't get a connection" not in str(err)


def test_a_server_gone_while_the_pool_holds_no_connection_is_told_at_once(
        own_server: PgServer) -> None:
    """After a checkout proved the server, the pool may hold no connection (the first one is
    the checkout's own; the pool's worker closes idle ones): a server gone then must not leave
    the next caller waiting for the checkout timeout, on the hot or the cold path, blocking
    or asyncio."""
    own_server.psql("CREATE DATABASE gone")
    led = Ledger.open(own_server.url("gone"), clock=ManualClock(T0))
    try:
        led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r1", ttl_s=30)
        pool = storage_of(led).driver.pool
        aled = AsyncLedger(led)

        async def asyncio_side() -> DatabaseUnavailable:
            await aled.renew_lease(lease, ttl_s=30)  # the loop's pool proven, empty
            led.renew_lease(lease, ttl_s=30)
            pool._sync_pool().drain()  # as the worker closes idle ones: proven, empty too
            own_server.stop()
            with pytest.raises(DatabaseUnavailable) as caught:
                await aled.renew_lease(lease, ttl_s=30)
            return caught.value

        _told_at_once(asyncio.run(asyncio_side()))
        with pytest.raises(DatabaseUnavailable) as cold:
            led.get_run("r1")  # SQLAlchemy, lent a connection by the same pool
        _told_at_once(cold.value)
        with pytest.raises(DatabaseUnavailable) as hot:
            led.renew_lease(lease, ttl_s=30)
        _told_at_once(hot.value)

        own_server.start()  # back: the same ledger answers again, on both paths
        assert led.renew_lease(lease, ttl_s=30).run_id == "r1"
        assert led.get_run("r1").run_id == "r1"
    finally:
        led.close()


CALLS = 100  # each caller's calls at most: the close comes well before they are done


def test_calls_in_flight_when_the_ledger_closes_fail_as_invalid_state_and_reopen_nothing(
        pg_server: PgServer, pg_url: str) -> None:
    """A checkout waiting when the pool closed (or asked after) is the ledger's typed error,
    never psycopg_pool's or an AttributeError on the closed pool; nothing opens a new one."""
    led = Ledger.open(pg_url, migrate_schema=False)
    led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    started = threading.Event()

    def outcome(call: Any) -> BaseException | None:
        try:
            for _ in range(CALLS):
                call()
                started.set()
        except BaseException as e:  # what each caller ends with is asserted below
            return e
        return None

    async def asyncio_side() -> list[BaseException | None]:
        aled = AsyncLedger(led)

        async def caller() -> BaseException | None:
            try:
                for _ in range(CALLS):
                    await aled.acquire_lease("r1", ttl_s=60)
                    started.set()
            except BaseException as e:
                return e
            return None

        callers = [asyncio.create_task(caller()) for _ in range(50)]
        while not started.is_set():
            await asyncio.sleep(0.001)
        await aled.close()
        return list(await asyncio.gather(*callers))

    ends = asyncio.run(asyncio_side())
    _closed_ledgers_refusals(ends, 50)
    assert _pool_threads() == []
    assert _settled(pg_server, pg_url, 0) == 0

    led = Ledger.open(pg_url, migrate_schema=False)
    led.admit_run("r2", plan=routes(), budget=budget(), grant=grant())
    started.clear()
    found: list[BaseException | None] = []
    threads = [threading.Thread(target=lambda: found.append(
        outcome(lambda: led.acquire_lease("r2", ttl_s=60)))) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait(60)
    led.close()
    for t in threads:
        t.join(60)
    _closed_ledgers_refusals(found, 8)
    assert _pool_threads() == []
    assert _settled(pg_server, pg_url, 0) == 0


def _closed_ledgers_refusals(ends: list[BaseException | None], callers: int) -> None:
    assert len(ends) == callers
    for e in ends:
        assert isinstance(e, InvalidState), repr(e)
        assert e.fields["problem"] == "ledger_closed" and "Ledger.open" in str(e)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_closed_ledger_leaves_no_engine_nor_pool_in_memory(pg_url: str, pg_empty_url: str,
                                                             kind: str) -> None:
    # SQLAlchemy's PostgreSQL dialect keeps its last 128 instances in reflection caches of its
    # class: nothing the ledger makes may hang off a dialect (an event listener) or send one
    # there on every open (a reflected has_table), or each closed ledger's engine, context
    # and pool would stay for 128 opens. The first open migrates a database with no schema
    # (Alembic reflects its version table); the others find it at head.
    alive: list[weakref.ref[Any]] = []

    def kept(led: Any) -> None:
        store = storage_of(led)
        alive.extend(weakref.ref(o) for o in (store, store.context, store.context.engine,
                                              store.driver.pool))
        assert AuditQueries(store.context).schema_present()

    def sync(url: str) -> None:
        with Ledger.open(url) as led:
            kept(led)
            led.health()

    async def awaited(url: str) -> None:
        async with AsyncLedger.open(url) as led:
            kept(led)
            await led.health()

    for i in range(20):
        url = pg_empty_url if i == 0 else pg_url
        if kind == "sync":
            sync(url)
        else:
            asyncio.run(awaited(url))
    for thread in threading.enumerate():
        if thread.name == "ledger-close":
            thread.join()  # an AsyncLedger's close was awaited: its thread is on its way out
    gc.collect()
    assert [r() for r in alive if r() is not None] == []
