"""Tool-call ids stay unique in a Run when a session's turns hand them out at once.

A provider may give every call the same id (``call_fake_1``, as the shipped fake does). The
integrations rename a call whose id the Run used already; the ids the Run used are read once
per session. Turns of one session run at once (``asyncio.gather`` of agents, a graph's
branches): the first of them to read the recorded ids replaced what the others had just taken,
so two agents kept one id, and the second's tool result was refused as another call's.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest

from ledger import AsyncLedger, Budget, Envelope, Grant, Part, ToolSpec
from ledger.integrations._run import RunLink
from ledger.testing import Behavior, FakeProvider
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "tool_description"]})
SEARCH = ToolSpec(name="search", parameters={"type": "object", "properties": {}})


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_turns_handing_out_ids_at_once_never_keep_one_id_twice(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
    async def main() -> tuple[list[str], list[dict[str, object]]]:
        async with AsyncLedger.open(db_url) as led, \
                led.run("ids", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            results = []
            for i in range(3):
                fake.enqueue(Behavior(tool_call=("search", {"q": i})), model="primary-model")
                results.append(await run.turn(Envelope(parts=[Part(content=f"question {i}")],
                                                       tools=[SEARCH])))
            assert len({c.tool_call_id for r in results for c in r.parts
                        if c.tool_call_id}) == 1  # the provider's one id, three times
            link = RunLink(run, who="test")
            # At once, as agents of one session are: each awaits the first read of the ids.
            served = await asyncio.gather(*(link.stable_calls(r, ()) for r in results))
            events = [e.data for e in await led.events("ids", ["tool_call_id"])]
            return [p.tool_call_id or "" for parts in served for p in parts
                    if p.tool_call_id], events

    ids, events = asyncio.run(main())
    assert len(ids) == 3 and len(set(ids)) == 3, ids
    assert len(events) == 2  # the first keeps the provider's id, the others are renamed
