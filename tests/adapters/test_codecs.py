"""Pure request building and response parsing, per protocol (no I/O)."""

from __future__ import annotations

import json
import re

import pytest

from ledger.adapters import anthropic, gemini, openai, openai_responses
from ledger.adapters.contract import (
    Codec,
    MalformedPayload,
    ProviderErrorPayload,
    TextDelta,
    reasoning_data,
)
from ledger.adapters.sse import SSEEvent
from ledger.domain.carried import refusals_for, uncarried
from ledger.domain.envelope import Envelope, Part, ToolSpec
from ledger.domain.facts import WireProtocol
from ledger.domain.media import REASONING_MEDIA_TYPE
from ledger.domain.values import Capabilities
from ledger.errors import InvalidArgument

from .conftest import make_route

CODECS: dict[str, Codec] = {"openai": openai.CODEC, "openai_responses": openai_responses.CODEC,
                            "anthropic": anthropic.CODEC, "gemini": gemini.CODEC}

CONVERSATION = Envelope(
    parts=[
        Part(role="system", content="You are terse."),
        Part(content="Find papers on failover."),
        Part(
            role="assistant",
            content='{"query": "failover"}',
            tool_call_id="c1",
            name="search",
            data_class="model_derived",
        ),
        Part(
            role="tool",
            content='{"hits": 2}',
            tool_call_id="c1",
            name="search",
            data_class="tool_result",
        ),
        Part(content="Summarise."),
    ],
    tools=[
        ToolSpec(
            name="search",
            description="web search",
            parameters={"type": "object", "properties": {"query": {"type": "string"}}},
        )
    ],
    params={"temperature": 0.2, "top_p": 0.9, "stop": "END"},
    max_output_tokens=256,
)


def test_openai_request() -> None:
    route = make_route("https://api.example.com/v1/", "openai", model="gpt-x")
    wire = openai.CODEC.build_request(route, CONVERSATION)
    assert wire.url == "https://api.example.com/v1/chat/completions"
    b = wire.body
    assert b["model"] == "gpt-x" and b["max_tokens"] == 256 and b["temperature"] == 0.2
    assert [m["role"] for m in b["messages"]] == ["system", "user", "assistant", "tool", "user"]
    call = b["messages"][2]["tool_calls"][0]
    assert call["function"] == {"name": "search", "arguments": '{"query": "failover"}'}
    assert b["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": '{"hits": 2}'}
    assert b["tools"][0]["function"]["name"] == "search"
    assert "stream" not in b
    assert "authorization" not in wire.headers  # the credential is added by the engine only
    streamed = openai.CODEC.build_request(route, CONVERSATION.model_copy(update={"stream": True}))
    assert streamed.body["stream"] is True
    assert streamed.body["stream_options"] == {"include_usage": True}


def test_openai_declared_parameters_choose_names() -> None:
    caps = Capabilities(parameters=["temperature", "top_p", "stop", "max_completion_tokens"])
    route = make_route("https://x/v1", "openai", capabilities=caps)
    body = openai.CODEC.build_request(route, CONVERSATION.model_copy(update={"stream": True})).body
    assert body["max_completion_tokens"] == 256 and "max_tokens" not in body
    assert "stream_options" not in body


def test_params_that_would_overwrite_structure_or_are_unsupported_are_refused() -> None:
    route = make_route("https://x/v1", "openai")
    bad = CONVERSATION.model_copy(update={"params": {"messages": []}})
    with pytest.raises(InvalidArgument) as err:
        openai.CODEC.build_request(route, bad)
    assert err.value.field == "envelope.params.messages"
    limited = make_route("https://x/v1", "openai", capabilities=Capabilities(parameters=[]))
    with pytest.raises(InvalidArgument, match="does not support parameter 'temperature'"):
        openai.CODEC.build_request(limited, CONVERSATION)


def test_anthropic_request() -> None:
    route = make_route("https://api.anthropic.com", "anthropic", model="claude-x")
    wire = anthropic.CODEC.build_request(route, CONVERSATION)
    assert wire.url == "https://api.anthropic.com/v1/messages"
    assert wire.headers["anthropic-version"] == anthropic.ANTHROPIC_VERSION
    b = wire.body
    assert b["system"] == "You are terse." and b["max_tokens"] == 256
    assert b["stop_sequences"] == ["END"] and "stop" not in b
    assert [m["role"] for m in b["messages"]] == ["user", "assistant", "user"]
    assert b["messages"][1]["content"][0] == {
        "type": "tool_use",
        "id": "c1",
        "name": "search",
        "input": {"query": "failover"},
    }
    # The tool result and the next user text merge into one user turn, in order.
    assert [c["type"] for c in b["messages"][2]["content"]] == ["tool_result", "text"]
    assert b["tools"][0]["input_schema"]["properties"]["query"] == {"type": "string"}
    assert anthropic.AnthropicCodec.url("https://h/v1") == "https://h/v1/messages"
    default = anthropic.CODEC.build_request(route, Envelope(parts=[Part(content="hi")])).body
    assert default["max_tokens"] == 4096


def test_gemini_request() -> None:
    route = make_route(
        "https://generativelanguage.googleapis.com", "gemini", model="models/gemini-x"
    )
    wire = gemini.CODEC.build_request(route, CONVERSATION)
    assert wire.url == (
        "https://generativelanguage.googleapis.com/v1beta/models/gemini-x:generateContent"
    )
    assert "key=" not in wire.url
    b = wire.body
    assert b["systemInstruction"] == {"parts": [{"text": "You are terse."}]}
    assert [c["role"] for c in b["contents"]] == ["user", "model", "user"]
    assert b["contents"][1]["parts"][0] == {
        "functionCall": {"name": "search", "args": {"query": "failover"}}
    }
    assert b["contents"][2]["parts"][0] == {
        "functionResponse": {"name": "search", "response": {"hits": 2}}
    }
    assert b["generationConfig"] == {
        "temperature": 0.2,
        "topP": 0.9,
        "stopSequences": ["END"],
        "maxOutputTokens": 256,
    }
    stream = gemini.CODEC.build_request(route, CONVERSATION.model_copy(update={"stream": True}))
    assert stream.url.endswith("/models/gemini-x:streamGenerateContent?alt=sse")
    assert (
        gemini.GeminiCodec.url("https://h/v1", "m", False)
        == "https://h/v1/models/m:generateContent"
    )


def test_tool_call_part_needs_json_object_arguments() -> None:
    bad = Envelope(
        parts=[
            Part(content="x"),
            Part(role="assistant", content="not json", tool_call_id="c", name="t"),
        ]
    )
    for codec, proto in (
        (openai.CODEC, "openai"),
        (anthropic.CODEC, "anthropic"),
        (gemini.CODEC, "gemini"),
    ):
        with pytest.raises(InvalidArgument) as err:
            codec.build_request(make_route("https://h", proto), bad)
        assert err.value.field == "envelope.parts[1]"


def _thinking_of(protocol: str) -> Part:
    """A reasoning item the route ``r-<protocol>`` returned, as a turn carries it back."""
    item = {"type": "thinking", "thinking": "hm", "signature": "sig"}
    return Part(role="assistant", media_type=REASONING_MEDIA_TYPE, data_class="model_derived",
                data=reasoning_data(make_route("https://h", protocol), item))


UNBUILDABLE = [
    [Part(content="q"), Part(role="assistant", content="{}", tool_call_id="c",
                             data_class="model_derived")],
    [Part(content="q"), Part(role="assistant", content="[1]", tool_call_id="c", name="t",
                             data_class="model_derived")],
    # Arguments no JSON body can carry: NaN, an infinity, a lone surrogate (escaped); an
    # escaped pair is one character beyond the BMP, which every codec builds.
    *([Part(content="q"), Part(role="assistant", content=args, tool_call_id="c", name="t",
                               data_class="model_derived")]
      for args in ('{"n": NaN}', '{"n": [1, -Infinity]}', '{"n": 1e400}',
                   '{"s": "\\udc80"}', '{"\\ud800": 1}', '{"s": "\\ud83d\\ude00"}')),
    [Part(content="q"), Part(role="tool", content="r", name="t", data_class="tool_result")],
    [Part(content="q"), Part(role="tool", content="r", tool_call_id="c",
                             data_class="tool_result")],
    [Part(role="system", content="s")],
    [Part(role="system", content="s"), Part(content="")],
    [Part(role="system", content="s"), Part(role="assistant", content="",
                                            data_class="model_derived")],
    [Part(content="")],
]


@pytest.mark.parametrize("parts", UNBUILDABLE)
@pytest.mark.parametrize("protocol", ["openai", "openai_responses", "anthropic", "gemini"])
def test_a_codec_refuses_exactly_what_preflight_finds_it_cannot_carry(
        protocol: str, parts: list[Part]) -> None:
    """One rule (ledger.domain.carried), two callers: what a turn's preflight rules a route
    out for is what its codec raises, field for field, and a codec builds what it lets by."""
    route = make_route("https://h", protocol)
    for env in (Envelope(parts=parts), Envelope(parts=[*parts[:1], _thinking_of(protocol),
                                                       *parts[1:]])):
        refused = refusals_for(route.protocol, uncarried(env))
        if not refused:
            CODECS[protocol].build_request(route, env)
            continue
        with pytest.raises(InvalidArgument) as err:
            CODECS[protocol].build_request(route, env)
        assert err.value.field == refused[0].field, (protocol, env)
        assert str(err.value) == str(refused[0].error())


def test_responses_params_tools_refused_by_the_codec_as_by_preflight() -> None:
    route = make_route("https://h", "openai_responses")
    for tools in ({"type": "web_search"}, [{"type": "function"}], [{"type": ""}], ["x"]):
        env = Envelope(parts=[Part(content="q")], params={"tools": tools})
        [refused] = uncarried(env)
        assert refused.protocols == {WireProtocol.OPENAI_RESPONSES}
        with pytest.raises(InvalidArgument) as err:
            openai_responses.CODEC.build_request(route, env)
        assert err.value.field == refused.field
    # With a part it cannot map too, the part is what both name first.
    both = Envelope(parts=[Part(content="q"), Part(role="tool", content="r", name="t",
                                                    data_class="tool_result")],
                    params={"tools": ["x"]})
    with pytest.raises(InvalidArgument) as err:
        openai_responses.CODEC.build_request(route, both)
    assert err.value.field == uncarried(both)[0].field == "envelope.parts[1]"
    ok = Envelope(parts=[Part(content="q")], params={"tools": [{"type": "web_search"}]})
    assert uncarried(ok) == ()
    assert openai_responses.CODEC.build_request(route, ok).body["tools"] == [
        {"type": "web_search"}]


def test_parse_replies() -> None:
    r = openai.CODEC.parse_reply(
        {
            "model": "gpt-x-2025",
            "choices": [
                {
                    "message": {
                        "content": "hi",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": '{"a":1}'},
                            }
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4},
        }
    )
    assert (r.text, r.model, r.finish_reason) == ("hi", "gpt-x-2025", "tool_calls")
    assert r.tool_calls[0].arguments == {"a": 1} and r.usage is not None
    a = anthropic.CODEC.parse_reply(
        {
            "model": "claude-x",
            "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "yo"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 5, "cache_read_input_tokens": 10, "output_tokens": 2},
        }
    )
    assert a.text == "yo" and a.usage is not None and a.usage.prompt_tokens == 15
    g = gemini.CODEC.parse_reply(
        {
            "candidates": [
                {
                    "content": {"parts": [{"text": "x", "thought": True}, {"text": "ok"}]},
                    "finishReason": "STOP",
                }
            ],
            "usageMetadata": {
                "promptTokenCount": 2,
                "candidatesTokenCount": 3,
                "thoughtsTokenCount": 4,
            },
            "modelVersion": "gemini-x-001",
        }
    )
    assert g.text == "ok" and g.usage is not None and g.usage.completion_tokens == 7
    with pytest.raises(ProviderErrorPayload, match="blockReason=SAFETY"):
        gemini.CODEC.parse_reply({"promptFeedback": {"blockReason": "SAFETY"}})
    with pytest.raises(MalformedPayload):
        openai.CODEC.parse_reply({"choices": []})
    with pytest.raises(MalformedPayload):
        anthropic.CODEC.parse_reply({"content": "nope"})
    with pytest.raises(ProviderErrorPayload):
        anthropic.CODEC.parse_reply({"type": "error", "error": {"type": "overloaded_error"}})


def _feed(state: object, *datas: str, event: str = "message") -> list[object]:
    out: list[object] = []
    for d in datas:
        out.extend(state.feed(SSEEvent(event=event, data=d)))  # type: ignore[attr-defined]
    return out


def test_openai_stream_completion_rules() -> None:
    s = openai.CODEC.new_stream()
    _feed(s, json.dumps({"choices": [{"index": 0, "delta": {"content": "a"}}]}))
    assert s.content_seen and not s.completed
    _feed(s, json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    assert s.completed and not s.terminated
    _feed(s, "[DONE]")
    assert s.terminated
    with pytest.raises(MalformedPayload):
        _feed(openai.CODEC.new_stream(), "{nope")
    with pytest.raises(MalformedPayload):
        _feed(openai.CODEC.new_stream(), json.dumps({"choices": "x"}))


def test_anthropic_stream_tool_use_and_usage() -> None:
    s = anthropic.CODEC.new_stream()
    out = _feed(
        s,
        json.dumps(
            {
                "type": "message_start",
                "message": {"model": "c", "usage": {"input_tokens": 9, "output_tokens": 1}},
            }
        ),
        json.dumps(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
            }
        ),
        json.dumps(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": '{"a": '},
            }
        ),
        json.dumps(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": "1}"},
            }
        ),
        json.dumps({"type": "content_block_stop", "index": 0}),
        json.dumps(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use"},
                "usage": {"output_tokens": 12},
            }
        ),
        json.dumps({"type": "some_future_event"}),
        json.dumps({"type": "message_stop"}),
    )
    assert len(out) == 1 and s.tool_calls[0].arguments == {"a": 1}
    assert s.usage is not None and (s.usage.prompt_tokens, s.usage.completion_tokens) == (9, 12)
    assert s.completed and s.terminated and s.model == "c"


def test_gemini_stream_has_no_terminator_only_finish_reason() -> None:
    s = gemini.CODEC.new_stream()
    _feed(s, json.dumps({"candidates": [{"content": {"parts": [{"text": "a"}]}}]}))
    assert not s.completed
    _feed(
        s,
        json.dumps(
            {"candidates": [{"content": {"parts": [{"text": "b"}]}, "finishReason": "STOP"}]}
        ),
    )
    assert s.completed and not s.terminated and s.reply().text == "ab"


# -- the Responses API ---------------------------------------------------------------------


def test_openai_responses_request_urls_and_structure() -> None:
    for endpoint in ("https://api.example.com/v1", "https://api.example.com/v1/responses/"):
        route = make_route(endpoint, "openai_responses", model="gpt-x")
        wire = openai_responses.CODEC.build_request(route, CONVERSATION)
        assert wire.url == "https://api.example.com/v1/responses"
    b = wire.body
    assert b["instructions"] == "You are terse." and b["store"] is False
    assert b["max_output_tokens"] == 256 and b["stop"] == "END"  # passed as given
    assert "authorization" not in wire.headers
    assert openai_responses.CODEC.auth_headers("k") == {"authorization": "Bearer k"}
    with pytest.raises(InvalidArgument):
        openai_responses.CODEC.build_request(route, Envelope(parts=[
            Part(role="system", content="only a system part")]))


def test_openai_responses_reply_reads_every_output_item() -> None:
    r = openai_responses.CODEC.parse_reply({
        "status": "completed", "model": "gpt-x-2025",
        "output": [
            {"type": "reasoning", "id": "rs_plain", "summary": []},  # unencrypted: not carried
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e",
             "status": "completed"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Yes, ", "annotations": []},
                {"type": "refusal", "refusal": "but not that."}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
             "arguments": '{"a": 1}'},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        ],
        "usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4},
                  "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 2}},
    })
    assert (r.text, r.model, r.finish_reason) == ("Yes, but not that.", "gpt-x-2025",
                                                  "completed")
    assert [(c.id, c.name, c.arguments) for c in r.tool_calls] == [("call_1", "f", {"a": 1})]
    assert r.reasoning == [{"type": "reasoning", "id": "rs_1", "summary": [],
                            "encrypted_content": "e"}]
    assert r.usage is not None and (r.usage.cached_tokens, r.usage.reasoning_tokens) == (4, 2)
    with pytest.raises(MalformedPayload, match="still in_progress"):
        openai_responses.CODEC.parse_reply({"status": "in_progress", "output": []})
    with pytest.raises(ProviderErrorPayload, match="cancelled"):
        openai_responses.CODEC.parse_reply({"status": "cancelled", "output": []})
    with pytest.raises(ProviderErrorPayload, match="server_error"):
        openai_responses.CODEC.parse_reply({"status": "failed", "output": [], "error": {
            "code": "server_error", "message": "boom"}})
    with pytest.raises(MalformedPayload):
        openai_responses.CODEC.parse_reply({"status": "completed", "output": "nope"})


def test_openai_responses_stream_proposes_calls_assembled_from_argument_deltas() -> None:
    s = openai_responses.CODEC.new_stream()

    def ev(obj: dict[str, object]) -> list[object]:
        return _feed(s, json.dumps(obj), event=str(obj["type"]))

    ev({"type": "response.created", "response": {"model": "gpt-x", "status": "in_progress"}})
    assert not s.content_seen
    ev({"type": "response.output_item.added", "output_index": 0,
        "item": {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
                 "arguments": ""}})
    assert s.content_seen
    ev({"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": '{"a":'})
    ev({"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": " 1}"})
    assert s.tool_calls == []  # proposed only once complete
    out = ev({"type": "response.completed", "response": {
        "status": "completed", "usage": {"input_tokens": 3, "output_tokens": 4}}})
    assert s.terminated and [p.call.arguments for p in out] == [{"a": 1}]  # type: ignore[attr-defined]
    assert s.reply().usage is not None
    bad = openai_responses.CODEC.new_stream()
    with pytest.raises(MalformedPayload):
        _feed(bad, json.dumps({"type": "response.function_call_arguments.delta",
                               "item_id": "nope", "delta": "x"}))
    done = openai_responses.CODEC.new_stream()
    _feed(done, "[DONE]")
    assert done.terminated


# Per protocol: an answer whose tool call carries no id (Gemini's functionCall has none).
_CALL_WITHOUT_ID = {
    "openai": (openai.CODEC, {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "{}"}}]}}]}),
    "openai_responses": (openai_responses.CODEC, {"status": "completed", "output": [
        {"type": "function_call", "name": "f", "arguments": "{}"}]}),
    "anthropic": (anthropic.CODEC, {"type": "message", "stop_reason": "tool_use", "content": [
        {"type": "tool_use", "name": "f", "input": {}}]}),
    "gemini": (gemini.CODEC, {"candidates": [{"finishReason": "STOP", "content": {"parts": [
        {"functionCall": {"name": "f", "args": {}}}]}}]}),
}
_MADE_UP = re.compile(r"call_[0-9a-f]{24}")


@pytest.mark.parametrize("protocol", sorted(_CALL_WITHOUT_ID))
def test_a_made_up_tool_call_id_is_unique_across_answers(protocol: str) -> None:
    codec, body = _CALL_WITHOUT_ID[protocol]
    ids = [call.id for _ in range(3) for call in codec.parse_reply(body).tool_calls]
    assert len(set(ids)) == 3 and all(_MADE_UP.fullmatch(i) for i in ids)


def test_a_made_up_streamed_tool_call_id_is_unique_across_answers() -> None:
    chunks = (
        json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"name": "f", "arguments": "{}"}}]}}]}),
        json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        "[DONE]")
    ids = []
    for _ in range(2):
        s = openai.CODEC.new_stream()
        _feed(s, *chunks)
        s.end()
        ids += [c.id for c in s.tool_calls]
    gem = gemini.CODEC.new_stream()
    _feed(gem, json.dumps(_CALL_WITHOUT_ID["gemini"][1]))
    ids += [c.id for c in gem.tool_calls]
    assert len(set(ids)) == 3 and all(_MADE_UP.fullmatch(i) for i in ids)


def test_a_chat_refusal_is_the_answers_text_whole_or_streamed() -> None:
    r = openai.CODEC.parse_reply({"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": None, "refusal": "I cannot help with that."}}]})
    assert (r.text, r.finish_reason) == ("I cannot help with that.", "stop")
    s = openai.CODEC.new_stream()
    out = _feed(
        s,
        json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "refusal": ""}}]}),
        json.dumps({"choices": [{"index": 0, "delta": {"refusal": "I cannot "}}]}),
        json.dumps({"choices": [{"index": 0, "delta": {"refusal": "help."},
                                 "finish_reason": "stop"}]}),
        "[DONE]")
    assert [e.text for e in out if isinstance(e, TextDelta)] == ["I cannot ", "help."]
    assert s.reply().text == "I cannot help." and s.content_seen


def test_gemini_request_fields_go_at_the_top_and_generation_parameters_in_their_config() -> None:
    safety = [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}]
    tool_config = {"functionCallingConfig": {"mode": "ANY"}}
    body = gemini.CODEC.build_request(make_route("https://g", "gemini"), Envelope(
        parts=[Part(content="Q")], params={
            "safetySettings": safety, "toolConfig": tool_config,
            "cachedContent": "cachedContents/c1", "temperature": 0.5})).body
    assert (body["safetySettings"], body["toolConfig"], body["cachedContent"]) == (
        safety, tool_config, "cachedContents/c1")
    assert body["generationConfig"] == {"temperature": 0.5}


def test_a_conversations_tool_calls_are_parsed_once_not_again_every_turn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every turn judges the whole history's tool calls before any begin (issue 23: the turn's
    CPU); an agent loop re-sends the same parts every turn, so their arguments are parsed the
    first time only, and a codec reads each call's arguments once per request."""
    from ledger.domain import carried

    calls = [Part(role="assistant", content=json.dumps({"q": f"call {i}", "n": i}),
                  tool_call_id=f"c{i}", name="search") for i in range(20)]
    env = Envelope(parts=[Part(content="go"), *calls])
    parsed: list[str] = []
    real = carried._read_arguments  # the one parse every reading of arguments goes through
    monkeypatch.setattr(carried, "_read_arguments",
                        lambda content: parsed.append(content) or real(content))
    carried._remembered_arguments.cache_clear()
    carried.uncarried(env)
    first = len(parsed)
    assert 0 < first <= 20
    carried.uncarried(env)
    assert len(parsed) == first  # the second turn parses nothing again
    parsed.clear()
    carried.tool_arguments(calls[0], 1)
    assert parsed == [calls[0].content]  # one parse, not a check and then a parse
