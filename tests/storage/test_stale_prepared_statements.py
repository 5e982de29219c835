"""A migration that changes a column's type under running workers costs them nothing.

psycopg prepares on the server the statements a connection repeats. Once a migration changes
the type of a column such a statement returns (0021: ``health.key`` from 200 characters to
609), the server refuses it on that connection until it is prepared again (``cached plan
must not change result type``, SQLSTATE 0A000): a worker's next turn failed with a plain
``StorageError`` out of its snapshot, and its Run ended ``failed`` with no Attempt. The
transaction was rolled back, so it is retry-safe: the driver lets go of what the connection
prepared and runs the transaction again from its start on it; one it cannot make anew (a
caller of the driver itself, past the first step) is told
:class:`~ledger.errors.DatabaseUnavailable` (``schema_changed``), which a retry gets past.
The cold path prepares nothing. (tests/storage/test_schema_change_once.py: every call of the
API, and the pool drained at most once.)

Migrations also wait a bounded time for a table's lock: an ``ALTER TABLE`` queued behind a
transaction left open holds every worker's statements on that table behind it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from ledger import AsyncLedger, Budget, Grant, Ledger, Price, Route
from ledger.api.face import storage_of
from ledger.api.turn import SendResult, aexecute, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.errors import DatabaseUnavailable
from ledger.storage import migrate
from ledger.storage.driver import Flush, Q
from ledger.storage.pgpool import release
from ledger.storage.statements import Stmt
from ledger.storage.store import resolving
from ledger.testing.pgserver import PgServer

from .helpers import downgrade_schema

pytestmark = pytest.mark.postgres

T0 = 30_000.0
ROUTE = Route(id="a", provider="OpenAI", model="m", group="g", recipient="r", price=Price())
OK = SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)
ENVELOPE = Envelope(parts=[Part(content="Hi.")], max_output_tokens=10)
# Uses of a statement that make psycopg prepare it on every connection of a single caller's
# pool (it prepares one a connection ran 5 times; the pool hands its connections round).
WARM = 20
# The driver's and the store's word that a transaction ran again, which proves that the
# statement was prepared, and refused, on the connection the test used after the migration.
AGAIN = "a migration changed the schema under"
# A statement that returns health.key, as the snapshot's health read does.
HEALTH_KEYS = Stmt("health_keys", "SELECT key FROM health WHERE key = %s", ("key",), ("key",),
                   None)
PATIENCE_S = 15  # how long the transaction left open lasts at most: a miss fails, it never hangs
ANY_RUN = Stmt("any_run", "SELECT count(*) FROM runs", (), ("count",), None)


def _migrate_column(url: str) -> None:
    """What a later migration may do under running workers: change a column's type."""
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as conn:
        conn.execute("ALTER TABLE health ALTER COLUMN key TYPE VARCHAR(700)")


def _admitted(led: Ledger) -> Any:
    led.admit_run("r", plan=[ROUTE], policy="goclaw", grant=Grant(recipients={"r": ["user_input"]}),
                  budget=Budget(max_calls=100, max_retries=6, max_cost=Decimal(1)))
    return led.acquire_lease("r", ttl_s=600)


def _ran_again(caplog: pytest.LogCaptureFixture) -> int:
    return sum(AGAIN in r.getMessage() for r in caplog.records)


def test_a_turn_after_a_migration_changed_a_column_it_reads_goes_through(
        pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ledger.storage")
    with Ledger.open(pg_url, clock=ManualClock(T0)) as led:
        lease = _admitted(led)
        for _ in range(WARM):
            execute(led, lease, ENVELOPE, lambda d: OK)
        _migrate_column(pg_url)
        result = execute(led, lease, ENVELOPE, lambda d: OK)
        assert result.output == "ok"
        assert _ran_again(caplog) >= 1
        assert led.get_run("r").status.value == "running"


def test_an_async_turn_after_a_migration_changed_a_column_it_reads_goes_through(
        pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ledger.storage")
    with Ledger.open(pg_url, clock=ManualClock(T0)) as sync:
        lease = _admitted(sync)

    async def main() -> str:
        async with AsyncLedger.open(pg_url, clock=ManualClock(T0)) as led:
            for _ in range(WARM):
                await aexecute(led, lease, ENVELOPE, lambda d: OK)
            _migrate_column(pg_url)
            return (await aexecute(led, lease, ENVELOPE, lambda d: OK)).output or ""

    assert asyncio.run(main()) == "ok"
    assert _ran_again(caplog) >= 1


def _health_keys_second(sql: Any) -> Iterator[Any]:
    """A transaction whose statement on health comes past its first step."""
    yield Q(ANY_RUN)
    rows = yield Flush((Q(HEALTH_KEYS, {"key": "route:a"}),), commit=True)
    return rows


def test_a_stale_statement_past_the_first_step_is_retry_safe_and_a_write_is_made_again(
        pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ledger.storage")
    with Ledger.open(pg_url) as led:
        store = storage_of(led)
        for _ in range(WARM):
            store.driver.run(_health_keys_second(store.sql), write=False)
        _migrate_column(pg_url)
        # The transaction function decided on rows of the one rolled back: it is not sent
        # its step again, and the error says what happened and that a retry goes through.
        with pytest.raises(DatabaseUnavailable) as ei:
            store.driver.run(_health_keys_second(store.sql), write=False)
        assert ei.value.fields["schema_changed"] is True
        assert "commit" not in ei.value.fields
        assert "a retry prepares the statement anew and goes through" in str(ei.value)
        # Each connection that held the statement lets go of it when refused: once at most.
        refused = _refusals(lambda: store.driver.run(_health_keys_second(store.sql),
                                                     write=False))
        for _ in range(WARM):
            store.driver.run(_health_keys_second(store.sql), write=False)
        assert len(refused) < WARM
        _migrate_column_back(pg_url)
        # A write through the store's resolving() is made again from its start.
        assert store.runner.run(resolving(
            "probe", lambda _again: _health_keys_second(store.sql))) == [[]]
        assert _ran_again(caplog) >= 1


def _refusals(call: Callable[[], object]) -> list[DatabaseUnavailable]:
    """``call()`` made :data:`WARM` times: the schema changes it was told."""
    told: list[DatabaseUnavailable] = []
    for _ in range(WARM):
        try:
            call()
        except DatabaseUnavailable as e:
            assert e.fields["schema_changed"] is True
            told.append(e)
    return told


def test_each_connection_that_prepared_the_statement_lets_go_of_it_once_and_serves_on(
        pg_url: str) -> None:
    with Ledger.open(pg_url) as led:
        store = storage_of(led)
        store.driver.run(_health_keys_second(store.sql), write=False)  # the pool serves now
        held = [store.driver.pool.checkout() for _ in range(3)]
        for conn in held:
            for _ in range(WARM):
                conn.execute(HEALTH_KEYS.text, ["route:a"]).fetchall()
            assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0]
        pids = {conn.info.backend_pid for conn in held}
        for conn in held:
            release(conn)
        _migrate_column(pg_url)
        # A transaction the driver cannot make anew (past its first step) is told, once per
        # connection; no connection is dropped for it, nor the pool drained.
        refused = _refusals(lambda: store.driver.run(_health_keys_second(store.sql),
                                                     write=False))
        assert 1 <= len(refused) <= len(held)
        assert _refusals(lambda: store.driver.run(_health_keys_second(store.sql),
                                                  write=False)) == []
        held = [store.driver.pool.checkout() for _ in range(3)]
        try:
            assert {conn.info.backend_pid for conn in held} == pids
        finally:
            for conn in held:
                release(conn)


def _migrate_column_back(url: str) -> None:
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as conn:
        conn.execute("ALTER TABLE health ALTER COLUMN key TYPE VARCHAR(609)")


def test_a_cold_path_read_after_a_migration_goes_through_for_it_prepares_nothing(
        pg_url: str) -> None:
    with Ledger.open(pg_url, clock=ManualClock(T0)) as led:
        for _ in range(WARM):
            led.health()
        _migrate_column(pg_url)
        for _ in range(WARM):
            assert led.health() == {}


def test_a_migration_behind_a_transaction_left_open_gives_up_in_time_and_changes_nothing(
        pg_server: PgServer, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(migrate, "MIGRATION_LOCK_TIMEOUT", "500ms")  # the test's patience
    downgrade_schema(pg_url, "0020", "health")
    holder = psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"))
    # The bound of a miss: the session lets go by itself, and the migration would go through.
    timer = threading.Timer(PATIENCE_S, holder.rollback)
    try:
        holder.execute("SELECT count(*) FROM health")  # its transaction stays open
        timer.start()
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as ei:
            Ledger.open(pg_url)  # migrates: 0021 alters health
        waited = time.monotonic() - started
        assert 0.5 <= waited < PATIENCE_S, waited
        err = ei.value
        assert err.fields["contention"] == "55P03"
        assert err.fields["revision"] == "0020"
        assert "pg_stat_activity" in str(err) and "pg_terminate_backend" in str(err)
        assert "failover-ledger db init" in str(err) and "nothing changed" in str(err)
        with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql")) as look:
            assert look.execute("SELECT version_num FROM alembic_version").fetchone() == (
                "0020",)
            assert look.execute(
                "SELECT character_maximum_length FROM information_schema.columns "
                "WHERE table_name = 'health' AND column_name = 'key'").fetchone() == (200,)
    finally:
        timer.cancel()
        timer.join()
        holder.rollback()
        holder.close()
    Ledger.open(pg_url).close()  # once the session is gone, it migrates
    with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql")) as look:
        assert look.execute("SELECT version_num FROM alembic_version").fetchone() == (
            migrate.head_revision(),)
