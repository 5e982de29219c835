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
import time
from collections.abc import Generator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger import AsyncLedger
from ledger.errors import BudgetExceeded, DatabaseUnavailable, LedgerError
from ledger.storage.driver import Flush, Q, SqliteDriver, Tx
from ledger.storage.groupcommit import GroupWriter

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


def count() -> Tx[int]:
    [(n,)] = yield Q(COUNT)
    return int(n)


def _old_snapshot(started: threading.Event, go: threading.Event) -> Tx[tuple[int, int]]:
    """A read that takes its snapshot, holds the reading thread until ``go``, reads again."""
    [(before,)] = yield Q(COUNT)
    started.set()
    assert go.wait(PATIENCE_S)
    [(after,)] = yield Q(COUNT)
    return int(before), int(after)


def _holding(started: threading.Event, go: threading.Event) -> Tx[None]:
    """A write that keeps the database's own thread busy until ``go`` (it writes nothing)."""
    yield Q(COUNT)
    started.set()
    assert go.wait(PATIENCE_S)


def _thread_name() -> Tx[str]:
    yield Q(COUNT)
    return threading.current_thread().name


def test_a_read_sees_every_write_its_caller_awaited_though_an_older_snapshot_is_open(
        tmp_path: Path) -> None:
    """A read that finds the database's own thread busy runs on the reading thread, and reads
    queued there together share one snapshot; a read submitted once its caller's write is
    committed never joins a snapshot taken before that commit: it waits for the next read
    transaction, which sees the write."""
    path = _db(tmp_path)
    driver = SqliteDriver(path)

    async def busy_writer() -> tuple[threading.Event, asyncio.Future[None]]:
        started, go = threading.Event(), threading.Event()
        held = asyncio.ensure_future(driver.arun(_holding(started, go), write=True))
        assert await asyncio.to_thread(started.wait, PATIENCE_S)
        return go, held

    async def main() -> tuple[tuple[int, int], int, list[int]]:
        go1, held1 = await busy_writer()
        started, go = threading.Event(), threading.Event()
        old = asyncio.ensure_future(driver.arun(_old_snapshot(started, go), write=False))
        assert await asyncio.to_thread(started.wait, PATIENCE_S)
        go1.set()
        await held1
        # The reading thread is inside a read transaction: the write commits beside it.
        wrote = await asyncio.wait_for(driver.arun(insert("w"), write=True), PATIENCE_S)
        go2, held2 = await busy_writer()
        reads = [asyncio.ensure_future(driver.arun(count(), write=False)) for _ in range(3)]
        await asyncio.sleep(0)  # all three queue behind the old snapshot: one group
        go.set()
        go2.set()
        await held2
        return await old, wrote, await asyncio.gather(*reads)

    try:
        old, wrote, reads = asyncio.run(main())
    finally:
        driver.close()
    assert old == (0, 0)  # its snapshot is from before the write, to its end
    assert wrote == 1 and reads == [1, 1, 1]


def test_a_read_runs_on_the_idle_writers_thread_and_beside_a_busy_one(tmp_path: Path) -> None:
    """The reading thread is for reads the database's own thread cannot take at once: on an
    idle one a read runs on its warm connection (a connection of its own would find its page
    cache stale after every write: measured, a quarter to half a millisecond per turn)."""
    driver = SqliteDriver(_db(tmp_path))

    async def main() -> tuple[str, str]:
        idle = await driver.arun(_thread_name(), write=False)
        started, go = threading.Event(), threading.Event()
        held = asyncio.ensure_future(driver.arun(_holding(started, go), write=True))
        assert await asyncio.to_thread(started.wait, PATIENCE_S)
        beside = await asyncio.wait_for(driver.arun(_thread_name(), write=False), PATIENCE_S)
        go.set()
        await held
        return idle, beside

    try:
        idle, beside = asyncio.run(main())
    finally:
        driver.close()
    assert idle.startswith("ledger-sqlite_") and beside.startswith("ledger-sqlite-read")


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


# -- The busy timeout counts from the caller's submission ---------------------------------------

BUSY_S = 1.0  # the driver's busy timeout in the tests below
# A write told DatabaseUnavailable within this of its submission waited one busy timeout, not
# two (a second would take it past 2 * BUSY_S); the margin is for a loaded machine.
ONE_TIMEOUT_BOUND_S = 1.6 * BUSY_S
BUSY_PRAGMA = _Sql("PRAGMA busy_timeout")


def _lock(path: str) -> sqlite3.Connection:
    """Another connection holding the database's write lock until it is closed."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def _busy_timeout() -> Tx[int]:
    [(ms,)] = yield Q(BUSY_PRAGMA)
    return int(ms)


def _held_reading(started: threading.Event, go: threading.Event) -> Tx[str]:
    """Holds the database's thread until ``go``; reads, so another's write lock is no bar."""
    started.set()
    assert go.wait(PATIENCE_S)
    yield Q(COUNT)
    return "gate"


async def _timed(call: Any) -> tuple[Any, float]:
    """``call``'s result or error, and how long after it was made it was told."""
    t0 = time.perf_counter()
    try:
        got = await call
    except LedgerError as e:
        got = e
    return got, time.perf_counter() - t0


@pytest.mark.parametrize("queued", [1, 3])
def test_a_write_queued_behind_one_waiting_for_the_lock_waits_one_busy_timeout_in_all(
        tmp_path: Path, queued: int) -> None:
    """Another connection holds the write lock past two busy timeouts. A write waits for it on
    the database's thread; writes submitted meanwhile queue behind it (alone, or as a group),
    and each is told DatabaseUnavailable one busy timeout after it was submitted: its time
    queued counts, it does not start a busy timeout of its own once the first gives up."""
    path = _db(tmp_path)
    driver = SqliteDriver(path, busy_timeout_s=BUSY_S)
    waiting = threading.Event()

    def watch() -> Tx[None]:
        driver.connection().set_trace_callback(
            lambda s: waiting.set() if s == "BEGIN IMMEDIATE" else None)
        yield Q(COUNT)

    async def main() -> tuple[list[tuple[Any, float]], int, int]:
        # On the database's writing thread, its connection (reads have a thread of their own).
        await driver.arun(watch(), write=True)
        holder = _lock(path)
        try:
            first = asyncio.ensure_future(_timed(driver.arun(insert("first"), write=True)))
            assert await asyncio.to_thread(waiting.wait, PATIENCE_S)  # in BEGIN, waiting
            behind = [asyncio.ensure_future(_timed(driver.arun(insert(f"k{i}"), write=True)))
                      for i in range(queued)]
            got = await asyncio.wait_for(asyncio.gather(first, *behind), PATIENCE_S)
        finally:
            holder.close()
        after = await driver.arun(insert("after"), write=True)
        return got, after, await driver.arun(_busy_timeout(), write=True)  # the writer's

    try:
        got, after, busy_ms = asyncio.run(main())
    finally:
        driver.close()
    told = [e for e, _ in got]
    assert all(isinstance(e, DatabaseUnavailable) for e in told), told
    # Each told SQLite's own busy error, as the first (which waited alone) was.
    assert {(str(e), tuple(sorted(e.fields.items()))) for e in told} == {
        (str(told[0]), tuple(sorted(told[0].fields.items())))}
    waited = [round(s, 2) for _, s in got]
    assert all(0.95 * BUSY_S <= s < ONE_TIMEOUT_BOUND_S for _, s in got), waited
    # The lock gone, the thread writes again, and its connection waits the busy timeout again.
    assert after == 1 and busy_ms == int(BUSY_S * 1000)
    assert _keys(path) == ["after"]


def _skewed_writer(driver: SqliteDriver, skew: list[float]) -> GroupWriter:
    """The driver's thread, its clock ``skew[0]`` seconds off: a transaction submitted with it
    set to ``-BUSY_S`` is one whose busy timeout is already up."""
    driver._writer = GroupWriter(driver, clock=lambda: time.monotonic() + skew[0])
    return driver._writer


def _late_and_fresh(path: str, holder: bool) -> tuple[tuple[Any, float], tuple[Any, float]]:
    """A group of two behind a reading gate: the first submitted a busy timeout ago, the second
    now; with another connection holding the write lock or not. What each was told, and how
    long after the gate let go (the first) or after it was submitted (the second)."""
    driver = SqliteDriver(path, busy_timeout_s=BUSY_S)
    skew = [0.0]
    writer = _skewed_writer(driver, skew)
    started, go = threading.Event(), threading.Event()

    async def main() -> tuple[tuple[Any, float], tuple[Any, float]]:
        lock = _lock(path) if holder else None
        try:
            # Straight to the writing thread: the driver sends its reads to another one.
            gate = asyncio.wrap_future(writer.submit(_held_reading(started, go), False))
            assert await asyncio.to_thread(started.wait, PATIENCE_S)
            skew[0] = -BUSY_S
            late = asyncio.ensure_future(driver.arun(insert("late"), write=True))
            await asyncio.sleep(0)  # submitted on the skewed clock: queued behind the gate
            skew[0] = 0.0
            fresh = asyncio.ensure_future(_timed(driver.arun(insert("fresh"), write=True)))
            await asyncio.sleep(0)  # and this one now
            go.set()
            assert await gate == "gate"
            return await _timed(late), await asyncio.wait_for(fresh, PATIENCE_S)
        finally:
            if lock is not None:
                lock.close()

    try:
        return asyncio.run(main())
    finally:
        driver.close()


def test_a_member_whose_busy_timeout_is_up_is_told_at_once_and_the_others_wait_their_own(
        tmp_path: Path) -> None:
    """In a group behind another connection's write lock, a member whose busy timeout ran out
    while it queued gets one try, without waiting, and is told DatabaseUnavailable; the
    younger member is not told with it, but waits out its own busy timeout."""
    path = _db(tmp_path)
    (late, late_s), (fresh, fresh_s) = _late_and_fresh(path, holder=True)
    assert isinstance(late, DatabaseUnavailable) and isinstance(fresh, DatabaseUnavailable)
    assert str(late) == str(fresh)
    assert late_s < 0.5 * BUSY_S, late_s
    assert 0.95 * BUSY_S <= fresh_s < ONE_TIMEOUT_BOUND_S, fresh_s
    assert _keys(path) == []


def test_a_member_whose_busy_timeout_is_up_still_begins_when_the_lock_is_free(
        tmp_path: Path) -> None:
    """Its time up is no error by itself: with nobody holding the lock, the late member's one
    try begins, and it commits with the group."""
    path = _db(tmp_path)
    (late, late_s), (fresh, fresh_s) = _late_and_fresh(path, holder=False)
    assert (late, fresh) == (1, 2)
    assert late_s < 0.5 * BUSY_S and fresh_s < 0.5 * BUSY_S
    assert _keys(path) == ["fresh", "late"]
