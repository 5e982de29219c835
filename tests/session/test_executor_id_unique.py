"""One open ledger per executor id and database in a process: a second is refused.

``acquire_lease`` hands an executor its own live lease back under the same fence, so two
ledgers opened with the same explicit ``executor_id`` (a configuration copied) would each take
the other's leases for their own: a Run session on each would run turns under one fence, and
the first to leave would end the Run under the other's turns (each ledger's registry of open
sessions sees only its own). So the second open raises ``InvalidArgument``
(``field="executor_id"``, ``problem="executor_in_use"``) before it opens or migrates
anything; a ledger on another database may share the id (their leases never meet); an
``AsyncLedger`` over the open ledger shares it (one executor), and closing the ledger frees
its id. Both backends.
"""

from __future__ import annotations

import asyncio
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger import AsyncLedger, Budget, Envelope, Grant, Ledger, Part, SendResult
from ledger.clock import ManualClock
from ledger.errors import InvalidArgument
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
HELLO = Envelope(parts=[Part(content="hello")])
OK = SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)


def _in_use(error: InvalidArgument) -> None:
    assert error.field == "executor_id"
    assert error.fields["problem"] == "executor_in_use"
    assert error.fields["executor_id"] == "host-1"
    assert "Give each ledger its own executor_id" in str(error)
    assert "close it first" in str(error)


def test_a_second_ledger_under_an_executor_id_in_use_is_refused_before_it_opens_anything(
        db_url: str, fake: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ManualClock(90_000.0)
    with Ledger.open(db_url, clock=clock, executor_id="host-1") as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            before = led.events("r")
            with pytest.raises(InvalidArgument) as refused:
                Ledger.open(db_url, clock=clock, executor_id="host-1")
            _in_use(refused.value)
            # Per database: another database's ledger may share the id (their leases never
            # meet), and the refused one opens nothing.
            elsewhere = tmp_path / "elsewhere.db"
            with Ledger.open(str(elsewhere), clock=clock, executor_id="host-1") as beside:
                assert beside.executor_id == "host-1"
            if led.backend == "sqlite":
                # The same file under another spelling is the same database.
                # The same file under another spelling is the same database: its URL, a
                # relative URL, a link to it.
                folder = Path(db_url).parent
                link = folder / "link.db"
                link.symlink_to(db_url)
                for spelled in (f"sqlite:///{db_url}", "sqlite:///ledger.db", "ledger.db",
                                str(link)):
                    with monkeypatch.context() as m:
                        m.chdir(folder)
                        with pytest.raises(InvalidArgument) as refused:
                            Ledger.open(spelled, clock=clock, executor_id="host-1")
                    _in_use(refused.value)

            async def async_open() -> None:
                with pytest.raises(InvalidArgument) as refused:
                    await AsyncLedger.open(db_url, clock=clock, executor_id="host-1")
                _in_use(refused.value)
                # An AsyncLedger over the open ledger is the same executor: it shares it.
                assert AsyncLedger(led).executor_id == "host-1"

            asyncio.run(async_open())
            assert led.events("r") == before  # nothing recorded
            # The open ledger's session goes on under its own lease.
            assert run.turn(HELLO, send=lambda _d: OK).output == "ok"
            assert run.lease.fence == 1
        # Other ids, and the default (a new unique one each time), open beside it.
        with Ledger.open(db_url, clock=clock, executor_id="host-2") as other, \
                Ledger.open(db_url, clock=clock) as fresh:
            assert fresh.executor_id not in (led.executor_id, other.executor_id)
    # Closed: its id is free again, and continues the Run as its executor.
    with Ledger.open(db_url, clock=clock, executor_id="host-1") as again, \
            again.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
        assert run.turn(HELLO, send=lambda _d: OK).output == "ok"
        assert run.lease.executor == "host-1"


def test_two_ledgers_opened_at_once_under_one_executor_id_leave_one_open(
        db_url: str) -> None:
    clock = ManualClock(90_000.0)
    start = threading.Barrier(2)
    opened: list[Ledger] = []
    refused: list[InvalidArgument] = []

    def open_one() -> None:
        start.wait()
        try:
            opened.append(Ledger.open(db_url, clock=clock, executor_id="host-1"))
        except InvalidArgument as e:
            refused.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert (len(opened), len(refused)) == (1, 1)
        _in_use(refused[0])
    finally:
        for led in opened:
            led.close()
