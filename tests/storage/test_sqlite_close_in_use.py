"""Closing a SQLite ledger never closes a connection under a transaction running on it.

A blocking ledger shared by threads has one SQLite connection per thread; closing a connection
while another thread executes on it can crash the whole process (seen as a segmentation fault
in a waiter's last write racing ``close()``). The driver's close leaves a connection in use to
its thread, which closes it when its transaction ends.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger import Budget, Grant, Ledger, Price, Route, faults
from ledger.api.face import storage_of
from ledger.domain.records import AttemptRecord, AttemptState
from ledger.errors import LedgerError

ROUTE = Route(id="a", provider="fake", model="m", group="g", recipient="fake",
              endpoint="http://127.0.0.1:9/v1", price=Price())
PATIENCE_S = 120


def test_a_transaction_running_when_the_sqlite_driver_closes_ends_on_its_own_connection(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.db")
    led = Ledger.open(path)
    led.admit_run("r", plan=[ROUTE], grant=Grant(recipients={"fake": ["user_input"]}),
                  budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal("1")))
    lease = led.acquire_lease("r", ttl_s=3600)
    inside, go_on = threading.Event(), threading.Event()

    def hold(_point: str) -> None:  # inside the begin's transaction, before its last writes
        inside.set()
        assert go_on.wait(PATIENCE_S)

    got: list[object] = []

    def begin() -> None:
        try:
            got.append(led.begin_attempt(lease, route="a", envelope_hash="sha256:x",
                                         reserve="0"))
        except BaseException as e:
            got.append(e)

    faults.arm("begin.before_commit", hold)
    try:
        worker = threading.Thread(target=begin)
        worker.start()
        assert inside.wait(PATIENCE_S)
        storage_of(led).driver.close()  # the worker's connection is in use
        go_on.set()
        worker.join(PATIENCE_S)
    finally:
        faults.disarm()
        go_on.set()
    [att] = got
    assert isinstance(att, AttemptRecord), att
    led.close()
    with Ledger.open(path) as again:
        [row] = again.timeline("r")
        assert row.attempt_id == att.attempt_id and row.state is AttemptState.DISPATCHING


def test_a_transaction_on_a_closed_sqlite_connection_fails_as_the_ledgers_error(
        tmp_path: Path) -> None:
    # Rolling back read the closed connection's in_transaction, which raised sqlite3's own
    # ProgrammingError past the driver's wrapping, hiding the transaction's error.
    led = Ledger.open(str(tmp_path / "ledger.db"))
    driver = storage_of(led).driver
    driver.connection().close()  # this thread's: as a close under a transaction leaves it

    def tx() -> Iterator[Any]:
        return
        yield

    with pytest.raises(LedgerError) as info:
        driver.run(tx(), write=True)
    assert isinstance(info.value.__cause__, sqlite3.ProgrammingError)
    led.close()
