"""Gemini ``generateContent`` and ``streamGenerateContent?alt=sse``.

``Route.endpoint`` is the API root (``https://generativelanguage.googleapis.com``); the path
``/v1beta/models/{model}:generateContent`` is appended (an endpoint already ending in ``/v1beta``
or ``/v1`` gets only ``/models/...``). ``Route.model`` may carry the ``models/`` prefix or not.
The credential goes in ``x-goog-api-key``, never in the URL's ``key=`` parameter: URLs end up in
logs and exception messages.

Envelope mapping: ``system`` parts go, in order, into ``systemInstruction``; the others become
``contents`` with roles ``user`` and ``model`` (consecutive parts of one role are merged). An
assistant part with ``tool_call_id`` is a ``functionCall`` (``name``, JSON-object ``content`` as
``args``), a ``tool`` part a ``functionResponse`` (``name`` required; JSON content is passed as
the response object, other text as ``{"result": text}``); a turn's ``functionResponse`` parts
open the user turn, and the files its tools returned follow them
(:func:`~ledger.adapters.contract.wire_order`, as on every protocol); the result of a call whose
tool returned files alone (an empty ``tool`` part, or none) has
:data:`~ledger.adapters.contract.TOOL_FILES_TEXT` as its ``result``, with a note, and the files
follow (:func:`~ledger.domain.carried.files_alone`). A trailing assistant part
is sent as a final ``model`` turn (prefill); models that refuse it answer with a 400. The
request's own fields ``safetySettings``, ``toolConfig`` and ``cachedContent`` in
``Envelope.params`` are sent at the top level of the request; every other parameter goes into
``generationConfig``: ``max_output_tokens``, ``temperature``, ``top_p``, ``top_k`` and ``stop``
are renamed to Gemini's names, other keys are passed as given.

Images and documents (binary parts) are parts of the user turn: ``inline_data`` (``mime_type``,
base64 ``data``) for bytes, ``file_data`` (``mime_type``, ``file_uri``) for an ``https://``
link; a plain-text document's media type is sent as ``text/plain``. An image or a document a
model returned (an assistant binary part) goes back the same way in the ``model`` turn.

Thought signatures: a thinking model (Gemini 2.5, 3) puts an opaque ``thoughtSignature`` on
parts of its answer: on the first ``functionCall`` part of a step, on a text part (in a stream
possibly an empty one at the end), on an image it generated. Each is the answer's reasoning
(``AdapterResult.reasoning``), as an item that says which part it belongs to
(``{"part": "functionCall", "index": k, "name": ..., "thoughtSignature": ...}``, ``k`` the
call's place among the answer's calls; ``{"part": "text", ...}``; ``{"part": "media", "index":
k, ...}``). Gemini 3 requires the signature back on the same ``functionCall`` part of the
``model`` turn in the next request (a 400 otherwise). A reasoning part this very route produced
is put back on the matching part of its turn (a turn's reasoning parts come before its text,
files and calls): the ``k``-th call of that turn if it has the same name, its text part, its
``k``-th file. A signature whose part the turn does not hold (the text of an answer that had
none, a call that is not there) is left out with a note: it is never moved to another part.
Reasoning parts of another route or protocol are left out, with a note: a signature is
verified by the model that wrote it.

Answers: the first candidate's ``text`` parts (thought parts left out), ``functionCall`` parts
as tool calls, and ``inlineData`` / ``fileData`` parts (an image model's output) as the answer's
images and documents (``AdapterResult.media``), in a stream as the chunk that carries each one
whole arrives; a media type the ledger does not carry, or a link that is not ``https://``, is
left out with a note.

Stream completion: Gemini has no terminator event; a stream whose body ends cleanly is complete
only if a candidate carried a ``finishReason``. A response without candidates whose
``promptFeedback`` has a ``blockReason`` is a provider refusal, reported as a failure with the
usage (``usageMetadata``) it reports; so is a candidate withheld for its content
(``finishReason`` ``SAFETY``, ``RECITATION``, ``BLOCKLIST``, ``PROHIBITED_CONTENT``, ``SPII``,
``IMAGE_SAFETY``, ...) that carries no text, call or media, and so is a candidate that ends
empty for any reason but ``STOP`` or ``MAX_TOKENS`` (``MALFORMED_FUNCTION_CALL``, ``LANGUAGE``,
``OTHER``, ...). Each is the provider's whole
verdict (phase ``after_headers``, streamed or not); the policies classify the reason
(``codes.gemini_status``): the content reasons as ``content_policy``, a botched call or answer
(``MALFORMED_FUNCTION_CALL``, ``UNEXPECTED_TOOL_CALL``, ``TOO_MANY_TOOL_CALLS``,
``MALFORMED_RESPONSE``) and ``LANGUAGE`` as ``format``, the rest (``OTHER``, ``NO_IMAGE``, ...,
unmapped) as ``unknown``. A candidate that carries
some text before such a ``finishReason`` is that text: a success whose ``finish_reason`` says it
was cut short.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import quote

from ledger.adapters.contract import (
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
    check_params,
    detail_count,
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
    take_output_media,
    tool_files_note,
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
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.media import MediaKind, b64, wire_media_type
from ledger.domain.values import Route

# The request's own fields beside generationConfig (GenerateContentRequest): sent at the top.
_TOP_LEVEL = frozenset({"safetySettings", "toolConfig", "cachedContent"})
_RENAME = {
    "temperature": "temperature",
    "top_p": "topP",
    "top_k": "topK",
    "stop": "stopSequences",
    "max_output_tokens": "maxOutputTokens",
    "presence_penalty": "presencePenalty",
    "frequency_penalty": "frequencyPenalty",
    "seed": "seed",
}
_VERSIONED = re.compile(r"/v1(beta\d*|alpha\d*)?$")
_SIGNATURE = "thoughtSignature"


class _Turn:
    """The thought signatures of one ``model`` turn being built, put on its parts.

    A turn's reasoning parts come first; each later part of the turn takes the signature that
    names it. What is left when the turn ends is noted, never moved to another part.
    """

    def __init__(self, route: Route, notes: list[str]) -> None:
        self.route = route
        self.notes = notes
        self.pending: list[tuple[int, dict[str, Any]]] = []  # (part index, item)
        self.calls = 0
        self.media = 0
        self.started = False  # a part other than reasoning was added to the turn

    def signature(self, index: int, item: dict[str, Any]) -> None:
        if self.started:  # another answer's reasoning: the turn before has ended
            self.end()
        self.pending.append((index, item))

    def _take(self, part: dict[str, Any], kind: str, index: int | None = None,
              name: str | None = None) -> None:
        self.started = True
        for n, (_i, item) in enumerate(self.pending):
            if item.get("part") == kind and (index is None or item.get("index") == index) and (
                    name is None or item.get("name") == name):
                part[_SIGNATURE] = item[_SIGNATURE]
                del self.pending[n]
                return

    def text(self, part: dict[str, Any]) -> None:
        self._take(part, "text")

    def call(self, part: dict[str, Any], name: str) -> None:
        self._take(part, "functionCall", self.calls, name)
        self.calls += 1

    def file(self, part: dict[str, Any]) -> None:
        self._take(part, "media", self.media)
        self.media += 1

    def end(self) -> None:
        for i, item in self.pending:
            what = item.get("part")
            if what == "functionCall":
                what = f"function call {item.get('index')} ({item.get('name')!r})"
            elif what == "media":
                what = f"file {item.get('index')}"
            self.notes.append(
                f"envelope.parts[{i}]: a thought signature of route {self.route.id!r} for the "
                f"answer's {what} is left out of the request: its turn holds no such part (a "
                "signature goes back on the part it was written for, or not at all)")
        self.pending.clear()
        self.calls = self.media = 0
        self.started = False


def _signature_item(route: Route, part: Part, protocol: str) -> dict[str, Any] | None:
    """The thought-signature item of a reasoning part ``route`` produced, else ``None``."""
    found = reasoning_item(part)
    if found is None or found[0] != route.id or found[1] != protocol:
        return None
    item = found[2]
    if not isinstance(item.get(_SIGNATURE), str) or item.get("part") not in (
            "functionCall", "text", "media"):
        return None
    return item


def _usage(value: Any) -> Usage | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return unreadable_usage(value)
    u = value
    # Thinking tokens are billed as output. Gemini's JSON leaves out a count that is 0 (an
    # answer with no candidate tokens has no candidatesTokenCount); a prompt always has some.
    return reported_usage(
        u, ("promptTokenCount",), ("candidatesTokenCount", "thoughtsTokenCount"),
        required=("promptTokenCount",),
        cached=detail_count(u, "cachedContentTokenCount"),
        reasoning=detail_count(u, "thoughtsTokenCount"))


def _error(data: dict[str, Any]) -> ProviderErrorPayload:
    err = data.get("error")
    status = err.get("status") if isinstance(err, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err
    return ProviderErrorPayload(
        f"provider error {status or ''}: {provider_message(msg) if msg else 'no message'}",
        json.dumps(data),
    )


class GeminiCodec(Codec):
    """The Gemini ``generateContent`` protocol, as the module describes."""

    protocol = WireProtocol.GEMINI

    @staticmethod
    def url(endpoint: str, model: str, stream: bool) -> str:
        """The ``generateContent`` (or streaming SSE) URL of ``model`` under ``endpoint``."""
        base = endpoint.rstrip("/")
        if not _VERSIONED.search(base):
            base = join_url(base, "v1beta")
        name = model.removeprefix("models/")
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        return join_url(base, f"models/{quote(name, safe='-._@')}:{method}")

    def build_request(self, route: Route, envelope: Envelope) -> WireRequest:
        """A ``generateContent`` request; InvalidArgument for parts it cannot carry."""
        assert route.endpoint is not None  # checked by the engine before building
        system: list[str] = []
        contents: list[dict[str, Any]] = []
        notes: list[str] = []
        turn = _Turn(route, notes)

        def add(role: str, part: dict[str, Any]) -> None:
            if role != "model":
                turn.end()
            if contents and contents[-1]["role"] == role:
                contents[-1]["parts"].append(part)
            else:
                contents.append({"role": role, "parts": [part]})

        files_only = files_alone(envelope.parts)
        for i, p in wire_order(envelope.parts, files_only):
            if p.role == "system":
                system.append(p.content)
            elif p.role == "tool":
                require_tool_result(self.protocol, p, i)
                assert p.name is not None  # require_tool_result refused a part without one
                try:
                    response = json.loads(p.content)
                except (ValueError, RecursionError):
                    response = None
                if i in files_only:
                    # The files follow the turn's functionResponse parts (the response object
                    # every Gemini model takes is JSON), and the result says so, not nothing.
                    response = {"result": TOOL_FILES_TEXT}
                    notes.append(tool_files_note(route, envelope.parts, i, files_only[i]))
                elif not isinstance(response, dict):
                    response = {"result": p.content}
                add("user", {"functionResponse": {"name": p.name, "response": response}})
            elif p.role == "assistant" and p.tool_call_id:
                args = tool_arguments(p, i)
                assert p.name is not None  # tool_arguments refused a part without one
                call = {"functionCall": {"name": p.name, "args": args}}
                turn.call(call, p.name)
                add("model", call)
            elif p.kind is MediaKind.REASONING:
                item = _signature_item(route, p, self.protocol)
                if item is not None:
                    turn.signature(i, item)
                else:
                    notes.append(dropped_reasoning(route, p, i))
            elif p.media_type is not None:
                _kind, payload, link = media_of(p, i, route)
                mime = wire_media_type(p.media_type)
                # A file the model returned goes back in its own (model) turn, as Gemini's
                # multi-turn image editing sends it.
                role = "model" if p.role == "assistant" else "user"
                blob = ({"file_data": {"mime_type": mime, "file_uri": link}} if link is not None
                        else {"inline_data": {"mime_type": mime, "data": b64(payload or b"")}})
                if role == "model":
                    turn.file(blob)
                add(role, blob)
            elif p.role == "assistant":
                text = {"text": p.content}
                turn.text(text)
                # Gemini returns an empty text part to carry a thought signature, and takes it
                # back; an empty text part without one it refuses (an empty text parameter).
                if p.content or _SIGNATURE in text:
                    add("model", text)
                else:
                    notes.append(empty_text_note(route, i))
            elif not p.content:
                notes.append(empty_text_note(route, i))
            else:
                add("user", {"text": p.content})
        turn.end()
        require_answered(self.protocol, envelope.parts, route.id)
        nothing = message_refusal(self.protocol, envelope.parts)
        if nothing is not None:
            raise nothing.error()
        check_params(route, envelope.params)
        config: dict[str, Any] = {}
        top: dict[str, Any] = {}
        for key, value in envelope.params.items():
            if key in _TOP_LEVEL:
                top[key] = value
                continue
            name = _RENAME.get(key, key)
            if name == "stopSequences" and isinstance(value, str):
                value = [value]
            config[name] = value
        if envelope.max_output_tokens is not None:
            config["maxOutputTokens"] = envelope.max_output_tokens
        body: dict[str, Any] = {"contents": contents}
        if system:
            body["systemInstruction"] = {"parts": [{"text": s} for s in system]}
        if config:
            body["generationConfig"] = config
        body.update(top)
        if envelope.tools:
            body["tools"] = [
                {
                    "functionDeclarations": [
                        {
                            "name": t.name,
                            "description": t.description,
                            **({"parameters": t.parameters} if t.parameters else {}),
                        }
                        for t in envelope.tools
                    ]
                }
            ]
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream" if envelope.stream else "application/json",
        }
        return WireRequest(
            url=self.url(route.endpoint, route.model, envelope.stream), headers=headers, body=body,
            notes=tuple(notes),
            # A cached content may declare the tools itself (the request then may not).
            offers_tools=bool(envelope.tools) or "cachedContent" in envelope.params,
        )

    def auth_headers(self, secret: str) -> dict[str, str]:
        """``x-goog-api-key: <secret>`` (never the ``key=`` URL parameter: URLs get logged)."""
        return {"x-goog-api-key": secret}

    def parse_reply(self, data: Any) -> Reply:
        """A ``GenerateContentResponse`` body; an error object raises."""
        obj = require_object(data, "response body")
        reply = Reply()
        chunk = _Chunk(obj)
        try:
            chunk.apply(reply, [], whole=True)
            refuse_held(reply)
        except (MalformedPayload, ProviderErrorPayload) as exc:
            # Refused after a tool Gemini ran (executed code): never sent again (invariant 9).
            exc.provider_ran |= chunk.provider_ran
            raise
        reply.provider_ran = chunk.provider_ran
        return reply

    def new_stream(self) -> StreamState:
        """An accumulator of streamed ``GenerateContentResponse`` chunks."""
        return _GeminiStream()


class _Chunk:
    """One GenerateContentResponse (a whole body, or one stream chunk)."""

    def __init__(self, obj: dict[str, Any]) -> None:
        if "error" in obj and "candidates" not in obj:
            raise _error(obj)
        self.obj = obj
        self.provider_ran = False  # a part or metadata of a tool Gemini ran itself

    def apply(self, reply: Reply, out: list[StreamEvent], *, whole: bool) -> bool:
        """Fold the chunk into ``reply``; append events to ``out``; True if content arrived."""
        obj = self.obj
        version = optional_str(obj.get("modelVersion"), "modelVersion")
        if version:
            reply.model = version
        if obj.get("usageMetadata") is not None:
            reply.usage = _usage(obj["usageMetadata"])
        candidates = obj.get("candidates")
        if candidates is None or candidates == []:
            feedback = obj.get("promptFeedback")
            if isinstance(feedback, dict) and feedback.get("blockReason"):
                # Its usageMetadata (the prompt's tokens) is what the refusal is billed at.
                # The whole verdict on the request, streamed or not (``final``).
                raise ProviderErrorPayload(
                    f"prompt blocked: blockReason={feedback.get('blockReason')}", json.dumps(obj),
                    usage=reply.usage, model=reply.model, final=True)
            if whole:
                raise MalformedPayload("candidates is missing or empty")
            return False  # a usage-only chunk
        if not isinstance(candidates, list):
            raise MalformedPayload("candidates is not a list")
        cand = require_object(candidates[0], "candidates[0]")
        content_seen = False
        if _GROUNDING_KEYS & cand.keys():
            self.provider_ran = True  # it searched (Google Search, URL context) for the answer
        content = cand.get("content")
        parts = require_object(content, "candidate.content").get("parts") if content else []
        if parts is None:
            parts = []
        if not isinstance(parts, list):
            raise MalformedPayload("content.parts is not a list")
        for j, raw in enumerate(parts):
            part = require_object(raw, f"parts[{j}]")
            where = f"candidates[0].content.parts[{j}]"
            if part.keys() - _HOSTS_PART_KEYS:
                # executableCode, codeExecutionResult, a tool part added later: Gemini ran it.
                self.provider_ran = True
            signature = part.get(_SIGNATURE, part.get("thought_signature"))
            if signature is not None and (not isinstance(signature, str) or not signature):
                raise MalformedPayload(f"{where}.thoughtSignature is not a signature text")
            if part.get("thought"):
                if signature:
                    reply.notes.append(f"{where}: the thought signature of a thought summary is "
                                       "left out (the ledger carries no thought summaries)")
                continue  # thinking summaries are not answer text
            if "text" in part:
                text = optional_str(part.get("text"), "part.text") or ""
                if text:
                    content_seen = True
                    reply.text += text
                    out.append(TextDelta(text))
                if signature:
                    reply.reasoning.append({"part": "text", _SIGNATURE: signature})
            elif _MEDIA_KEYS & part.keys():
                content_seen = True
                if _take_media(reply, part, where) and signature:
                    reply.reasoning.append({"part": "media", "index": len(reply.media) - 1,
                                            _SIGNATURE: signature})
            elif "functionCall" in part:
                fc = require_object(part.get("functionCall"), "functionCall")
                name = optional_str(fc.get("name"), "functionCall.name")
                if not name:
                    raise MalformedPayload("functionCall has no name")
                index = len(reply.tool_calls)
                # A refused call is held: the usageMetadata may come in a later chunk.
                call = take_call(reply, ToolCall(
                    id=optional_str(fc.get("id"), "functionCall.id")
                    or made_up_call_id(),
                    name=name,
                    arguments_json=json.dumps(fc.get("args") or {}),
                ), "functionCall")
                content_seen = True
                if call is not None:
                    if signature:
                        reply.reasoning.append({"part": "functionCall", "index": index,
                                                "name": name, _SIGNATURE: signature})
                    out.append(ToolCallProposal(call))
        finish = optional_str(cand.get("finishReason"), "finishReason")
        if finish:
            reply.finish_reason = finish
            reason = finish.upper()
            if reason not in _ANSWERED and not (reply.text or reply.tool_calls or reply.media
                                                or reply.refused):
                # Nothing of an answer, and the provider says why: it refused this request's
                # content, as a blocked prompt is refused, or the model failed to answer it.
                # An empty success would count for the route's health and hand the caller
                # nothing. An answer cut short by the same reason after some text is that
                # text (a success whose finish_reason says so).
                said = "answer blocked" if reason in _BLOCKED else "no answer"
                raise ProviderErrorPayload(
                    f"{said}: finishReason={finish}", json.dumps(obj),
                    usage=reply.usage, model=reply.model, final=True,
                    provider_ran=self.provider_ran)
        return content_seen


_MEDIA_KEYS = frozenset({"inlineData", "inline_data", "fileData", "file_data"})
#: The keys of the parts that are the host's (text, thoughts, media, its own tools' calls) and
#: their metadata: a part with any other key (executableCode, codeExecutionResult, a tool part
#: added later) is something Gemini ran for the request, so the request is never sent again.
_HOSTS_PART_KEYS = _MEDIA_KEYS | frozenset({
    "text", "thought", _SIGNATURE, "thought_signature", "functionCall", "function_call",
    "videoMetadata", "video_metadata", "partMetadata", "part_metadata", "mediaResolution",
    "media_resolution"})
#: Candidate metadata that says Gemini ran a search or fetched pages for the answer.
_GROUNDING_KEYS = frozenset({"groundingMetadata", "grounding_metadata", "urlContextMetadata",
                             "url_context_metadata"})
# The finishReasons by which Gemini withholds an answer for its content (FinishReason).
_BLOCKED = frozenset({"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII",
                      "IMAGE_SAFETY", "IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION"})
# The finishReasons of a candidate that answered: with nothing in it, it is still what it says
# (MAX_TOKENS spent on thinking, an empty STOP). Every other reason of an empty candidate is a
# failure: the content refusals (_BLOCKED), a tool call or answer the model botched
# (MALFORMED_FUNCTION_CALL, UNEXPECTED_TOOL_CALL, TOO_MANY_TOOL_CALLS, MALFORMED_RESPONSE), a
# language it does not serve (LANGUAGE), no image made (NO_IMAGE, IMAGE_OTHER), OTHER, and any
# reason Gemini adds later: an empty success would count for the route's health.
_ANSWERED = frozenset({"STOP", "MAX_TOKENS", "FINISH_REASON_UNSPECIFIED"})


def _take_media(reply: Reply, part: dict[str, Any], where: str) -> bool:
    """An ``inlineData`` (bytes) or ``fileData`` (link) part of the answer, into ``reply``.

    Responses name the fields in camelCase; the snake_case the requests use is read too.
    True if it was added (else it is left out with a note).
    """
    inline = part.get("inlineData", part.get("inline_data"))
    if inline is not None:
        blob = require_object(inline, f"{where}.inlineData")
        return take_output_media(reply, f"{where}.inlineData",
                                 blob.get("mimeType", blob.get("mime_type")),
                                 b64data=blob.get("data"))
    ref = require_object(part.get("fileData", part.get("file_data")), f"{where}.fileData")
    uri = ref.get("fileUri", ref.get("file_uri"))
    if not isinstance(uri, str) or not uri:
        raise MalformedPayload(f"{where}.fileData has no fileUri")
    return take_output_media(reply, f"{where}.fileData",
                             ref.get("mimeType", ref.get("mime_type")), url=uri)


class _GeminiStream(StreamState):
    def __init__(self) -> None:
        super().__init__()
        self._reply = Reply()

    def feed(self, event: SSEEvent) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        chunk = _Chunk(parse_json_event(event))
        try:
            if chunk.apply(self._reply, out, whole=False):
                self.content_seen = True
        finally:
            self.provider_ran |= chunk.provider_ran
        r = self._reply
        self.usage, self.model = r.usage, r.model
        if r.finish_reason:
            self.finish_reason = r.finish_reason
            self.completed = True
        self.text_parts = [r.text]
        self.tool_calls = list(r.tool_calls)
        # Kept once set: the adapter holds a refusal of its own here too (no tools offered).
        self.refused = self.refused or r.refused
        # A streamed image or document arrives whole, in one chunk's part.
        self.media = list(r.media)
        self.reasoning = list(r.reasoning)
        self.notes = list(r.notes)
        return out


CODEC = GeminiCodec()
register_codec(CODEC)

__all__ = ["CODEC", "GeminiCodec"]
