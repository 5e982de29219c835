"""Reasoning a provider requires back, through Run sessions on both backends over loopback.

An Anthropic route with extended thinking and a Gemini 3 route: a tool round trip carries the
route's thinking block / thought signature back to it (the fake provider refuses the request
otherwise, as the real APIs do); a failover in the middle of the tool loop leaves the reasoning
out of the backup's request with a note, and the backup answers.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from ledger import Budget, Envelope, Grant, Ledger, Part, Route, ToolSpec, WireProtocol
from ledger.domain.media import REASONING_MEDIA_TYPE
from ledger.testing import Behavior, FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import PRICE

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "tool_result",
                                   "tool_description", "system"]})
TOOLS = [ToolSpec(name="lookup", description="Look a ticker up.",
                  parameters={"type": "object", "properties": {"ticker": {"type": "string"}}})]
THINK = "The ticker first, then its sector."

# (protocol, model, the parameters that turn thinking on, the backup's protocol)
THINKING_ROUTES = [
    ("anthropic", "claude-sonnet-4-5", {"thinking": {"type": "enabled", "budget_tokens": 1024}},
     "openai"),
    ("gemini", "gemini-3-pro-preview", {"thinkingConfig": {"thinkingBudget": 1024}},
     "anthropic"),
]


def routes(fake: FakeProvider, protocol: str, model: str, backup: str) -> list[Route]:
    return [Route(id="thinker", provider="fake", model=model, group="ga", recipient="fake",
                  protocol=WireProtocol(protocol), endpoint=fake.endpoint(protocol),
                  price=PRICE),
            Route(id="backup", provider="fake-b", model="backup-model", group="gb",
                  recipient="fake", protocol=WireProtocol(backup),
                  endpoint=fake.endpoint(backup), price=PRICE)]


def reasoning_sent(body: dict[str, Any], protocol: str) -> list[Any]:
    """The thinking blocks / thought signatures a request carried."""
    if protocol == "anthropic":
        return [b for m in body["messages"] for b in m["content"]
                if isinstance(b, dict) and b["type"] in ("thinking", "redacted_thinking")]
    return [p["thoughtSignature"] for c in body["contents"] for p in c["parts"]
            if "thoughtSignature" in p]


@pytest.mark.parametrize(("protocol", "model", "think", "backup"), THINKING_ROUTES)
def test_a_thinking_route_gets_its_reasoning_back_through_a_tool_round_trip(
        db_url: str, fake: FakeProvider, protocol: str, model: str, think: dict[str, Any],
        backup: str) -> None:
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK), model=model)
    fake.enqueue(Behavior(reasoning=THINK), model=model)
    ask = Part(content="Which sector is XOM in?")
    with Ledger.open(db_url) as led, led.run("think", plan=routes(fake, protocol, model, backup),
                                              budget=BUDGET, grant=GRANT) as run:
        first = run.turn(Envelope(parts=[ask], tools=TOOLS, params=think))
        assert first.route.id == "thinker"
        assert first.parts[0].media_type == REASONING_MEDIA_TYPE
        assert THINK not in first.output.text
        [call] = first.tool_calls
        answer = run.tool_result(call.tool_call_id or "", '{"sector": "Energy"}')
        second = run.turn(Envelope(parts=[ask, *first.parts, answer], tools=TOOLS,
                                   params=think))
        assert second.route.id == "thinker" and second.output.notes == ()
    sent = fake.requests[-1]
    assert sent.problem is None and len(reasoning_sent(sent.json, protocol)) == 1


@pytest.mark.parametrize(("protocol", "model", "think", "backup"), THINKING_ROUTES)
def test_a_failover_mid_tool_loop_leaves_the_reasoning_out_with_a_note_and_the_backup_answers(
        db_url: str, fake: FakeProvider, protocol: str, model: str, think: dict[str, Any],
        backup: str) -> None:
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK), model=model)
    fake.enqueue(Fault.UNAVAILABLE, model=model)  # the request with the tool's result
    ask = Part(content="Which sector is XOM in?")
    with Ledger.open(db_url) as led, led.run("move", plan=routes(fake, protocol, model, backup),
                                              budget=BUDGET, grant=GRANT) as run:
        first = run.turn(Envelope(parts=[ask], tools=TOOLS, params=think))
        [call] = first.tool_calls
        answer = run.tool_result(call.tool_call_id or "", '{"sector": "Energy"}')
        moved = run.turn(Envelope(parts=[ask, *first.parts, answer], tools=TOOLS,
                                  params=think))
        assert moved.route.id == "backup" and moved.switched
        assert moved.output.text == Behavior().text
        (note,) = moved.output.notes
        assert f"a reasoning item of route 'thinker' ({protocol}) is left out" in note
        assert [a.state.value for a in moved.attempts] == ["failed", "succeeded"]
    thinker, backup_req = fake.requests[-2:]
    # The thinker was sent its reasoning; the backup, which could not verify it, was not.
    assert len(reasoning_sent(thinker.json, protocol)) == 1
    assert backup_req.protocol == backup and backup_req.problem is None
    assert THINK not in backup_req.body.decode() and "enc:" not in backup_req.body.decode()
