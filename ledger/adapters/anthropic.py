"""Anthropic messages (``POST {endpoint}/v1/messages``).

``Route.endpoint`` is the API root (``https://api.anthropic.com``); an endpoint ending in ``/v1``
gets ``/messages``, one ending in ``/v1/messages`` is used as is. The credential goes in
``x-api-key``; ``anthropic-version`` is sent as :data:`ANTHROPIC_VERSION`.

Envelope mapping: every ``system`` part goes, in order, into the top-level ``system`` text.
Other parts become content blocks of alternating ``user``/``assistant`` messages (consecutive
parts of one role are merged): an assistant part with ``tool_call_id`` is a ``tool_use`` block
(``name``, JSON-object ``content`` as ``input``), a ``tool`` part a ``tool_result`` block in a user
message; a turn's ``tool_result`` blocks open their user message, and the files the tools
returned follow them (the API refuses a ``tool_result`` after another block;
:func:`~ledger.adapters.contract.wire_order`). A call whose tool returned files alone (an empty
``tool`` part, or none) has them as its ``tool_result``'s content, and an empty result with no file
goes without content: never an empty text, which the API refuses
(:func:`~ledger.domain.carried.files_alone`). A trailing assistant part is
Anthropic's native prefill: the answer continues it, and the result's text is the continuation
only. ``max_tokens`` is required by the API:
``max_output_tokens`` or ``default_max_tokens`` (4096,
:data:`~ledger.domain.envelope.DEFAULT_OUTPUT_TOKENS`, which the Run's hold also counts). The
``stop`` parameter is sent as ``stop_sequences``; other parameters pass through, and disclosure
preflight counts each ``mcp_servers`` entry's ``url`` as a recipient the grant must approve
(:func:`~ledger.decide.preflight.param_disclosures`).

Images and documents (binary parts) are content blocks of the user message: an image is an
``image`` block, a PDF a ``document`` block, each with a ``base64`` source of its bytes or a
``url`` source for an ``https://`` link; a plain-text document is a ``document`` block with a
``text`` source (no link). A part's ``name`` is the document's ``title``. An image or a
document a model returned (an assistant binary part) cannot be in an assistant message: it is
sent in the user message that follows, after the text
:data:`~ledger.adapters.contract.ASSISTANT_MEDIA_TEXT`, with a note.

Extended thinking (``params={"thinking": {"type": "enabled", "budget_tokens": ...}}``): an
answer's ``thinking`` blocks (with their ``signature``) and ``redacted_thinking`` blocks are its
reasoning (``AdapterResult.reasoning``), never its text. With thinking enabled and tool use, the
API requires them back, unchanged and before the ``tool_use`` blocks, in the assistant message
of the next request: a reasoning part this very route produced goes back as the block the
provider returned, at its place (a turn's reasoning parts come first, so its blocks open the
assistant message, as they did in the answer). A reasoning part of another route or protocol is
left out, with a note: a signature is verified by the provider that wrote it.

Answers are text, ``tool_use`` and thinking blocks: the Messages API returns no images or
documents, so an Anthropic answer's ``AdapterResult.media`` is always empty.

Stream completion: ``message_stop`` terminates. A body that ends cleanly without it is complete
only if a ``message_delta`` carried a ``stop_reason``. An ``error`` event is a provider failure,
reported with its body (e.g. ``overloaded_error``): phase ``after_headers`` when it comes before
any text or ``tool_use`` (the same verdict a 529 gives; thinking alone is not content),
``mid_stream`` once the answer had begun.
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
    empty_text_note,
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
    unreadable_usage,
    wire_order,
)
from ledger.adapters.sse import SSEEvent
from ledger.domain.carried import (
    files_alone,
    message_refusal,
    reasoning_item,
    require_answered,
    require_tool_result,
    tool_arguments,
)
from ledger.domain.envelope import DEFAULT_OUTPUT_TOKENS, Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.media import MediaKind, b64
from ledger.domain.values import Route

ANTHROPIC_VERSION = "2023-06-01"

# The blocks of an answer that are its reasoning, and the keys each keeps when carried back
# (the API verifies them unchanged: nothing is added).
_THINKING_KEYS = {"thinking": ("type", "thinking", "signature"),
                  "redacted_thinking": ("type", "data")}
# The blocks that are the host's: its answer's text, its own tools' calls, the reasoning. Any
# other (server_tool_use, mcp_tool_use, their results, a type added later) is a tool the
# provider ran itself.
_HOSTS_BLOCKS = frozenset({"text", "tool_use", *_THINKING_KEYS})


def _thinking(into: Reply | StreamState, block: dict[str, Any], where: str) -> None:
    """A ``thinking`` or ``redacted_thinking`` block, as the reasoning item carried back.

    A block without its signature (or redacted data) cannot be verified by the provider, so
    it could not go back: it is left out with a note (some compatible servers send none).
    """
    kind = block["type"]
    for key in _THINKING_KEYS[kind][1:]:
        if not isinstance(block.get(key), str) or not block[key]:
            into.notes.append(f"{where}: a {kind} block without its {key} is left out of the "
                              "reasoning carried to the next turn (the provider could not "
                              "verify it)")
            return
    into.reasoning.append({k: block[k] for k in _THINKING_KEYS[kind]})


def _usage(value: Any, previous: Usage | None = None) -> Usage | None:
    if value is None:
        return previous
    if not isinstance(value, dict):
        # Not kept from before either: a message_delta's count is the cumulative one, so
        # message_start's would under-report the answer.
        return unreadable_usage(value)
    u = value
    # Cached prompt tokens are prompt tokens too; they are billed, at their own rates.
    prompt_keys = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    usage = reported_usage(
        u, prompt_keys, ("output_tokens",),
        # message_delta usage is cumulative and may omit either side (kept from before).
        required=() if previous is not None else ("input_tokens", "output_tokens"),
        # The prompt tokens read from the cache (cache_creation ones were written to it).
        cached=detail_count(u, "cache_read_input_tokens"))
    if usage is None or previous is None:
        return usage
    has_prompt = any(u.get(k) is not None for k in prompt_keys)
    return Usage(
        prompt_tokens=usage.prompt_tokens if has_prompt else previous.prompt_tokens,
        completion_tokens=(previous.completion_tokens if u.get("output_tokens") is None
                           else usage.completion_tokens),
        cached_tokens=usage.cached_tokens if has_prompt else previous.cached_tokens)


def _error(data: dict[str, Any]) -> ProviderErrorPayload:
    err = data.get("error")
    kind = err.get("type") if isinstance(err, dict) else None
    msg = err.get("message") if isinstance(err, dict) else None
    return ProviderErrorPayload(
        f"provider error {kind or ''}: {provider_message(msg) if msg else 'no message'}".replace(
            "  ", " "
        ),
        json.dumps(data),
    )


def _media_block(part: Part, index: int, route: Route) -> dict[str, Any]:
    """An ``image`` or ``document`` content block for a binary part."""
    kind, payload, link = media_of(part, index, route)
    mt = part.media_type or ""
    if link is not None:
        source: dict[str, Any] = {"type": "url", "url": link}
    elif kind is MediaKind.TEXT:
        source = {"type": "text", "media_type": "text/plain",
                  "data": document_text(payload or b"")}
    else:
        source = {"type": "base64", "media_type": mt, "data": b64(payload or b"")}
    if kind is MediaKind.IMAGE:
        return {"type": "image", "source": source}
    block: dict[str, Any] = {"type": "document", "source": source}
    if part.name:
        block["title"] = part.name
    return block


class AnthropicCodec(Codec):
    """The Anthropic Messages protocol (``/v1/messages``), as the module describes.

    Args:
        default_max_tokens: ``max_tokens`` of a request whose envelope sets no
            ``max_output_tokens`` (the protocol requires one).
    """

    protocol = WireProtocol.ANTHROPIC

    def __init__(self, *, default_max_tokens: int = DEFAULT_OUTPUT_TOKENS) -> None:
        self.default_max_tokens = default_max_tokens

    @staticmethod
    def url(endpoint: str) -> str:
        """The Messages URL under ``endpoint`` (with or without ``/v1``)."""
        e = endpoint.rstrip("/")
        if e.endswith("/v1/messages"):
            return e
        if e.endswith("/v1"):
            return join_url(e, "messages")
        return join_url(e, "v1/messages")

    def build_request(self, route: Route, envelope: Envelope) -> WireRequest:
        """A Messages request; InvalidArgument for parts the protocol cannot carry."""
        assert route.endpoint is not None  # checked by the engine before building
        system: list[str] = []
        messages: list[dict[str, Any]] = []
        notes: list[str] = []

        def add(role: str, block: dict[str, Any]) -> None:
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"].append(block)
            else:
                messages.append({"role": role, "content": [block]})

        files_only = files_alone(envelope.parts)
        in_results = {k for files in files_only.values() for k in files}
        for i, part in wire_order(envelope.parts, files_only):
            if i in in_results:
                continue  # sent in its call's tool_result
            if part.role == "system":
                system.append(part.content)
            elif part.role == "tool":
                require_tool_result(self.protocol, part, i)
                result: dict[str, Any] = {"type": "tool_result", "tool_use_id": part.tool_call_id}
                if i in files_only:
                    # A tool_result's content may be image and document blocks: the files
                    # are the result, where an empty text would be refused.
                    result["content"] = [_media_block(envelope.parts[k], k, route)
                                         for k in files_only[i]]
                elif part.content:
                    result["content"] = part.content
                # else no content (optional): a tool that returned nothing, without the
                # empty text the API refuses.
                add("user", result)
            elif part.role == "assistant" and part.tool_call_id:
                add(
                    "assistant",
                    {
                        "type": "tool_use",
                        "id": part.tool_call_id,
                        "name": part.name,
                        "input": tool_arguments(part, i),
                    },
                )
            elif part.kind is MediaKind.REASONING:
                found = reasoning_item(part)
                if (found is not None and found[0] == route.id and found[1] == self.protocol
                        and found[2].get("type") in _THINKING_KEYS):
                    # This route's thinking block, as it returned it, at its place in the turn.
                    add("assistant", found[2])
                else:
                    notes.append(dropped_reasoning(route, part, i))
            elif part.media_type is not None and part.role == "assistant":
                # Image and document blocks belong in user messages: a file a model returned
                # goes back there, after a line that says whose it is.
                add("user", {"type": "text", "text": ASSISTANT_MEDIA_TEXT})
                add("user", _media_block(part, i, route))
                notes.append(assistant_media_note(route, part, i))
            elif part.media_type is not None:
                add("user", _media_block(part, i, route))
            elif not part.content:
                # An empty answer (one that stopped while thinking) is an empty text part; the
                # API refuses an empty text block, and the turn loses nothing without it.
                notes.append(empty_text_note(route, i))
            else:
                add(part.role, {"type": "text", "text": part.content})
        require_answered(self.protocol, envelope.parts)
        nothing = message_refusal(self.protocol, envelope.parts)
        if nothing is not None:
            raise nothing.error()
        params = dict(envelope.params)
        check_params(route, params)
        if "stop" in params:
            stop = params.pop("stop")
            params["stop_sequences"] = [stop] if isinstance(stop, str) else stop
        body: dict[str, Any] = {
            "model": route.model,
            "max_tokens": envelope.max_output_tokens or self.default_max_tokens,
            "messages": messages,
        }
        if system:
            body["system"] = "\n\n".join(system)
        body.update(params)
        if envelope.tools:
            body["tools"] = [
                {
                    "name": t.name,
                    "description": t.description,
                    "input_schema": t.parameters or {"type": "object", "properties": {}},
                }
                for t in envelope.tools
            ]
        headers = {
            "content-type": "application/json",
            "anthropic-version": ANTHROPIC_VERSION,
            "accept": "text/event-stream" if envelope.stream else "application/json",
        }
        if envelope.stream:
            body["stream"] = True
        return WireRequest(url=self.url(route.endpoint), headers=headers, body=body,
                           notes=tuple(notes), offers_tools=bool(envelope.tools))

    def auth_headers(self, secret: str) -> dict[str, str]:
        """``x-api-key: <secret>``."""
        return {"x-api-key": secret}

    def parse_reply(self, data: Any) -> Reply:
        """A ``message`` body; an error object raises."""
        obj = require_object(data, "response body")
        if obj.get("type") == "error" or ("error" in obj and "content" not in obj):
            raise _error(obj)
        content = obj.get("content")
        if not isinstance(content, list):
            raise MalformedPayload("content is not a list")
        # Any block but text, the host's tool calls and thinking is a tool the provider ran
        # itself (an MCP call, a web search, their results): known before any refusal below.
        ran = any(isinstance(b, dict) and b.get("type") not in _HOSTS_BLOCKS for b in content)
        try:
            reply = refuse_held(self._reply(obj, content))
        except MalformedPayload as exc:
            exc.provider_ran |= ran
            raise
        reply.provider_ran = ran
        return reply

    @staticmethod
    def _reply(obj: dict[str, Any], content: list[Any]) -> Reply:
        text: list[str] = []
        reply = Reply()
        for j, raw in enumerate(content):
            block = require_object(raw, f"content[{j}]")
            kind = block.get("type")
            if kind == "text":
                text.append(optional_str(block.get("text"), "text") or "")
            elif kind == "tool_use":
                name = optional_str(block.get("name"), "tool_use.name")
                if not name:
                    raise MalformedPayload(f"content[{j}] tool_use has no name")
                take_call(reply, ToolCall(
                    id=optional_str(block.get("id"), "tool_use.id") or made_up_call_id(),
                    name=name,
                    arguments_json=json.dumps(block.get("input") or {}),
                ), f"content[{j}]")
            elif kind in _THINKING_KEYS:
                # Reasoning, not answer text: carried back to this route on the next turn.
                _thinking(reply, block, f"content[{j}]")
            # other block types (server tools' calls and results, ...) are not the host's answer
        reply.text = "".join(text)
        reply.usage = _usage(obj.get("usage"))
        reply.model = optional_str(obj.get("model"), "model")
        reply.finish_reason = optional_str(obj.get("stop_reason"), "stop_reason")
        return reply

    def new_stream(self) -> StreamState:
        """An accumulator of Messages stream events, ended by ``message_stop``."""
        return _AnthropicStream()


class _AnthropicStream(StreamState):
    def __init__(self) -> None:
        super().__init__()
        self._tools: dict[int, list[Any]] = {}  # index -> [id, name, json pieces]
        # The blocks of tools the provider runs itself (server_tool_use, mcp_tool_use): their
        # input streams as input_json_delta too, and is the provider's, not a host tool call.
        self._hosted: set[int] = set()
        # index -> [block type, thinking pieces, signature pieces, redacted data]
        self._thinking: dict[int, list[Any]] = {}

    def feed(self, event: SSEEvent) -> list[StreamEvent]:
        data = parse_json_event(event)
        kind = data.get("type", event.event)
        out: list[StreamEvent] = []
        if kind == "error":
            raise _error(data)
        if kind == "message_start":
            msg = require_object(data.get("message"), "message_start.message")
            self.model = optional_str(msg.get("model"), "message.model") or self.model
            self.usage = _usage(msg.get("usage"), self.usage)
        elif kind == "content_block_start":
            index = self._index(data)
            block = require_object(data.get("content_block"), "content_block")
            if block.get("type") == "tool_use":
                name = optional_str(block.get("name"), "tool_use.name")
                if not name:
                    raise MalformedPayload("tool_use block has no name")
                tid = optional_str(block.get("id"), "tool_use.id") or made_up_call_id()
                self._tools[index] = [tid, name, []]
                self.content_seen = True
            elif block.get("type") in _THINKING_KEYS:
                kind0 = block["type"]
                self._thinking[index] = [
                    kind0, [optional_str(block.get("thinking"), "thinking.thinking") or ""],
                    [optional_str(block.get("signature"), "thinking.signature") or ""],
                    optional_str(block.get("data"), "redacted_thinking.data")]
            elif block.get("type") == "text":
                text = optional_str(block.get("text"), "text") or ""
                if text:
                    self.content_seen = True
                    self.text_parts.append(text)
                    out.append(TextDelta(text))
            else:
                # Anything else (server_tool_use, mcp_tool_use, web_search_tool_result,
                # mcp_tool_result, a type added later) is a tool the provider runs itself.
                self.provider_ran = True
                self._hosted.add(index)
        elif kind == "content_block_delta":
            index = self._index(data)
            delta = require_object(data.get("delta"), "content_block_delta.delta")
            dkind = delta.get("type")
            if dkind == "text_delta":
                text = optional_str(delta.get("text"), "text_delta.text") or ""
                if text:
                    self.content_seen = True
                    self.text_parts.append(text)
                    out.append(TextDelta(text))
            elif dkind == "input_json_delta" and index in self._hosted:
                pass  # the input of a tool the provider runs: no call of the host's
            elif dkind == "input_json_delta":
                if index not in self._tools:
                    raise MalformedPayload(f"input_json_delta for block {index} without tool_use")
                piece = optional_str(delta.get("partial_json"), "partial_json") or ""
                self._tools[index][2].append(piece)
                self.content_seen = True
            elif dkind in ("thinking_delta", "signature_delta"):
                if index not in self._thinking:
                    raise MalformedPayload(f"{dkind} for block {index} without thinking")
                key = "thinking" if dkind == "thinking_delta" else "signature"
                piece = optional_str(delta.get(key), f"{dkind}.{key}") or ""
                self._thinking[index][1 if key == "thinking" else 2].append(piece)
        elif kind == "content_block_stop":
            index = self._index(data)
            slot = self._tools.pop(index, None)
            if slot is not None:
                out.extend(self._proposal(slot))
            thought = self._thinking.pop(index, None)
            if thought is not None:
                kind0, pieces, signature, redacted = thought
                block = ({"type": kind0, "data": redacted} if kind0 == "redacted_thinking"
                         else {"type": kind0, "thinking": "".join(pieces),
                               "signature": "".join(signature)})
                _thinking(self, block, f"content block {index}")
        elif kind == "message_delta":
            delta = require_object(data.get("delta") or {}, "message_delta.delta")
            stop = optional_str(delta.get("stop_reason"), "stop_reason")
            if stop:
                self.finish_reason = stop
                self.completed = True
            self.usage = _usage(data.get("usage"), self.usage)
        elif kind == "message_stop":
            self.terminated = True
        # "ping" and event types added later are ignored, as the API documentation asks.
        return out

    def _proposal(self, slot: list[Any]) -> list[StreamEvent]:
        tid, name, pieces = slot
        args = "".join(pieces) or "{}"
        # A refused call is held: the output tokens come with message_delta, after it.
        call = take_call(self, ToolCall(id=tid, name=name, arguments_json=args),
                         f"tool_use {tid[:64]!r}")
        return [] if call is None else [ToolCallProposal(call)]

    @staticmethod
    def _index(data: dict[str, Any]) -> int:
        index = data.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            raise MalformedPayload(f"{data.get('type')} has no integer index")
        return index


CODEC = AnthropicCodec()
register_codec(CODEC)

__all__ = ["ANTHROPIC_VERSION", "CODEC", "AnthropicCodec"]
