"""Migration 0021: ``health.key`` holds every valid route's key, on both backends.

A provider name may be 200 characters and its key keeps it case-folded (0020), up to three
characters for one: ``provider:`` and 600. The column held 200. Upgrading keeps every row;
the downgrade gives the older package back a column of 200 and only the rows it can read.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect, text

from ledger.api.facade import Ledger
from ledger.api.turn import SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import FailoverExhausted
from ledger.storage.engine import normalize_url

from .helpers import downgrade_schema

T0 = 30_000.0
LONGEST = "\u0390" * 200  # folds to 600 characters
LONG = Route(id="long", provider=LONGEST, model="m", group="long", recipient="r", price=Price())
SHORT = Route(id="short", provider="OpenAI", model="m", group="short", recipient="r",
              price=Price())


def _execute(url: str, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
    engine = create_engine(normalize_url(url))
    try:
        with engine.begin() as conn:
            result = conn.execute(text(sql), params or {})
            return [dict(r) for r in result.mappings()] if result.returns_rows else []
    finally:
        engine.dispose()


def _key_length(url: str) -> int | None:
    engine = create_engine(normalize_url(url))
    try:
        with engine.connect() as conn:
            [key] = [c for c in inspect(conn).get_columns("health") if c["name"] == "key"]
            return key["type"].length  # type: ignore[no-any-return]
    finally:
        engine.dispose()


def _overload_each(url: str, run_id: str, routes: list[Route]) -> None:
    """One turn over ``routes`` under ``goclaw`` (health keyed by provider), every call 503."""
    with Ledger.open(url, clock=ManualClock(T0)) as led:
        led.admit_run(run_id, plan=routes, policy="goclaw",
                      grant=Grant(recipients={"r": ["user_input"]}),
                      budget=Budget(max_calls=10, max_retries=6, max_cost=Decimal(1)))
        with pytest.raises(FailoverExhausted):
            execute(led, led.acquire_lease(run_id, ttl_s=600),
                    Envelope(parts=[Part(content="Hi.")], max_output_tokens=10),
                    lambda d: SendResult.failed(Observation(status=503, body="overloaded")))


def test_a_ledger_from_before_0021_keeps_its_rows_and_takes_the_longest_provider_key(
        db_url: str) -> None:
    downgrade_schema(db_url, "0020", "health")
    assert _key_length(db_url) == 200
    _execute(db_url, "INSERT INTO health (key, kind, provider, cooldown_until, error_count, "
                     "failure_counts, updated_at) VALUES ('provider:openai', 'provider', "
                     "'OpenAI', :until, 1, '{\"overloaded\": 1}', :now)",
             {"until": T0 + 600, "now": T0})
    _overload_each(db_url, "r", [LONG])  # opening upgrades to head first
    assert _key_length(db_url) == 609
    with Ledger.open(db_url, clock=ManualClock(T0)) as led:
        health = led.health()
    assert sorted(health) == sorted(["provider:" + LONGEST.casefold(), "provider:openai"])
    assert health["provider:openai"].cooldown_until == T0 + 600
    assert set(health["provider:" + LONGEST.casefold()].failure_counts) == {"overloaded"}


def test_the_downgrade_from_0021_keeps_only_the_keys_the_older_package_reads(
        db_url: str) -> None:
    _overload_each(db_url, "r", [SHORT, LONG])
    assert len(_execute(db_url, "SELECT key FROM health")) == 2
    downgrade_schema(db_url, "0020", "health")
    # The older package refuses a key over 200 characters (and PostgreSQL would not narrow the
    # column over it): that row goes, every other stays.
    assert [r["key"] for r in _execute(db_url, "SELECT key FROM health")] == [
        "provider:openai"]
    assert _key_length(db_url) == 200
    with Ledger.open(db_url, clock=ManualClock(T0)) as led:  # and up again
        assert list(led.health()) == ["provider:openai"]
    assert _key_length(db_url) == 609
