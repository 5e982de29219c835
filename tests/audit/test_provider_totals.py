"""The cost totals by provider agree with the health key: one provider per folded name.

Health keyed by provider folds the name (``provider:openai`` for routes of ``OpenAI`` and
``openai``). The attempts and their roll-ups keep the name as each route spelled it (it is
part of the Run's frozen plan); the totals by provider must still show one group per folded
name, its sums merged, the same on both backends for names SQL's ``lower()`` does not fold
alike (SQLite's is ASCII-only; neither maps ``ß`` to ``ss`` as ``str.casefold`` does).
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger.api.facade import Ledger
from ledger.api.turn import SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.ops.audit import Audit, Totals

HOUR = 3600.0
T0 = 1_000 * HOUR  # on an hour's start
ENV = Envelope(parts=[Part(content="Summarise the filings.")], max_output_tokens=100)
GRANT = Grant(recipients={"p": ["user_input"]})


def route(provider: str, n: int) -> Route:
    # Priced so that each attempt's hold (0.1) covers the cost its send reports.
    return Route(id=f"r{n}", provider=provider, model="m", group=f"g{n}", recipient="p",
                 price=Price(output_per_mtok=Decimal(1000)))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0 + 60)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock) as ledger:
        yield ledger


def call(led: Ledger, run_id: str, r: Route, prompt_tokens: int) -> None:
    led.admit_run(run_id, plan=[r], grant=GRANT,
                  budget=Budget(max_calls=1, max_retries=0, max_cost=Decimal(1)))
    execute(led, led.acquire_lease(run_id, ttl_s=600), ENV,
            lambda d: SendResult(ok=True, output="answer", prompt_tokens=prompt_tokens,
                                 completion_tokens=5, cost=Decimal(prompt_tokens) / 10_000))


def spelled(led: Ledger, at: int) -> None:
    """One attempt for each of three spellings of two providers, from run ids ``at``..."""
    for i, (provider, tokens) in enumerate((("OpenAI", 30), ("openai", 20), ("OPENAI", 10),
                                            ("Straße", 4), ("STRASSE", 2), ("strasse", 1))):
        call(led, f"run-{at + i}", route(provider, at + i), tokens)


def by_provider(audit: Audit, **window: float) -> list[Totals]:
    out: list[Totals] = []
    cursor = None
    while True:
        page = audit.costs(by="provider", limit=1, cursor=cursor, **window)
        out += page.items
        if page.next_cursor is None:
            return out
        cursor = page.next_cursor


def _t(key: str, n: int, prompt_tokens: int) -> Totals:
    return Totals(key, n, n, 0, 0, prompt_tokens, 5 * n, Decimal(prompt_tokens) / 10_000)


def test_a_provider_totals_as_one_whatever_its_routes_spelling(led: Ledger) -> None:
    spelled(led, 0)
    audit = Audit(led)
    expected = [_t("openai", 3, 60), _t("strasse", 3, 7)]
    assert audit.costs(by="provider").items == expected
    # Paged one by one, the same groups in the same order.
    assert by_provider(audit) == expected


def test_rolled_hours_and_live_attempts_of_one_provider_total_as_one(
        led: Ledger, clock: ManualClock) -> None:
    spelled(led, 0)
    clock.advance(2 * HOUR)
    assert led.roll_up(lag=0).hours  # the first hour's sums now come from attempt_rollups
    spelled(led, 10)  # and these from attempts: the same providers, spelled the same ways
    audit = Audit(led)
    expected = [_t("openai", 6, 120), _t("strasse", 6, 14)]
    assert audit.costs(by="provider", since=T0, until=T0 + 3 * HOUR).items == expected
    assert by_provider(audit, since=T0, until=T0 + 3 * HOUR) == expected
    # A window of the rolled hour alone reads its roll-ups alone.
    assert audit.costs(by="provider", since=T0, until=T0 + HOUR).items == [
        _t("openai", 3, 60), _t("strasse", 3, 7)]
