"""Routes without a Price get the maintained table's price (genai-prices) at admission, frozen
with the Run; an explicit Price wins; an unknown model under a cost budget is refused."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from ledger.adapters import StaticSecretProvider, SyncAdapter, sync_sender
from ledger.api.facade import Ledger
from ledger.api.turn import execute
from ledger.clock import ManualClock
from ledger.decide.pricing import lookup_price, resolve_prices
from ledger.domain.envelope import Envelope, Part
from ledger.domain.records import from_micros, to_micros
from ledger.domain.values import Budget, Price, Profile, Route
from ledger.errors import InvalidArgument
from ledger.testing.fakeprovider import FakeProvider

GPT4O = Price(input_per_mtok=Decimal("2.5"), output_per_mtok=Decimal("10"))
BUDGET = Budget(max_calls=2, max_retries=1, max_cost=Decimal("1"))


def _at(day: str) -> float:
    return datetime.fromisoformat(day).replace(tzinfo=UTC).timestamp()


def _route(rid: str = "a", provider: str = "openai", model: str = "gpt-4o",
           **kw: object) -> Route:
    return Route(id=rid, provider=provider, model=model, group=f"g-{rid}", recipient=provider,
                 **kw)  # type: ignore[arg-type]


def test_lookup_by_provider_and_model_in_the_real_table() -> None:
    assert lookup_price("openai", "gpt-4o") == GPT4O
    assert lookup_price("anthropic", "claude-sonnet-4-5") == Price(
        input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))
    assert lookup_price("gemini", "gemini-2.5-pro") is not None  # the table's "google"
    # A provider name the table does not know, but an endpoint it does.
    assert lookup_price("my-gateway", "gpt-4o", endpoint="https://api.openai.com/v1") == GPT4O


def test_unknown_models_and_providers_have_no_price() -> None:
    assert lookup_price("openai", "gpt-nonexistent-9") is None
    assert lookup_price("p1", "m1") is None
    assert lookup_price("p1", "m1", endpoint="http://127.0.0.1:9/v1") is None


def test_lookup_uses_the_admission_time() -> None:
    # o3's price changed on 2025-06-10: the table keeps both, the instant picks one.
    before = lookup_price("openai", "o3", at=_at("2025-01-01"))
    after = lookup_price("openai", "o3", at=_at("2025-07-01"))
    assert before is not None and after is not None
    assert before.input_per_mtok > after.input_per_mtok


def test_admission_freezes_the_table_price_in_the_plan(db_url: str) -> None:
    with Ledger.open(db_url, clock=ManualClock(_at("2026-01-01"))) as led:
        given = _route()
        assert given.price is None
        led.admit_run("r", plan=[given], budget=BUDGET)
        (frozen,) = led.get_run("r").plan
        assert frozen.price == GPT4O
        assert frozen.model_copy(update={"price": None}) == given
        # Re-submitting the same request is the same Run, not a conflict.
        assert led.admit_run("r", plan=[given], budget=BUDGET).run_id == "r"
        # The low-level API accepts the caller's unpriced route object for the frozen one.
        lease = led.acquire_lease("r")
        att = led.begin_attempt(lease, route=given, envelope_hash="sha256:e", reserve="0.01")
        assert att.route_id == "a"


def test_history_keeps_its_original_price(db_url: str) -> None:
    clock = ManualClock(_at("2025-01-01"))
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("old", plan=[_route(model="o3")], budget=BUDGET)
        clock.set(_at("2025-07-01"))
        led.admit_run("new", plan=[_route(model="o3")], budget=BUDGET)
        old, new = led.get_run("old").plan[0].price, led.get_run("new").plan[0].price
    assert old is not None and new is not None and old.input_per_mtok > new.input_per_mtok
    with Ledger.open(db_url) as later:  # read again today: still the price it was admitted at
        assert later.get_run("old").plan[0].price == old


def test_an_explicit_price_always_wins(db_url: str) -> None:
    mine = Price(input_per_mtok=Decimal("0.5"), output_per_mtok=Decimal("0.5"))
    with Ledger.open(db_url) as led:
        led.admit_run("r", plan=[_route(price=mine), _route("free", price=Price())],
                      budget=BUDGET)
        assert [r.price for r in led.get_run("r").plan] == [mine, Price()]


def test_unknown_model_with_a_cost_budget_is_refused_naming_the_field(db_url: str) -> None:
    plan = [_route(), _route("x", provider="acme", model="acme-large")]
    with Ledger.open(db_url) as led:
        with pytest.raises(InvalidArgument) as err:
            led.admit_run("r", plan=plan, budget=BUDGET)
        assert err.value.field == "plan[1].price"
        msg = str(err.value)
        assert "'acme'" in msg and "'acme-large'" in msg and "price=Price(" in msg
        with pytest.raises(Exception, match="unknown run id"):
            led.get_run("r")  # nothing was admitted
        # No cost budget (the Run may spend nothing): admitted, the unknown route frozen free.
        led.admit_run("z", plan=plan, budget=Budget(max_calls=1, max_retries=0, max_cost=0))
        assert [r.price for r in led.get_run("z").plan] == [GPT4O, Price()]


def test_a_child_takes_its_parents_frozen_prices(db_url: str) -> None:
    clock = ManualClock(_at("2025-01-01"))
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("p", plan=[_route(model="o3")], budget=BUDGET)
        clock.set(_at("2025-07-01"))  # the table's o3 price has changed since
        lease = led.acquire_lease("p")  # the parent, leased now (a child needs its lease)
        led.admit_run("c", plan=[_route(model="o3")], parent=lease,
                      budget=Budget(max_calls=1, max_retries=0, max_cost=Decimal("0.5")))
        assert led.get_run("c").plan == led.get_run("p").plan


def test_resolve_is_pure_and_keeps_order() -> None:
    plan = [_route("a", price=Price()), _route("b"), _route("c", model="gpt-4o-mini")]
    out = resolve_prices(plan, BUDGET, at=_at("2026-01-01"))
    assert [r.id for r in out] == ["a", "b", "c"]
    assert out[0].price == Price() and out[1].price == GPT4O
    assert out[2].price is not None and out[2].price.input_per_mtok < GPT4O.input_per_mtok
    assert plan[1].price is None  # the caller's routes are not changed


def test_the_hold_and_the_cost_use_the_resolved_price(tmp_path: object) -> None:
    """A real call over loopback: the default hold and the adapter's cost both come from the
    price the table gave the frozen route (the caller's route had none)."""
    with FakeProvider().in_thread() as fake:
        route = _route(endpoint=fake.endpoint("openai"), profiles=[Profile(id="k")])
        adapter = SyncAdapter(secrets=StaticSecretProvider({"k": "key"}))
        try:
            with Ledger.open(f"{tmp_path}/l.db") as led:
                led.admit_run("r", plan=[route], budget=BUDGET)
                lease = led.acquire_lease("r")
                env = Envelope(parts=[Part(content="Price this.")], max_output_tokens=100)
                res = execute(led, lease, env, sync_sender(adapter))
                att = res.attempt
                frozen = led.get_run("r").plan[0]
        finally:
            adapter.close()
    assert att.prompt_tokens and att.completion_tokens
    # The ledger stores money in micros (six decimals).
    expected = from_micros(to_micros(GPT4O.cost(att.prompt_tokens, att.completion_tokens)))
    assert att.cost == expected > 0
    assert res.route.price == GPT4O == frozen.price
    # The default hold covers the request's max output at the resolved output price (and its
    # prompt estimate); at a zero price it would be nothing.
    assert att.reserved >= GPT4O.cost(0, 100) > 0
