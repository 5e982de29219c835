"""A LangChain agent on a thinking route calls a tool through ``LedgerChatModel``, on both
backends over loopback: an Anthropic route's thinking block and a Gemini 3 route's thought
signature ride in ``response_metadata["ledger"]["reasoning"]`` and go back to that route with
the tool's result (the fake provider refuses a Gemini 3 request without the signature, and a
changed thinking block, as the real APIs do), streamed or not.
"""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.tools import tool

from ledger import AsyncLedger, Budget, Grant, Route, WireProtocol
from ledger.integrations.langchain import LedgerChatModel, LedgerMiddleware
from ledger.testing import Behavior, FakeProvider
from ledger.testing.fakewire import reasoning_secret, thought_signature
from tests import fakeplan
from tests.fakeplan import PRICE

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "tool_result",
                                   "tool_description", "system"]})
FULL_TEXT = Behavior().text
THINK = "Search the filings first."
MODELS = {"anthropic": "claude-sonnet-4-5", "gemini": "gemini-3-pro-preview"}


@tool
def search(query: str) -> str:
    """Search the company filings."""
    return json.dumps({"hits": 3, "query": query})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["anthropic", "gemini"])
def test_a_langchain_agent_on_a_thinking_route_gets_its_reasoning_back_with_the_tool_result(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool) -> None:
    model = MODELS[protocol]
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"}), reasoning=THINK),
                 model=model)
    fake.enqueue(Behavior(reasoning=THINK), model=model)
    route = Route(id="thinker", provider="fake", model=model, group="g", recipient="fake",
                  protocol=WireProtocol(protocol), endpoint=fake.endpoint(protocol),
                  price=PRICE)

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("think", plan=[route], budget=BUDGET, grant=GRANT) as run:
            agent = create_agent(LedgerChatModel(run), tools=[search],
                                 middleware=[LedgerMiddleware(run)])
            ask = {"messages": [("user", "Compare the two filings.")]}
            state: dict[str, Any] = {}
            if stream:
                async for mode, data in agent.astream(ask, stream_mode=["messages", "values"]):
                    if mode == "messages":
                        assert not isinstance(data[0], AIMessageChunk) or THINK not in \
                            data[0].text  # thinking is never streamed as answer text
                    else:
                        state = data
            else:
                state = await agent.ainvoke(ask)
            answers = [m for m in state["messages"] if isinstance(m, AIMessage)]
            assert [m.text for m in answers] == [FULL_TEXT, FULL_TEXT]
            assert len(answers[0].response_metadata["ledger"]["reasoning"]) == 1
            # The history, reasoning included, passes preflight on a further call.
            again = await agent.ainvoke({"messages": [*state["messages"], ("user", "And?")]})
            assert again["messages"][-1].text == FULL_TEXT

    asyncio.run(main())
    assert all(r.problem is None for r in fake.requests)
    assert [r.stream for r in fake.requests[:2]] == [stream, stream]
    body = fake.requests[1].json  # the request with the tool's result
    if protocol == "anthropic":
        assistant = body["messages"][1]["content"]
        assert [b["type"] for b in assistant] == ["thinking", "text", "tool_use"]
        assert assistant[0] == {"type": "thinking", "thinking": THINK,
                                "signature": reasoning_secret(model, THINK)}
    else:
        call = body["contents"][1]["parts"][-1]
        assert call["functionCall"]["name"] == "search"
        assert call["thoughtSignature"] == thought_signature(model, "search", THINK)
