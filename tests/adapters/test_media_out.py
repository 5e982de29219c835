"""Images a model returns, on the wire and back, over real HTTP on loopback.

Gemini's ``inlineData`` parts, the Responses API's ``image_generation_call`` items and the
chat-completions gateways' ``message.images`` become ``AdapterResult.media`` and, through
``output_parts``, assistant binary parts of class ``model_derived`` (streaming included: an
image arrives whole, as the protocol frames it). Anthropic's Messages API returns no images.
Sent again, a model's image goes back in each protocol's own way: Gemini in the ``model`` turn,
the others (whose APIs take files in user messages only) in a user message after a line that
says whose it is, with a note; the fake refuses it anywhere else, as the providers do.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from ledger.adapters import HttpAdapter, TextDelta
from ledger.adapters.contract import (
    ASSISTANT_MEDIA_TEXT,
    MalformedPayload,
    OutputMedia,
    codec_for,
)
from ledger.adapters.runner import output_parts, to_send_result
from ledger.domain.envelope import MODEL_DERIVED, Envelope, Part, ToolSpec
from ledger.domain.facts import WireProtocol
from ledger.domain.media import MediaKind
from ledger.errors import InvalidArgument
from ledger.testing import Behavior, FakeProvider, Fault
from tests.media import gif, jpeg, png, webp

from .conftest import PROFILE, PROTOCOLS, make_route

pytestmark = pytest.mark.anyio

PNG = png(96, 64)
IMAGE_OUT = ["openai", "openai_responses", "gemini"]  # the protocols that return images
ASK = Part(content="Draw the revenue chart.")


async def send(adapter: HttpAdapter, fake: FakeProvider, protocol: str, envelope: Envelope,
               ) -> tuple[Any, list[Any]]:
    events: list[Any] = []
    result = await adapter.send(make_route(fake.endpoint(protocol), protocol), envelope,
                                profile_id=PROFILE, on_event=events.append)
    return result, events


# -- an image the model returns ---------------------------------------------------------------


@pytest.mark.parametrize("protocol", IMAGE_OUT)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_image_the_model_returns_is_an_assistant_part_of_the_answer(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    fake.enqueue(Behavior(image_out=("image/png", PNG)))
    result, events = await send(adapter, fake, protocol, Envelope(parts=[ASK], stream=stream))
    assert result.ok, result.observation
    assert result.media == (OutputMedia("image/png", PNG),) and result.effective_output
    assert result.text == Behavior().text and result.notes == ()
    if stream:
        # Text streams as it comes; the image is no stream event: it is a part of the answer.
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == result.text
        assert all(isinstance(e, TextDelta) for e in events)
    text, image = output_parts(result, "a-1")
    assert (text.content, text.media_type) == (result.text, None)
    assert (image.role, image.data_class, image.provenance) == ("assistant", MODEL_DERIVED,
                                                                 "a-1")
    assert (image.kind, image.media_type, image.data) == (MediaKind.IMAGE, "image/png", PNG)
    # The Run records every part's hash as the Attempt's provenance, the image's included.
    assert to_send_result(result, "a-1").provenance == (text.content_hash, image.content_hash)


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_returns_no_images(
        adapter: HttpAdapter, fake: FakeProvider, stream: bool) -> None:
    fake.enqueue(Behavior(image_out=("image/png", PNG)))  # the fake has no way to send one
    result, _ = await send(adapter, fake, "anthropic", Envelope(parts=[ASK], stream=stream))
    assert result.ok and result.media == ()
    assert [p.media_type for p in output_parts(result, "a-1")] == [None]


@pytest.mark.parametrize(("protocol", "media_type", "data"), [
    ("gemini", "image/jpeg", jpeg(320, 200)),
    ("openai", "image/webp", webp(80, 40)),
    ("openai_responses", "image/jpeg", jpeg(320, 200)),  # its output_format says jpeg
    ("openai_responses", "image/gif", gif(8, 8)),  # no output_format: told by the bytes
])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_media_type_comes_from_the_wire(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, media_type: str, data: bytes,
        stream: bool) -> None:
    fake.enqueue(Behavior(image_out=(media_type, data)))
    result, _ = await send(adapter, fake, protocol, Envelope(parts=[ASK], stream=stream))
    assert result.ok and result.media == (OutputMedia(media_type, data),)


@pytest.mark.parametrize("protocol", IMAGE_OUT)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_image_only_answer_holds_no_empty_text_part(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    fake.enqueue(Behavior(text="", image_out=("image/png", PNG)))
    result, _ = await send(adapter, fake, protocol, Envelope(parts=[ASK], stream=stream))
    assert result.ok and result.text == "" and result.effective_output
    # An empty text block is what Anthropic refuses when the conversation goes on there.
    (image,) = output_parts(result, "a-1")
    assert image.data == PNG


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", IMAGE_OUT)
async def test_a_streamed_image_larger_than_a_megabyte_arrives_whole(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    # One event carries the whole image as base64 (4 MiB here): more than the SSE line bound
    # the parser had before images came back.
    big = png(8, 8) + bytes(range(256)) * (3 * 4096)
    fake.enqueue(Behavior(image_out=("image/png", big)))
    result, _ = await send(adapter, fake, protocol, Envelope(parts=[ASK], stream=stream))
    assert result.ok, result.observation
    assert [m.data for m in result.media] == [big]


@pytest.mark.parametrize(("protocol", "image_out", "says"), [
    ("gemini", ("audio/wav", b"RIFF\x00\x00\x00\x00WAVEfmt "), "carries application/pdf"),
    ("gemini", ("image/png", jpeg()), "not image/png"),
    ("openai_responses", ("image/png", jpeg()), "not image/png"),
    ("openai", ("image/svg+xml", b"<svg/>"), "carries application/pdf"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_file_the_ledger_cannot_carry_is_left_out_with_a_note(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, image_out: tuple[str, bytes],
        says: str, stream: bool) -> None:
    fake.enqueue(Behavior(image_out=image_out))
    result, _ = await send(adapter, fake, protocol, Envelope(parts=[ASK], stream=stream))
    # The rest of the answer stands; the file is not a part, and the result says why.
    assert result.ok and result.media == () and result.text == Behavior().text
    (note,) = result.notes
    assert "left out of the answer" in note and says in note, note
    assert [p.media_type for p in output_parts(result, "a-1")] == [None]


@pytest.mark.parametrize(("protocol", "body"), [
    ("gemini", {"candidates": [{"content": {"role": "model", "parts": [
        {"inlineData": {"mimeType": "image/png", "data": "@@not base64@@"}}]},
        "finishReason": "STOP"}]}),
    ("openai_responses", {"status": "completed", "output": [
        {"type": "image_generation_call", "id": "ig_1", "status": "completed",
         "result": "@@not base64@@"}]}),
    ("openai", {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "", "images": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}}]}),
])
def test_an_image_that_is_not_base64_is_no_answer(protocol: str, body: dict[str, Any]) -> None:
    with pytest.raises(MalformedPayload, match="base64"):
        codec_for(WireProtocol(protocol)).parse_reply(body)


def test_gemini_file_data_is_a_link_and_only_an_https_one() -> None:
    codec = codec_for(WireProtocol.GEMINI)
    reply = codec.parse_reply({"candidates": [{"content": {"role": "model", "parts": [
        {"fileData": {"mimeType": "image/png", "fileUri": "https://files.example/f/1"}},
        {"file_data": {"mime_type": "image/png", "file_uri": "gs://bucket/out.png"}}]},
        "finishReason": "STOP"}]})
    assert reply.media == [OutputMedia("image/png", url="https://files.example/f/1")]
    (note,) = reply.notes
    assert "parts[1].fileData" in note and "https://" in note


def test_a_failed_image_generation_call_is_a_note_not_an_image() -> None:
    reply = codec_for(WireProtocol.OPENAI_RESPONSES).parse_reply({"status": "completed",
        "output": [{"type": "image_generation_call", "id": "ig_1", "status": "failed",
                    "result": None}]})
    assert reply.media == [] and "ended failed result" in reply.notes[0]


async def test_a_stream_cut_after_its_image_is_no_answer(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    # Every content event (the image's output_item.done included), then a cut before
    # response.completed: the answer never finished, and its image is not one.
    fake.enqueue(Behavior(fault=Fault.STREAM_CUT, fault_after_content=True,
                          image_out=("image/png", PNG)))
    result, _ = await send(adapter, fake, "openai_responses",
                           Envelope(parts=[ASK], stream=True))
    assert not result.ok and result.media == ()


# -- asking for images -------------------------------------------------------------------------


@pytest.mark.parametrize(("protocol", "params", "sent"), [
    # Gemini's image models: generationConfig.responseModalities (passed through as given).
    ("gemini", {"responseModalities": ["TEXT", "IMAGE"]},
     lambda body: body["generationConfig"]["responseModalities"] == ["TEXT", "IMAGE"]),
    # The chat-completions gateways: a top-level modalities list.
    ("openai", {"modalities": ["image", "text"]},
     lambda body: body["modalities"] == ["image", "text"]),
    # The Responses API: the image_generation built-in tool, after the host's function tools.
    ("openai_responses", {"tools": [{"type": "image_generation", "partial_images": 1}]},
     lambda body: [t["type"] for t in body["tools"]] == ["function", "image_generation"]
     and body["tools"][1]["partial_images"] == 1),
])
async def test_asking_for_images_is_each_protocols_own_parameter(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, params: dict[str, Any],
        sent: Any) -> None:
    fake.enqueue(Behavior(image_out=("image/png", PNG)))
    envelope = Envelope(parts=[ASK], params=params, stream=True,
                        tools=[ToolSpec(name="lookup", description="Look a figure up.")])
    result, _ = await send(adapter, fake, protocol, envelope)
    assert result.ok and result.media == (OutputMedia("image/png", PNG),)
    assert sent(fake.requests[-1].json)


@pytest.mark.parametrize(("tools", "field"), [
    ({"type": "image_generation"}, "envelope.params.tools"),
    ([{"type": "function", "name": "lookup"}], "envelope.params.tools[0]"),
    (["image_generation"], "envelope.params.tools[0]"),
])
async def test_a_responses_params_tools_holds_built_in_tools_only(
        adapter: HttpAdapter, fake: FakeProvider, tools: Any, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        await send(adapter, fake, "openai_responses",
                   Envelope(parts=[ASK], params={"tools": tools}))
    assert info.value.field == field and "Envelope.tools" in str(info.value)
    assert fake.requests == []


# -- the model's image, sent again ------------------------------------------------------------


def conversation(image: Part) -> Envelope:
    return Envelope(parts=[
        ASK,
        Part(role="assistant", content="Here it is.", data_class=MODEL_DERIVED,
             provenance="a-1"),
        image,
        Part(content="Make the bars blue."),
    ])


def model_image(**kw: Any) -> Part:
    return Part(**{"role": "assistant", "data": PNG, "media_type": "image/png",
                   "data_class": MODEL_DERIVED, "provenance": "a-1", **kw})


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_models_image_goes_back_in_each_protocols_own_way(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    envelope = conversation(model_image()).model_copy(update={"stream": stream})
    result, _ = await send(adapter, fake, protocol, envelope)
    assert result.ok, result.observation
    (req,) = fake.requests
    assert req.problem is None  # the provider would take it as sent
    (media,) = req.media
    assert media.data == PNG and media.media_type == "image/png"
    body = req.json
    if protocol == "gemini":
        # Native: the model's turn holds its text and its image.
        assert media.role == "model" and result.notes == ()
        assert [c["role"] for c in body["contents"]] == ["user", "model", "user"]
        assert [list(p) for p in body["contents"][1]["parts"]] == [["text"], ["inline_data"]]
        return
    # The others take files in user messages only: a user message, after a line saying whose.
    assert media.role == "user"
    (note,) = result.notes
    assert "envelope.parts[2]: an image the model returned" in note
    assert "user messages only" in note
    sent = json.dumps(body)
    assert sent.index(json.dumps(ASSISTANT_MEDIA_TEXT)) < sent.index(
        base64.b64encode(PNG).decode())
    if protocol == "openai":
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "user"]
    elif protocol == "openai_responses":
        assert [i.get("role") for i in body["input"]] == ["user", "assistant", "user"]
    else:  # anthropic: the note, the image and the next question are one user message
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
        assert [b["type"] for b in body["messages"][2]["content"]] == ["text", "image", "text"]


@pytest.mark.parametrize("protocol", ["openai_responses", "anthropic", "gemini"])
async def test_a_models_image_link_goes_back_as_a_link(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    link = model_image(data=None, url="https://files.example/f/1.png")
    result, _ = await send(adapter, fake, protocol, conversation(link))
    assert result.ok and fake.requests[-1].problem is None
    (media,) = fake.requests[-1].media
    assert media.url == link.url
    assert media.role == ("model" if protocol == "gemini" else "user")


@pytest.mark.parametrize(("protocol", "body", "says"), [
    # What a codec must never send: the providers refuse a file in an assistant message.
    ("openai", {"model": "m", "messages": [{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                   + base64.b64encode(PNG).decode()}}]}]},
     "only allowed for messages with role 'user'"),
    ("openai_responses", {"model": "m", "input": [{"type": "message", "role": "assistant",
                                                   "content": [{"type": "input_image",
                                                                "image_url": "https://x/a.png"}]}]},
     "holds output_text"),
    ("anthropic", {"model": "m", "max_tokens": 10, "messages": [{"role": "assistant", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}]}]},
     "belong in user messages"),
])
async def test_the_fake_refuses_a_file_in_an_assistant_message(
        fake: FakeProvider, protocol: str, body: dict[str, Any], says: str) -> None:
    path = {"openai": "/v1/chat/completions", "openai_responses": "/v1/responses",
            "anthropic": "/v1/messages"}[protocol]
    async with httpx.AsyncClient() as client:
        response = await client.post(fake.base_url + path, json=body)
    assert response.status_code == 400 and says in response.json()["error"]["message"]
