"""SQLite's async transactions queued behind a busy writer commit together, and a group changes
nothing a caller can see but the number of commits.

The driver-level tests hold the database's thread with a transaction that waits on an event,
queue the others behind it (one ``asyncio.sleep(0)`` lets every task submit its transaction),
then let go: what queued runs as one group, deterministically. Each member's result, error and
writes are then checked against what it would have had alone. The ledger-level test holds
SQLite's write lock from another process instead, so that concurrent begins on one Run queue
for real, and checks that the budget is exact with the begins committed in one group.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Generator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger import AsyncLedger
from ledger.errors import BudgetExceeded, LedgerError
from ledger.storage.driver import Flush, Q, SqliteDriver, Tx

from .helpers import SQLITE_LOCK_HOLDER, budget, routes

PATIENCE_S = 120


@dataclass(frozen=True)
class _Sql:
    text: str
    rows: bool = True

    def args(self, params: Any) -> list[Any]:
        return list(params)


INSERT = _Sql("INSERT INTO t (k) VALUES (:k)", rows=False)
COUNT = _Sql("SELECT count(*) FROM t")
INSERT_CHILD = _Sql("INSERT INTO child (k, parent) VALUES (:k, :parent)", rows=False)
INSERT_BOOM = _Sql("INSERT INTO boom (k) VALUES (:k)", rows=False)


def _db(tmp_path: Path) -> str:
    path = str(tmp_path / "group.db")
    conn = sqlite3.connect(path)
    conn.executescript("""
        PRAGMA journal_mode = WAL;
        CREATE TABLE t (k TEXT PRIMARY KEY);
        CREATE TABLE parent (k TEXT PRIMARY KEY);
        CREATE TABLE child (k TEXT PRIMARY KEY,
                            parent TEXT REFERENCES parent (k) DEFERRABLE INITIALLY DEFERRED);
        CREATE TABLE boom (k TEXT);
        -- Ends the whole transaction from inside a statement, as a full disk or an I/O error
        -- does.
        CREATE TRIGGER boom_ends_it BEFORE INSERT ON boom
            BEGIN SELECT RAISE(ROLLBACK, 'the transaction is gone'); END;
    """)
    conn.close()
    return path


def _keys(path: str, table: str = "t") -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return sorted(k for (k,) in conn.execute(f"SELECT k FROM {table}"))
    finally:
        conn.close()


class _Gate:
    """A transaction that holds the database's thread until :meth:`open`, and counts the
    commits of that thread's connection from then on."""

    def __init__(self, driver: SqliteDriver) -> None:
        self.driver = driver
        self.started = threading.Event()
        self.go = threading.Event()
        self.statements: list[str] = []

    def tx(self) -> Tx[str]:
        conn = self.driver.connection()
        conn.set_trace_callback(self.statements.append)
        self.started.set()
        assert self.go.wait(PATIENCE_S)
        yield Q(INSERT, {"k": "gate"})
        return "gate"

    def commits(self) -> int:
        return sum(1 for s in self.statements if s.strip().upper() == "COMMIT")


def insert(k: str) -> Tx[int]:
    yield Q(INSERT, {"k": k})
    [(n,)] = yield Q(COUNT)
    return int(n)


def insert_then_fail(k: str) -> Tx[int]:
    yield Q(INSERT, {"k": k})
    raise ValueError(f"{k} refuses")


def commit_then(k: str, path: str, *, fail: bool) -> Tx[bool]:
    """Insert, reach the commit point, then look from another connection (or fail)."""
    yield Flush((Q(INSERT, {"k": k}),), commit=True)
    if fail:
        raise ValueError(f"{k} refused once recorded")
    return k in _keys(path)


def orphan(k: str) -> Tx[None]:
    yield Q(INSERT_CHILD, {"k": k, "parent": "nobody"})  # deferred: fails at COMMIT


def boom() -> Tx[None]:
    yield Q(INSERT_BOOM, {"k": "boom"})


async def _grouped(driver: SqliteDriver, txs: list[Generator[Any, Any, Any]]
                   ) -> tuple[_Gate, list[Any]]:
    """Run ``txs`` as one group behind a gate; their results or errors, in order."""
    gate = _Gate(driver)
    held = asyncio.ensure_future(driver.arun(gate.tx(), write=True))
    assert await asyncio.to_thread(gate.started.wait, PATIENCE_S)
    tasks = [asyncio.ensure_future(driver.arun(tx, write=True)) for tx in txs]
    await asyncio.sleep(0)  # every task submits its transaction: they queue behind the gate
    gate.go.set()
    assert await held == "gate"
    return gate, await asyncio.gather(*tasks, return_exceptions=True)


def _run_grouped(path: str, txs: list[Generator[Any, Any, Any]],
                 then: Generator[Any, Any, Any] | None = None) -> tuple[_Gate, list[Any], Any]:
    """``txs`` run as one group behind a gate on a fresh driver, then ``then`` alone: the gate,
    their results or errors in order, and ``then``'s result."""
    driver = SqliteDriver(path)

    async def main() -> tuple[_Gate, list[Any], Any]:
        gate, got = await _grouped(driver, txs)
        return gate, got, None if then is None else await driver.arun(then, write=True)

    try:
        return asyncio.run(main())
    finally:
        driver.close()


def test_transactions_queued_behind_a_busy_writer_commit_once_and_run_in_arrival_order(
        tmp_path: Path) -> None:
    path = _db(tmp_path)
    gate, got, _ = _run_grouped(path, [insert(f"k{i}") for i in range(5)])
    assert got == [2, 3, 4, 5, 6]  # each saw the gate's row and those queued before it
    assert gate.commits() == 2  # the gate alone, then the five together
    assert _keys(path) == sorted(["gate", *(f"k{i}" for i in range(5))])


def test_a_member_failing_before_its_commit_point_is_rolled_back_alone(tmp_path: Path) -> None:
    path = _db(tmp_path)
    _, got, _ = _run_grouped(path, [insert("a"), insert_then_fail("b"), insert("k"),
                                    insert("a")])
    assert got[0] == 2 and got[2] == 3
    assert isinstance(got[1], ValueError) and str(got[1]) == "b refuses"
    # A SQLite error is told as the ledger's, as it is alone, with the driver's as its cause.
    assert isinstance(got[3], LedgerError) and isinstance(got[3].__cause__, sqlite3.Error)
    assert _keys(path) == ["a", "gate", "k"]


def test_code_after_a_commit_point_runs_once_the_group_is_durable(tmp_path: Path) -> None:
    path = _db(tmp_path)
    _, got, _ = _run_grouped(path, [commit_then("a", path, fail=False),
                                    commit_then("b", path, fail=True), insert("c")])
    assert got[0] is True  # another connection already saw its row: it was committed
    # Failing after its commit point keeps what it committed (a refusal recorded, then raised).
    assert isinstance(got[1], ValueError) and got[2] == 4
    assert _keys(path) == ["a", "b", "c", "gate"]


def test_a_failed_group_commit_tells_every_member_and_keeps_none_of_their_writes(
        tmp_path: Path) -> None:
    path = _db(tmp_path)
    # Then another transaction alone: the thread goes on.
    _, got, after = _run_grouped(path, [insert("a"), orphan("o"), insert("b")],
                                 then=insert("after"))
    assert all(isinstance(g, LedgerError) and isinstance(g.__cause__, sqlite3.IntegrityError)
               for g in got), got
    assert len({id(g) for g in got}) == len(got)  # each caller its own error to raise
    assert after == 2 and _keys(path) == ["after", "gate"] and _keys(path, "child") == []


def test_a_failure_that_ends_sqlite_s_transaction_fails_the_members_it_held_and_no_other(
        tmp_path: Path) -> None:
    path = _db(tmp_path)
    _, got, _ = _run_grouped(path, [insert("a"), insert("b"), boom(), insert("c"), insert("d")])
    # "a" and "b" were held in the transaction SQLite ended: told, and not kept; "c" and "d"
    # ran in the next one (each saw the gate's row, committed alone before them).
    assert all(isinstance(g, LedgerError) and "the transaction is gone" in str(g)
               for g in got[:3]), got
    assert got[3:] == [2, 3]
    assert _keys(path) == ["c", "d", "gate"] and _keys(path, "boom") == []


def test_a_transaction_whose_caller_was_cancelled_before_it_was_taken_never_runs(
        tmp_path: Path) -> None:
    path = _db(tmp_path)
    driver = SqliteDriver(path)

    async def main() -> None:
        gate = _Gate(driver)
        held = asyncio.ensure_future(driver.arun(gate.tx(), write=True))
        assert await asyncio.to_thread(gate.started.wait, PATIENCE_S)
        dropped = asyncio.ensure_future(driver.arun(insert("dropped"), write=True))
        kept = asyncio.ensure_future(driver.arun(insert("kept"), write=True))
        await asyncio.sleep(0)
        dropped.cancel()
        held.cancel()  # already taken: it runs to its commit all the same
        gate.go.set()
        assert await kept == 2
        with pytest.raises(asyncio.CancelledError):
            await dropped

    try:
        asyncio.run(main())
    finally:
        driver.close()
    assert _keys(path) == ["gate", "kept"]


HOLDER = SQLITE_LOCK_HOLDER


def test_concurrent_begins_grouped_behind_another_process_s_lock_keep_the_budget_exact(
        tmp_path: Path) -> None:
    from benchmarks.txcount import SqliteTxCounter

    url = str(tmp_path / "ledger.db")
    tries = 60

    async def main() -> tuple[list[Any], int | None]:
        counter = SqliteTxCounter(url)  # before the ledger opens its connections
        async with AsyncLedger.open(url) as led:
            await led.admit_run("shared", plan=routes(), budget=budget(calls=1000, cost="0.95"))
            lease = await led.acquire_lease("shared", ttl_s=600)
            # One begin first, so that the Run's frozen parts are read and kept: each begin
            # below is then one write transaction, and all of them queue behind the lock.
            first = await led.begin_attempt(lease, route="a", envelope_hash="sha256:e",
                                            reserve="0.05")
            await led.settle_attempt(lease, first.attempt_id, outcome="succeeded", cost="0.05")
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, url], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert holder.stdout is not None and holder.stdin is not None
            try:
                assert holder.stdout.readline().strip() == "locked"
                counter.start()
                begins = [asyncio.ensure_future(led.begin_attempt(
                    lease, route="a", envelope_hash="sha256:e", reserve="0.05"))
                    for _ in range(tries)]
                await asyncio.sleep(0)  # all of them queue behind the lock
                holder.stdin.write("go\n")
                holder.stdin.flush()
                assert holder.stdout.readline().strip() == "released"
                got = await asyncio.wait_for(asyncio.gather(*begins, return_exceptions=True),
                                             PATIENCE_S)
                writes = counter.finish().writes
            finally:
                counter.close()
                holder.kill()
                holder.communicate(timeout=PATIENCE_S)
            return got, writes

    got, writes = asyncio.run(main())
    begun = [g for g in got if not isinstance(g, BaseException)]
    refused = [g for g in got if isinstance(g, BudgetExceeded)]
    assert len(begun) == 18 and len(refused) == tries - 18, got  # 1 + 18 = 0.95 / 0.05
    # What the thread took before it blocked on the lock, then everything else at once.
    assert writes in (1, 2)

    async def check() -> None:
        async with AsyncLedger.open(url) as led:
            run = await led.get_run("shared")
            assert run.posted == Decimal("0.05") and run.reserved == Decimal("0.90")
            assert run.calls_used == 19
            tl = await led.timeline("shared")
            assert sorted(a.seq for a in tl) == list(range(1, 20))

    asyncio.run(check())
