"""A migration under running workers is seen by no call, and costs each connection one statement.

After a migration changes the type of a column a prepared statement returns, the server refuses
that statement on every connection that prepared it (``cached plan must not change result
type``). Two things are protected here:

* every transaction, not only a turn's own writes (a retry permission, an event, a probe claim,
  a lease renewal, and the cold path's reads), goes through the first time it is made after the
  change: the refused one was rolled back whole, and it runs once more from its start on a
  connection that no longer holds the statement;
* the pool is drained at most once per change: the refused connection is cleaned where it is
  (psycopg's rollback deallocates what it prepared), so the connections that were in use
  beside it, each refused once in turn, do not drain it again, each closing the fresh ones
  made since.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import psycopg
import psycopg_pool
import pytest

from ledger import AsyncLedger, Budget, Grant, Ledger, Price, Route
from ledger.api.face import storage_of
from ledger.clock import ManualClock
from ledger.storage.driver import Q
from ledger.storage.statements import Stmt

pytestmark = pytest.mark.postgres

T0 = 30_000.0
ROUTE = Route(id="a", provider="OpenAI", model="m", group="g", recipient="r", price=Price())
# Uses of a call that make psycopg prepare its statements on every connection a single
# caller's pool hands round (it prepares what a connection ran 5 times).
WARM = 20
PATIENCE_S = 15  # how long a barrier waits at most: a miss fails, it never hangs
# Connections in use at once when the change is met (below the pool's bound of 20).
AT_ONCE = 4
HEALTH_KEYS = Stmt("health_keys", "SELECT key FROM health WHERE key = %s", ("key",), ("key",),
                   None)
# The columns a migration changes, each returned by statements of the calls below: health.key
# (the health read, the probe claim), runs.lease_holder (the Run's lock that opens every write
# under a lease), runs.compactions (returned past the first step of the compaction's write,
# alone: the lock before it is then still good). Each change flips between two types, so a test
# may make several.
TYPES = {("health", "key"): ("character varying(609)", "character varying(700)"),
         ("runs", "lease_holder"): ("character varying(200)", "character varying(300)"),
         ("runs", "compactions"): ("integer", "bigint")}
PAST_FIRST = ("runs", "compactions")


def _migrate(url: str, name: str = "") -> None:
    """What a later migration may do under running workers: change the types of the columns
    that statements of the call ``name`` return, each to its other type."""
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as conn:
        for (table, column), types in TYPES.items():
            if ((table, column) == PAST_FIRST) != (name == "record_compaction"):
                continue
            [(now,)] = conn.execute(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = %s::regclass AND attname = %s", [table, column]).fetchall()
            other = types[1] if now == types[0] else types[0]
            conn.execute(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE {other}")


@pytest.fixture
def drains(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each drain of a psycopg pool (blocking or asyncio), counted as it happens."""
    seen: list[str] = []
    sync_drain = psycopg_pool.ConnectionPool.drain
    async_drain = psycopg_pool.AsyncConnectionPool.drain

    def counted(pool: Any) -> None:
        seen.append("sync")
        sync_drain(pool)

    async def acounted(pool: Any) -> None:
        seen.append("async")
        await async_drain(pool)

    monkeypatch.setattr(psycopg_pool.ConnectionPool, "drain", counted)
    monkeypatch.setattr(psycopg_pool.AsyncConnectionPool, "drain", acounted)
    return seen


def _admit(led: Ledger) -> Any:
    led.admit_run("r", plan=[ROUTE], policy="goclaw", grant=Grant(recipients={"r": ["user_input"]}),
                  budget=Budget(max_calls=100, max_retries=1000, max_cost=Decimal(1)))
    return led.acquire_lease("r", ttl_s=600)


CALLS = ("reserve_retry", "append_event", "claim_probe", "renew_lease", "record_compaction",
         "health", "get_run")


def _calls(led: Any, lease: Any) -> dict[str, Callable[[], Any]]:
    """The calls other than a turn's own writes, on a Ledger or an AsyncLedger."""
    return {
        "reserve_retry": lambda: led.reserve_retry(lease),
        "append_event": lambda: led.append_event(lease, "note", {"n": 1}),
        "claim_probe": lambda: led.claim_probe(ROUTE, 0.0),
        "renew_lease": lambda: led.renew_lease(lease, ttl_s=600),
        "record_compaction": lambda: led.record_compaction(lease),
        "health": lambda: led.health(),
        "get_run": lambda: led.get_run("r"),
    }


def test_every_call_after_a_migration_goes_through_the_first_time(
        pg_url: str, drains: list[str]) -> None:
    refused: dict[str, BaseException] = {}
    with Ledger.open(pg_url, clock=ManualClock(T0)) as led:
        calls = _calls(led, _admit(led))
        for name in CALLS:
            for _ in range(WARM):
                calls[name]()
            before = len(drains)
            _migrate(pg_url, name)
            try:
                calls[name]()
            except Exception as e:  # each call's own outcome, told together
                refused[name] = e
            assert len(drains) - before <= 1, (name, drains)
            for _ in range(WARM):  # and every one after it, on each connection of the pool
                calls[name]()
    assert refused == {}


def test_every_async_call_after_a_migration_goes_through_the_first_time(
        pg_url: str, drains: list[str]) -> None:
    with Ledger.open(pg_url, clock=ManualClock(T0)) as sync:
        lease = _admit(sync)

    async def main() -> dict[str, BaseException]:
        refused: dict[str, BaseException] = {}
        async with AsyncLedger.open(pg_url, clock=ManualClock(T0)) as led:
            calls = _calls(led, lease)
            for name in CALLS:
                for _ in range(WARM):
                    await calls[name]()
                before = len(drains)
                _migrate(pg_url, name)
                try:
                    await calls[name]()
                except Exception as e:
                    refused[name] = e
                assert len(drains) - before <= 1, (name, drains)
                for _ in range(WARM):
                    await calls[name]()
        return refused

    assert asyncio.run(main()) == {}


def _read_after(barrier: threading.Barrier) -> Iterator[Any]:
    """A read that waits, on its connection, until as many are in use at once."""
    barrier.wait(PATIENCE_S)
    return (yield Q(HEALTH_KEYS, {"key": "route:a"}))


def test_connections_in_use_when_the_schema_changed_drain_the_pool_at_most_once(
        pg_url: str, drains: list[str]) -> None:
    with Ledger.open(pg_url) as led:
        driver = storage_of(led).driver
        failed: list[BaseException] = []

        def at_once() -> None:
            barrier = threading.Barrier(AT_ONCE)

            def one() -> None:
                try:
                    driver.run(_read_after(barrier), write=False)
                except BaseException as e:  # told to the test's thread
                    failed.append(e)

            threads = [threading.Thread(target=one) for _ in range(AT_ONCE)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        for _ in range(WARM // 2):  # every connection of the pool prepares the read
            at_once()
        assert not failed, failed
        prepared = len(drains)
        _migrate(pg_url)
        at_once()  # each connection in use meets the change
        assert failed == []
        assert len(drains) - prepared <= 1, drains


def test_async_connections_in_use_when_the_schema_changed_drain_the_pool_at_most_once(
        pg_url: str, drains: list[str]) -> None:
    async def main() -> list[BaseException]:
        async with AsyncLedger.open(pg_url) as led:
            driver = storage_of(led).driver

            async def at_once() -> list[BaseException]:
                out = await asyncio.gather(*(
                    driver.arun(_read_now(), write=False) for _ in range(AT_ONCE)),
                    return_exceptions=True)
                return [e for e in out if isinstance(e, BaseException)]

            for _ in range(WARM):
                assert await at_once() == []
            prepared = len(drains)
            _migrate(pg_url)
            failed = await at_once()
            assert len(drains) - prepared <= 1, drains
            return failed

    assert asyncio.run(main()) == []


def _read_now() -> Iterator[Any]:
    return (yield Q(HEALTH_KEYS, {"key": "route:a"}))
