"""Migration 0020: a provider's health rows of several spellings become one, on both backends.

Before 0020 a provider's health key kept its name as each route spelled it, so a ledger may
hold ``provider:OpenAI`` and ``provider:openai``. The package now reads only the folded key: a
cooldown or disable left under another spelling must carry over to it, the stricter state
winning, or it would be lost while it still ran.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from sqlalchemy import create_engine, text

from ledger.api.facade import Ledger
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.storage.engine import normalize_url

from .helpers import downgrade_schema

T0 = 20_000.0
_COLUMNS = ("key", "kind", "provider", "cooldown_until", "disabled_until", "disabled_reason",
            "error_count", "failure_counts", "last_failure_at", "counted_at", "last_used",
            "last_probe_at", "reset_at", "recent_failures", "updated_at")


def _row(key: str, kind: str = "provider", **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(_COLUMNS)
    row.update(key=key, kind=kind, provider=key.removeprefix("provider:"), error_count=0,
               failure_counts="{}", updated_at=T0)
    row.update(values)
    return row


# As the package of 0019 left them: one provider under two spellings, a cooldown on one (the
# darker) and a shorter billing disable on the other; a lone row spelled otherwise; rows the
# migration has no business with.
OLD_ROWS = [
    _row("provider:OpenAI", cooldown_until=T0 + 600, error_count=2,
         failure_counts=json.dumps({"overloaded": 2}), last_failure_at=T0, counted_at=T0 - 60,
         reset_at=T0 + 600, last_probe_at=T0 - 30, updated_at=T0),
    _row("provider:openai", disabled_until=T0 + 300, disabled_reason="billing", error_count=1,
         failure_counts=json.dumps({"billing": 1}), last_failure_at=T0 - 10,
         counted_at=T0 - 10, reset_at=T0 + 300, last_used=T0 - 100, last_probe_at=T0 - 5,
         updated_at=T0 - 10),
    _row("provider:Gemini", disabled_until=T0 + 7200, disabled_reason="auth", error_count=1,
         failure_counts=json.dumps({"auth": 1}), last_failure_at=T0, counted_at=T0,
         reset_at=T0 + 7200),
    _row("provider:deepseek", cooldown_until=T0 + 60, error_count=1,
         failure_counts=json.dumps({"overloaded": 1}), last_failure_at=T0, reset_at=T0 + 60),
    _row("OpenAI-direct", kind="route", cooldown_until=T0 + 60, error_count=1,
         failure_counts=json.dumps({"overloaded": 1}), reset_at=T0 + 60),
]


def _execute(url: str, sql: str, rows: list[dict[str, Any]] | None = None) -> list[Any]:
    engine = create_engine(normalize_url(url))
    try:
        with engine.begin() as conn:
            result = conn.execute(text(sql), rows or {})
            return [dict(r) for r in result.mappings()] if result.returns_rows else []
    finally:
        engine.dispose()


def _ledger_from_before_0020(url: str) -> None:
    downgrade_schema(url, "0019", "health")
    _execute(url, f"INSERT INTO health ({', '.join(_COLUMNS)}) VALUES "
                  f"({', '.join(':' + c for c in _COLUMNS)})", OLD_ROWS)


def test_a_providers_rows_of_every_spelling_become_one_keeping_the_stricter_state(
        db_url: str) -> None:
    _ledger_from_before_0020(db_url)
    clock = ManualClock(T0 + 1)
    with Ledger.open(db_url, clock=clock) as led:  # opening upgrades to head
        health = led.health()
    assert sorted(health) == ["OpenAI-direct", "provider:deepseek", "provider:gemini",
                              "provider:openai"]
    openai = health["provider:openai"]
    # The darker row's state, its counters with it; the other's disable and reason kept, and
    # the latest use and probe of the two.
    assert (openai.cooldown_until, openai.error_count, openai.failure_counts,
            openai.counted_at, openai.reset_at) == (T0 + 600, 2, {"overloaded": 2}, T0 - 60,
                                                     T0 + 600)
    assert (openai.disabled_until, openai.disabled_reason) == (T0 + 300, "billing")
    assert (openai.last_used, openai.last_probe_at) == (T0 - 100, T0 - 5)
    # A lone row spelled otherwise is renamed, nothing lost; the others are as they were.
    gemini = health["provider:gemini"]
    assert (gemini.disabled_until, gemini.disabled_reason, gemini.error_count) == (
        T0 + 7200, "auth", 1)
    assert health["provider:deepseek"].cooldown_until == T0 + 60
    assert health["OpenAI-direct"].cooldown_until == T0 + 60
    [kind] = _execute(db_url, "SELECT kind, provider FROM health WHERE key = 'provider:openai'")
    assert kind == {"kind": "provider", "provider": "OpenAI"}


def test_a_disable_kept_under_an_old_spelling_still_darkens_its_routes_after_0020(
        db_url: str) -> None:
    _ledger_from_before_0020(db_url)
    gemini = Route(id="gemini", provider="gemini", model="gemini-3-flash", group="gemini",
                   recipient="google", price=Price())
    other = Route(id="other", provider="other", model="m", group="other", recipient="other",
                  price=Price())
    sent: list[str] = []

    def send(d: Dispatch) -> SendResult:
        sent.append(d.route.id)
        return SendResult(ok=True, output="answer", prompt_tokens=1, completion_tokens=1,
                          cost=Decimal(0))

    with Ledger.open(db_url, clock=ManualClock(T0 + 60)) as led:
        led.admit_run("r", plan=[gemini, other], policy="goclaw",
                      grant=Grant(recipients={"google": ["user_input"],
                                              "other": ["user_input"]}),
                      budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal(1)))
        res = execute(led, led.acquire_lease("r", ttl_s=600),
                      Envelope(parts=[Part(content="Hi.")], max_output_tokens=10), send)
    assert res.route.id == "other" and sent == ["other"]


def test_the_downgrade_from_0020_gives_the_older_package_its_spelling_back(db_url: str) -> None:
    _ledger_from_before_0020(db_url)
    with Ledger.open(db_url, clock=ManualClock(T0 + 1)):
        pass
    downgrade_schema(db_url, "0019", "health")
    rows = {r["key"]: r for r in _execute(
        db_url, "SELECT key, cooldown_until, disabled_until FROM health")}
    assert rows["provider:OpenAI"]["cooldown_until"] == T0 + 600
    assert rows["provider:OpenAI"]["disabled_until"] == T0 + 300
    assert rows["provider:Gemini"]["disabled_until"] == T0 + 7200
    assert "provider:openai" in rows and "provider:gemini" in rows
