"""A pydantic-ai agent on a thinking route calls a tool through ``LedgerModel``, on both backends
over loopback: an Anthropic route's thinking block comes back as a ``ThinkingPart`` (its text as
the content) and goes back to that route, unchanged and before the tool call; a Gemini 3
route's thought signature goes back on its function call (the fake provider refuses the
request otherwise, as Gemini 3 does). Streaming and not.
"""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, ThinkingPart, ToolCallPart

from ledger import AsyncLedger, Budget, Grant, Route, WireProtocol
from ledger.api.session import AsyncRunSession
from ledger.integrations.pydantic_ai import LedgerModel
from ledger.testing import Behavior, FakeProvider, Fault
from ledger.testing.fakewire import reasoning_secret, thought_signature
from tests import fakeplan
from tests.fakeplan import PRICE

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "tool_result",
                                   "tool_description", "system"]})
FULL_TEXT = Behavior().text
THINK = "Look the ticker up first."
MODELS = {"anthropic": ("claude-sonnet-4-5", "claude-opus-4-1"),
          "gemini": ("gemini-3-pro-preview", "gemini-3-flash-preview")}


def lookup(ticker: str) -> str:
    """Look a company up."""
    return json.dumps({"ticker": ticker, "sector": "energy"})


def plan(fake: FakeProvider, protocol: str) -> list[Route]:
    primary, backup = MODELS[protocol]
    return [Route(id=rid, provider=f"fake-{rid}", model=model, group=f"g-{rid}",
                  recipient="fake", protocol=WireProtocol(protocol),
                  endpoint=fake.endpoint(protocol), price=PRICE)
            for rid, model in (("primary", primary), ("backup", backup))]


def agent_for(run: AsyncRunSession) -> Agent[None, str]:
    return Agent(LedgerModel(run), tools=[lookup], instructions="Read carefully.")


def carried(body: dict[str, Any], protocol: str) -> list[Any]:
    """What of the reasoning a request carried: thinking blocks, or thought signatures."""
    if protocol == "anthropic":
        return [b for m in body["messages"] for b in m["content"]
                if isinstance(b, dict) and b["type"] == "thinking"]
    return [p["thoughtSignature"] for c in body["contents"] for p in c["parts"]
            if "thoughtSignature" in p]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["anthropic", "gemini"])
def test_a_pydantic_ai_agent_on_a_thinking_route_gets_its_reasoning_back_through_a_tool_call(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool) -> None:
    model = MODELS[protocol][0]
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK),
                 model=model)
    fake.enqueue(Behavior(reasoning=THINK), model=model)

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, led.run(
                "think", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            agent = agent_for(run)
            if stream:  # agent.iter streams every model request of a run with tools
                async with agent.iter("Which sector is XOM in?") as agent_run:
                    async for node in agent_run:
                        if Agent.is_model_request_node(node):
                            async with node.stream(agent_run.ctx) as events:
                                async for _event in events:
                                    pass
                assert agent_run.result is not None
                assert agent_run.result.output == FULL_TEXT
                messages = agent_run.result.all_messages()
            else:
                result = await agent.run("Which sector is XOM in?")
                assert result.output == FULL_TEXT
                messages = result.all_messages()
            first = next(m for m in messages if isinstance(m, ModelResponse))
            assert isinstance(first.parts[0], ThinkingPart)
            if protocol == "anthropic":  # the thinking shows; a signature holds no text
                assert first.parts[0].content == THINK
            assert isinstance(first.parts[-1], ToolCallPart)
            assert all(THINK not in getattr(p, "content", "") for p in first.parts[1:])
            # The history, reasoning included, passes preflight on the next run.
            fake.enqueue(Fault.UNAVAILABLE, model=model)
            moved = await agent.run("And its peers?", message_history=messages)
            assert moved.output == FULL_TEXT
            last = [m for m in moved.all_messages() if isinstance(m, ModelResponse)][-1]
            details = (last.provider_details or {})["ledger"]
            # The primary failed: the backup (another model) served, without the primary's
            # reasoning, which it could not verify; the result says what was left out.
            assert details["route"] == "backup" and details["switched"]
            assert details["notes"] and all("route 'primary'" in n for n in details["notes"])

    asyncio.run(main())
    assert all(r.problem is None for r in fake.requests)
    assert [r.stream for r in fake.requests[:2]] == [stream, stream]
    # The request with the tool's result carried the primary's reasoning back, as written.
    back = fake.requests[1].json
    expected = ({"type": "thinking", "thinking": THINK,
                 "signature": reasoning_secret(model, THINK)} if protocol == "anthropic"
                else thought_signature(model, "lookup", THINK))
    assert carried(back, protocol) == [expected]
    if protocol == "anthropic":
        assistant = back["messages"][1]["content"]
        assert [b["type"] for b in assistant] == ["thinking", "text", "tool_use"]
    assert carried(fake.requests[-1].json, protocol) == []
