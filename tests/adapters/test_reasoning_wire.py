"""Reasoning a provider requires back, carried over real HTTP on loopback.

Anthropic's extended thinking: with thinking enabled and tool use, the assistant message of the
next request must start with the thinking blocks the model wrote, unchanged (their signature
is verified). Gemini's thought signatures: a thinking model (Gemini 3) requires the signature
back on the ``functionCall`` part it was written for. The fake provider writes both, signed
for the requested model, and refuses a request that leaves them out, moves them or changes
them, as the real APIs do: each test below would fail against it if the codec dropped,
reordered or altered the reasoning.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ledger.adapters import HttpAdapter, TextDelta
from ledger.adapters.contract import reasoning_data
from ledger.adapters.runner import output_parts
from ledger.domain.envelope import Envelope, Part, ToolSpec
from ledger.domain.media import REASONING_MEDIA_TYPE
from ledger.testing import Behavior, FakeProvider
from ledger.testing.fakewire import reasoning_secret, thought_signature

from .conftest import make_route

pytestmark = pytest.mark.anyio

ASK = Part(content="Which sector is XOM in?")
TOOLS = [ToolSpec(name="lookup", description="Look a ticker up.",
                  parameters={"type": "object", "properties": {"ticker": {"type": "string"}}})]
THINK = "The ticker first, then its sector."
ANTHROPIC_THINKING = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
GEMINI_THINKING = {"thinkingConfig": {"thinkingBudget": 1024}}


async def send(adapter: HttpAdapter, fake: FakeProvider, protocol: str, envelope: Envelope,
               **route: Any) -> Any:
    events: list[Any] = []
    result = await adapter.send(make_route(fake.endpoint(protocol), protocol, **route),
                                envelope, profile_id="fake:default", on_event=events.append)
    return result, events


def tool_turn(result: Any) -> list[Part]:
    """The answer's parts and the tool's result: the conversation's next request."""
    (call,) = result.tool_calls
    return [ASK, *output_parts(result, "att-1"),
            Part(role="tool", content='{"sector": "Energy"}', tool_call_id=call.id,
                 name=call.name)]


def items(result: Any) -> list[dict[str, Any]]:
    return [json.loads(data)["item"] for data in result.reasoning]


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_thinking_blocks_go_back_unchanged_before_the_tool_use(
        adapter: HttpAdapter, fake: FakeProvider, stream: bool) -> None:
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK,
                          redacted_thinking=True))
    env = Envelope(parts=[ASK], tools=TOOLS, params=ANTHROPIC_THINKING, stream=stream)
    first, events = await send(adapter, fake, "anthropic", env)
    assert first.ok, first.observation
    # The thinking is reasoning, never answer text (nor a streamed delta).
    assert THINK not in first.text and first.text
    assert THINK not in "".join(e.text for e in events if isinstance(e, TextDelta))
    assert items(first) == [
        {"type": "thinking", "thinking": THINK, "signature": reasoning_secret("m1", THINK)},
        {"type": "redacted_thinking", "data": reasoning_secret("m1", "redacted")}]
    parts = output_parts(first, "att-1")
    assert [p.media_type for p in parts[:2]] == [REASONING_MEDIA_TYPE] * 2

    second, _ = await send(adapter, fake, "anthropic", env.model_copy(
        update={"parts": tool_turn(first)}))
    assert second.ok and second.notes == () and fake.requests[-1].problem is None
    assistant = fake.requests[-1].json["messages"][1]
    assert assistant["role"] == "assistant"
    assert [b["type"] for b in assistant["content"]] == [
        "thinking", "redacted_thinking", "text", "tool_use"]
    assert assistant["content"][:2] == items(first)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_fake_refuses_an_anthropic_tool_turn_without_its_thinking_block(
        adapter: HttpAdapter, fake: FakeProvider, stream: bool) -> None:
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK))
    env = Envelope(parts=[ASK], tools=TOOLS, params=ANTHROPIC_THINKING, stream=stream)
    first, _ = await send(adapter, fake, "anthropic", env)
    bare = [p for p in tool_turn(first) if p.media_type != REASONING_MEDIA_TYPE]
    refused, _ = await send(adapter, fake, "anthropic", env.model_copy(update={"parts": bare}))
    assert not refused.ok and refused.http_status == 400
    assert "must start with a thinking block" in (fake.requests[-1].problem or "")


@pytest.mark.parametrize("change", ["thinking", "signature", "redacted data"])
async def test_a_tampered_anthropic_thinking_block_is_refused_by_the_fake(
        adapter: HttpAdapter, fake: FakeProvider, change: str) -> None:
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK,
                          redacted_thinking=True))
    env = Envelope(parts=[ASK], tools=TOOLS, params=ANTHROPIC_THINKING)
    first, _ = await send(adapter, fake, "anthropic", env)
    block, redacted = items(first)
    if change == "redacted data":
        redacted["data"] = reasoning_secret("m2", "redacted")  # another model's
    elif change == "signature":
        block["signature"] = reasoning_secret("m2", THINK)
    else:
        block["thinking"] = THINK + "!"
    route = make_route(fake.endpoint("anthropic"), "anthropic")
    forged = [Part(role="assistant", data=reasoning_data(route, item),
                   media_type=REASONING_MEDIA_TYPE, data_class="model_derived")
              for item in (block, redacted)]
    ask, *rest = [p for p in tool_turn(first) if p.media_type != REASONING_MEDIA_TYPE]
    parts = [ask, *forged, *rest]
    refused, _ = await send(adapter, fake, "anthropic", env.model_copy(update={"parts": parts}))
    assert not refused.ok and refused.http_status == 400
    expected = ("Invalid `data` in `redacted_thinking` block" if change == "redacted data"
                else "Invalid `signature` in `thinking` block")
    assert expected in (fake.requests[-1].problem or "")


@pytest.mark.parametrize("protocol", ["openai", "openai_responses", "gemini"])
async def test_anthropic_thinking_is_left_out_with_a_note_for_another_route_or_protocol(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK))
    first, _ = await send(adapter, fake, "anthropic", Envelope(
        parts=[ASK], tools=TOOLS, params=ANTHROPIC_THINKING))
    follow = Envelope(parts=tool_turn(first), tools=TOOLS)
    # Another Anthropic route (another model, maybe another account) cannot verify it either.
    other, _ = await send(adapter, fake, "anthropic", follow, id="other", model="m2")
    moved, _ = await send(adapter, fake, protocol, follow)
    for result in (other, moved):
        assert result.ok and fake.requests[-1].problem is None
        (note,) = result.notes
        assert "reasoning item of route 'r-anthropic' (anthropic) is left out" in note
    assert "thinking" not in json.dumps(fake.requests[-1].json)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_gemini_thought_signature_goes_back_on_the_function_call_it_was_written_for(
        adapter: HttpAdapter, fake: FakeProvider, stream: bool) -> None:
    model = "gemini-3-pro-preview"  # Gemini 3 requires the signature back
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK))
    fake.enqueue(Behavior(reasoning=THINK))  # the answer after the tool's result
    env = Envelope(parts=[ASK], tools=TOOLS, params=GEMINI_THINKING, stream=stream)
    first, _ = await send(adapter, fake, "gemini", env, model=model)
    assert first.ok, first.observation
    signature = thought_signature(model, "lookup", THINK)
    assert items(first) == [{"part": "functionCall", "index": 0, "name": "lookup",
                             "thoughtSignature": signature}]
    assert output_parts(first, "att-1")[0].media_type == REASONING_MEDIA_TYPE

    second, _ = await send(adapter, fake, "gemini", env.model_copy(
        update={"parts": tool_turn(first)}), model=model)
    assert second.ok and second.notes == () and fake.requests[-1].problem is None
    turn = fake.requests[-1].json["contents"][1]
    assert turn["role"] == "model"
    assert turn["parts"] == [{"text": first.text},
                             {"functionCall": {"name": "lookup", "args": {"ticker": "XOM"}},
                              "thoughtSignature": signature}]
    # The text answer of that step carries its own signature on its text part (in a stream,
    # Gemini sends it on an empty text part at the end): it goes back on the turn's text.
    assert second.text and len(second.reasoning) == 1
    assert items(second)[0]["part"] == "text"
    third, _ = await send(adapter, fake, "gemini", env.model_copy(update={"parts": [
        *tool_turn(first), *output_parts(second, "att-2"), Part(content="And its peers?")]}),
        model=model)
    assert third.ok and third.notes == () and fake.requests[-1].problem is None
    last = fake.requests[-1].json["contents"][3]
    assert last == {"role": "model", "parts": [
        {"text": second.text, "thoughtSignature": thought_signature(model, "text", THINK)}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_the_fake_refuses_a_gemini_3_function_call_without_its_signature(
        adapter: HttpAdapter, fake: FakeProvider, stream: bool) -> None:
    model = "gemini-3-pro-preview"
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK))
    env = Envelope(parts=[ASK], tools=TOOLS, stream=stream)
    first, _ = await send(adapter, fake, "gemini", env, model=model)
    bare = [p for p in tool_turn(first) if p.media_type != REASONING_MEDIA_TYPE]
    refused, _ = await send(adapter, fake, "gemini", env.model_copy(update={"parts": bare}),
                            model=model)
    assert not refused.ok and refused.http_status == 400
    assert "missing a thought_signature" in (fake.requests[-1].problem or "")


@pytest.mark.parametrize("forgery", ["another model's", "another call's", "bytes changed"])
async def test_a_tampered_gemini_thought_signature_is_refused_by_the_fake(
        adapter: HttpAdapter, fake: FakeProvider, forgery: str) -> None:
    model = "gemini-3-pro-preview"
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK))
    env = Envelope(parts=[ASK], tools=TOOLS)
    first, _ = await send(adapter, fake, "gemini", env, model=model)
    (item,) = items(first)
    item["thoughtSignature"] = {
        "another model's": thought_signature("gemini-2.5-pro", "lookup", THINK),
        "another call's": thought_signature(model, "search", THINK),
        "bytes changed": item["thoughtSignature"][:-3] + "@@=",
    }[forgery]
    route = make_route(fake.endpoint("gemini"), "gemini", model=model)
    forged = Part(role="assistant", data=reasoning_data(route, item),
                  media_type=REASONING_MEDIA_TYPE, data_class="model_derived")
    parts = [forged if p.media_type == REASONING_MEDIA_TYPE else p for p in tool_turn(first)]
    refused, _ = await send(adapter, fake, "gemini", env.model_copy(update={"parts": parts}),
                            model=model)
    assert not refused.ok and refused.http_status == 400
    assert "Unable to verify thought signature" in (fake.requests[-1].problem or "")


async def test_a_gemini_signature_whose_part_the_turn_lacks_is_left_out_with_a_note(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    route = make_route(fake.endpoint("gemini"), "gemini")

    def signed(item: dict[str, Any]) -> Part:
        return Part(role="assistant", data=reasoning_data(route, item),
                    media_type=REASONING_MEDIA_TYPE, data_class="model_derived")

    parts = [ASK,
             signed({"part": "functionCall", "index": 0, "name": "search",
                     "thoughtSignature": thought_signature("m1", "search", THINK)}),
             signed({"part": "text", "thoughtSignature": thought_signature("m1", "text", THINK)}),
             Part(role="assistant", content='{"ticker": "XOM"}', tool_call_id="c1",
                  name="lookup"),
             Part(role="tool", content='{"sector": "Energy"}', tool_call_id="c1", name="lookup")]
    result, _ = await send(adapter, fake, "gemini", Envelope(parts=parts, tools=TOOLS))
    assert result.ok and fake.requests[-1].problem is None
    assert "thoughtSignature" not in json.dumps(fake.requests[-1].json)
    call_note, text_note = result.notes
    assert call_note.startswith("envelope.parts[1]: a thought signature of route 'r-gemini' "
                                "for the answer's function call 0 ('search') is left out")
    assert text_note.startswith("envelope.parts[2]:") and "answer's text" in text_note
    assert "on the part it was written for, or not at all" in text_note


async def test_gemini_reasoning_is_left_out_with_a_note_on_another_route(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(tool_call=("lookup", {"ticker": "XOM"}), reasoning=THINK))
    env = Envelope(parts=[ASK], tools=TOOLS)
    first, _ = await send(adapter, fake, "gemini", env)
    follow = env.model_copy(update={"parts": tool_turn(first)})
    for protocol in ("anthropic", "gemini"):
        moved, _ = await send(adapter, fake, protocol, follow, id="other", model="m2")
        assert moved.ok and fake.requests[-1].problem is None
        (note,) = moved.notes
        assert "reasoning item of route 'r-gemini' (gemini) is left out" in note
