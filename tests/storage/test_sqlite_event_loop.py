"""SQLite's async path never blocks the event loop, even behind another process's write lock.

Another process takes the database's write lock (``BEGIN IMMEDIATE``) and holds it. An
:class:`~ledger.AsyncLedger`'s write then waits for the lock (up to the busy timeout), on the
database's own thread: meanwhile the event loop keeps running other tasks (a heartbeat ticks
on). Once the other process lets go, the write completes. Nothing sleeps to make time pass: the
test waits for the heartbeat to have ticked, then releases the lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import subprocess
import sys
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger import AsyncLedger, Budget, Price, Route
from ledger.api.face import storage_of
from ledger.domain.records import AttemptState
from ledger.errors import InvalidState

from .helpers import SQLITE_LOCK_HOLDER

HOLDER = SQLITE_LOCK_HOLDER
TICKS = 20
PATIENCE_S = 120


def test_a_write_behind_another_process_s_lock_leaves_the_event_loop_running(
        tmp_path: Path) -> None:
    url = str(tmp_path / "ledger.db")
    route = Route(id="a", provider="p", model="m", group="g", recipient="r", price=Price())

    async def main() -> None:
        async with AsyncLedger.open(url) as led:
            await led.admit_run("r", plan=[route],
                                budget=Budget(max_calls=2, max_retries=0, max_cost=Decimal(1)))
            lease = await led.acquire_lease("r", ttl_s=600)
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, url], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert holder.stdout is not None and holder.stdin is not None
            try:
                assert holder.stdout.readline().strip() == "locked"
                begin = asyncio.create_task(led.begin_attempt(
                    lease, route="a", envelope_hash="sha256:e", reserve="0"))
                ticks = 0
                while ticks < TICKS:  # the loop runs while the write waits for the lock
                    await asyncio.sleep(0.005)
                    ticks += 1
                    assert not begin.done(), "the write did not wait for the other's lock"
                holder.stdin.write("go\n")
                holder.stdin.flush()
                assert holder.stdout.readline().strip() == "released"
                att = await asyncio.wait_for(begin, PATIENCE_S)
                assert att.state is AttemptState.DISPATCHING
            finally:
                holder.kill()
                holder.communicate(timeout=PATIENCE_S)

    asyncio.run(main())


READ_BUSY_S = 5  # the ledger's busy timeout below: the write waits this long at most


def _sqlite_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("ledger-sqlite"))


def test_a_read_never_waits_for_the_write_lock_another_process_holds(tmp_path: Path) -> None:
    """Another process holds the write lock with a write of its own uncommitted. An
    AsyncLedger's write waits for the lock, a second write queues behind it; a read submitted
    after both (a WAL reader needs no write lock) answers at once, while both writes still wait,
    and the event loop ticks on. Once the lock is free the writes land, and the caller's next
    read sees what it wrote; closing the ledger ends its threads, the reading one too."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}?timeout={READ_BUSY_S}"
    route = Route(id="a", provider="p", model="m", group="g", recipient="r", price=Price())
    threads_before = _sqlite_threads()

    async def main() -> None:
        async with AsyncLedger.open(url) as led:
            await led.admit_run("r", plan=[route],
                                budget=Budget(max_calls=5, max_retries=0, max_cost=Decimal(1)))
            lease = await led.acquire_lease("r", ttl_s=600)
            first = await led.begin_attempt(lease, route="a", envelope_hash="sha256:e0",
                                            reserve="0")
            driver = storage_of(led).driver
            # The writing thread has reached its BEGIN IMMEDIATE (and waits there for the lock).
            waiting = threading.Event()
            begin, arun, writes = driver.begin, driver.arun, [0]

            def watched(conn: Any, *, write: bool, wait_s: float | None = None) -> None:
                if write:
                    waiting.set()
                begin(conn, write=write, wait_s=wait_s)

            async def counted(tx: Any, *, write: bool, again: Any = None) -> Any:
                writes[0] += write  # counted as it is submitted (arun submits before it awaits)
                return await arun(tx, write=write, again=again)

            driver.begin, driver.arun = watched, counted
            holder = subprocess.Popen(
                [sys.executable, "-c", HOLDER, str(path), "CREATE TABLE held (x)",
                 "INSERT INTO held VALUES (1)"],
                text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert holder.stdout is not None and holder.stdin is not None
            try:
                assert holder.stdout.readline().strip() == "locked"
                w1 = asyncio.create_task(led.begin_attempt(
                    lease, route="a", envelope_hash="sha256:e1", reserve="0"))
                while not waiting.is_set():  # the loop runs while the write waits for the lock
                    await asyncio.sleep(0.005)
                w2 = asyncio.create_task(led.begin_attempt(
                    lease, route="a", envelope_hash="sha256:e2", reserve="0"))
                while writes[0] < 2:
                    await asyncio.sleep(0.005)
                read = asyncio.create_task(led.get_attempt(first.attempt_id))
                done, _ = await asyncio.wait({read, w1, w2}, timeout=PATIENCE_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                assert done == {read}, "the read waited behind the writes waiting for the lock"
                assert read.result().attempt_id == first.attempt_id  # not "database is locked"
                for _ in range(TICKS):  # the loop runs on, the writes still waiting
                    await asyncio.sleep(0.005)
                    assert not w1.done() and not w2.done(), "a write did not wait for the lock"
                holder.stdin.write("go\n")
                holder.stdin.flush()
                assert holder.stdout.readline().strip() == "released"
                begun = await asyncio.wait_for(asyncio.gather(w1, w2), PATIENCE_S)
            finally:
                holder.kill()
                holder.communicate(timeout=PATIENCE_S)
            # The caller awaited its writes: its next reads (the reading thread's) see them.
            for att in begun:
                got = await led.get_attempt(att.attempt_id)
                assert got.state is AttemptState.DISPATCHING
            assert any(t.startswith("ledger-sqlite-read") for t in _sqlite_threads())
        assert _sqlite_threads() == threads_before

    asyncio.run(main())


# The loop's default executor in the test below: fewer threads than admissions waiting.
HOST_THREADS = 4
ADMISSIONS = 2 * HOST_THREADS
# How long the host's own executor call may take while the admissions wait: well under the
# busy timeout (30 s) they wait for the lock.
HOST_PROMPT_S = 5.0


def _ledger_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ledger-cold")]


def test_admissions_behind_another_process_s_lock_leave_the_default_executor_to_the_host(
        tmp_path: Path) -> None:
    """An AsyncLedger's blocking calls (admission is one) run on the ledger's own threads: while
    more of them wait for another process's write lock than the loop's default executor has
    threads, the host's ``run_in_executor(None, ...)`` still runs at once."""
    url = str(tmp_path / "ledger.db")
    route = Route(id="a", provider="p", model="m", group="g", recipient="r", price=Price())
    budget = Budget(max_calls=2, max_retries=0, max_cost=Decimal(1))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        host_pool = concurrent.futures.ThreadPoolExecutor(HOST_THREADS)
        loop.set_default_executor(host_pool)
        async with AsyncLedger.open(url) as led:
            runs = led._store._runs  # the admission's blocking call: counted on entry
            admit, entered, lock = runs.admit, [0], threading.Lock()

            def counted(*args: Any, **kwargs: Any) -> Any:
                with lock:
                    entered[0] += 1
                return admit(*args, **kwargs)

            runs.admit = counted
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, url], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert holder.stdout is not None and holder.stdin is not None
            try:
                assert holder.stdout.readline().strip() == "locked"
                admissions = [asyncio.create_task(led.admit_run(f"r{i}", plan=[route],
                                                                budget=budget))
                              for i in range(ADMISSIONS)]
                # Every thread that could be the host's is taken by a waiting admission (if
                # the admissions ran on the default executor), or the ledger's are.
                want = HOST_THREADS  # the ledger's own threads are more (WORKERS_MAX)
                for _ in range(int(PATIENCE_S / 0.005)):
                    if entered[0] >= want:
                        break
                    await asyncio.sleep(0.005)  # the loop runs the admissions to their threads
                assert entered[0] >= want
                assert not any(a.done() for a in admissions), "they did not wait for the lock"
                assert await asyncio.wait_for(
                    loop.run_in_executor(None, lambda: "host"), HOST_PROMPT_S) == "host", \
                    "the host's executor call waited behind the ledger's"
                assert not any(a.done() for a in admissions)
                holder.stdin.write("go\n")
                holder.stdin.flush()
                assert holder.stdout.readline().strip() == "released"
                done = await asyncio.wait_for(asyncio.gather(*admissions), PATIENCE_S)
                assert sorted(r.run_id for r in done) == sorted(f"r{i}" for i in range(ADMISSIONS))
                assert entered[0] == ADMISSIONS
            finally:
                holder.kill()
                holder.communicate(timeout=PATIENCE_S)
        host_pool.shutdown(wait=True)

    asyncio.run(main())


def test_the_ledger_s_threads_end_when_it_closes(tmp_path: Path) -> None:
    """The ledger's own threads run its blocking calls while it is open and are gone once
    ``close()`` returns; a call afterwards is refused as a closed ledger's."""
    url = str(tmp_path / "ledger.db")
    route = Route(id="a", provider="p", model="m", group="g", recipient="r", price=Price())
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def main() -> None:
        led = await AsyncLedger.open(url)
        runs = led._runs
        get_run, seen = runs.get_run, []

        def traced(run_id: str) -> Any:
            seen.append((threading.current_thread().name, var.get()))
            return get_run(run_id)

        runs.get_run = traced
        await led.admit_run("r", plan=[route],
                            budget=Budget(max_calls=2, max_retries=0, max_cost=Decimal(1)))
        var.set("the caller's")
        assert (await led.get_run("r")).run_id == "r"
        assert seen == [(seen[0][0], "the caller's")] and seen[0][0].startswith("ledger-cold")
        assert _ledger_threads()
        await led.close()
        assert not _ledger_threads()
        with pytest.raises(InvalidState) as err:
            await led.get_run("r")
        assert err.value.fields["problem"] == "ledger_closed"
        assert not _ledger_threads()

    asyncio.run(main())


def test_a_connection_opened_while_the_driver_closes_is_closed_not_leaked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread (the reading thread opens its connection late, on the first read that finds
    the writer busy) may pass the "closed?" check, then open its connection while close() takes
    the list of connections: that connection was added to a list nobody closes. It is closed,
    and the caller told the driver is closed."""
    import sqlite3

    from ledger.storage.driver import SqliteDriver

    driver = SqliteDriver(str(tmp_path / "l.db"))
    opened: list[sqlite3.Connection] = []
    connect = sqlite3.connect

    def connect_while_closing(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)
        opened.append(conn)
        driver.close()  # the close lands between the check and the bookkeeping
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect_while_closing)
    with pytest.raises(InvalidState, match="is closed"):
        driver.connection()
    [conn] = opened
    with pytest.raises(sqlite3.ProgrammingError):  # closed: "Cannot operate on a closed database"
        conn.execute("SELECT 1")
