"""What the tests of a Child's writes behind a cutting proxy share: a parent's budget and a
Child's, a plan whose endpoint no turn calls (each passes its own ``send``), and one test's
PostgreSQL database behind a :class:`~tests.pgcut.CommitCutter` beside a ledger opened on it
directly."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal

from ledger import Budget, Envelope, Grant, Ledger, Part, Price, Route
from ledger.decide.effects import Dispatch, SendResult
from ledger.ops.reconcile import reconcile
from ledger.testing.pgserver import PgServer
from tests.pgcut import CommitCutter

BUDGET = Budget(max_calls=6, max_retries=4, max_cost=Decimal("1"))
CHILD = Budget(max_calls=2, max_retries=1, max_cost=Decimal("0.3"))
GRANT = Grant(recipients={"fake": ["user_input"]})
HELLO = Envelope(parts=[Part(content="hello")])
OK = SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)
TTL_S = 600.0  # the keepers never renew during a test: the tests tick them by hand
_names = itertools.count()


def served(_d: Dispatch) -> SendResult:
    return OK


async def aserved(_d: Dispatch) -> SendResult:
    return OK


def routes() -> list[Route]:
    """A plan whose endpoint is never called (every turn here passes its own ``send``)."""
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
    return [Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", protocol="openai", endpoint="http://127.0.0.1:9/v1",
                  price=price)]


@dataclass
class Db:
    """One test's database: behind the proxy, and read directly."""

    cutter: CommitCutter
    db: str
    led: Ledger  # directly on the server, never through the proxy

    @property
    def url(self) -> str:
        return self.cutter.url(self.db)


@contextmanager
def cut_db(pg_server: PgServer, prefix: str) -> Iterator[Db]:
    """A fresh database behind a cutter; its books must reconcile at the end."""
    name = f"{prefix}_{os.getpid()}_{next(_names)}"
    url = pg_server.create_database(name, template="ledger_template")
    with CommitCutter(pg_server.port) as cutter, Ledger.open(url) as led:
        yield Db(cutter, name, led)
        assert reconcile(led).violations == []
