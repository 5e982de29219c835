"""One pool to a PostgreSQL database: the hot path and the cold path (SQLAlchemy) take their
connections from the store's psycopg_pool, checkouts are bounded, and closing the store leaves
no pool thread and no connection behind."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from sqlalchemy import text

from ledger.api.facade import AsyncLedger, Ledger, storage_of
from ledger.clock import ManualClock
from ledger.errors import DatabaseUnavailable
from ledger.storage.pgpool import PgPool, release
from ledger.testing.pgserver import PgServer

from .helpers import budget, grant, routes

pytestmark = pytest.mark.postgres

T0 = 1_700_000_000.0


def _backends(server: PgServer, url: str) -> int:
    """The server's sessions on ``url``'s database (the psql asking is on another one)."""
    db = url.rsplit("/", 1)[1]
    return int(server.psql(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}'"))


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
