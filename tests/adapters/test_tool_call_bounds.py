"""A tool call the host could not send back, or too many of them, is a malformed answer.

The host carries an answer's tool calls into its next turn as assistant parts, which must hold
a JSON object a request body can carry (anything else, NaN or a lone surrogate included, is
refused there as caller misuse): a proposal whose arguments are not one is the provider's
malformed answer, never a success. An answer may propose at most
``MAX_TOOL_CALLS`` (128) calls: a 16 MiB body could otherwise propose 275,000, each held in
memory and recorded. An answer proposing calls to a request that offered no tools proposes
tools of the model's own invention, which the host cannot run: malformed too (a parameter that
brings its own tools, such as Gemini's ``cachedContent``, offers them). Over real HTTP on
loopback, every protocol, both drivers.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from ledger.adapters import HttpAdapter, Reset, StreamEvent, TextDelta, ToolCallProposal
from ledger.adapters.contract import MAX_TOOL_CALLS, Usage
from ledger.adapters.runner import output_parts
from ledger.domain.envelope import Envelope, Part, ToolSpec
from ledger.domain.facts import Phase, Transport
from ledger.testing import Behavior, FakeProvider, Fault

from .conftest import PROFILE, PROTOCOLS, make_route

pytestmark = pytest.mark.anyio

TOOLS = [ToolSpec(name="search", parameters={"type": "object", "properties": {}})]


async def _send(adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool, *,
                tools: list[ToolSpec] = TOOLS, params: dict[str, Any] | None = None
                ) -> tuple[Any, list[StreamEvent]]:
    events: list[StreamEvent] = []
    result = await adapter.send(make_route(fake.endpoint(protocol), protocol),
                                Envelope(parts=[Part(content="hi")], tools=tools, stream=stream,
                                         params=params or {}),
                                profile_id=PROFILE, on_event=events.append)
    return result, events


def _raw(body: bytes, *, stream: bool) -> Behavior:
    ctype = "text/event-stream" if stream else "application/json"
    head = (f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    return Behavior(fault=Fault.RAW, raw=(head, body))


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def _body(protocol: str, n: int, args: str = "{}") -> bytes:
    """A whole answer proposing ``n`` calls of ``search`` with ``args`` (a JSON text)."""
    if protocol == "openai":
        calls = [{"id": f"c{i}", "type": "function",
                  "function": {"name": "search", "arguments": args}} for i in range(n)]
        obj: dict[str, Any] = {"model": "m1", "choices": [{
            "index": 0, "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": None, "tool_calls": calls}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    elif protocol == "openai_responses":
        obj = {"id": "resp_1", "object": "response", "status": "completed", "model": "m1",
               "output": [{"type": "function_call", "id": f"fc_{i}", "call_id": f"c{i}",
                           "name": "search", "arguments": args} for i in range(n)],
               "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}
    elif protocol == "anthropic":
        obj = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m1",
               "content": [{"type": "tool_use", "id": f"t{i}", "name": "search",
                            "input": json.loads(args)} for i in range(n)],
               "stop_reason": "tool_use", "usage": {"input_tokens": 3, "output_tokens": 1}}
    else:
        obj = {"candidates": [{"content": {"role": "model", "parts": [
            {"functionCall": {"name": "search", "args": json.loads(args)}} for _ in range(n)]},
            "finishReason": "STOP"}],
            "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1}}
    return json.dumps(obj).encode()


def _assert_malformed(result: Any, events: list[StreamEvent], *, after_text: bool,
                      broke_off: bool = False) -> None:
    obs = result.observation
    assert not result.ok and result.tool_calls == (), obs
    assert obs.transport is Transport.MALFORMED_EVENT
    # Refused whole once the provider finished the answer, streamed or not; only a stream
    # refused while it was still arriving (``broke_off``) is left mid-stream.
    assert obs.phase is (Phase.MID_STREAM if broke_off else Phase.AFTER_HEADERS)
    # As for any malformed answer: text the caller was shown is effective output, and it is
    # told (Reset) that what it showed is not an answer.
    assert result.effective_output is after_text
    assert not any(isinstance(e, ToolCallProposal) for e in events)
    if after_text:
        assert isinstance(events[-1], Reset)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_call_whose_arguments_are_not_a_json_object_is_a_malformed_answer(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    # The fake streams its text first, then the call with these arguments (a JSON array).
    fake.enqueue(Behavior(tool_call=("search", ["not", "an", "object"])))  # type: ignore[arg-type]
    result, events = await _send(adapter, fake, protocol, stream)
    _assert_malformed(result, events, after_text=stream)
    assert "not a JSON object" in result.observation.message
    if stream:
        assert any(isinstance(e, TextDelta) for e in events)


@pytest.mark.parametrize(("protocol", "stream", "raw"), [
    ("openai", False, _body("openai", 1).replace(b'"{}"', b'"not json {"')),
    ("openai_responses", False,
     _body("openai_responses", 1).replace(b'"{}"', b'"not json {"')),
    ("openai", True, _sse(
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c0", "function": {
            "name": "search", "arguments": "not json {"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ) + b"data: [DONE]\n\n"),
    ("anthropic", True, _sse(
        {"type": "message_start", "message": {"model": "m1", "usage": {"input_tokens": 3}}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "tool_use", "id": "t0", "name": "search", "input": {}}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": "not json {"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
        {"type": "message_stop"})),
])
async def test_tool_call_arguments_that_are_not_json_are_a_malformed_answer(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool,
        raw: bytes) -> None:
    fake.enqueue(_raw(raw, stream=stream))
    result, events = await _send(adapter, fake, protocol, stream)
    _assert_malformed(result, events, after_text=False)
    assert "'not json {'" in result.observation.message


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("args", ['{"days": NaN}', '{"days": 1e400}', '{"city": "\\ud800"}'])
async def test_a_tool_call_whose_arguments_no_request_can_carry_back_is_a_malformed_answer(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, args: str) -> None:
    """NaN, an infinity or a lone surrogate: Python's reader takes them, no JSON body carries
    them, so the next turn would refuse the call's part (the same rule, json_object)."""
    fake.enqueue(_raw(_body(protocol, 1, args), stream=False))
    result, events = await _send(adapter, fake, protocol, False)
    _assert_malformed(result, events, after_text=False)
    assert "a request can carry back" in result.observation.message


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_answer_proposing_more_than_max_tool_calls_is_a_malformed_answer(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    fake.enqueue(_raw(_body(protocol, MAX_TOOL_CALLS + 1), stream=False))
    result, events = await _send(adapter, fake, protocol, False)
    _assert_malformed(result, events, after_text=False)
    assert f"more than {MAX_TOOL_CALLS} tool calls" in result.observation.message


async def test_a_stream_proposing_more_than_max_tool_calls_is_a_malformed_answer(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    # Chat completions assemble a stream's calls by index until the finish: the cap holds
    # while they are still arriving, not only once they are proposed.
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [{
        "index": i, "id": f"c{i}", "function": {"name": "search", "arguments": "{}"}}]}}]}
        for i in range(MAX_TOOL_CALLS + 1)]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    fake.enqueue(_raw(_sse(*chunks) + b"data: [DONE]\n\n", stream=True))
    result, events = await _send(adapter, fake, "openai", True)
    _assert_malformed(result, events, after_text=False, broke_off=True)
    assert f"more than {MAX_TOOL_CALLS} tool calls" in result.observation.message


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_answer_proposing_max_tool_calls_is_a_success(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    fake.enqueue(_raw(_body(protocol, MAX_TOOL_CALLS, '{"q": 1}'), stream=False))
    result, _ = await _send(adapter, fake, protocol, False)
    assert result.ok, result.observation
    assert len(result.tool_calls) == MAX_TOOL_CALLS
    assert all(c.arguments == {"q": 1} for c in result.tool_calls)


def _streamed(protocol: str) -> bytes:
    """A stream of text, then one call of ``search`` with ``{}``, then the protocol's end
    (with 3 prompt and 1 completion tokens reported after the call, as each protocol does);
    where the protocol delivers a call before the answer's finish, text follows it."""
    if protocol == "openai":
        return _sse(
            {"choices": [{"index": 0, "delta": {"content": "Let me look."}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c0",
             "function": {"name": "search", "arguments": "{}"}}]}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
        ) + b"data: [DONE]\n\n"
    if protocol == "openai_responses":
        return _sse(
            {"type": "response.output_text.delta", "delta": "Let me look."},
            {"type": "response.output_item.done", "output_index": 1, "item": {
                "type": "function_call", "id": "fc_0", "call_id": "c0", "name": "search",
                "arguments": "{}"}},
            {"type": "response.output_text.delta", "delta": " Done."},
            {"type": "response.completed", "response": {
                "status": "completed", "model": "m1",
                "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}})
    if protocol == "anthropic":
        return _sse(
            {"type": "message_start", "message": {"model": "m1", "usage": {
                "input_tokens": 3, "output_tokens": 0}}},
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": "Let me look."}},
            {"type": "content_block_stop", "index": 0},
            {"type": "content_block_start", "index": 1,
             "content_block": {"type": "tool_use", "id": "t0", "name": "search", "input": {}}},
            {"type": "content_block_delta", "index": 1,
             "delta": {"type": "input_json_delta", "partial_json": "{}"}},
            {"type": "content_block_stop", "index": 1},
            {"type": "content_block_start", "index": 2,
             "content_block": {"type": "text", "text": " Done."}},
            {"type": "content_block_stop", "index": 2},
            {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
             "usage": {"output_tokens": 1}},
            {"type": "message_stop"})
    return _sse(
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "Let me look."}]}}]},
        {"candidates": [{"content": {"role": "model", "parts": [
            {"functionCall": {"name": "search", "args": {}}}]}}]},
        {"candidates": [{"content": {"role": "model", "parts": [{"text": " Done."}]},
                         "finishReason": "STOP"}],
         "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1}})


def _answer(protocol: str, stream: bool) -> Behavior:
    return _raw(_streamed(protocol) if stream else _body(protocol, 1), stream=stream)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_proposing_tool_calls_to_a_request_that_offered_no_tools_is_malformed(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    # The same answer is a success when the request offered a tool: only the offer differs.
    fake.enqueue(_answer(protocol, stream))
    offered, _ = await _send(adapter, fake, protocol, stream)
    assert offered.ok and [c.name for c in offered.tool_calls] == ["search"], offered
    fake.enqueue(_answer(protocol, stream))
    result, events = await _send(adapter, fake, protocol, stream, tools=[])
    _assert_malformed(result, events, after_text=stream)
    assert "tool call 'search' but the request offered no tools" in result.observation.message
    # Read to its end, yet nothing of it after the refused call reaches the caller.
    assert [e.text for e in events if isinstance(e, TextDelta)] == (
        ["Let me look."] if stream else [])
    # Refused once read whole: with the usage the answer reported (a stream's after the call).
    assert result.usage == Usage(prompt_tokens=3, completion_tokens=1)
    assert result.cost == make_route("", protocol).cost(3, 1)


@pytest.mark.parametrize(("protocol", "params"), [
    ("gemini", {"cachedContent": "cachedContents/abc"}),
    ("openai_responses", {"prompt": {"id": "pmpt_1"}}),
    ("openai", {"functions": [{"name": "search", "parameters": {"type": "object"}}]}),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_parameter_that_brings_its_own_tools_offers_them(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, params: dict[str, Any],
        stream: bool) -> None:
    # A cached content, a stored prompt or the legacy functions declare tools the envelope
    # does not list: the calls they lead to are the answer.
    fake.enqueue(_answer(protocol, stream))
    result, _ = await _send(adapter, fake, protocol, stream, tools=[], params=params)
    assert result.ok and [c.name for c in result.tool_calls] == ["search"], result.observation


# An id no part's tool_call_id can be: too long, with a line break and a NUL.
_BAD_ID = "id\n\x00" + "x" * 300


def _with_call(protocol: str, stream: bool, *, call_id: str | None = None,
               name: str | None = None) -> Behavior:
    """``_answer`` with its call's id and name replaced (Gemini's call is given the id)."""
    body = _streamed(protocol) if stream else _body(protocol, 1)
    if call_id is not None:
        old = {"openai": b'"id": "c0"', "openai_responses": b'"call_id": "c0"',
               "anthropic": b'"id": "t0"', "gemini": b'"functionCall": {'}[protocol]
        new = (b'"functionCall": {"id": ' + json.dumps(call_id).encode() + b", "
               if protocol == "gemini" else old.split(b":")[0] + b": "
               + json.dumps(call_id).encode())
        assert old in body
        body = body.replace(old, new)
    if name is not None:
        body = body.replace(b'"name": "search"', b'"name": ' + json.dumps(name).encode())
    return _raw(body, stream=stream)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_id_no_part_can_keep_is_made_up_before_the_proposal_is_delivered(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    fake.enqueue(_with_call(protocol, stream, call_id=_BAD_ID))
    result, events = await _send(adapter, fake, protocol, stream)
    assert result.ok, result.observation
    [call] = result.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.provider_id == _BAD_ID
    assert call.name == "search"
    # The caller is shown the id the answer's part will carry, never the provider's.
    assert [e.call for e in events if isinstance(e, ToolCallProposal)] == (
        [call] if stream else [])
    [part] = [p for p in output_parts(result, "att-1") if p.tool_call_id is not None]
    assert (part.tool_call_id, part.name) == (call.id, "search")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["sea\x00rch", "s" * 201])
async def test_a_tool_name_no_part_can_keep_is_a_malformed_answer(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool,
        name: str) -> None:
    """The host runs the tool the name names: it cannot be made up as an id is."""
    fake.enqueue(_with_call(protocol, stream, name=name))
    result, events = await _send(adapter, fake, protocol, stream)
    _assert_malformed(result, events, after_text=stream)
    assert f"the name of tool call {name[:64]!r}" in result.observation.message
