"""Images a model returns, to a pydantic-ai agent through ``LedgerModel``, on both backends,
against the shipped fake provider over loopback.

pydantic-ai (2.x) has ``FilePart`` for a file in a model response, holding a ``BinaryContent``
(``BinaryImage`` for an image): the turn's image part becomes one, streamed or not, and the
``FilePart`` in the message history goes back as the assistant part the ledger recorded (its
Attempt's provenance), so the next request passes preflight and an edited image does not.
"""

from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import (
    BinaryContent,
    BinaryImage,
    FilePart,
    ModelMessage,
    ModelResponse,
    TextPart,
)

from ledger import AsyncLedger, Budget, FailoverExhausted, Grant
from ledger.integrations.pydantic_ai import LedgerModel, response_parts
from ledger.testing import Behavior, FakeProvider
from tests import fakeplan
from tests.fakeplan import plan
from tests.media import png

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "system"]})
FULL_TEXT = Behavior().text
CHART = png(64, 48)
IMAGE_OUT = ["openai", "openai_responses", "gemini"]


def files(messages: list[ModelMessage]) -> list[FilePart]:
    return [p for m in messages if isinstance(m, ModelResponse) for p in m.parts
            if isinstance(p, FilePart)]


@pytest.mark.parametrize("protocol", IMAGE_OUT)
@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_gets_the_models_image_as_a_file_part_and_carries_it_on(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool) -> None:
    fake.enqueue(Behavior(image_out=("image/png", CHART)), model="primary-model")

    async def ask(agent: Agent[None, str], prompt: str, **kw: Any) -> tuple[str, list[Any]]:
        if not stream:
            done = await agent.run(prompt, **kw)
            return done.output, done.all_messages()
        async with agent.run_stream(prompt, **kw) as streamed:
            output = await streamed.get_output()
        return output, streamed.all_messages()

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, led.run(
                "draw", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            agent = Agent(LedgerModel(run))
            output, history = await ask(agent, "Draw the revenue chart.")
            assert output == FULL_TEXT  # the agent's output stays the text
            (file,) = files(history)
            assert isinstance(file.content, BinaryImage)
            assert (file.content.data, file.content.media_type) == (CHART, "image/png")
            # The history's file is the part the ledger recorded for the Attempt.
            last = [m for m in history if isinstance(m, ModelResponse)][-1]
            (image,) = [p for p in response_parts(last) if p.media_type is not None]
            attempt = last.provider_details["ledger"]["attempt_id"]  # type: ignore[index]
            assert image.content_hash in (await led.provenance("draw"))[attempt]
            output, _ = await ask(agent, "Make the bars blue.", message_history=history)
            assert output == FULL_TEXT
            assert [m.data for m in fake.requests[-1].media] == [CHART]

            # An edited image in the history is not covered: refused, nothing sent.
            edited = [dataclasses.replace(m, parts=[
                dataclasses.replace(p, content=BinaryContent(data=png(64, 49),
                                                             media_type="image/png"))
                if isinstance(p, FilePart) else p for p in m.parts])
                if isinstance(m, ModelResponse) else m for m in history]
            sent = len(fake.requests)
            with pytest.raises(FailoverExhausted, match="mismatch"):
                await ask(agent, "Make the bars blue.", message_history=edited)
            assert len(fake.requests) == sent

    asyncio.run(main())
    assert all(r.problem is None for r in fake.requests)


def test_a_file_link_the_model_returned_goes_back_from_the_provider_details() -> None:
    # A FilePart holds bytes: a file the provider returned as a link (Gemini fileData) rides
    # in the response's provider details, and goes back as the part the ledger recorded.
    response = ModelResponse(parts=[TextPart("Here.")], provider_details={"ledger": {
        "attempt_id": "a-1", "links": [{"url": "https://files.example/f/1.png",
                                        "media_type": "image/png"}]}})
    text, link = response_parts(response)
    assert text.content == "Here."
    assert (link.role, link.data_class, link.provenance) == ("assistant", "model_derived",
                                                              "a-1")
    assert (link.url, link.media_type) == ("https://files.example/f/1.png", "image/png")
