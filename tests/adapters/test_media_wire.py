"""Images, documents and the Responses API on the wire, over real HTTP on loopback.

Every protocol carries binary parts to the fake provider, which decodes and checks them as a
provider would (``ReceivedRequest.media``, a 400 for what a provider refuses); the Responses
API keeps no state at the provider, reports cached and reasoning tokens, carries reasoning
items to the route that wrote them only, and reports failed and incomplete responses and error
events as provider failures.
"""

from __future__ import annotations

import base64
import json
import logging
from decimal import Decimal
from typing import Any

import httpx
import pytest

from ledger.adapters import HttpAdapter, TextDelta, openai
from ledger.adapters.contract import TOOL_FILES_TEXT, reasoning_data, wire_order
from ledger.adapters.runner import output_parts
from ledger.decide.classify import classify
from ledger.domain.carried import files_alone as results_of_files_alone
from ledger.domain.carried import refusals_for, unanswered_refusals, uncarried
from ledger.domain.envelope import Envelope, Part, ToolSpec
from ledger.domain.facts import Category, Phase, WireProtocol
from ledger.domain.media import REASONING_MEDIA_TYPE
from ledger.errors import InvalidArgument
from ledger.policy.load import preset
from ledger.testing import Behavior, FakeProvider, Fault
from ledger.testing.fakewire import thought_signature
from tests.media import pdf, png

from .conftest import PROFILE, PROTOCOLS, make_route

pytestmark = pytest.mark.anyio

PNG = png(48, 24)
PDF = pdf(2)
NOTES = "Q3 notes: margins widened.\n"


def attachments() -> Envelope:
    return Envelope(parts=[
        Part(role="system", content="Be precise."),
        Part(content="Compare the chart with the filing and the notes."),
        Part(data=PNG, media_type="image/png"),
        Part(data=PDF, media_type="application/pdf", name="10-K.pdf"),
        Part(data=NOTES.encode(), media_type="text/plain", name="notes.txt"),
    ])


async def send(adapter: HttpAdapter, fake: FakeProvider, protocol: str, envelope: Envelope,
               **route: Any) -> Any:
    events: list[Any] = []
    result = await adapter.send(make_route(fake.endpoint(protocol), protocol, **route),
                                envelope, profile_id=PROFILE, on_event=events.append)
    return result, events


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_images_and_documents_arrive_intact_on_every_protocol(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    env = attachments().model_copy(update={"stream": stream})
    result, events = await send(adapter, fake, protocol, env)
    assert result.ok, result.observation
    if stream:
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == result.text
    (req,) = fake.requests
    assert req.problem is None
    by_type = {m.media_type: m for m in req.media}
    assert by_type["image/png"].data == PNG
    assert by_type["application/pdf"].data == PDF
    sent = req.body.decode()
    if protocol in ("openai", "openai_responses"):
        # No plain-text document type in OpenAI's protocols: the document's text is the content.
        assert "text/plain" not in by_type and json.dumps(NOTES)[1:-1] in sent
        assert by_type["application/pdf"].filename == "10-K.pdf"
    else:
        assert by_type["text/plain"].data == NOTES.encode()
    if protocol == "anthropic":
        assert by_type["application/pdf"].filename == "10-K.pdf"  # the document's title


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_links_are_sent_for_the_provider_to_fetch(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    image = Part(url="https://files.example/chart.png", media_type="image/png")
    document = Part(url="https://files.example/10-K.pdf", media_type="application/pdf")
    question = Part(content="What do these show?")
    result, _ = await send(adapter, fake, protocol, Envelope(parts=[question, image]))
    assert result.ok and [m.url for m in fake.requests[-1].media] == [image.url]
    if protocol == "openai":
        # Chat completions takes no document link, and the ledger never fetches one.
        with pytest.raises(InvalidArgument) as info:
            await send(adapter, fake, protocol, Envelope(parts=[question, document]))
        assert info.value.field == "envelope.parts[1].url" and "data=" in str(info.value)
        assert len(fake.requests) == 1  # nothing more was sent
        return
    result, _ = await send(adapter, fake, protocol, Envelope(parts=[question, document]))
    assert result.ok and [m.url for m in fake.requests[-1].media] == [document.url]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_link_written_with_an_upper_case_scheme_goes_out_in_its_canonical_form(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    image = Part(url="HTTPS://files.example/Chart.png", media_type="image/png")
    result, _ = await send(adapter, fake, protocol,
                           Envelope(parts=[Part(content="What does this show?"), image]))
    assert result.ok, result.observation
    assert [m.url for m in fake.requests[-1].media] == ["https://files.example/Chart.png"]


_CALL_A, _CALL_B = ({"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    for c in "ab")
_TOOL_USE_AB = {"role": "assistant", "content": [
    {"type": "tool_use", "id": c, "name": "f", "input": {}} for c in "ab"]}
_RESULT_A, _RESULT_B = ({"type": "tool_result", "tool_use_id": c, "content": c.upper()}
                        for c in "ab")


@pytest.mark.parametrize(("protocol", "body", "says"), [
    ("openai", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]},
     "not valid base64"),
    ("openai", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_data": "data:application/pdf;base64,"
                                               + base64.b64encode(PDF).decode()}}]}]},
     "filename is required"),
    ("openai_responses", {"model": "m", "input": [{"type": "message", "role": "user",
                                                   "content": [{"type": "input_image",
                                                                "image_url": "data:image/png;"
                                                                "base64," + base64.b64encode(
                                                                    PDF).decode()}]}]},
     "not image/png"),
    ("openai_responses", {"model": "m", "previous_response_id": "resp_1", "input": []},
     "previous_response_id"),
    ("openai_responses", {"model": "m", "input": [{"type": "reasoning", "id": "rs_1",
                                                   "encrypted_content": "enc:other:eA=="}]},
     "could not be decrypted"),
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/tiff",
                                     "data": "AAAA"}}]}]}, "image/tiff"),
    ("gemini", {"contents": [{"role": "user", "parts": [
        {"file_data": {"mime_type": "application/pdf", "file_uri": "http://x/a.pdf"}}]}]},
     "https://"),
    # Tool results: each call answered right after the calls, before anything else.
    ("openai", {"model": "m", "messages": [
        {"role": "user", "content": "Go."}, {"role": "assistant", "content": None,
                                             "tool_calls": [_CALL_A, _CALL_B]},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "user", "content": [{"type": "text", "text": "a file"}]},
        {"role": "tool", "tool_call_id": "b", "content": "B"}]},
     "The following tool_call_ids did not have response messages: b"),
    ("openai", {"model": "m", "messages": [{"role": "user", "content": "Go."},
                                           {"role": "tool", "tool_call_id": "a",
                                            "content": "A"}]},
     "must be a response to a preceeding message with 'tool_calls'"),
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "Go."}, _TOOL_USE_AB,
        {"role": "user", "content": [_RESULT_A, {"type": "text", "text": "a file"}, _RESULT_B]}]},
     "tool_result blocks must come first"),
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "Go."}, _TOOL_USE_AB,
        {"role": "user", "content": [_RESULT_A]}]},
     "`tool_use` ids were found without `tool_result` blocks immediately after: b"),
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [_RESULT_A]}]}, "unexpected `tool_use_id`"),
    # A result that answers no call before it.
    ("openai", {"model": "m", "messages": [
        {"role": "user", "content": "Go."}, {"role": "assistant", "content": None,
                                             "tool_calls": [_CALL_A]},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "x", "content": "X"}]},
     "'tool_call_id' of 'x' not found in 'tool_calls' of previous message"),
    ("openai_responses", {"model": "m", "input": [
        {"type": "message", "role": "user", "content": "Go."},
        {"type": "function_call_output", "call_id": "a", "output": "A"}]},
     "No tool call found for function call output with call_id a"),
    ("openai_responses", {"model": "m", "input": [
        {"type": "function_call_output", "call_id": "a", "output": "A"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "A"}]},
     "No tool call found for function call output with call_id a"),
    ("gemini", {"contents": [{"role": "user", "parts": [
        {"text": "Go."}, {"functionResponse": {"name": "f", "response": {}}}]}]},
     "function response turn comes immediately after a function call turn"),
    ("gemini", {"contents": [
        {"role": "user", "parts": [{"text": "Go."}]},
        {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {}}},
                                   {"functionResponse": {"name": "f", "response": {}}}]}]},
     "the number of function response parts is equal to the number of function call parts"),
    # A second result of one call, in the turn that answers it.
    ("openai", {"model": "m", "messages": [
        {"role": "user", "content": "Go."}, {"role": "assistant", "content": None,
                                             "tool_calls": [_CALL_A]},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "a", "content": "A"}]},
     "Duplicate value for 'tool_call_id' of 'a'"),
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "Go."}, _TOOL_USE_AB,
        {"role": "user", "content": [_RESULT_A, _RESULT_B, _RESULT_A]}]},
     "each tool_use must have a single result"),
    ("openai_responses", {"model": "m", "input": [
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "A"},
        {"type": "message", "role": "user", "content": "Again?"},
        {"type": "function_call_output", "call_id": "a", "output": "A"}]},
     "Duplicate function_call_output for call_id 'a'"),
    # Two calls of one id: in one turn, and (Anthropic, Responses) one in each of two turns.
    ("openai", {"model": "m", "messages": [
        {"role": "user", "content": "Go."}, {"role": "assistant", "content": None,
                                             "tool_calls": [_CALL_A, _CALL_A]},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "a", "content": "A"}]},
     "Duplicate value for 'tool_call_id' of 'a' in messages[2] and messages[3]"),
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "Go."}, {"role": "assistant", "content": [
            _TOOL_USE_AB["content"][0], _TOOL_USE_AB["content"][0]]},
        {"role": "user", "content": [_RESULT_A, _RESULT_A]}]},
     "messages.1.content.1: `tool_use` ids must be unique"),
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "Go."}, _TOOL_USE_AB,
        {"role": "user", "content": [_RESULT_A, _RESULT_B, {"type": "text", "text": "Again."}]},
        {"role": "assistant", "content": [_TOOL_USE_AB["content"][0]]},
        {"role": "user", "content": [_RESULT_A]}]},
     "messages.3.content.0: `tool_use` ids must be unique"),
    ("openai_responses", {"model": "m", "input": [
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "A"},
        {"type": "message", "role": "user", "content": "Again."},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "A"}]},
     "Duplicate function_call_output for call_id 'a'"),
    # An empty text block, and a file in a tool_result checked as one anywhere else.
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "text content blocks must be non-empty"),
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "Go."}, _TOOL_USE_AB,
        {"role": "user", "content": [_RESULT_A, {**_RESULT_B, "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/tiff",
                                         "data": "AAAA"}}]}]}]}, "image/tiff"),
    ("openai_responses", {"model": "m", "input": [
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": [
            {"type": "input_image", "image_url": "data:image/png;base64,@@@"}]}]},
     "not valid base64"),
])
async def test_the_fake_refuses_what_a_provider_would(
        fake: FakeProvider, protocol: str, body: dict[str, Any], says: str) -> None:
    path = {"openai": "/v1/chat/completions", "openai_responses": "/v1/responses",
            "anthropic": "/v1/messages", "gemini": "/v1beta/models/m:generateContent"}[protocol]
    async with httpx.AsyncClient() as client:
        response = await client.post(fake.base_url + path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert says in error["message"]
    assert fake.requests[-1].problem == error["message"]



# -- a turn's tool results and the files the tools returned -----------------------------------


def tool_files(file_first: bool) -> Envelope:
    """Two parallel calls, each answered with its text and a file, as ``run.tool_result`` builds
    them (a file is a user part of class ``tool_result`` with the call as provenance)."""
    parts = [Part(content="Fetch both filings."),
             *(Part(role="assistant", content=f'{{"q": "{c}"}}', tool_call_id=f"call_{c}",
                    name="fetch", data_class="model_derived") for c in "ab")]
    for c, file in (("a", {"data": PDF, "media_type": "application/pdf", "name": "a.pdf"}),
                    ("b", {"data": PNG, "media_type": "image/png", "name": "b.png"})):
        text = Part(role="tool", content=f"fetched {c}", tool_call_id=f"call_{c}", name="fetch",
                    data_class="tool_result", provenance=f"call_{c}")
        media = Part(**file, data_class="tool_result", provenance=f"call_{c}")
        parts += [media, text] if file_first else [text, media]
    return Envelope(parts=parts)


def after_the_calls(protocol: str, body: dict[str, Any]) -> list[str]:
    """What follows the assistant's tool calls on the wire: ``result:<call>`` and ``file:<type>``
    items, in the order sent (and ``|`` where a new message or turn begins)."""
    out: list[str] = []
    if protocol == "openai":
        for m in body["messages"][2:]:
            out += ["|"] + ([f"result:{m['tool_call_id']}"] if m["role"] == "tool" else [
                f"file:{c['type']}" for c in m["content"]])
    elif protocol == "openai_responses":
        for item in body["input"][3:]:
            out += ["|"] + ([f"result:{item['call_id']}"] if item["type"] ==
                            "function_call_output" else [f"file:{c['type']}"
                                                         for c in item["content"]])
    elif protocol == "anthropic":
        (message,) = body["messages"][2:]
        out += ["|"] + [f"result:{b['tool_use_id']}" if b["type"] == "tool_result" else
                        f"file:{b['type']}" for b in message["content"]]
    else:
        (content,) = body["contents"][2:]
        out += ["|"] + [f"result:{p['functionResponse']['name']}" if "functionResponse" in p
                        else f"file:{p['inline_data']['mime_type']}" for p in content["parts"]]
    return out


WIRE_ORDER = {
    "openai": ["|", "result:call_a", "|", "result:call_b", "|", "file:file", "file:image_url"],
    "openai_responses": ["|", "result:call_a", "|", "result:call_b", "|", "file:input_file",
                         "file:input_image"],
    "anthropic": ["|", "result:call_a", "result:call_b", "file:document", "file:image"],
    "gemini": ["|", "result:fetch", "result:fetch", "file:application/pdf", "file:image/png"],
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("file_first", [False, True], ids=["text-then-file", "file-then-text"])
async def test_a_turns_tool_results_come_before_the_files_its_tools_returned(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, file_first: bool) -> None:
    # Chat completions refuses anything between the assistant's tool_calls and a tool message
    # for each; Anthropic a user message whose tool_result blocks do not open it. The fake
    # refuses both, as they do.
    result, _ = await send(adapter, fake, protocol, tool_files(file_first))
    (req,) = fake.requests
    assert req.problem is None and result.ok, (req.problem, result.observation)
    assert [m.data for m in req.media] == [PDF, PNG]
    assert after_the_calls(protocol, req.json) == WIRE_ORDER[protocol]


def test_only_a_turns_tool_results_are_reordered_and_the_users_own_files_stay_in_place() -> None:
    # A user's file stays with the question before it; the turn's tool results end where
    # the user speaks again.
    chart, own = (Part(data=PNG, media_type="image/png", name=n) for n in ("c.png", "own.png"))
    env = Envelope(parts=[
        Part(content="Look at this chart."), chart,
        Part(role="assistant", content="{}", tool_call_id="call_a", name="fetch",
             data_class="model_derived"),
        Part(data=PDF, media_type="application/pdf", name="a.pdf", data_class="tool_result",
             provenance="call_a"),
        Part(role="tool", content="fetched a", tool_call_id="call_a", name="fetch",
             data_class="tool_result", provenance="call_a"),
        Part(content="And this one?"), own])
    body = openai.CODEC.build_request(make_route("https://x/v1", "openai"), env).body
    assert [(m["role"], [c.get("type") for c in m["content"]] if isinstance(
        m["content"], list) else m["content"]) for m in body["messages"]] == [
        ("user", ["text", "image_url"]), ("assistant", None), ("tool", "fetched a"),
        ("user", ["file"]), ("user", ["text", "image_url"])]
    assert [i for i, _ in wire_order(env.parts)] == [0, 1, 2, 4, 3, 5, 6]

def files_alone() -> Envelope:
    """Two parallel calls: ``call_a`` answered with text and a PDF, ``call_b`` with an image
    alone (an empty text result beside it, as ``run.tool_result(call, "")`` and the framework
    integrations leave for a tool that returned no text)."""
    parts = [Part(content="Fetch the filing and take a screenshot."),
             *(Part(role="assistant", content="{}", tool_call_id=f"call_{c}", name=n,
                    data_class="model_derived") for c, n in (("a", "fetch"), ("b", "shot")))]
    parts += [
        Part(role="tool", content="fetched a", tool_call_id="call_a", name="fetch",
             data_class="tool_result", provenance="call_a"),
        Part(data=PDF, media_type="application/pdf", name="a.pdf", data_class="tool_result",
             provenance="call_a"),
        Part(data=PNG, media_type="image/png", data_class="tool_result", provenance="call_b"),
        Part(role="tool", content="", tool_call_id="call_b", name="shot",
             data_class="tool_result", provenance="call_b")]
    return Envelope(parts=parts)


def empty_texts(value: Any, key: str = "") -> list[str]:
    """The keys under which ``value`` (a request body) holds an empty string."""
    if isinstance(value, dict):
        return [k for v_key, v in value.items() for k in empty_texts(v, v_key)]
    if isinstance(value, list):
        return [k for v in value for k in empty_texts(v, key)]
    return [key] if value == "" else []


FILES_ALONE = {
    # The protocols whose tool result carries files: the image is call_b's result.
    "openai_responses": [
        ("call_a", "fetched a"),
        ("call_b", [{"type": "input_image", "image_url": "data:image/png;base64,"
                     + base64.b64encode(PNG).decode(), "detail": "auto"}]),
        ("user", ["input_file"])],
    "anthropic": [
        ("call_a", "fetched a"),
        ("call_b", [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": base64.b64encode(PNG).decode()}}]),
        ("user", ["document"])],
    # Text only in a tool result: the result says where the image is, which follows.
    "openai": [("call_a", "fetched a"), ("call_b", TOOL_FILES_TEXT),
               ("user", ["file", "image_url"])],
    "gemini": [("fetch", {"result": "fetched a"}), ("shot", {"result": TOOL_FILES_TEXT}),
               ("user", ["application/pdf", "image/png"])],
}


def results_and_files(protocol: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """What follows the assistant's tool calls: ``(call, its result)`` in the order sent, then
    ``("user", [the types of the files sent after the results])``."""
    out: list[tuple[str, Any]] = []
    files: list[str] = []
    if protocol == "openai":
        for m in body["messages"][2:]:
            if m["role"] == "tool":
                out.append((m["tool_call_id"], m["content"]))
            else:
                files += [c["type"] for c in m["content"]]
    elif protocol == "openai_responses":
        for item in body["input"][3:]:
            if item["type"] == "function_call_output":
                out.append((item["call_id"], item["output"]))
            else:
                files += [c["type"] for c in item["content"]]
    elif protocol == "anthropic":
        (message,) = body["messages"][2:]
        for b in message["content"]:
            if b["type"] == "tool_result":
                out.append((b["tool_use_id"], b["content"]))
            else:
                files.append(b["type"])
    else:
        (content,) = body["contents"][2:]
        for p in content["parts"]:
            if "functionResponse" in p:
                out.append((p["functionResponse"]["name"], p["functionResponse"]["response"]))
            else:
                files.append(p["inline_data"]["mime_type"])
    return [*out, ("user", files)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_tool_result_of_files_alone_reaches_the_model_without_an_empty_text(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    # Anthropic refuses an empty text block, and an empty result tells the model the tool
    # returned nothing. Where the protocol's tool result carries files (Anthropic's
    # tool_result, the Responses API's function_call_output), the image is the result; where
    # it carries text only, the result says the files follow, and they do.
    result, _ = await send(adapter, fake, protocol, files_alone())
    (req,) = fake.requests
    assert req.problem is None and result.ok, (req.problem, result.observation)
    assert sorted(m.data or b"" for m in req.media) == sorted([PDF, PNG])
    assert empty_texts(req.json) == []
    assert results_and_files(protocol, req.json) == FILES_ALONE[protocol]
    said = [n for n in result.notes if "no text, only the files envelope.parts[5]" in n]
    assert len(said) == (1 if protocol in ("openai", "gemini") else 0), result.notes


async def test_an_empty_tool_result_goes_to_anthropic_without_empty_content(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    # A tool that returned nothing: the tool_result's content is optional, and an empty text
    # is what the Messages API refuses.
    env = Envelope(parts=[
        Part(content="Clear the cache."),
        Part(role="assistant", content="{}", tool_call_id="call_a", name="clear",
             data_class="model_derived"),
        Part(role="tool", content="", tool_call_id="call_a", name="clear",
             data_class="tool_result", provenance="call_a")])
    result, _ = await send(adapter, fake, "anthropic", env)
    (req,) = fake.requests
    assert req.problem is None and result.ok, (req.problem, result.observation)
    assert req.json["messages"][2]["content"] == [{"type": "tool_result",
                                                   "tool_use_id": "call_a"}]


def test_only_a_files_own_empty_result_carries_it() -> None:
    # A file goes with the empty result of the call that returned it, within the turn's tool
    # results: not with another call's, nor with a result of an earlier turn.
    shot = Part(data=PNG, media_type="image/png", data_class="tool_result", provenance="call_b")
    empty_a, empty_b = (Part(role="tool", content="", tool_call_id=f"call_{c}", name="f",
                             data_class="tool_result", provenance=f"call_{c}") for c in "ab")
    calls = [Part(role="assistant", content="{}", tool_call_id=f"call_{c}", name="f",
                  data_class="model_derived") for c in "ab"]
    parts = [Part(content="Go."), calls[0], empty_a, Part(content="And now?"), calls[1], shot,
             empty_b, Part(data=PDF, media_type="application/pdf", name="a.pdf",
                           data_class="tool_result", provenance="call_a")]
    assert results_of_files_alone(parts) == {6: (5,)}
    assert [i for i, _ in wire_order(parts)] == [0, 1, 2, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_call_answered_by_its_files_alone_has_them_as_its_result(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    # run.tool_result(call, Part(...)) with no text result leaves no tool part for the call,
    # and every provider refuses a call without its result (a 400). The call gets the empty
    # result it lacks, named as the call, and its image goes as that result, exactly as for
    # an empty result beside the image.
    env = Envelope(parts=files_alone().parts[:-1])  # no tool part for call_b
    result, _ = await send(adapter, fake, protocol, env)
    (req,) = fake.requests
    assert req.problem is None and result.ok, (req.problem, result.observation)
    assert sorted(m.data or b"" for m in req.media) == sorted([PDF, PNG])
    assert empty_texts(req.json) == []
    assert results_and_files(protocol, req.json) == FILES_ALONE[protocol]
    said = [n for n in result.notes if n.startswith(
        "envelope.parts[2]: the tool call has no tool part, only the files envelope.parts[5]")]
    assert len(said) == (1 if protocol in ("openai", "gemini") else 0), result.notes


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_tool_call_without_its_result_is_refused_before_anything_is_sent(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    # Followed by more conversation, every provider answers it with a 400; at the end of the
    # request, chat completions does ("must be followed by tool messages"), while the others'
    # prefill is theirs to judge.
    question, call, _, result = files_alone().parts[:4]
    goes_on = Envelope(parts=[question, call, Part(content="Never mind: what is 2 + 2?")])
    with pytest.raises(InvalidArgument) as info:
        await send(adapter, fake, protocol, goes_on)
    assert info.value.field == "envelope.parts[1]"
    assert "'call_a' (fetch) has no result" in str(info.value)
    assert "run.tool_result(call, ...)" in str(info.value)
    assert fake.requests == []
    answered, _ = await send(adapter, fake, protocol, Envelope(
        parts=[question, call, result, goes_on.parts[-1]]))
    assert answered.ok and fake.requests[-1].problem is None
    ends = Envelope(parts=[question, call])
    if protocol == "openai":
        with pytest.raises(InvalidArgument) as info:
            await send(adapter, fake, protocol, ends)
        assert info.value.field == "envelope.parts[1]" and "ends the request" in str(info.value)
        assert len(fake.requests) == 1
    else:
        prefill, _ = await send(adapter, fake, protocol, ends)
        assert prefill.ok and fake.requests[-1].problem is None


# Where each protocol reads a call's result: chat completions among the tool messages right
# after the assistant message, Anthropic among the tool_result blocks that open the next user
# message, Gemini in the turn right after the call's; the Responses API anywhere after the call.
ASKS = Part(content="Also: which quarter was it?")
ANSWERS = Part(role="assistant", content="Q3.", data_class="model_derived")
STEERS = Part(role="system", content="Answer in one line.")
# Case: (the parts between the call and its result, {refusing protocol: the part named as
# sent before the result past its place}).
MISPLACED = {
    # The user's text: Anthropic merges it and the result into one user message, text first;
    # Gemini's next user turn holds the result still.
    "user text": ([ASKS], {"openai": 2, "anthropic": 2}),
    # The user's text and the assistant's answer: Gemini's next turn is the text alone.
    "a whole turn": ([ASKS, ANSWERS], {"openai": 2, "anthropic": 2, "gemini": 3}),
    # A system part: Anthropic and Gemini send it in the top-level system text.
    "a system part": ([STEERS], {"openai": 2}),
}


@pytest.mark.parametrize("case", sorted(MISPLACED))
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_tool_result_where_its_protocol_reads_none_is_refused_before_sending(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, case: str) -> None:
    # A call answered later in the conversation, but not where the provider reads its result,
    # is a 400 there (after an Attempt was begun, and on every route of a failover); a
    # protocol whose codec sends the result where the provider reads it takes the request.
    question, call, _, result = files_alone().parts[:4]
    between, refusing = MISPLACED[case]
    env = Envelope(parts=[question, call, *between, result])
    if protocol in refusing:
        with pytest.raises(InvalidArgument) as info:
            await send(adapter, fake, protocol, env)
        assert info.value.field == "envelope.parts[1]"
        said = str(info.value)
        assert (f"'call_a' (fetch) has its result, envelope.parts[{len(between) + 2}], sent "
                f"after envelope.parts[{refusing[protocol]}]") in said, said
        assert "Responses API" in said  # the fix names the protocol that takes it as it is
        assert fake.requests == []
    else:
        sent, _ = await send(adapter, fake, protocol, env)
        (req,) = fake.requests
        assert req.problem is None and sent.ok, (req.problem, sent.observation)


# A tool result that answers no call before it: every provider matches a result to a call
# it has read already, and answers one without with a 400 ("messages with role 'tool' must be
# a response to a preceeding message with 'tool_calls'", "'tool_call_id' of ... not found in
# 'tool_calls' of previous message", "No tool call found for function call output with
# call_id ...", "unexpected `tool_use_id` found in `tool_result` blocks", "function response
# turn comes immediately after a function call turn"). Case: (the parts after the question,
# the index of the result refused, what the message says of its call).
THEN = Part(content="And what changed since?")
REPLIED = Part(role="assistant", content="Margins widened.", data_class="model_derived")
TYPO = Part(role="tool", content="fetched again", tool_call_id="call_x", name="fetch",
            data_class="tool_result", provenance="call_x")
ORPHANED = {
    # A memory window dropped the turn's call and kept its result.
    "its call trimmed away": (lambda call, result: [result, REPLIED, THEN], 1,
                              "no assistant part with tool_call_id='call_a' is in the request"),
    # Its call answered, and a result of an id no call has beside it.
    "a typo'd id": (lambda call, result: [call, result, TYPO, THEN], 3,
                    "no assistant part with tool_call_id='call_x' is in the request"),
    # The result sent before its call (which a later result answers).
    "the result before its call": (lambda call, result: [result, call, result, THEN], 1,
                                   "its call, envelope.parts[2], comes after it"),
}


@pytest.mark.parametrize("case", sorted(ORPHANED))
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_tool_result_that_answers_no_call_before_it_is_refused_before_sending(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, case: str) -> None:
    # Every provider refuses it with a 400 (the fake as each does): sent, an Attempt was begun
    # for nothing, and on a failover every route would get the same 400.
    question, call, _, result = files_alone().parts[:4]
    parts_of, index, said = ORPHANED[case]
    env = Envelope(parts=[question, *parts_of(call, result)])
    with pytest.raises(InvalidArgument) as info:
        await send(adapter, fake, protocol, env)
    assert info.value.field == f"envelope.parts[{index}]"
    message = str(info.value)
    assert "answers no tool call before it" in message and said in message, message
    assert "drop the result, or keep its call's part" in message
    assert "trim a call and its results together" in message
    assert fake.requests == []
    # Without the result, or with its call before it, the provider takes the request.
    for fixed in ([p for i, p in enumerate(env.parts) if i != index],
                  [question, call, result, THEN]):
        sent, _ = await send(adapter, fake, protocol, Envelope(parts=fixed))
        assert fake.requests[-1].problem is None and sent.ok, (fake.requests[-1].problem,
                                                               sent.observation)


# A second result of a call its first result answers already: chat completions ("Duplicate
# value for 'tool_call_id'"; in a later turn, "must be a response to a preceeding message with
# 'tool_calls'"), the Responses API ("Duplicate function_call_output for call_id"), Anthropic
# ("each tool_use must have a single result"; later, no tool_use of its id in the message
# before) and Gemini (more responses than calls; later, no call turn before) answer a 400.
# Case: (the parts after the question, the index of the repeated result).
REPEATED = {
    "in a later turn": (lambda call, result: [call, result, THEN, REPLIED, THEN, result], 6),
    "in the same turn": (lambda call, result: [call, result, result, THEN], 3),
}


@pytest.mark.parametrize("case", sorted(REPEATED))
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_second_result_of_an_answered_call_is_refused_before_sending(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, case: str) -> None:
    question, call, _, result = files_alone().parts[:4]
    parts_of, index = REPEATED[case]
    env = Envelope(parts=[question, *parts_of(call, result)])
    with pytest.raises(InvalidArgument) as info:
        await send(adapter, fake, protocol, env)
    assert info.value.field == f"envelope.parts[{index}]"
    message = str(info.value)
    assert ("tool_call_id='call_a' repeats a result: its call, envelope.parts[1], has its "
            "result already, envelope.parts[2]") in message, message
    assert "drop the repeated result" in message
    assert fake.requests == []
    # Without the repeated result, the provider takes the request.
    fixed = [p for i, p in enumerate(env.parts) if i != index]
    sent, _ = await send(adapter, fake, protocol, Envelope(parts=fixed))
    assert fake.requests[-1].problem is None and sent.ok, (fake.requests[-1].problem,
                                                           sent.observation)


def fetch_call(call_id: str, n: int) -> list[Part]:
    """A call of ``fetch`` with id ``call_id`` (its ``n``-th) and its result right after it."""
    return [Part(role="assistant", content=f'{{"n": {n}}}', tool_call_id=call_id, name="fetch",
                 data_class="model_derived"),
            Part(role="tool", content=f"fetched {n}", tool_call_id=call_id, name="fetch",
                 data_class="tool_result")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_call_id_reused_in_a_later_turn_is_refused_where_the_request_holds_each_id_once(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    # Frameworks that number calls per answer (call_0, call_0, ...) reuse an id across turns.
    # Anthropic ("`tool_use` ids must be unique") and the Responses API ("Duplicate
    # function_call_output for call_id") answer a 400, as the fake does; chat completions reads
    # each turn's tool messages against the assistant message before them, and Gemini's calls
    # carry no id: they take it, each result answering the call of its turn.
    parts = [Part(content="Fetch it."), *fetch_call("call_0", 1), REPLIED, THEN,
             *fetch_call("call_0", 2), THEN]
    if protocol in ("anthropic", "openai_responses"):
        with pytest.raises(InvalidArgument) as info:
            await send(adapter, fake, protocol, Envelope(parts=parts))
        assert info.value.field == "envelope.parts[5]"
        message = str(info.value)
        assert ("tool call 'call_0' (fetch) has the id of another tool call in an earlier "
                "turn, envelope.parts[1]") in message, message
        assert "give each tool call an id of its own" in message
        assert fake.requests == []
        # Each call with an id of its own, the provider takes the request.
        parts[5:7] = fetch_call("call_1", 2)
    sent, _ = await send(adapter, fake, protocol, Envelope(parts=parts))
    assert fake.requests[-1].problem is None and sent.ok, (fake.requests[-1].problem,
                                                           sent.observation)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_two_calls_of_one_id_in_a_turn_are_refused_before_sending_where_ids_are_sent(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    # Two tool_use blocks of one id are a 400 on Anthropic ("`tool_use` ids must be unique"),
    # two tool messages of one id after an assistant message on chat completions ("Duplicate
    # value for 'tool_call_id'"), two outputs of one call_id on the Responses API ("Duplicate
    # function_call_output"): refused before an Attempt is begun. Gemini's calls carry no id.
    first, second = fetch_call("call_0", 1), fetch_call("call_0", 2)
    parts = [Part(content="Fetch both."), first[0], second[0], first[1], second[1], THEN]
    if protocol == "gemini":
        sent, _ = await send(adapter, fake, protocol, Envelope(parts=parts))
        assert fake.requests[-1].problem is None and sent.ok, fake.requests[-1].problem
        return
    with pytest.raises(InvalidArgument) as info:
        await send(adapter, fake, protocol, Envelope(parts=parts))
    assert info.value.field == "envelope.parts[2]"
    message = str(info.value)
    assert ("tool call 'call_0' (fetch) has the id of another tool call in the same turn, "
            "envelope.parts[1]") in message, message
    assert "give each tool call an id of its own" in message
    assert fake.requests == []
    parts[2], parts[4] = fetch_call("call_1", 2)
    sent, _ = await send(adapter, fake, protocol, Envelope(parts=parts))
    assert fake.requests[-1].problem is None and sent.ok, fake.requests[-1].problem


def gemini_text_signature(route: Any) -> Part:
    """The thought signature ``route`` (model m1) wrote for an answer's text, as the part that
    carries it back: Gemini returns an empty text part to carry one."""
    item = {"part": "text", "thoughtSignature": thought_signature("m1", "text", "I thought.")}
    return Part(role="assistant", data=reasoning_data(route, item),
                media_type=REASONING_MEDIA_TYPE, data_class="model_derived")


SAID_NOTHING = Part(role="assistant", content="", data_class="model_derived")


async def test_a_signed_empty_gemini_text_between_a_call_and_its_result_is_refused_on_its_route(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    # The route that wrote the signature sends the empty text back with it: a model turn of its
    # own between the call's turn and the result's, which Gemini answers with a 400 ("function
    # response turn comes immediately after a function call turn"). It was taken for left out,
    # as an empty text is, and sent. Another Gemini route leaves both out, and is sent it.
    question, call, _, result = files_alone().parts[:4]
    route = make_route(fake.endpoint("gemini"), "gemini")
    parts = [question, call, ASKS, gemini_text_signature(route), SAID_NOTHING, result]
    with pytest.raises(InvalidArgument) as info:
        await send(adapter, fake, "gemini", Envelope(parts=parts))
    assert info.value.field == "envelope.parts[1]"
    message = str(info.value)
    assert ("'call_a' (fetch) has its result, envelope.parts[5], sent after envelope.parts[4] "
            "on route 'r-gemini', which sends the empty answer text envelope.parts[4] back with "
            "the thought signature it wrote") in message, message
    assert "leave out the empty text and the reasoning part before it" in message
    assert fake.requests == []
    refused = refusals_for(WireProtocol.GEMINI, uncarried(Envelope(parts=parts)), "r-gemini")
    assert [r.field for r in refused] == ["envelope.parts[1]"]
    assert refusals_for(WireProtocol.GEMINI, uncarried(Envelope(parts=parts)), "other") == []
    sent, _ = await send(adapter, fake, "gemini", Envelope(parts=parts), id="other")
    assert fake.requests[-1].problem is None and sent.ok, fake.requests[-1].problem
    assert "thoughtSignature" not in json.dumps(fake.requests[-1].json)


async def test_a_signed_empty_gemini_text_in_the_calls_own_turn_goes_back_with_the_call(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    # After the call in its own answer's turn, the empty text is part of that model turn: the
    # result follows the turn, as Gemini reads it, and the signature goes back on the text.
    question, call, _, result = files_alone().parts[:4]
    route = make_route(fake.endpoint("gemini"), "gemini")
    parts = [question, call, gemini_text_signature(route), SAID_NOTHING, result, THEN]
    assert refusals_for(WireProtocol.GEMINI, uncarried(Envelope(parts=parts)), "r-gemini") == []
    sent, _ = await send(adapter, fake, "gemini", Envelope(parts=parts))
    assert fake.requests[-1].problem is None and sent.ok, fake.requests[-1].problem
    model_turn = fake.requests[-1].json["contents"][1]
    assert model_turn["role"] == "model"
    assert [sorted(p) for p in model_turn["parts"]] == [["functionCall"],
                                                        ["text", "thoughtSignature"]]


def test_a_gemini_result_without_an_id_answers_the_call_of_its_turn_in_every_refusal() -> None:
    # By name, a result answers the call of its name in the turn right before it (as Gemini
    # pairs a functionResponse): here call b, so call a has no result. It was taken for a's
    # (the first call of its name), and the refusal said "tool call 'a' (search) has its
    # result, envelope.parts[5], sent after envelope.parts[3]"; the refusals of unanswered and
    # of misplaced results now read one pairing.
    def search(call_id: str) -> Part:
        return Part(role="assistant", content="{}", tool_call_id=call_id, name="search",
                    data_class="model_derived")
    found = Part(role="tool", content="found", name="search", data_class="tool_result")
    parts = [Part(content="Search."), search("a"), Part(content="hm"),
             Part(role="assistant", content="ok", data_class="model_derived"), search("b"),
             found, Part(content="Go on.")]
    gemini = [r for r in unanswered_refusals(parts) if WireProtocol.GEMINI in r.protocols]
    assert [r.field for r in gemini] == ["envelope.parts[1]"], gemini
    assert "tool call 'a' (search) has no result" in gemini[0].message
    assert all("has its result" not in r.message for r in gemini)
    # Call b is answered there on Gemini only (the others need the id).
    (b,) = [r for r in unanswered_refusals(parts) if r.field == "envelope.parts[4]"]
    assert WireProtocol.GEMINI not in b.protocols


def test_a_result_without_an_id_that_no_call_of_its_name_is_left_for_is_refused_on_gemini(
) -> None:
    # Gemini pairs a result without an id with a call of its function's name (the others need
    # the id, and refuse it for that): one result per call, the call's empty result included
    # when the files its tool returned alone answer it.
    question, call_a, call_b, result_a, pdf_a, png_b, _ = files_alone().parts
    fetch, shot = (Part(role="tool", content="again", name=n, data_class="tool_result")
                   for n in ("fetch", "shot"))
    answered = [question, call_a, call_b, result_a, pdf_a, png_b]  # call_b: its image alone
    assert unanswered_refusals(answered) == []
    for parts, index, why in (
            ([question, fetch, call_a, result_a], 1, "no tool call of that name comes before"),
            ([*answered, fetch], 6, "each call of that name before it has its result already"),
            ([*answered, shot], 6, "each call of that name before it has its result already")):
        (refusal,) = unanswered_refusals(parts)
        assert refusal.protocols == {WireProtocol.GEMINI}, parts
        assert refusal.field == f"envelope.parts[{index}]" and why in refusal.message
    # Taken by a call of its name that no result of its id answers, it is that call's result
    # there: only the call is refused, and not on Gemini.
    (refusal,) = unanswered_refusals([question, call_a, fetch, THEN])
    assert refusal.field == "envelope.parts[1]" and WireProtocol.GEMINI not in refusal.protocols


def test_a_calls_files_alone_stand_for_its_result_in_its_own_turn_only() -> None:
    # The file of a call no tool part answers is that call's result, where the file stands
    # among the turn's results; a file of that call in a later turn's results is no result of
    # it (that turn's calls are others), and is sent after those results as any other.
    calls = [Part(role="assistant", content="{}", tool_call_id=f"call_{c}", name="f",
                  data_class="model_derived") for c in "abc"]
    shot, later = (Part(data=d, media_type=t, data_class="tool_result", provenance="call_b")
                   for d, t in ((PNG, "image/png"), (PDF, "application/pdf")))
    fetched = Part(role="tool", content="fetched", tool_call_id="call_a", name="f",
                   data_class="tool_result", provenance="call_a")
    done = Part(role="tool", content="done", tool_call_id="call_c", name="f",
                data_class="tool_result", provenance="call_c")
    parts = [Part(content="Go."), calls[0], calls[1], shot, fetched, Part(content="Again."),
             calls[2], done, later]
    assert results_of_files_alone(parts) == {2: (3,)}
    order = wire_order(parts)
    assert [i for i, _ in order] == [0, 1, 2, 2, 4, 3, 5, 6, 7, 8]
    lacking = order[3][1]
    assert (lacking.role, lacking.content, lacking.tool_call_id, lacking.name) == (
        "tool", "", "call_b", "f")
    assert unanswered_refusals(parts) == []
    # Without its file, call_b has no result: refused on every protocol.
    (refusal,) = unanswered_refusals([p for p in parts if p is not shot])
    assert refusal.field == "envelope.parts[2]" and len(refusal.protocols) == 4


def test_a_gemini_result_that_names_its_function_answers_the_call_there_only() -> None:
    # Gemini matches a functionResponse to its call by the function's name: a tool part with
    # the name and no tool_call_id answers the call on Gemini (docs/adapters.md), where the
    # refusal of unanswered calls took it for none and refused a request Gemini takes.
    call = Part(role="assistant", content='{"city": "Paris"}', tool_call_id="c1",
                name="get_weather", data_class="model_derived")
    result = Part(role="tool", content='{"t": 20}', name="get_weather", provenance="c1",
                  data_class="tool_result")
    parts = [Part(content="Weather in Paris?"), call, result,
             Part(role="assistant", content="It is 20C.", data_class="model_derived"),
             Part(content="And tomorrow?")]
    (refusal,) = unanswered_refusals(parts)
    assert WireProtocol.GEMINI not in refusal.protocols and len(refusal.protocols) == 3
    # One result answers one call: a second call of the name is still unanswered on Gemini.
    again = Part(role="assistant", content='{"city": "Rome"}', tool_call_id="c2",
                 name="get_weather", data_class="model_derived")
    refusals = unanswered_refusals([*parts[:2], again, *parts[2:]])
    assert [r.field for r in refusals] == ["envelope.parts[1]", "envelope.parts[2]"]
    assert [WireProtocol.GEMINI in r.protocols for r in refusals] == [False, True]


# -- the Responses API ---------------------------------------------------------------------


CONVERSATION = Envelope(
    parts=[
        Part(role="system", content="You are terse."),
        Part(content="Find papers on failover."),
        Part(role="assistant", content='{"q": "failover"}', tool_call_id="call_1",
             name="search", data_class="model_derived"),
        Part(role="tool", content='{"hits": 2}', tool_call_id="call_1", name="search",
             data_class="tool_result"),
        Part(role="assistant", content="Two hits.", data_class="model_derived"),
        Part(content="Summarise them."),
        Part(data=PNG, media_type="image/png"),
    ],
    tools=[ToolSpec(name="search", description="web search",
                    parameters={"type": "object", "properties": {"q": {"type": "string"}}})],
    params={"tool_choice": "auto", "temperature": 0.2},
    max_output_tokens=300,
)


async def test_a_responses_request_sends_the_whole_conversation_and_stores_nothing(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    result, _ = await send(adapter, fake, "openai_responses", CONVERSATION)
    assert result.ok
    (req,) = fake.requests
    body = req.json
    assert req.path == "/v1/responses" and body["store"] is False
    assert body["instructions"] == "You are terse." and body["max_output_tokens"] == 300
    assert body["tool_choice"] == "auto" and body["temperature"] == 0.2
    assert body["tools"] == [{"type": "function", "name": "search", "description": "web search",
                              "parameters": CONVERSATION.tools[0].parameters}]
    assert [i["type"] for i in body["input"]] == [
        "message", "function_call", "function_call_output", "message", "message"]
    assert body["input"][1] == {"type": "function_call", "call_id": "call_1", "name": "search",
                                "arguments": '{"q": "failover"}'}
    assert body["input"][2] == {"type": "function_call_output", "call_id": "call_1",
                                "output": '{"hits": 2}'}
    last = body["input"][4]
    assert last["role"] == "user" and [c["type"] for c in last["content"]] == [
        "input_text", "input_image"]
    assert "include" not in body  # no reasoning asked for


@pytest.mark.parametrize("param", ["previous_response_id", "conversation", "background"])
async def test_provider_held_conversation_state_is_refused_with_the_reason(
        adapter: HttpAdapter, fake: FakeProvider, param: str) -> None:
    env = Envelope(parts=[Part(content="Go on.")], params={param: "resp_123"})
    with pytest.raises(InvalidArgument) as info:
        await send(adapter, fake, "openai_responses", env)
    assert info.value.field == f"envelope.params.{param}"
    if param != "background":
        assert "failover" in str(info.value) or "no other route" in str(info.value)
    assert fake.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_usage_reports_cached_and_reasoning_tokens(
        adapter: HttpAdapter, fake: FakeProvider, stream: bool) -> None:
    fake.enqueue(Behavior(usage=(120, 40), cached_tokens=100, reasoning_tokens=25))
    env = Envelope(parts=[Part(content="Think.")], stream=stream)
    result, _ = await send(adapter, fake, "openai_responses", env)
    assert result.ok and result.finish_reason == "completed"
    u = result.usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens) == (
        120, 40, 100, 25)
    # Cost at the route's flat price: cached tokens are held at the input price (conservative).
    assert result.cost == (Decimal(120) * 3 + Decimal(40) * 15) / 1_000_000


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_every_protocol_reports_cached_and_reasoning_tokens_where_it_says_them(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    # Each in its own words (chat completions' *_tokens_details, Anthropic's
    # cache_read_input_tokens beside input_tokens, Gemini's cachedContentTokenCount and
    # thoughtsTokenCount beside candidatesTokenCount); the totals include the parts.
    fake.enqueue(Behavior(usage=(120, 40), cached_tokens=100, reasoning_tokens=25))
    result, _ = await send(adapter, fake, protocol, Envelope(parts=[Part(content="Hi.")],
                                                              stream=stream))
    assert result.ok and result.usage is not None
    u = result.usage
    reasoning = None if protocol == "anthropic" else 25  # Anthropic's usage does not say it
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens) == (
        120, 40, 100, reasoning)
    # Where the answer says nothing of them, they are not reported (None, not 0).
    fake.enqueue(Behavior(usage=(12, 4)))
    plain, _ = await send(adapter, fake, protocol, Envelope(parts=[Part(content="Hi.")],
                                                            stream=stream))
    assert plain.usage is not None
    assert (plain.usage.cached_tokens, plain.usage.reasoning_tokens) == (
        (0, 0) if protocol == "openai_responses" else (None, None))


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_items_are_carried_back_to_the_route_that_wrote_them_only(
        adapter: HttpAdapter, fake: FakeProvider, stream: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    fake.enqueue(Behavior(reasoning="Margins first, then revenue."))
    ask = Part(content="Compare the margins.")
    env = Envelope(parts=[ask], params={"reasoning": {"effort": "low"}}, stream=stream)
    first, _ = await send(adapter, fake, "openai_responses", env)
    assert first.ok and fake.requests[0].json["include"] == ["reasoning.encrypted_content"]
    assert len(first.reasoning) == 1
    answer = output_parts(first, "att-1")
    assert answer[0].media_type == REASONING_MEDIA_TYPE and answer[0].role == "assistant"
    assert answer[0].data_class == "model_derived" and answer[0].provenance == "att-1"
    assert "".join(p.content for p in answer) == first.text
    follow = Envelope(parts=[ask, *answer, Part(content="And revenue?")], stream=stream)

    # The same route: the item goes back as the provider returned it (the fake reads it back
    # only for the model it was written for).
    again, _ = await send(adapter, fake, "openai_responses", follow)
    assert again.ok and again.notes == ()
    sent = fake.requests[-1].json["input"]
    assert [i.get("type") for i in sent] == ["message", "reasoning", "message", "message"]
    assert sent[1]["encrypted_content"].startswith("enc:m1:")
    # Another route (another model, so another account could be behind it) and another
    # protocol: the item is left out, with a note; the conversation goes on.
    with caplog.at_level(logging.INFO, logger="ledger.adapters"):
        other, _ = await send(adapter, fake, "openai_responses", follow, id="other",
                              model="m2")
    assert other.ok and fake.requests[-1].problem is None
    assert "reasoning" not in [i.get("type") for i in fake.requests[-1].json["input"]]
    (note,) = other.notes
    assert "envelope.parts[1]" in note and "route 'r-openai_responses'" in note
    assert note in caplog.text
    for protocol in ("openai", "anthropic", "gemini"):
        moved, _ = await send(adapter, fake, protocol, follow)
        assert moved.ok and len(moved.notes) == 1 and fake.requests[-1].problem is None


@pytest.mark.parametrize("stream", [False, True])
async def test_an_incomplete_response_is_a_failure_fact_not_an_answer(
        adapter: HttpAdapter, fake: FakeProvider, stream: bool) -> None:
    fake.enqueue(Fault.INCOMPLETE)
    env = Envelope(parts=[Part(content="Write a long report.")], stream=stream,
                   max_output_tokens=7)
    result, _ = await send(adapter, fake, "openai_responses", env)
    assert not result.ok and result.text == ""
    obs = result.observation
    assert obs.status == 200 and obs.transport is None
    assert obs.phase is Phase.AFTER_HEADERS  # streamed too: response.incomplete is the whole
    body = json.loads(obs.body)
    assert body["status"] == "incomplete" and body["error"]["code"] == "max_output_tokens"
    assert "raise max_output_tokens" in obs.message
    assert result.usage is not None  # it was billed
    fact = classify(obs, preset("failure-domain"))
    assert fact.provider_code == "max_output_tokens" and not fact.moves_on
    # Chat completions marks the same stop per choice: an answer that finished at the limit.
    fake.enqueue(Fault.INCOMPLETE)
    chat, _ = await send(adapter, fake, "openai", env)
    assert chat.ok and chat.finish_reason == "length"


async def test_a_failed_response_body_is_a_provider_failure(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    fake.enqueue(Fault.ERROR_EVENT)
    result, _ = await send(adapter, fake, "openai_responses", Envelope(parts=[Part(content="x")]))
    obs = result.observation
    assert not result.ok and (obs.status, obs.phase) == (200, Phase.AFTER_HEADERS)
    assert json.loads(obs.body)["error"]["code"] == "server_error"


async def test_an_error_event_in_a_responses_stream_is_a_provider_failure(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    delta = {"type": "response.output_text.delta", "item_id": "m", "output_index": 0,
             "content_index": 0, "delta": "Half an answer"}
    error = {"type": "error", "code": "rate_limit_exceeded",
             "message": "Rate limit reached for requests", "param": None, "sequence_number": 2}
    body = (f"event: response.output_text.delta\ndata: {json.dumps(delta)}\n\n"
            f"event: error\ndata: {json.dumps(error)}\n\n").encode()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body,)))
    result, _ = await send(adapter, fake, "openai_responses",
                           Envelope(parts=[Part(content="x")], stream=True))
    obs = result.observation
    assert not result.ok and obs.phase is Phase.MID_STREAM and obs.effective_output
    assert result.partial_text == "Half an answer"
    fact = classify(obs, preset("failure-domain"))
    assert fact.category is Category.RATE_LIMIT and fact.provider_code == "rate_limit_exceeded"
