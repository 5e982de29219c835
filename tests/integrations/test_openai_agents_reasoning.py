"""An OpenAI Agents SDK agent on a thinking route calls a tool through the ledger's model
provider, on both backends over loopback: an Anthropic route's thinking block and a Gemini 3
route's thought signature come back as ``reasoning`` items and go back to that route with the
tool's output (the fake provider refuses a Gemini 3 request without the signature, and a
changed thinking block, as the real APIs do).
"""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal

import pytest
from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled

from ledger import AsyncLedger, Budget, Grant, Route, WireProtocol
from ledger.integrations.openai_agents import LedgerModelProvider
from ledger.testing import Behavior, FakeProvider
from ledger.testing.fakewire import reasoning_secret, thought_signature
from tests import fakeplan
from tests.fakeplan import PRICE

set_tracing_disabled(True)  # the SDK's trace export would reach api.openai.com

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "tool_result",
                                   "tool_description", "system"]})
FULL_TEXT = Behavior().text
THINK = "Search the filings first."
MODELS = {"anthropic": "claude-sonnet-4-5", "gemini": "gemini-3-pro-preview"}


@function_tool
def search(query: str) -> str:
    """Search the company filings."""
    return json.dumps({"hits": 3, "query": query})


@pytest.mark.parametrize("protocol", ["anthropic", "gemini"])
def test_an_agents_sdk_agent_on_a_thinking_route_gets_its_reasoning_back_with_the_tool_output(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
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
            researcher = Agent(name="researcher", tools=[search])
            config = RunConfig(model_provider=LedgerModelProvider(run), tracing_disabled=True)
            result = await Runner.run(researcher, "Compare the two filings.",
                                      run_config=config)
            assert result.final_output == FULL_TEXT
            items = result.to_input_list()
            kinds = [i.get("type", "message") for i in items]
            assert kinds[:4] == ["message", "reasoning", "message", "function_call"]
            if protocol == "anthropic":  # the block's thinking is the item's summary
                assert items[1]["summary"] == [{"text": THINK, "type": "summary_text"}]
            # The history, reasoning included, passes preflight on a further run.
            again = await Runner.run(researcher, [*items, {"role": "user", "content": "More."}],
                                     run_config=config)
            assert again.final_output == FULL_TEXT

    asyncio.run(main())
    assert all(r.problem is None for r in fake.requests)
    body = fake.requests[1].json  # the request with the tool's output
    if protocol == "anthropic":
        assistant = body["messages"][1]["content"]
        assert [b["type"] for b in assistant] == ["thinking", "text", "tool_use"]
        assert assistant[0]["signature"] == reasoning_secret(model, THINK)
    else:
        call = body["contents"][1]["parts"][-1]
        assert call["thoughtSignature"] == thought_signature(model, "search", THINK)
