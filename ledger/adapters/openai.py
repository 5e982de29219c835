"""OpenAI-compatible chat completions (``POST {endpoint}/chat/completions``).

``Route.endpoint`` is the base URL including the version, as every OpenAI-compatible client
configures it (``https://api.openai.com/v1``, ``https://openrouter.ai/api/v1``); an endpoint that
already ends in ``/chat/completions`` is used as is. The credential goes in
``Authorization: Bearer``.

Envelope mapping: parts become messages in order (``system``, ``user``, ``assistant``, ``tool``).
An assistant part with ``tool_call_id`` is a tool call the model made earlier (``name`` = the
tool, ``content`` = its JSON arguments); consecutive ones form one assistant message. A ``tool``
part is a tool result for ``tool_call_id``. A trailing assistant part (prefill) is sent as the last
message: servers that continue it do, others answer with a 400 that is reported as observed.
A turn's tool results are sent first, a ``tool`` message for each call right after the
assistant's, then the files the tools returned, in a user message (the API refuses anything
between the tool calls and their results; :func:`~ledger.adapters.contract.wire_order`). A
``tool`` message carries text only: the result of a call whose tool returned files alone (an empty
``tool`` part, or none: the call gets one) is :data:`~ledger.adapters.contract.TOOL_FILES_TEXT`,
with a note, and the files follow as any tool's do
(:func:`~ledger.domain.carried.files_alone`).
``max_output_tokens`` is sent as ``max_tokens``, or as ``max_completion_tokens`` when the route's
``Capabilities.parameters`` lists that name and not ``max_tokens``. Streaming asks for
``stream_options.include_usage`` (so cost is known) unless the route's declared parameters omit
``stream_options``.

Images and documents (binary parts) join the user message before them as content items:
an image as ``image_url`` (a ``data:`` URL of its bytes, or its ``https://`` link), a PDF as
``file`` (``filename``, ``file_data``: a ``data:`` URL; chat completions takes no PDF link), a
plain-text document as a ``text`` item holding its text. An image or a document a model
returned (an assistant binary part) cannot be in an assistant message (the API takes images in
user messages only): it is sent in a user message of its own, after the text
:data:`~ledger.adapters.contract.ASSISTANT_MEDIA_TEXT`, with a note. Reasoning items another
protocol produced are left out, with a note.

OpenAI's chat completions returns no images. The OpenAI-compatible gateways that serve image
models (OpenRouter, Vercel's AI Gateway; ``modalities: ["image", "text"]`` in
``Envelope.params``) return them as ``message.images`` (``delta.images`` in a stream, each entry
one whole image): ``image_url`` items whose ``data:`` URL becomes one of the answer's images
(``AdapterResult.media``); a link, which names no media type, is left out with a note.

Answers: ``message.content`` and ``message.refusal`` (what a model that declines says, with
``content`` null) are the answer's text, in that order; in a stream ``delta.content`` and
``delta.refusal`` are text deltas.

Stream completion: ``data: [DONE]`` terminates. A body that ends cleanly without it is complete
only if every choice seen carried a ``finish_reason``; otherwise it was cut.
"""

from __future__ import annotations

import json
from typing import Any

from ledger.adapters.contract import (
    ASSISTANT_MEDIA_TEXT,
    MAX_TOOL_CALLS,
    TOOL_FILES_TEXT,
    Codec,
    MalformedPayload,
    ProviderErrorPayload,
    Reply,
    StreamEvent,
    StreamState,
    TextDelta,
    ToolCall,
    ToolCallProposal,
    Usage,
    WireRequest,
    assistant_media_note,
    check_params,
    detail_count,
    document_text,
    dropped_reasoning,
    error_extras,
    join_url,
    made_up_call_id,
    media_of,
    optional_str,
    parse_json_event,
    provider_message,
    refuse_held,
    register_codec,
    reported_usage,
    require_object,
    take_call,
    take_output_media,
    tool_files_note,
    unreadable_usage,
    wire_order,
)
from ledger.adapters.sse import SSEEvent
from ledger.domain.carried import (
    files_alone,
    require_answered,
    require_tool_result,
    tool_arguments,
)
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.media import MediaKind, data_url
from ledger.domain.values import Route


def _usage(value: Any) -> Usage | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return unreadable_usage(value)
    u = value
    keys = ("prompt_tokens", "completion_tokens")
    return reported_usage(
        u, keys[:1], keys[1:], required=keys,
        cached=detail_count(u.get("prompt_tokens_details"), "cached_tokens"),
        reasoning=detail_count(u.get("completion_tokens_details"), "reasoning_tokens"))


def _error(data: dict[str, Any]) -> ProviderErrorPayload:
    """An error object (a 2xx body, or a stream chunk) as the provider's failure.

    The usage and model beside it are kept, in a body and in a chunk alike: the call may be
    billed at that usage, and the model is the one that answered.
    """
    err = data.get("error")
    msg = err.get("message") if isinstance(err, dict) else err
    usage, model = error_extras(data, _usage)
    return ProviderErrorPayload(
        f"provider error: {provider_message(msg) if msg is not None else 'no message'}",
        json.dumps(data), usage=usage, model=model,
    )


def _content_text(value: Any, what: str) -> str:
    # Some compatible servers send content as a list of typed parts instead of a string.
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, dict) and isinstance(item.get("text"), str):
                out.append(item["text"])
        return "".join(out)
    raise MalformedPayload(f"{what} is neither a string nor a list of parts")


def _media_item(part: Part, index: int, route: Route) -> dict[str, Any]:
    """A user message's content item for an image or a document part."""
    kind, payload, link = media_of(part, index, route)
    mt = part.media_type or ""
    if kind is MediaKind.IMAGE:
        return {"type": "image_url", "image_url": {"url": link or data_url(mt, payload or b"")}}
    assert payload is not None  # media_of refused a document link: chat takes none
    if kind is MediaKind.PDF:
        return {"type": "file", "file": {"filename": part.name or "document.pdf",
                                          "file_data": data_url(mt, payload)}}
    # Chat completions has no plain-text document: its text is the content.
    return {"type": "text", "text": document_text(payload)}


def _take_images(into: Reply | StreamState, images: Any, where: str) -> None:
    """The images of an answer (``message.images``, ``delta.images``), into ``into.media``.

    Not OpenAI's own chat completions (which returns no image) but the extension
    OpenAI-compatible gateways serve image models with (OpenRouter, Vercel's AI Gateway): a
    list of ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``.
    """
    if images is None:
        return
    if not isinstance(images, list):
        raise MalformedPayload(f"{where} is not a list")
    for k, raw in enumerate(images):
        item = require_object(raw, f"{where}[{k}]")
        ref = item.get("image_url")
        url = require_object(ref, f"{where}[{k}].image_url").get("url") if isinstance(
            ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise MalformedPayload(f"{where}[{k}] has no image_url.url")
        if url[:5].lower() != "data:":
            # A link names no media type; the ledger would have to guess one.
            into.notes.append(f"{where}[{k}]: an image link the model returned is left out of "
                              "the answer: it names no media type (a data: URL does)")
            continue
        take_output_media(into, f"{where}[{k}]", None, url=url)


class OpenAICodec(Codec):
    """The OpenAI Chat Completions protocol (``/chat/completions``), as the module describes."""

    protocol = WireProtocol.OPENAI

    def build_request(self, route: Route, envelope: Envelope) -> WireRequest:
        """A Chat Completions request; InvalidArgument for parts the protocol cannot carry."""
        assert route.endpoint is not None  # checked by the engine before building
        endpoint = route.endpoint.rstrip("/")
        url = (
            endpoint
            if endpoint.endswith("/chat/completions")
            else join_url(endpoint, "chat/completions")
        )
        messages: list[dict[str, Any]] = []
        notes: list[str] = []
        files_only = files_alone(envelope.parts)
        for i, part in wire_order(envelope.parts, files_only):
            if part.role == "assistant" and part.tool_call_id:
                call = {
                    "id": part.tool_call_id,
                    "type": "function",
                    "function": {
                        "name": part.name,
                        "arguments": json.dumps(tool_arguments(part, i)),
                    },
                }
                last = messages[-1] if messages else None
                # One assistant message per turn: its text and its tool calls together.
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif part.role == "tool":
                require_tool_result(self.protocol, part, i)
                content = part.content
                if i in files_only:
                    # A tool message carries text only: the files go in the user message after
                    # the turn's results, and the result says so rather than nothing.
                    content = TOOL_FILES_TEXT
                    notes.append(tool_files_note(route, envelope.parts, i, files_only[i]))
                messages.append(
                    {"role": "tool", "tool_call_id": part.tool_call_id, "content": content}
                )
            elif part.kind is MediaKind.REASONING:
                notes.append(dropped_reasoning(route, part, i))
            elif part.media_type is not None and part.role == "assistant":
                # Chat completions carries images and files in user messages only ("Image URLs
                # are only allowed for messages with role 'user'"): a file the model returned
                # goes back in a user message of its own, after a line that says whose it is.
                messages.append({"role": "user", "content": [
                    {"type": "text", "text": ASSISTANT_MEDIA_TEXT},
                    _media_item(part, i, route)]})
                notes.append(assistant_media_note(route, part, i))
            elif part.media_type is not None:
                item = _media_item(part, i, route)
                last = messages[-1] if messages else None
                # An image or a document joins the user message before it (a question and its
                # attachment are one message); its own message otherwise.
                if last is not None and last["role"] == "user" and "name" not in last:
                    if isinstance(last["content"], str):
                        last["content"] = [{"type": "text", "text": last["content"]}]
                    last["content"].append(item)
                else:
                    messages.append({"role": "user", "content": [item]})
            else:
                msg: dict[str, Any] = {"role": part.role, "content": part.content}
                if part.name and part.role == "user":
                    msg["name"] = part.name
                messages.append(msg)
        require_answered(self.protocol, envelope.parts)
        check_params(route, envelope.params)
        body: dict[str, Any] = {"model": route.model, "messages": messages}
        body.update(envelope.params)
        declared = route.capabilities.parameters
        if envelope.max_output_tokens is not None:
            use_completion = (
                declared is not None
                and "max_completion_tokens" in declared
                and "max_tokens" not in declared
            )
            key = "max_completion_tokens" if use_completion else "max_tokens"
            body[key] = envelope.max_output_tokens
        if envelope.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters or {"type": "object", "properties": {}},
                    },
                }
                for t in envelope.tools
            ]
        if envelope.stream:
            body["stream"] = True
            if declared is None or "stream_options" in declared:
                body["stream_options"] = {"include_usage": True}
        headers = {"content-type": "application/json", "accept": "application/json"}
        if envelope.stream:
            headers["accept"] = "text/event-stream"
        # The legacy params["functions"] offers tools too (a compatible server may answer
        # them with tool_calls).
        return WireRequest(url=url, headers=headers, body=body, notes=tuple(notes),
                           offers_tools=bool(envelope.tools) or "functions" in envelope.params)

    def auth_headers(self, secret: str) -> dict[str, str]:
        """``Authorization: Bearer <secret>``."""
        return {"authorization": f"Bearer {secret}"}

    def parse_reply(self, data: Any) -> Reply:
        """A ``chat.completion`` body (its first choice); an error object raises."""
        obj = require_object(data, "response body")
        if "error" in obj and not obj.get("choices"):
            raise _error(obj)
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            raise MalformedPayload("choices is missing or empty")
        choice = require_object(choices[0], "choices[0]")
        message = require_object(choice.get("message"), "choices[0].message")
        reply = Reply(
            # A refusal (content null, refusal the model's words) is the answer's text, as
            # the Responses codec reads its refusal parts.
            text=_content_text(message.get("content"), "message.content")
            + (optional_str(message.get("refusal"), "message.refusal") or ""),
            usage=_usage(obj.get("usage")),
            model=optional_str(obj.get("model"), "model"),
            finish_reason=optional_str(choice.get("finish_reason"), "finish_reason"),
        )
        raw_calls = message.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise MalformedPayload("message.tool_calls is not a list")
        for j, rc in enumerate(raw_calls):
            c = require_object(rc, f"tool_calls[{j}]")
            fn = require_object(c.get("function"), f"tool_calls[{j}].function")
            name = optional_str(fn.get("name"), "function.name")
            if not name:
                raise MalformedPayload(f"tool_calls[{j}] has no function name")
            args = fn.get("arguments")
            take_call(reply, ToolCall(
                id=optional_str(c.get("id"), "tool_call.id") or made_up_call_id(),
                name=name,
                arguments_json=args if isinstance(args, str) else json.dumps(args or {}),
            ), f"tool_calls[{j}]")
        _take_images(reply, message.get("images"), "choices[0].message.images")
        return refuse_held(reply)

    def new_stream(self) -> StreamState:
        """An accumulator of ``chat.completion.chunk`` events, ended by ``data: [DONE]``."""
        return _OpenAIStream()


class _OpenAIStream(StreamState):
    def __init__(self) -> None:
        super().__init__()
        # tool-call fragments by index: [id, name, argument pieces]
        self._calls: dict[int, list[Any]] = {}
        self._emitted: set[int] = set()
        self._choices_open: set[int] = set()
        self._choices_finished: set[int] = set()

    def feed(self, event: SSEEvent) -> list[StreamEvent]:
        if event.data.strip() == "[DONE]":
            self.terminated = True
            return []
        data = parse_json_event(event)
        if "error" in data and not data.get("choices"):
            raise _error(data)
        model = optional_str(data.get("model"), "model")
        if model:
            self.model = model
        if data.get("usage") is not None:
            self.usage = _usage(data["usage"])
        choices = data.get("choices") or []
        if not isinstance(choices, list):
            raise MalformedPayload("choices is not a list")
        out: list[StreamEvent] = []
        for raw in choices:
            choice = require_object(raw, "choice")
            index = choice.get("index", 0)
            if not isinstance(index, int):
                raise MalformedPayload("choice.index is not an integer")
            self._choices_open.add(index)
            if index != 0:
                continue  # one answer per call; n > 1 is refused when building the request
            delta = choice.get("delta") or {}
            delta = require_object(delta, "choice.delta")
            text = _content_text(delta.get("content"), "delta.content") + (
                optional_str(delta.get("refusal"), "delta.refusal") or "")
            if text:
                self.content_seen = True
                self.text_parts.append(text)
                out.append(TextDelta(text))
            if delta.get("images"):
                # Each entry is one whole image (OpenRouter frames them so).
                _take_images(self, delta.get("images"), "delta.images")
                self.content_seen = True
            tcs = delta.get("tool_calls") or []
            if not isinstance(tcs, list):
                raise MalformedPayload("delta.tool_calls is not a list")
            for rtc in tcs:
                tc = require_object(rtc, "delta.tool_calls[]")
                ti = tc.get("index", 0)
                if not isinstance(ti, int):
                    raise MalformedPayload("tool_call.index is not an integer")
                if ti not in self._calls and len(self._calls) >= MAX_TOOL_CALLS:
                    raise MalformedPayload(
                        f"the answer proposes more than {MAX_TOOL_CALLS} tool calls "
                        "(MAX_TOOL_CALLS)")
                slot = self._calls.setdefault(ti, [None, None, []])
                if tc.get("id"):
                    slot[0] = optional_str(tc.get("id"), "tool_call.id")
                fn = tc.get("function") or {}
                fn = require_object(fn, "tool_call.function")
                if fn.get("name"):
                    slot[1] = optional_str(fn.get("name"), "function.name")
                piece = optional_str(fn.get("arguments"), "function.arguments")
                if piece:
                    slot[2].append(piece)
                self.content_seen = True
            finish = optional_str(choice.get("finish_reason"), "finish_reason")
            if finish:
                self.finish_reason = finish
                self._choices_finished.add(index)
                out.extend(self._flush())
        if self._choices_open and self._choices_open <= self._choices_finished:
            self.completed = True
        return out

    def _flush(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for ti in sorted(self._calls):
            if ti in self._emitted:
                continue
            cid, name, pieces = self._calls[ti]
            if not name:
                raise MalformedPayload(f"tool call {ti} ended without a function name")
            self._emitted.add(ti)
            # Refused calls are held: the usage chunk comes after the finish_reason.
            call = take_call(self, ToolCall(id=cid or made_up_call_id(), name=name,
                                            arguments_json="".join(pieces)), f"tool call {ti}")
            if call is not None:
                out.append(ToolCallProposal(call))
        return out

    def end(self) -> list[StreamEvent]:
        return self._flush()


CODEC = OpenAICodec()
register_codec(CODEC)

__all__ = ["CODEC", "OpenAICodec"]
