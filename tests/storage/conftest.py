"""Fixtures shared by the storage tests (a module that needs another clock or ledger defines
its own, which takes precedence)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.testing.pgserver import PgServer

from ._standby import synchronous_pair


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(10_000.0)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    """A ledger on each backend, on ``clock``, as executor ``w1``."""
    ledger = Ledger.open(db_url, clock=clock, executor_id="w1")
    yield ledger
    ledger.close()


@pytest.fixture
def cluster() -> Iterator[tuple[PgServer, PgServer]]:
    """A primary with a synchronous hot standby (``synchronous_commit=on``,
    ``synchronous_standby_names=s1``): a commit is acknowledged once the standby has it."""
    with synchronous_pair("ha") as pair:
        yield pair
