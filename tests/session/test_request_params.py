"""What ``Envelope.params`` a route can carry is decided before any Attempt is begun.

A parameter a route's protocol builds itself (``messages`` on chat completions, ``input`` on
the Responses API, ``contents`` on Gemini), one that keeps the conversation at the provider
(``previous_response_id``) and one the route's ``Capabilities.parameters`` leaves out make that
route ineligible (preflight, capability). A request no route of its plan can carry is bad
input: the turn refuses it with ``InvalidArgument`` naming ``envelope.params.<name>``, before
anything is recorded. Real HTTP over loopback, on both backends.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from ledger import Budget, Capabilities, Envelope, InvalidArgument, Ledger, Part, Route
from ledger.domain.facts import WireProtocol
from ledger.testing import FakeProvider
from tests import fakeplan
from tests.fakeplan import PRICE, plan

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))


def _route(fake: FakeProvider, rid: str, protocol: str, group: str,
           caps: Capabilities | None = None) -> Route:
    return Route(id=rid, provider="fake", model=f"{rid}-model", group=group, recipient="fake",
                 protocol=WireProtocol(protocol), endpoint=fake.endpoint(protocol), price=PRICE,
                 **({"capabilities": caps} if caps is not None else {}))


@pytest.mark.parametrize(("protocol", "params", "name"), [
    ("openai", {"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("openai_responses", {"input": "x"}, "input"),
    ("openai_responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
    ("anthropic", {"temperature": 0.1, "system": "x"}, "system"),
    ("gemini", {"contents": []}, "contents"),
])
def test_params_no_route_can_carry_are_refused_before_any_attempt(
        db_url: str, fake: FakeProvider, protocol: str, params: dict[str, Any],
        name: str) -> None:
    """Bad input is refused at the turn's start: the typed error names the parameter, and the
    Run has no Attempt, no hold, no spent call or retry, no decision recorded."""
    env = Envelope(parts=[Part(content="question")], params=params)
    with Ledger.open(db_url) as led:
        with led.run("t", plan=plan(fake, protocol), budget=BUDGET) as run:
            with pytest.raises(InvalidArgument) as ei:
                run.turn(env)
            assert led.timeline("t") == [] and fake.requests == []  # no Attempt row
            assert ei.value.field == f"envelope.params.{name}"
            assert f"leave {name!r} out of Envelope.params" in str(ei.value)
            assert {"primary", "backup"} <= set(ei.value.fields["routes"])
            run.turn(Envelope(parts=[Part(content="question")]))  # the Run goes on
        assert len(fake.requests) == 1 and len(led.timeline("t")) == 1
        rec = led.get_run("t")
        assert rec.calls_used == 1 and rec.retries_used == 0
        assert [e.kind for e in led.events("t") if e.kind in ("select", "stop")] == ["select"]


def test_params_a_route_does_not_support_are_refused_before_any_attempt(
        db_url: str, fake: FakeProvider) -> None:
    """``Capabilities.parameters`` counts the same way: a parameter no planned route takes is
    refused with the typed error, nothing recorded."""
    caps = Capabilities(parameters=["temperature"])
    routes = [_route(fake, "primary", "openai", "ga", caps),
              _route(fake, "backup", "openai", "gb", caps)]
    env = Envelope(parts=[Part(content="question")], params={"top_p": 0.5})
    with Ledger.open(db_url) as led:
        with led.run("t", plan=routes, budget=BUDGET) as run, \
                pytest.raises(InvalidArgument) as ei:
            run.turn(env)
        assert fake.requests == [] and led.timeline("t") == []  # no Attempt row
        assert ei.value.field == "envelope.params.top_p"
        assert "does not support parameter 'top_p'" in str(ei.value)


def test_a_route_whose_protocol_cannot_carry_the_params_is_skipped_without_an_attempt(
        db_url: str, fake: FakeProvider) -> None:
    """A parameter one protocol builds itself may be another's own: the Responses API's
    built-in ``tools``. In a plan mixing protocols only the route that cannot carry it is
    ineligible, skipped with its reason and no Attempt; the request goes to the one that can,
    without spending a retry permission."""
    routes = [_route(fake, "chat", "openai", "ga"),
              _route(fake, "responses", "openai_responses", "gb")]
    env = Envelope(parts=[Part(content="question")],
                   params={"tools": [{"type": "web_search"}]})
    with Ledger.open(db_url) as led:
        with led.run("t", plan=routes, budget=BUDGET) as run:
            result = run.turn(env)
        assert result.route.id == "responses"
        assert [a.route_id for a in led.timeline("t")] == ["responses"]
        assert [r.protocol for r in fake.requests] == ["openai_responses"]
        assert fake.requests[0].json["tools"] == [{"type": "web_search"}]
        assert led.get_run("t").retries_used == 0
        select = next(e for e in led.events("t") if e.kind == "select")
        skipped = select.data["skipped"]
        assert [s["route"] for s in skipped] == ["chat"]
        assert skipped[0]["reason"] == "capability" and "tools" in skipped[0]["detail"]
