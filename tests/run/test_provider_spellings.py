"""A provider is one provider however its routes capitalise its name, on both backends.

Under ``health.key: provider`` (``goclaw``) every route of a provider shares one health row.
Provider names are matched case-insensitively everywhere else (``exempt_providers``,
``base_s_by_provider``, ``auth_order``), so routes of ``OpenAI`` and ``openai`` share it too:
a cooldown seen through one spelling darkens both, one process per interval probes them, and
an operator reads and clears the row by either spelling.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger.api.facade import Ledger
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation
from ledger.domain.records import Lease
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import InvalidArgument

FREE = Price()
UPPER = Route(id="gpt-upper", provider="OpenAI", model="gpt-4o", group="openai-a",
              recipient="openai", price=FREE)
LOWER = Route(id="gpt-lower", provider="openai", model="gpt-4o-mini", group="openai-b",
              recipient="openai", price=FREE)
DEEPSEEK = Route(id="deepseek", provider="deepseek", model="deepseek-v4-flash", group="deepseek",
                 recipient="deepseek", price=FREE)
GRANT = Grant(recipients={r: ["user_input"] for r in ("openai", "deepseek")})
ENV = Envelope(parts=[Part(content="Summarise the filings.")], max_output_tokens=100)
OK = SendResult(ok=True, output="answer", prompt_tokens=10, completion_tokens=5,
                cost=Decimal(0))
OVERLOADED = SendResult.failed(Observation(status=503, body="The model is overloaded"))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(50_000.0)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock) as ledger:
        yield ledger


def admit(led: Ledger, run_id: str, plan: list[Route]) -> Lease:
    led.admit_run(run_id, plan=plan, grant=GRANT, policy="goclaw",
                  budget=Budget(max_calls=10, max_retries=6, max_cost=Decimal(1)))
    return led.acquire_lease(run_id, ttl_s=3600)


def overloaded_upper(d: Dispatch) -> SendResult:
    return OVERLOADED if d.route.id == UPPER.id else OK


def test_a_providers_cooldown_darkens_every_spelling_of_its_name(led: Ledger) -> None:
    sent: list[str] = []

    def send(d: Dispatch) -> SendResult:
        sent.append(d.route.id)
        return overloaded_upper(d)

    res = execute(led, admit(led, "r1", [UPPER, LOWER, DEEPSEEK]), ENV, send)
    # The 503s of OpenAI cooled openai too: the fleet does not go on to the same provider.
    assert res.route.id == "deepseek" and LOWER.id not in sent
    moved = led.events("r1", ["select"])[-1].data
    assert {s["route"]: s["reason"] for s in moved["skipped"]}[LOWER.id] == "route_cooldown"
    health = led.health()
    assert sorted(k for k in health if k.startswith("provider:")) == [
        "provider:deepseek", "provider:openai"]
    assert health["provider:openai"].failure_counts == {"overloaded": 1}


def test_a_provider_is_probed_once_per_interval_whatever_its_spelling(led: Ledger) -> None:
    assert led.claim_probe(UPPER, 30, key="provider:OpenAI")
    assert not led.claim_probe(LOWER, 30, key="provider:openai")
    assert not led.claim_probe(LOWER, 30, key="provider:OPENAI")
    assert [k for k in led.health() if k.startswith("provider:")] == ["provider:openai"]


def test_an_operator_reads_and_clears_a_provider_by_either_spelling(
        led: Ledger, clock: ManualClock) -> None:
    execute(led, admit(led, "r1", [LOWER, DEEPSEEK]),
            ENV, lambda d: OVERLOADED if d.route.id == LOWER.id else OK)
    cooling = led.health(["provider:OpenAI"])
    assert list(cooling) == ["provider:openai"]
    assert not cooling["provider:openai"].available(clock.now())
    event = led.clear_cooldown("provider:OpenAI", reason="status page: resolved", by="ana")
    assert (event.data["key"], event.data["kind"]) == ("provider:openai", "provider")
    assert led.health(["provider:openai"])["provider:openai"].available(clock.now())



# The longest provider name a Route takes (200 characters) whose case folding is the longest
# too: U+0390 folds to three characters, so its key is ``provider:`` and 600 characters.
LONGEST = "\u0390" * 200
LONGEST_KEY = "provider:" + LONGEST.casefold()
LONG = Route(id="long", provider=LONGEST, model="m", group="long", recipient="openai",
             price=FREE)


def test_every_valid_routes_provider_key_is_stored_on_both_backends(
        led: Ledger, clock: ManualClock) -> None:
    assert len(LONGEST_KEY) == 609
    # The probe claim writes the row first (on PostgreSQL it overflowed the column), then the
    # settles of a failure and of a success write it (they failed after the request was sent).
    assert led.claim_probe(LONG, 30, key="provider:" + LONGEST)
    assert not led.claim_probe(LONG, 30, key=LONGEST_KEY)
    res = execute(led, admit(led, "r1", [LONG, DEEPSEEK]), ENV,
                  lambda d: OVERLOADED if d.route.id == LONG.id else OK)
    assert res.route.id == DEEPSEEK.id
    assert led.health()[LONGEST_KEY].failure_counts == {"overloaded": 1}
    clock.advance(3600)
    assert execute(led, admit(led, "r2", [LONG]), ENV, lambda d: OK).route.id == LONG.id
    # An operator reads and clears it by the name as the route spells it, or as listed.
    assert list(led.health(["provider:" + LONGEST])) == [LONGEST_KEY]
    execute(led, admit(led, "r3", [LONG, DEEPSEEK]), ENV,
            lambda d: OVERLOADED if d.route.id == LONG.id else OK)
    event = led.clear_cooldown("provider:" + LONGEST, reason="resolved", by="ana")
    assert event.data["key"] == LONGEST_KEY
    assert led.health([LONGEST_KEY])[LONGEST_KEY].available(clock.now())


def test_a_health_key_no_route_can_have_is_refused_naming_the_key(led: Ledger) -> None:
    too_long = "k" * 610
    for field, call in (
            ("keys[0]", lambda: led.health([too_long])),
            ("key", lambda: led.clear_cooldown(too_long, reason="resolved")),
            ("key", lambda: led.claim_probe(LONG, 30, key=too_long)),
            # Short enough as spelled, but its name folds past any route's key.
            ("key", lambda: led.claim_probe(LONG, 30, key="provider:" + "\u0390" * 250))):
        with pytest.raises(InvalidArgument, match="609") as err:
            call()
        assert err.value.field == field
    assert led.health() == {}
