"""SQLite's async path never blocks the event loop, even behind another process's write lock.

Another process takes the database's write lock (``BEGIN IMMEDIATE``) and holds it. An
:class:`~ledger.AsyncLedger`'s write then waits for the lock (up to the busy timeout), on the
database's own thread: meanwhile the event loop keeps running other tasks (a heartbeat ticks
on). Once the other process lets go, the write completes. Nothing sleeps to make time pass: the
test waits for the heartbeat to have ticked, then releases the lock.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

from ledger import AsyncLedger, Budget, Price, Route
from ledger.domain.records import AttemptState

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
