"""An interruption that lands between a transaction's pipelined statements cancels what the
server is running, rather than waiting behind it.

psycopg turns a ``KeyboardInterrupt`` that lands in its own wait into a cancel request; one
that lands in Python code while a pipeline is being filled (building the next statement's
arguments) leaves the pipeline's exit to wait for every statement already sent, however long
the server takes: behind a row lock another session holds, until that session lets go. The
driver asks the server to cancel them, so the interruption reaches its caller at once (the
write's outcome is what it would be for any interruption: nothing, or unknown once its
``COMMIT`` was sent).

A server that has not yet read the statements when the cancel request comes finds its session
idle, and ignores the request; then it reads them, and waits on the lock. So the driver asks
again, until the pipeline has ended. A loopback proxy (:mod:`tests.pgcut`) makes that order
certain: it holds the pipeline's bytes until the first request has gone through.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Mapping
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from ledger import AsyncLedger, Budget, Grant, Ledger, Price, Route
from ledger.api.face import storage_of
from ledger.storage.driver import Flush, Q
from ledger.storage.statements import Stmt
from ledger.testing.pgserver import PgServer
from tests.pgcut import commit_cutter

ROUTE = Route(id="a", provider="fake", model="m", group="g", recipient="fake",
              endpoint="http://127.0.0.1:9/v1", price=Price())
PATIENCE_S = 20  # how long the lock is held at most: a miss fails, it never hangs


class _Interruption(Exception):
    """What interrupts the asyncio driver here (a ``KeyboardInterrupt`` raised in a task
    leaves its event loop, not the task's caller)."""


class _Interrupting(Mapping[str, Any]):
    """Parameters whose reading is interrupted (as a Ctrl-C landing there would be)."""

    def __init__(self, error: type[BaseException] = KeyboardInterrupt) -> None:
        self.error = error

    def __getitem__(self, key: str) -> Any:
        raise self.error

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


ADMISSION: dict[str, Any] = {
    "plan": [ROUTE], "grant": Grant(recipients={"fake": ["user_input"]}),
    "budget": Budget(max_calls=2, max_retries=0, max_cost=Decimal("1"))}
LOCKED = Stmt("locked", "SELECT run_id FROM runs WHERE run_id = %s FOR UPDATE", ("run_id",),
              ("run_id",), None)
OTHER = Stmt("other", "SELECT %s::text", ("x",), ("text",), None)


def _interrupted_tx(commit: bool, error: type[BaseException] = KeyboardInterrupt
                    ) -> Iterator[Any]:
    """The Run's row locked, then a statement whose parameters are interrupted as read."""
    yield Flush((Q(LOCKED, {"run_id": "r"}), Q(OTHER, _Interrupting(error))), commit=commit)


def _behind_a_lock(pg_server: PgServer, dbname: str, interrupted: Callable[[], None]) -> None:
    """Run ``interrupted`` (it raises) while another session holds the Run's row lock, held
    for :data:`PATIENCE_S` at most; assert that it reached its caller before the lock went."""
    holder = psycopg.connect(host="127.0.0.1", port=pg_server.port, user=pg_server.user,
                             dbname=dbname)
    holder.execute("SELECT 1 FROM runs WHERE run_id = 'r' FOR UPDATE")
    released = threading.Event()

    def let_go() -> None:  # the bound of a miss: the statement then ends by itself
        released.set()
        holder.rollback()

    timer = threading.Timer(PATIENCE_S, let_go)
    timer.start()
    try:
        interrupted()
        assert not released.is_set(), "the interruption waited for the lock to go"
    finally:
        timer.cancel()
        if not released.is_set():
            holder.rollback()
        holder.close()


@pytest.mark.postgres
@pytest.mark.parametrize("commit", [False, True])
def test_an_interruption_between_pipelined_statements_cancels_the_one_waiting_on_a_lock(
        pg_server: PgServer, pg_url: str, commit: bool) -> None:
    led = Ledger.open(pg_url)
    led.admit_run("r", **ADMISSION)

    def interrupted() -> None:
        with pytest.raises(KeyboardInterrupt):
            storage_of(led).driver.run(_interrupted_tx(commit), write=True)

    _behind_a_lock(pg_server, pg_url.rsplit("/", 1)[1], interrupted)
    # The connection it ran on went back clean (or was dropped): the ledger goes on.
    led.acquire_lease("r", ttl_s=60)
    led.close()


@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_cancel_request_the_idle_session_ignored_is_sent_again_until_the_pipeline_ends(
        pg_server: PgServer, pg_url: str, mode: str) -> None:
    # The proxy holds the pipeline's bytes until the first cancel request has gone through:
    # the session ignores it (idle), then reads the statements and waits on the lock. Only
    # a request sent again lets the interruption reach its caller before the lock goes.
    dbname = pg_url.rsplit("/", 1)[1]
    with commit_cutter(pg_server.port) as cutter:
        url = cutter.url(dbname, user=pg_server.user)
        if mode == "sync":
            led = Ledger.open(url)
            led.admit_run("r", **ADMISSION)

            def interrupted() -> None:
                cutter.stall("FOR UPDATE")
                with pytest.raises(KeyboardInterrupt):
                    storage_of(led).driver.run(_interrupted_tx(True), write=True)

            _behind_a_lock(pg_server, dbname, interrupted)
            # The connection went back with no request left to cancel what it runs next.
            led.acquire_lease("r", ttl_s=60)
            led.close()
            return

        async def main() -> None:
            aled = await AsyncLedger.open(url)
            try:
                await aled.admit_run("r", **ADMISSION)
                loop = asyncio.get_running_loop()

                def interrupted() -> None:
                    cutter.stall("FOR UPDATE")
                    run = storage_of(aled).driver.arun(_interrupted_tx(True, _Interruption),
                                                       write=True)
                    with pytest.raises(_Interruption):
                        asyncio.run_coroutine_threadsafe(run, loop).result()

                await asyncio.to_thread(_behind_a_lock, pg_server, dbname, interrupted)
                await aled.acquire_lease("r", ttl_s=60)
            finally:
                await aled.close()

        asyncio.run(main())
