"""OpenAI's Responses API (``POST {endpoint}/responses``), ``WireProtocol.OPENAI_RESPONSES``.

``Route.endpoint`` is the base URL including the version, as for chat completions
(``https://api.openai.com/v1``); an endpoint that already ends in ``/responses`` is used as is.
The credential goes in ``Authorization: Bearer``.

No conversation state at the provider. Every request sends the whole conversation as ``input``
items with ``store: false`` (unless ``Envelope.params`` sets ``store``), so a failover can send
the same input to any other route. ``previous_response_id`` and ``conversation``, which make
the provider hold the conversation, are refused with :class:`~ledger.errors.InvalidArgument`
(another route could not continue it), and so is ``background`` (the adapter does not poll).

Envelope mapping: ``system`` parts are joined into ``instructions``. Consecutive user parts form
one ``message`` item whose content is ``input_text``, ``input_image`` (``image_url``: a
``data:`` URL of the bytes or the ``https://`` link, ``detail: auto``) and ``input_file``
(``filename`` and ``file_data``, a ``data:`` URL, or ``file_url`` for a link) items; a
plain-text document is an ``input_text`` item holding its text. An assistant part is an
assistant ``message`` (its text); an assistant part with ``tool_call_id`` a ``function_call``
item (``call_id``, ``name``, ``arguments`` as JSON text); a ``tool`` part a
``function_call_output`` (``call_id``, ``output``); a turn's ``function_call_output`` items come
first, then the files its tools returned, in a user message
(:func:`~ledger.adapters.contract.wire_order`, as on every protocol); a call whose tool returned
files alone (an empty ``tool`` part, or none) has them as its ``output``, a list of those items
(:func:`~ledger.domain.carried.files_alone`). An image or a document a
model returned (an assistant binary part) cannot go back as it came: an assistant message holds
``output_text`` only, and an ``image_generation_call`` item is read back by its id from the
provider's store, which ``store: false`` leaves empty (and another route's image has no such
id); it is sent in a user message of its own, after the text
:data:`~ledger.adapters.contract.ASSISTANT_MEDIA_TEXT`, with a note. A reasoning item (an
earlier answer's, as the ledger carried it back) is sent as the provider returned it when it
came from this very route, and left out, with a note, otherwise: encrypted reasoning is readable
only by the account and model that wrote it. Tools are ``{"type": "function",
"name", "description", "parameters"}``, followed by the provider's built-in tools a host names
in ``params["tools"]`` (``[{"type": "image_generation"}]`` asks for images; a function tool
there is refused, :func:`~ledger.domain.carried.builtin_tools`, before any Attempt in a Run: it
belongs in ``Envelope.tools``; disclosure preflight counts a ``custom``
tool's description as ``tool_description`` data and an ``mcp`` tool's server as a recipient the
grant must approve, :func:`~ledger.decide.preflight.param_disclosures`); ``max_output_tokens``
is sent as is; other
parameters (``tool_choice``, ``reasoning``, ``temperature``, ``text``, ``include``, ...) pass
through. With
``params["reasoning"]`` and no ``include``, the request asks for
``include: ["reasoning.encrypted_content"]``, so the reasoning can be carried to the next turn
without being stored.

Answers: the ``output`` items' ``output_text`` (and ``refusal``) text, ``function_call`` items
as tool calls (a ``custom_tool_call`` item, a ``custom`` tool's call with free-text input, makes
the answer ``malformed_event``: a tool call the ledger carries has a JSON object for arguments,
and dropping the item would pass the answer off as plain text), ``reasoning`` items that
carry ``encrypted_content`` as reasoning to carry back, ``image_generation_call`` items (the
``image_generation`` tool's) as the answer's images (their base64 ``result``; the media type
from ``output_format``, else from the bytes' signature); usage ``input_tokens``
(``input_tokens_details.cached_tokens`` included) and ``output_tokens``
(``output_tokens_details.reasoning_tokens`` included); the finish is the response's ``status``.
A response whose status is ``failed`` or ``incomplete`` is a failure, not an answer: its
``error`` (``incomplete_details.reason`` for an incomplete one, e.g. ``max_output_tokens``) is
reported as the provider's error object, so the classifier reads ``error.code``.

Streams (no ``[DONE]``; each event's ``type`` says what it is): ``response.output_text.delta``
(and ``response.refusal.delta``) is text; ``response.output_item.added`` opens a function call,
``response.function_call_arguments.delta`` / ``.done`` fill its arguments and
``response.output_item.done`` completes it (then it is proposed) or hands over a reasoning
item or a generated image (whole: ``response.image_generation_call.partial_image`` previews
are not the answer); ``response.completed`` terminates with the final usage; ``response.failed``
and ``response.incomplete`` are provider failures holding the whole response, observed as the
same whole body is (``ProviderErrorPayload.final``), and ``error`` events provider failures
(phase ``after_headers`` before any content, as an error status; ``mid_stream`` once text, a
call or an image had begun). Other events
(``response.created``, ``response.in_progress``, content-part and reasoning-summary events,
events added later) are read for the model name at most and otherwise ignored.
"""

from __future__ import annotations

import json
from typing import Any

from ledger.adapters.contract import (
    ASSISTANT_MEDIA_TEXT,
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
    unreadable_usage,
    wire_order,
)
from ledger.adapters.sse import SSEEvent
from ledger.domain.carried import (
    builtin_tools,
    files_alone,
    message_refusal,
    reasoning_item,
    require_answered,
    require_tool_result,
    tool_arguments,
)
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.media import MediaKind, data_url
from ledger.domain.values import Route

# What a reasoning item keeps when carried back: the provider needs no more to read it.
_REASONING_KEYS = ("type", "id", "summary", "encrypted_content", "content")


def _usage(value: Any) -> Usage | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return unreadable_usage(value)
    u = value
    keys = ("input_tokens", "output_tokens")
    return reported_usage(
        u, keys[:1], keys[1:], required=keys,
        cached=detail_count(u.get("input_tokens_details"), "cached_tokens"),
        reasoning=detail_count(u.get("output_tokens_details"), "reasoning_tokens"))


def _error(err: Any, *, status: str | None = None) -> ProviderErrorPayload:
    """The provider's error object as the body the classifier reads (``error.code``, ...)."""
    obj = dict(err) if isinstance(err, dict) else {"message": err}
    msg = obj.get("message")
    code = obj.get("code") or obj.get("type")
    what = f"response {status}" if status else "provider error"
    return ProviderErrorPayload(
        f"{what} {code or ''}: {provider_message(msg) if msg else 'no message'}".replace(
            "  ", " "),
        json.dumps({"error": obj, **({"status": status} if status else {})}),
    )


def _ended_badly(response: dict[str, Any]) -> ProviderErrorPayload | None:
    """The failure a response object reports, or ``None`` when it completed."""
    status = optional_str(response.get("status"), "response.status")
    if status == "failed":
        err = response.get("error")
        return _error(err if isinstance(err, dict) else {"code": None,
                                                         "message": "the response failed"},
                      status="failed")
    if status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        reason = reason if isinstance(reason, str) else "unknown"
        return _error({"code": reason, "type": "incomplete",
                       "message": f"the response is incomplete ({reason}); it is not a finished "
                       "answer" + ("; raise max_output_tokens" if reason == "max_output_tokens"
                                   else "")},
                      status="incomplete")
    if status == "cancelled":
        return _error({"code": "cancelled", "message": "the response was cancelled"},
                      status="cancelled")
    if status in ("queued", "in_progress"):
        raise MalformedPayload(f"the response is still {status}: it holds no answer yet")
    return None


#: The output items that are the host's (text, reasoning, its own tools' calls): any other
#: item is one the provider ran for the request (mcp_call, web_search_call, file_search_call,
#: code_interpreter_call, image_generation_call, a type added later), so it is never sent again.
_HOSTS_ITEMS = frozenset({"message", "reasoning", "function_call", "custom_tool_call"})


def _provider_ran(item: Any) -> bool:
    """Whether an output item is one the provider ran (by exclusion: safe for new types)."""
    return isinstance(item, dict) and item.get("type") not in _HOSTS_ITEMS


def _ran_any(output: Any) -> bool:
    return isinstance(output, list) and any(_provider_ran(item) for item in output)


def _reasoning(item: dict[str, Any]) -> dict[str, Any] | None:
    """A reasoning output item as it is carried back (``None``: it cannot be, unencrypted)."""
    if not isinstance(item.get("encrypted_content"), str) or not item["encrypted_content"]:
        # Without store, an item the provider did not encrypt cannot be referenced again.
        return None
    return {k: item[k] for k in _REASONING_KEYS if k in item}


# The formats the image_generation tool writes (its output_format), by media type.
_IMAGE_FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "jpg": "image/jpeg",
                  "webp": "image/webp"}


def _take_image(into: Reply | StreamState, item: dict[str, Any], where: str) -> None:
    """An ``image_generation_call`` output item's image (base64 ``result``), into ``into``.

    Its media type is the item's ``output_format`` where it says one, else what the bytes'
    signature says. A call that failed (no result) is noted, not an image.
    """
    result = item.get("result")
    if result is None or result == "":
        status = optional_str(item.get("status"), f"{where}.status")
        into.notes.append(f"{where}: the image_generation_call ended {status or 'without a'} "
                          "result; the answer holds no image of it")
        return
    fmt = item.get("output_format")
    media_type = _IMAGE_FORMATS.get(fmt.lower(), f"image/{fmt.lower()}") if isinstance(
        fmt, str) and fmt else None
    take_output_media(into, f"{where} image_generation_call", media_type, b64data=result)


def _call_of(item: dict[str, Any], j: int) -> ToolCall:
    name = optional_str(item.get("name"), "function_call.name")
    if not name:
        raise MalformedPayload(f"output[{j}] function_call has no name")
    args = item.get("arguments")
    return ToolCall(
        id=optional_str(item.get("call_id"), "function_call.call_id")
        or optional_str(item.get("id"), "function_call.id") or made_up_call_id(),
        name=name,
        arguments_json=args if isinstance(args, str) else json.dumps(args or {}),
    )


def _custom_call(item: dict[str, Any], where: str, *, usage: Usage | None = None,
                 model: str | None = None, final: bool = False) -> MalformedPayload:
    """The refusal of a ``custom_tool_call`` output item (a ``custom`` tool's call).

    Its input is free text, and a tool call the ledger hands on carries its arguments as a
    JSON object (the assistant part the next turn sends back), which it would go back as: a
    ``function_call`` the provider does not match to the custom tool. Dropping the item would
    make the answer look like plain text, the call never run: the answer is refused instead.
    """
    name = item.get("name")
    shown = f" to tool {name[:64]!r}" if isinstance(name, str) and name else ""
    return MalformedPayload(
        f"{where} is a custom_tool_call{shown} (a custom tool's free-text input), which the "
        "ledger cannot carry as a tool call (its arguments are a JSON object, sent back as a "
        "function_call); offer the tool as a function tool in Envelope.tools, or leave the "
        "custom tool out of Envelope.params['tools']", usage=usage, model=model, final=final)


def _where(data: dict[str, Any]) -> str:
    """The output item a stream event is about, as a whole body would name it."""
    index = data.get("output_index")
    return f"output[{index}]" if isinstance(index, int) else "an output item"


def _message_text(item: dict[str, Any], j: int) -> str:
    content = item.get("content") or []
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MalformedPayload(f"output[{j}].content is not a list")
    out = []
    for k, raw in enumerate(content):
        c = require_object(raw, f"output[{j}].content[{k}]")
        if c.get("type") == "output_text":
            out.append(optional_str(c.get("text"), "output_text.text") or "")
        elif c.get("type") == "refusal":
            out.append(optional_str(c.get("refusal"), "refusal.refusal") or "")
    return "".join(out)


class OpenAIResponsesCodec(Codec):
    """The OpenAI Responses API (``/responses``), as the module describes."""

    protocol = WireProtocol.OPENAI_RESPONSES

    @staticmethod
    def url(endpoint: str) -> str:
        """The ``/responses`` URL under ``endpoint`` (a base URL with its version)."""
        e = endpoint.rstrip("/")
        return e if e.endswith("/responses") else join_url(e, "responses")

    def build_request(self, route: Route, envelope: Envelope) -> WireRequest:
        """A Responses request; InvalidArgument for parts or parameters it cannot carry."""
        assert route.endpoint is not None  # checked by the engine before building
        check_params(route, envelope.params)
        instructions: list[str] = []
        items: list[dict[str, Any]] = []
        notes: list[str] = []
        files_only = files_alone(envelope.parts)
        in_results = {k for files in files_only.values() for k in files}
        for i, part in wire_order(envelope.parts, files_only):
            if i in in_results:
                continue  # sent in its call's function_call_output
            if part.role == "system":
                instructions.append(part.content)
            elif part.kind is MediaKind.REASONING:
                found = reasoning_item(part)
                if found is not None and found[0] == route.id and found[1] == self.protocol:
                    items.append(found[2])
                else:
                    notes.append(dropped_reasoning(route, part, i))
            elif part.media_type is not None and part.role == "assistant":
                # An assistant message holds output_text only, and an image_generation_call
                # item is read back by its id from the provider's store (store=false keeps
                # none): a file the model returned goes back in a user message of its own.
                items.append({"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": ASSISTANT_MEDIA_TEXT},
                    _media_item(part, i, route)]})
                notes.append(assistant_media_note(route, part, i))
            elif part.media_type is not None:
                self._user(items).append(_media_item(part, i, route))
            elif part.role == "tool":
                require_tool_result(self.protocol, part, i)
                # A function_call_output's output may be input_image, input_file and
                # input_text items: a tool that returned files alone answers with them.
                output: str | list[dict[str, Any]] = part.content if i not in files_only else [
                    _media_item(envelope.parts[k], k, route) for k in files_only[i]]
                items.append({"type": "function_call_output", "call_id": part.tool_call_id,
                              "output": output})
            elif part.role == "assistant" and part.tool_call_id:
                args = tool_arguments(part, i)
                items.append({"type": "function_call", "call_id": part.tool_call_id,
                              "name": part.name, "arguments": json.dumps(args)})
            elif part.role == "assistant":
                items.append({"type": "message", "role": "assistant", "content": part.content})
            else:
                self._user(items).append({"type": "input_text", "text": part.content})
        require_answered(self.protocol, envelope.parts)
        nothing = message_refusal(self.protocol, envelope.parts)
        if nothing is not None:
            raise nothing.error()
        params = dict(envelope.params)
        builtin = builtin_tools(params.pop("tools", None))
        body: dict[str, Any] = {"model": route.model, "input": items, "store": False}
        if instructions:
            body["instructions"] = "\n\n".join(instructions)
        body.update(params)
        if "reasoning" in envelope.params and "include" not in envelope.params:
            body["include"] = ["reasoning.encrypted_content"]
        if envelope.max_output_tokens is not None:
            body["max_output_tokens"] = envelope.max_output_tokens
        if envelope.tools or builtin:
            body["tools"] = [
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters or {"type": "object", "properties": {}},
                }
                for t in envelope.tools
            ] + builtin
        headers = {"content-type": "application/json", "accept": "application/json"}
        if envelope.stream:
            body["stream"] = True
            headers["accept"] = "text/event-stream"
        # A stored prompt (params["prompt"]) may declare function tools of its own.
        return WireRequest(url=self.url(route.endpoint), headers=headers, body=body,
                           notes=tuple(notes),
                           offers_tools=bool(envelope.tools) or "prompt" in envelope.params)

    @staticmethod
    def _user(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The content list of the user message being built (a new one after anything else)."""
        last = items[-1] if items else None
        if last is None or last.get("type") != "message" or last.get("role") != "user":
            last = {"type": "message", "role": "user", "content": []}
            items.append(last)
        content: list[dict[str, Any]] = last["content"]
        return content

    def auth_headers(self, secret: str) -> dict[str, str]:
        """``Authorization: Bearer <secret>``."""
        return {"authorization": f"Bearer {secret}"}

    def parse_reply(self, data: Any) -> Reply:
        """A ``response`` object; an error object, or a failed or incomplete response, raises."""
        obj = require_object(data, "response body")
        if "error" in obj and obj.get("error") is not None and not obj.get("output"):
            err = _error(obj["error"], status=optional_str(obj.get("status"), "status"))
            # A failed response is billed, and the model it names is the one that answered.
            err.usage, err.model = error_extras(obj, _usage)
            raise err
        try:
            bad = _ended_badly(obj)
        except MalformedPayload as exc:
            exc.provider_ran = _ran_any(obj.get("output"))
            raise
        if bad is not None:
            # A failed or incomplete response is billed: its usage stays on the result.
            bad.usage = _usage(obj.get("usage"))
            bad.model = optional_str(obj.get("model"), "model")
            # A hosted tool it ran before it failed (an mcp_call) is never run again.
            bad.provider_ran = _ran_any(obj.get("output"))
            raise bad
        output = obj.get("output")
        if not isinstance(output, list):
            raise MalformedPayload("output is missing or not a list")
        try:
            reply = refuse_held(self._output(obj, output))
        except MalformedPayload as exc:
            exc.provider_ran |= _ran_any(output)
            raise
        reply.provider_ran = _ran_any(output)
        return reply

    @staticmethod
    def _output(obj: dict[str, Any], output: list[Any]) -> Reply:
        reply = Reply(usage=_usage(obj.get("usage")), model=optional_str(obj.get("model"), "model"),
                      finish_reason=optional_str(obj.get("status"), "status"))
        text: list[str] = []
        for j, raw in enumerate(output):
            item = require_object(raw, f"output[{j}]")
            kind = item.get("type")
            if kind == "message":
                text.append(_message_text(item, j))
            elif kind == "function_call":
                take_call(reply, _call_of(item, j), f"output[{j}]")
            elif kind == "custom_tool_call":
                raise _custom_call(item, f"output[{j}]", usage=reply.usage, model=reply.model)
            elif kind == "reasoning":
                carried = _reasoning(item)
                if carried is not None:
                    reply.reasoning.append(carried)
            elif kind == "image_generation_call":
                _take_image(reply, item, f"output[{j}]")
            # other built-in tool calls (web search, ...) are the provider's own: not the host's
        reply.text = "".join(text)
        return reply

    def new_stream(self) -> StreamState:
        """An accumulator of Responses stream events, ended by ``response.completed``."""
        return _ResponsesStream()


def _media_item(part: Part, index: int, route: Route) -> dict[str, Any]:
    """An ``input_image``, ``input_file`` or ``input_text`` item for a binary part."""
    kind, payload, link = media_of(part, index, route)
    mt = part.media_type or ""
    if kind is MediaKind.IMAGE:
        return {"type": "input_image", "image_url": link or data_url(mt, payload or b""),
                "detail": "auto"}
    if kind is MediaKind.PDF:
        if link is not None:
            return {"type": "input_file", "file_url": link}
        return {"type": "input_file", "filename": part.name or "document.pdf",
                "file_data": data_url(mt, payload or b"")}
    return {"type": "input_text", "text": document_text(payload or b"")}


class _ResponsesStream(StreamState):
    def __init__(self) -> None:
        super().__init__()
        # function calls by item id: [call id, name, argument pieces, final arguments]
        self._calls: dict[str, list[Any]] = {}
        self._done: set[str] = set()
        # The first custom_tool_call item and where it stands: the answer is refused with it.
        self._custom: tuple[dict[str, Any], str] | None = None

    def feed(self, event: SSEEvent) -> list[StreamEvent]:
        if event.data.strip() == "[DONE]":  # some compatible servers end with it anyway
            self.terminated = True
            return []
        data = parse_json_event(event)
        kind = data.get("type", event.event)
        out: list[StreamEvent] = []
        if kind == "error":
            err = data.get("error") if isinstance(data.get("error"), dict) else {
                k: data.get(k) for k in ("code", "message", "param")}
            raise _error(err)
        if kind in ("response.created", "response.in_progress", "response.completed",
                    "response.failed", "response.incomplete"):
            response = require_object(data.get("response"), f"{kind}.response")
            self.model = optional_str(response.get("model"), "response.model") or self.model
            if response.get("usage") is not None:
                self.usage = _usage(response["usage"])
            if kind == "response.completed":
                if self._custom is not None:
                    raise _custom_call(*self._custom, usage=self.usage, model=self.model,
                                       final=True)
                self.finish_reason = optional_str(response.get("status"), "status") or "completed"
                self.terminated = True
                return self._flush()
            if kind in ("response.failed", "response.incomplete"):
                bad = _ended_badly(response) or _error(
                    {"code": None, "message": f"{kind} without a status"}, status=kind[9:])
                # The whole response with its final status: the same verdict as the body.
                bad.final = True
                bad.provider_ran = self.provider_ran or _ran_any(response.get("output"))
                raise bad
        elif kind in ("response.output_text.delta", "response.refusal.delta"):
            text = optional_str(data.get("delta"), f"{kind}.delta") or ""
            if text:
                self.content_seen = True
                self.text_parts.append(text)
                out.append(TextDelta(text))
        elif kind == "response.output_item.added":
            item = require_object(data.get("item"), "output_item.added.item")
            # Added is when the provider starts running it: whatever follows, it may have run.
            self.provider_ran |= _provider_ran(item)
            if item.get("type") == "custom_tool_call":
                # Refused on completion, so the whole answer (and its usage) is known.
                self._custom = self._custom or (item, _where(data))
                self.content_seen = True
            if item.get("type") == "function_call":
                iid = self._item_id(item, data)
                name = optional_str(item.get("name"), "function_call.name")
                call_id = optional_str(item.get("call_id"), "function_call.call_id")
                self._calls[iid] = [call_id, name, [], None]
                self.content_seen = True
        elif kind == "response.function_call_arguments.delta":
            slot = self._slot(data, kind)
            slot[2].append(optional_str(data.get("delta"), f"{kind}.delta") or "")
            self.content_seen = True
        elif kind == "response.function_call_arguments.done":
            slot = self._slot(data, kind)
            slot[3] = optional_str(data.get("arguments"), f"{kind}.arguments")
            slot[1] = optional_str(data.get("name"), f"{kind}.name") or slot[1]
        elif kind == "response.output_item.done":
            item = require_object(data.get("item"), "output_item.done.item")
            self.provider_ran |= _provider_ran(item)
            if item.get("type") == "function_call":
                iid = self._item_id(item, data)
                slot = self._calls.setdefault(iid, [None, None, [], None])
                slot[0] = optional_str(item.get("call_id"), "function_call.call_id") or slot[0]
                slot[1] = optional_str(item.get("name"), "function_call.name") or slot[1]
                args = item.get("arguments")
                if isinstance(args, str):
                    slot[3] = args
                out.extend(self._propose(iid))
                self.content_seen = True
            elif item.get("type") == "custom_tool_call":
                self._custom = self._custom or (item, _where(data))
            elif item.get("type") == "reasoning":
                carried = _reasoning(item)
                if carried is not None:
                    self.reasoning.append(carried)
            elif item.get("type") == "image_generation_call":
                # The whole image, once generated (partial images before it are previews).
                index = data.get("output_index")
                _take_image(self, item, f"output[{index}]")
                self.content_seen = True
        # Everything else (content parts, summaries, annotations, events added later) is
        # ignored, as the API documentation asks of clients.
        return out

    @staticmethod
    def _item_id(item: dict[str, Any], data: dict[str, Any]) -> str:
        iid = item.get("id")
        if isinstance(iid, str) and iid:
            return iid
        index = data.get("output_index")
        if isinstance(index, int) and not isinstance(index, bool):
            return f"#{index}"
        raise MalformedPayload("a function_call item has neither an id nor an output_index")

    def _slot(self, data: dict[str, Any], kind: str) -> list[Any]:
        iid = data.get("item_id")
        if not isinstance(iid, str) or iid not in self._calls:
            index = data.get("output_index")
            iid = f"#{index}" if f"#{index}" in self._calls else iid
        if not isinstance(iid, str) or iid not in self._calls:
            raise MalformedPayload(f"{kind} for an item that is no function call")
        return self._calls[iid]

    def _propose(self, iid: str) -> list[StreamEvent]:
        if iid in self._done:
            return []
        call_id, name, pieces, final = self._calls[iid]
        if not name:
            raise MalformedPayload(f"function call {iid} ended without a name")
        self._done.add(iid)
        # A refused call is held: the usage comes with response.completed.
        call = take_call(self, ToolCall(
            id=call_id or iid, name=name,
            arguments_json=final if final is not None else "".join(pieces)),
            f"function call {iid}")
        return [] if call is None else [ToolCallProposal(call)]

    def _flush(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for iid in list(self._calls):
            out.extend(self._propose(iid))
        return out

    def end(self) -> list[StreamEvent]:
        return self._flush()


CODEC = OpenAIResponsesCodec()
register_codec(CODEC)

__all__ = ["CODEC", "OpenAIResponsesCodec"]
