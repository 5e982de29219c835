"""Seeded ledgers shared by the audit tests: seeded once per backend per module (the queries
only read, so sharing is safe and keeps the suite fast)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from ledger.api.facade import Ledger
from ledger.ops.audit import Audit

from .seed import seed

_n = itertools.count()


@pytest.fixture(scope="module",
                params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def seeded_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A ledger URL holding the seed history, once per backend."""
    if request.param == "sqlite":
        url = str(tmp_path_factory.mktemp("audit") / "ledger.db")
    else:
        srv = request.getfixturevalue("pg_server")
        name = f"audit_{os.getpid()}_{next(_n)}"
        url = srv.create_database(name, template="ledger_template")
    seed(url)
    return url


@pytest.fixture
def audit(seeded_url: str) -> Iterator[Audit]:
    from ledger.clock import ManualClock

    from .seed import T0

    led = Ledger.open(seeded_url, clock=ManualClock(T0 + 600), migrate_schema=False)
    try:
        yield Audit(led)
    finally:
        led.close()
