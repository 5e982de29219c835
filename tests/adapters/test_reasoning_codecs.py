"""The codecs' reasoning, as pure functions: the shapes the providers document, both ways.

Anthropic's thinking blocks (whole and streamed: ``content_block_start`` of type thinking,
``thinking_delta``, ``signature_delta``, ``content_block_stop``; redacted blocks whole) are
reasoning, never text; Gemini's thought signatures are items naming their part, put back on
that part of the same turn and nowhere else.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

import tests.media
from ledger.adapters import anthropic, gemini
from ledger.adapters.contract import MalformedPayload, TextDelta, reasoning_data
from ledger.adapters.sse import SSEEvent
from ledger.domain.envelope import Envelope, Part
from ledger.domain.media import REASONING_MEDIA_TYPE

from .conftest import make_route

ANTHROPIC = make_route("https://api.anthropic.com", "anthropic")
GEMINI = make_route("https://generativelanguage.googleapis.com", "gemini")


def feed(state: Any, *events: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for e in events:
        out.extend(state.feed(SSEEvent(event=e.get("type", "message"), data=json.dumps(e))))
    return out


def carried(route: Any, item: dict[str, Any]) -> Part:
    return Part(role="assistant", data=reasoning_data(route, item),
                media_type=REASONING_MEDIA_TYPE, data_class="model_derived")


def call(name: str, cid: str) -> Part:
    return Part(role="assistant", content="{}", tool_call_id=cid, name=name)


def test_anthropic_streamed_thinking_is_assembled_into_its_block_and_is_never_text() -> None:
    s = anthropic.CODEC.new_stream()
    events = feed(
        s,
        {"type": "message_start", "message": {"model": "claude-x", "usage": {
            "input_tokens": 5, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "Let me "}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "think."}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": "EqQBCgIYAhIM"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3p"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2, "content_block": {"type": "text",
                                                                      "text": ""}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta",
                                                              "text": "Answer."}},
        {"type": "content_block_stop", "index": 2},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
         "usage": {"output_tokens": 9}},
        {"type": "message_stop"},
    )
    assert events == [TextDelta("Answer.")]
    reply = s.reply()
    assert reply.text == "Answer." and reply.notes == []
    assert reply.reasoning == [
        {"type": "thinking", "thinking": "Let me think.", "signature": "EqQBCgIYAhIM"},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3p"}]


def test_an_anthropic_thinking_block_without_its_signature_is_noted_not_carried() -> None:
    reply = anthropic.CODEC.parse_reply({
        "model": "claude-x", "stop_reason": "end_turn",
        "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "yo"}]})
    assert reply.text == "yo" and reply.reasoning == []
    (note,) = reply.notes
    assert "content[0]: a thinking block without its signature is left out" in note
    s = anthropic.CODEC.new_stream()
    with pytest.raises(MalformedPayload, match="signature_delta for block 0 without thinking"):
        feed(s, {"type": "content_block_delta", "index": 0,
                 "delta": {"type": "signature_delta", "signature": "x"}})


def test_anthropic_thinking_opens_the_assistant_message_of_its_own_route_only() -> None:
    block = {"type": "thinking", "thinking": "hmm", "signature": "sig"}
    parts = [Part(content="Q"), carried(ANTHROPIC, block), Part(role="assistant", content="A"),
             call("lookup", "toolu_1"),
             Part(role="tool", content="42", tool_call_id="toolu_1", name="lookup")]
    req = anthropic.CODEC.build_request(ANTHROPIC, Envelope(parts=parts))
    assert req.notes == ()
    assert req.body["messages"][1] == {"role": "assistant", "content": [
        block, {"type": "text", "text": "A"},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}]}
    # The same item on another Anthropic route, or a Gemini item on this one: left out.
    other = make_route("https://api.anthropic.com", "anthropic", id="other")
    moved = anthropic.CODEC.build_request(other, Envelope(parts=parts))
    assert [b["type"] for b in moved.body["messages"][1]["content"]] == ["text", "tool_use"]
    assert len(moved.notes) == 1
    foreign = [carried(GEMINI, {"part": "text", "thoughtSignature": "s"}), *parts[2:]]
    assert len(anthropic.CODEC.build_request(
        ANTHROPIC, Envelope(parts=[parts[0], *foreign])).notes) == 1


def test_gemini_signatures_are_read_from_calls_text_and_files_and_thoughts_are_noted() -> None:
    png = base64.b64encode(tests.media.png(2, 2)).decode("ascii")
    reply = gemini.CODEC.parse_reply({"candidates": [{"content": {"role": "model", "parts": [
        {"text": "summary", "thought": True, "thoughtSignature": "t0"},
        {"text": "Looking."},
        {"functionCall": {"name": "a", "args": {}}, "thoughtSignature": "s1"},
        {"functionCall": {"name": "b", "args": {}}},  # a parallel call: no signature
        {"inlineData": {"mimeType": "image/png", "data": png}, "thoughtSignature": "s2"},
        {"text": "", "thoughtSignature": "s3"},
    ]}, "finishReason": "STOP"}]})
    assert reply.text == "Looking." and [c.name for c in reply.tool_calls] == ["a", "b"]
    assert reply.reasoning == [
        {"part": "functionCall", "index": 0, "name": "a", "thoughtSignature": "s1"},
        {"part": "media", "index": 0, "thoughtSignature": "s2"},
        {"part": "text", "thoughtSignature": "s3"}]
    (note,) = reply.notes
    assert "parts[0]: the thought signature of a thought summary is left out" in note
    with pytest.raises(MalformedPayload, match="thoughtSignature is not a signature text"):
        gemini.CODEC.parse_reply({"candidates": [{"content": {"parts": [
            {"text": "x", "thoughtSignature": 7}]}}]})


def test_gemini_streamed_signatures_name_the_call_by_its_place_in_the_whole_answer() -> None:
    s = gemini.CODEC.new_stream()
    feed(s, {"candidates": [{"content": {"role": "model", "parts": [
        {"functionCall": {"name": "a", "args": {}}}]}}]},
         {"candidates": [{"content": {"role": "model", "parts": [
             {"functionCall": {"name": "b", "args": {}}, "thoughtSignature": "sb"}]}}]},
         {"candidates": [{"content": {"role": "model", "parts": [
             {"text": "", "thoughtSignature": "st"}]}, "finishReason": "STOP"}]})
    assert s.reply().reasoning == [
        {"part": "functionCall", "index": 1, "name": "b", "thoughtSignature": "sb"},
        {"part": "text", "thoughtSignature": "st"}]


def test_gemini_signatures_go_back_on_their_parts_of_their_own_turn_only() -> None:
    parts = [
        Part(content="Q"),
        # The first answer: text and two calls, the second call signed.
        carried(GEMINI, {"part": "functionCall", "index": 1, "name": "b",
                         "thoughtSignature": "sb"}),
        carried(GEMINI, {"part": "text", "thoughtSignature": "st"}),
        Part(role="assistant", content="Looking."), call("a", "c1"), call("b", "c2"),
        Part(role="tool", content="1", tool_call_id="c1", name="a"),
        Part(role="tool", content="2", tool_call_id="c2", name="b"),
        # The second answer: one call, signed; an unsigned answer's call must not take it.
        carried(GEMINI, {"part": "functionCall", "index": 0, "name": "a",
                         "thoughtSignature": "sa"}),
        call("a", "c3"),
        Part(role="tool", content="3", tool_call_id="c3", name="a"),
        call("a", "c4"),
    ]
    req = gemini.CODEC.build_request(GEMINI, Envelope(parts=parts))
    assert req.notes == ()
    model_turns = [c["parts"] for c in req.body["contents"] if c["role"] == "model"]
    assert model_turns == [
        [{"text": "Looking.", "thoughtSignature": "st"},
         {"functionCall": {"name": "a", "args": {}}},
         {"functionCall": {"name": "b", "args": {}}, "thoughtSignature": "sb"}],
        [{"functionCall": {"name": "a", "args": {}}, "thoughtSignature": "sa"}],
        [{"functionCall": {"name": "a", "args": {}}}],
    ]


def test_a_gemini_signature_is_never_moved_to_a_part_it_was_not_written_for() -> None:
    parts = [Part(content="Q"),
             carried(GEMINI, {"part": "functionCall", "index": 0, "name": "b",
                              "thoughtSignature": "sb"}),
             carried(GEMINI, {"part": "media", "index": 0, "thoughtSignature": "sm"}),
             call("a", "c1"), Part(role="tool", content="1", tool_call_id="c1", name="a")]
    req = gemini.CODEC.build_request(GEMINI, Envelope(parts=parts))
    assert "thoughtSignature" not in json.dumps(req.body)
    assert [n.split(":")[0] for n in req.notes] == ["envelope.parts[1]", "envelope.parts[2]"]
    assert "function call 0 ('b')" in req.notes[0] and "file 0" in req.notes[1]
    # Another route's signature: left out as reasoning of another route, not matched.
    other = make_route("https://generativelanguage.googleapis.com", "gemini", id="other")
    moved = gemini.CODEC.build_request(other, Envelope(parts=parts))
    assert all("reasoning item of route 'r-gemini' (gemini)" in n for n in moved.notes)


def _thinking_only_answer(route: Any, item: dict[str, Any]) -> list[Part]:
    # An answer that stopped at max_tokens while thinking: its reasoning, and no text.
    return [Part(content="Q"), carried(route, item),
            Part(role="assistant", content="", data_class="model_derived"),
            Part(content="Go on.")]


def test_anthropic_never_sends_an_empty_text_block() -> None:
    thinking = {"type": "thinking", "thinking": "Long thought.", "signature": "sig"}
    req = anthropic.CODEC.build_request(ANTHROPIC, Envelope(
        parts=_thinking_only_answer(ANTHROPIC, thinking)))
    assert req.body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Q"}]},
        {"role": "assistant", "content": [thinking]},
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]}]
    [note] = req.notes
    assert note.startswith("envelope.parts[2]: an empty text part is left out")


def test_anthropic_merges_the_user_messages_around_a_left_out_empty_answer() -> None:
    req = anthropic.CODEC.build_request(ANTHROPIC, Envelope(parts=[
        Part(content="Q"), Part(role="assistant", content="", data_class="model_derived"),
        Part(content="Go on.")]))
    assert req.body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Q"}, {"type": "text", "text": "Go on."}]}]


def test_gemini_sends_an_empty_text_part_only_with_its_thought_signature() -> None:
    signed = gemini.CODEC.build_request(GEMINI, Envelope(parts=_thinking_only_answer(
        GEMINI, {"part": "text", "thoughtSignature": "st"})))
    assert signed.body["contents"][1] == {"role": "model", "parts": [
        {"text": "", "thoughtSignature": "st"}]}
    unsigned = gemini.CODEC.build_request(GEMINI, Envelope(parts=[
        Part(content="Q"), Part(role="assistant", content="", data_class="model_derived"),
        Part(content="Go on.")]))
    assert unsigned.body["contents"] == [{"role": "user", "parts": [
        {"text": "Q"}, {"text": "Go on."}]}]
    assert [n.split(":")[0] for n in unsigned.notes] == ["envelope.parts[1]"]
