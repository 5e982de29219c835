"""What the session and integration tests share: one fake provider per module and a two-route
plan (primary and backup, in different capacity groups) on it."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger import Price, Route
from ledger.domain.facts import WireProtocol
from ledger.testing import FakeProvider

PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as fp:
        yield fp


@pytest.fixture(autouse=True)
def _clear(fake: FakeProvider) -> None:
    fake.clear()


def plan(fake: FakeProvider, protocol: str = "openai") -> list[Route]:
    proto = WireProtocol(protocol)
    return [Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", protocol=proto, endpoint=fake.endpoint(protocol),
                  price=PRICE),
            Route(id="backup", provider="fake-b", model="backup-model", group="gb",
                  recipient="fake", protocol=proto, endpoint=fake.endpoint(protocol),
                  price=PRICE)]
