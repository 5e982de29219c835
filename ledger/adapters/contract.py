"""The adapter contract: results, stream events, and what a protocol codec provides."""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, ClassVar, TypeAlias

from ledger.adapters.sse import SSEEvent
from ledger.domain.carried import files_alone, json_object, reasoning_item, sent_order
from ledger.domain.envelope import MODEL_DERIVED, Envelope, Part, tool_link_problem
from ledger.domain.facts import Observation, WireProtocol
from ledger.domain.media import (
    ACCEPTED_MEDIA_TYPES,
    URL_KINDS,
    DataUrlError,
    MediaKind,
    decode_data_url,
    kind_of,
    sniff_image_type,
)
from ledger.domain.params import refused_params
from ledger.domain.values import Route, canonical_json
from ledger.errors import InvalidArgument
from ledger.redaction import redact

# --------------------------------------------------------------------------------------------
# Results and events


@dataclass(frozen=True, slots=True)
class Usage:
    """The tokens the provider reported for one call (prompt and completion).

    ``cached_tokens`` (prompt tokens served from the provider's cache) and
    ``reasoning_tokens`` (completion tokens spent reasoning) are included in the two totals;
    ``None`` where the answer does not say them (each protocol's fields are in
    ``docs/adapters.md``).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the model proposed. ``arguments_json`` is the model's text, verbatim.

    An adapter's answer holds only calls whose arguments are a JSON object, whose ``name`` a
    part can keep and whose ``id`` a part can keep (:func:`proposed_call`); ``arguments`` is
    ``None`` only for one built by hand. ``provider_id`` is the id the provider gave the call
    when no part could keep it (over 200 characters, holding a line break or a NUL, blank):
    ``id`` is then one the adapter made up (:func:`made_up_call_id`), and a Run records the
    pair in a ``tool_call_id`` event. ``None`` otherwise.
    """

    id: str
    name: str
    arguments_json: str = "{}"
    provider_id: str | None = None

    @property
    def arguments(self) -> dict[str, Any] | None:
        """The arguments as an object, or ``None`` when they are not one a request can carry.

        :func:`~ledger.domain.carried.json_object`: a JSON object holding no NaN, infinity or
        lone surrogate.
        """
        return json_object(self.arguments_json)


@dataclass(frozen=True, slots=True)
class OutputMedia:
    """An image or a document the model returned: its bytes, or a link the provider gave.

    ``media_type`` is one the ledger carries (:mod:`ledger.domain.media`), as the wire named it
    (or, where the wire does not, as the bytes' signature says); exactly one of ``data`` and
    ``url`` (an ``https://`` link) is set. A turn's parts hold it as an assistant part of class
    ``model_derived`` (:func:`ledger.adapters.runner.output_parts`).
    """

    media_type: str
    data: bytes | None = None
    url: str | None = None


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of streamed answer text."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallProposal:
    """A complete tool-call proposal (delivered once its arguments are complete)."""

    call: ToolCall


@dataclass(frozen=True, slots=True)
class Reset:
    """Everything delivered so far for this call must be discarded: it is not an answer.

    ``reason`` is the transport kind (or ``provider_error``) that ended the stream, or
    ``cancelled`` when the adapter's client was closed under it (a local cancellation).
    """

    reason: str


StreamEvent: TypeAlias = TextDelta | ToolCallProposal | Reset
EventCallback: TypeAlias = Callable[[StreamEvent], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class AdapterResult:
    """The outcome of one physical call.

    On success ``observation`` is ``None``. On failure ``text`` and ``tool_calls`` are empty:
    whatever a stream delivered before it failed is in ``partial_text`` and is never an answer.
    ``usage`` and ``cost`` are ``None`` when the provider reported no usage, or usage the ledger
    cannot store (a count above 10^15 tokens or not a count at all, a usage that is not an
    object, a cost above 10^12): such a report is kept as ``rejected_usage`` (a value that is
    not a count as the provider sent it, a usage that is not an object as its JSON text),
    evidence for the record, and never handed on as a figure.

    ``sent`` is ``False`` exactly when no byte of the request was handed to the socket (connect
    refused, DNS and TLS failures, connect timeout, a route that cannot build a request), and
    ``True`` from the moment the request started to be written (a reset after that is sent).
    """

    ok: bool
    route_id: str
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage | None = None
    model_reported: str | None = None
    cost: Decimal | None = None
    finish_reason: str | None = None
    observation: Observation | None = None
    effective_output: bool = False
    http_status: int | None = None
    evidence: str | None = None
    partial_text: str = ""
    request_id: str | None = None
    elapsed_s: float = 0.0
    sent: bool = True
    # Opaque reasoning items of the answer (a Responses-API route's reasoning items, Anthropic's
    # thinking blocks, Gemini's thought signatures), as the data of the parts that carry them
    # back to this route (see reasoning_data).
    reasoning: tuple[bytes, ...] = ()
    # What the codec left out of the request and why (e.g. another route's reasoning items),
    # or of the answer (an image of a media type the ledger does not carry).
    notes: tuple[str, ...] = ()
    rejected_usage: Usage | None = None
    # The images and documents of the answer, in the order the provider sent them.
    media: tuple[OutputMedia, ...] = ()


# --------------------------------------------------------------------------------------------
# What a protocol codec provides: pure request building and response parsing


@dataclass(frozen=True, slots=True)
class WireRequest:
    """What a codec builds: the URL, the non-secret headers and the JSON body.

    ``notes`` say what of the envelope was left out, and why (logged, and returned on the
    result). ``offers_tools`` says whether the request lets the model propose tool calls (it
    carries tools: ``Envelope.tools``, or a parameter that brings its own, such as Gemini's
    ``cachedContent``); an answer proposing any to a request that offers none is malformed
    (:func:`offered_calls`). A codec that does not say is taken to offer them.
    """

    url: str
    headers: dict[str, str]
    body: dict[str, Any]
    notes: tuple[str, ...] = ()
    offers_tools: bool = True


@dataclass(slots=True)
class Reply:
    """What a codec parsed from an answer: text, tool calls, usage, served model, finish.

    ``reasoning`` holds the answer's opaque reasoning items (JSON objects: what the provider
    sent, or for Gemini a thought signature and the part it belongs to), for protocols that
    carry them between turns; ``media`` its images and
    documents; ``notes`` what of the answer was left out, and why.
    """

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage | None = None
    model: str | None = None
    finish_reason: str | None = None
    reasoning: list[dict[str, Any]] = field(default_factory=list)
    media: list[OutputMedia] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The provider ran something of its own for the request (a hosted tool): a failure found
    # after parsing (an answer no caller could store) is never sent again either.
    provider_ran: bool = False
    # The first refusal of a tool call no part can keep (take_call), held while the rest of
    # the answer is read: its usage may come after the call (and in a stream, does). The
    # answer is refused whole when complete (refuse_held), never handed on.
    refused: MalformedPayload | None = None


class MalformedPayload(ValueError):
    """A body or event that does not have the protocol's shape, or an answer not to carry.

    An answer the ledger cannot carry (a Responses ``custom_tool_call``) is refused as one.

    ``usage`` and ``model`` are what the answer reported (it was run, and may be billed).
    ``final``: in a stream, raised on the answer's own completion, so the whole answer is
    known and refused as the same whole body is (phase ``after_headers``), not as a stream
    that broke off (``mid_stream``, whose execution is unknown). A tool call no part can keep
    is refused so (:func:`take_call`, :func:`refuse_held`), with the answer's usage.
    ``provider_ran``: the refused answer shows the provider already ran something on the
    request's behalf (:attr:`StreamState.provider_ran`), so it is never sent again.
    """

    def __init__(self, message: str, *, usage: Usage | None = None, model: str | None = None,
                 final: bool = False, provider_ran: bool = False) -> None:
        super().__init__(message)
        self.usage = usage
        self.model = model
        self.final = final
        self.provider_ran = provider_ran


#: The most tool calls one answer may propose; one more makes the answer ``malformed_event``.
#: Providers propose a handful in parallel (OpenAI takes at most 128 tools in a request),
#: while a hostile body of 16 MiB could otherwise propose 275,000, each held and recorded.
MAX_TOOL_CALLS = 128


def proposed_call(call: ToolCall, calls: Sequence[ToolCall], where: str) -> ToolCall:
    """``call``, checked before it joins ``calls`` (the answer's proposals so far).

    The host sends a proposal back as an assistant part in the next turn, and the answer's
    parts are built from it when the Attempt settles, so what no part can keep is settled
    here, by the part's own rules (:func:`~ledger.domain.envelope.tool_link_problem`):

    * its arguments must be a JSON object a request body can carry (no NaN, infinity or lone
      surrogate; :func:`ledger.domain.carried.tool_arguments`, the same rule), and its name a
      part's ``name`` (at most 200 printable characters): the host dispatches by the name, so
      it cannot be changed, and either is the provider's malformed answer, not a success;
    * an id no part's ``tool_call_id`` can be (over 200 characters, a line break or a NUL,
      blank) is only the provider's handle for the call, which the request sends back with
      its result: the call gets a made-up one (:func:`made_up_call_id`), as a call without
      an id does, and keeps the provider's as ``provider_id``.
    """
    if len(calls) >= MAX_TOOL_CALLS:
        raise MalformedPayload(
            f"the answer proposes more than {MAX_TOOL_CALLS} tool calls (MAX_TOOL_CALLS)")
    problem = tool_link_problem("name", call.name)
    if problem is not None:
        raise MalformedPayload(
            f"{where}: the name of tool call {call.name[:64]!r} {problem}: no conversation can "
            "carry it back (a tool's name is at most 200 printable characters)")
    if call.arguments is None:
        raise MalformedPayload(
            f"{where}: the arguments of tool call {call.name[:64]!r} are not a JSON object a "
            f"request can carry back: {call.arguments_json[:64]!r}")
    if tool_link_problem("tool_call_id", call.id) is not None:
        return replace(call, id=made_up_call_id(), provider_id=call.id)
    return call


def take_call(into: Reply | StreamState, call: ToolCall, where: str) -> ToolCall | None:
    """``call`` checked (:func:`proposed_call`) and added to ``into.tool_calls``.

    ``None`` when the answer is refused: a call no part can keep is held in ``into.refused``
    rather than raised (the first one; no later call is checked or added), and the rest of the
    answer is read on. Its usage may come after the call (a stream reports it at the end), and
    the provider ran the whole answer: :func:`refuse_held` then refuses it with that usage, so
    the failed Attempt is posted at the usage's cost rather than the whole hold, and a stream
    is refused on its completion, as the whole body is (``final``), not as one that broke off.
    """
    if into.refused is not None:
        return None
    try:
        taken = proposed_call(call, into.tool_calls, where)
    except MalformedPayload as exc:
        into.refused = exc
        return None
    into.tool_calls.append(taken)
    return taken


def refuse_held(reply: Reply) -> Reply:
    """``reply``, unless it holds a refusal (:func:`take_call`): that is raised.

    With the usage and model the answer reported, as the refusal of the whole, complete
    answer (``final``): for a body its parsing is done, for a stream it ended.
    """
    exc = reply.refused
    if exc is None:
        return reply
    exc.usage = exc.usage or reply.usage
    exc.model = exc.model or reply.model
    exc.provider_ran |= reply.provider_ran
    exc.final = True
    raise exc


def offered_calls(calls: Sequence[ToolCall], offers_tools: bool) -> None:
    """Refuse (:class:`MalformedPayload`) tool calls proposed to a request that offered none.

    The model could only have called a tool of its own invention, which the host has no way
    to run: the provider's malformed answer, as a call whose arguments are not a JSON object
    is (:func:`proposed_call`), never a success. Calls to tools other than those offered are
    the host's to judge (it knows its tools), and not refused here.
    """
    if calls and not offers_tools:
        raise MalformedPayload(
            f"the answer proposes tool call {calls[0].name[:64]!r} but the request offered "
            "no tools")


class ProviderErrorPayload(Exception):
    """The provider answered with an error object (in a stream, or in a 2xx body).

    ``usage`` and ``model`` are what a whole failed answer still reported (a Responses-API
    response that failed or was incomplete is billed): the result keeps them.

    ``final``: in a stream, the event is the answer's own final status, the very object a whole
    body carries (the Responses API's ``response.failed`` and ``response.incomplete`` hold the
    whole response). The provider's verdict is then complete and known, so the failure is
    observed as the same whole body is (phase ``after_headers``), not as a stream that broke
    off (``mid_stream``, which no policy resubmits unless it resubmits unknown executions).
    An error event that comes before any content is observed as a verdict too (``after_headers``,
    as the error status it stands for), whatever ``final`` says: no answer was begun. One that
    comes after the provider ran something for the request (a hosted tool's call or result:
    :attr:`StreamState.provider_ran`) is not: an answer was under way (``mid_stream``).
    Whether its text reached the caller is ``effective_output``'s to say, as for any failure.

    ``provider_ran``: the failed answer itself shows the provider already ran something on the
    request's behalf (a failed Responses response whose ``output`` holds an ``mcp_call``): the
    failure is observed with ``tool_started``, which no policy sends again (invariant 9).
    """

    def __init__(self, message: str, body: str, *, usage: Usage | None = None,
                 model: str | None = None, final: bool = False,
                 provider_ran: bool = False) -> None:
        super().__init__(message)
        self.body = body
        self.usage = usage
        self.model = model
        self.final = final
        self.provider_ran = provider_ran


def error_extras(obj: Mapping[str, Any], usage_of: Callable[[Any], Usage | None],
                 model_key: str = "model") -> tuple[Usage | None, str | None]:
    """``(usage, model)`` an error object's answer still reports beside its error.

    Read only where they have their shape (a usage object, a model name): the error is the
    provider's verdict, and a stray field beside it must not turn that verdict into a malformed
    answer (the evidence body keeps whatever was sent).
    """
    raw_usage = obj.get("usage")
    model = obj.get(model_key)
    return (usage_of(raw_usage) if isinstance(raw_usage, Mapping) else None,
            model if isinstance(model, str) and model else None)


def provider_message(value: Any, limit: int = 200) -> str:
    """A provider's error text for a message, at most ``limit`` characters.

    It is redacted whole first, then shortened: a secret cut in half would no longer be
    recognised.
    """
    text = redact(str(value))
    return text if len(text) <= limit else text[:limit] + "..."


def require_object(value: Any, what: str) -> dict[str, Any]:
    """``value`` if it is a JSON object, else :class:`MalformedPayload` naming ``what``."""
    if not isinstance(value, dict):
        raise MalformedPayload(f"{what} is not a JSON object")
    return value


def optional_str(value: Any, what: str) -> str | None:
    """``value`` if it is a string or ``None``, else :class:`MalformedPayload`."""
    if value is None or isinstance(value, str):
        return value
    raise MalformedPayload(f"{what} is not a string")


def is_token_count(value: Any) -> bool:
    """Whether ``value`` is a token count as JSON carries one (a non-negative integer)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _total(u: Mapping[str, Any], keys: Sequence[str]) -> Any:
    """The sum of the counts at ``keys`` (an absent one is 0).

    Or the first value that is not a count, as the provider sent it.
    """
    total = 0
    for key in keys:
        value = u.get(key)
        if value is None:
            continue
        if not is_token_count(value):
            return value
        total += value
    return total


def detail_count(obj: Any, key: str) -> int | None:
    """A usage detail (cached or reasoning tokens): ``None`` when not reported.

    A value that is not a count is returned as the provider sent it: the retry owner keeps
    the totals and records the detail in a ``usage_invalid`` event.
    """
    if not isinstance(obj, Mapping) or obj.get(key) is None:
        return None
    value: int = obj[key]  # a count, or the provider's value for the usage_invalid event
    return value


def unreadable_usage(value: Any) -> Usage:
    """The report of a usage that is present but not a JSON object (``"usage": []``).

    No count can be read from it, yet the answer is not malformed for it: the provider ran the
    call, and a hostile or buggy counter must not turn a delivered answer into a failure. Both
    totals hold the value's JSON text (``"[]"``, ``'"x"'``, ``"7"``), never a count even when
    the value is a number, so the adapter's billing check rejects the report as one whose
    counts are not counts (``rejected_usage``): the answer is served with the whole hold
    posted and the report kept in a ``usage_invalid`` event.
    """
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):  # nested too deep to write here
        text = f"a JSON {type(value).__name__} nested too deep to write"
    # Text, not a count: what the usage_invalid event keeps (see above).
    sent: Any = text
    return Usage(prompt_tokens=sent, completion_tokens=sent)


def reported_usage(u: Mapping[str, Any], prompt: Sequence[str], completion: Sequence[str], *,
                   required: Sequence[str], cached: int | None = None,
                   reasoning: int | None = None) -> Usage | None:
    """The usage a protocol's usage object ``u`` reports.

    The prompt and completion totals are the sums of the counts at the keys ``prompt`` and
    ``completion`` name (an absent one is 0). A report without one of the ``required`` keys
    is no report (``None``): the whole hold is posted, never a zero the provider did not say
    (``"usage": {}``, or only ``total_tokens``).

    A value that is not a token count (``2.0``, ``"10"``, ``-1``) does not make the answer
    malformed: the provider ran the call. The total keeps the value as sent, so the adapter's
    billing check rejects the report like one out of range (``rejected_usage``): the answer
    is served with the whole hold posted and the report kept in a ``usage_invalid`` event.
    """
    if any(u.get(key) is None for key in required):
        return None
    # Either total may hold the provider's non-count value (see above).
    prompt_total: int = _total(u, prompt)
    completion_total: int = _total(u, completion)
    return Usage(prompt_tokens=prompt_total, completion_tokens=completion_total,
                 cached_tokens=cached, reasoning_tokens=reasoning)


class StreamState(ABC):
    """Accumulates one protocol's stream; :meth:`feed` returns the events to deliver."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.usage: Usage | None = None
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.reasoning: list[dict[str, Any]] = []
        self.media: list[OutputMedia] = []  # whole images and documents, as they completed
        self.notes: list[str] = []
        self.terminated = False  # the protocol's terminator arrived
        self.completed = False  # the protocol's completion signal arrived
        # Any text, host tool-call fragment or media the model returned: the host's content.
        self.content_seen = False
        # The provider ran something on the request's behalf: any output item or block other
        # than text, reasoning and the host's own tool calls (a hosted MCP call, a web search,
        # executed code). Decided by exclusion, so a hosted tool type added later counts too.
        # A failure after it is observed with ``tool_started``: sending the request again, on
        # any route, would run that tool again (invariant 9).
        self.provider_ran = False
        # A tool call no part can keep (take_call): nothing more is delivered, and the answer
        # is refused when it completes (reply), with the usage it reported by then.
        self.refused: MalformedPayload | None = None

    @property
    def begun(self) -> bool:
        """Whether the answer has begun: content arrived, or the provider ran a hosted tool.

        This stops the first-token clock (and marks the first token): a hosted tool is the
        provider working on the answer, not silence, and once it ran the failure is never
        sent again (``tool_started``), so a first-token limit could only cut off an answer
        under way, not move a slow route's request on. Reasoning alone has not begun it.
        """
        return self.content_seen or self.provider_ran

    @abstractmethod
    def feed(self, event: SSEEvent) -> list[StreamEvent]:
        """Consume one SSE event. Raises MalformedPayload or ProviderErrorPayload."""

    def end(self) -> list[StreamEvent]:
        """The body ended (or the terminator arrived): flush anything complete."""
        return []

    def reply(self) -> Reply:
        """What the stream accumulated, as the :class:`Reply` a whole body would have parsed to.

        Raises:
            MalformedPayload: the answer holds a refusal (:func:`take_call`), raised as the
                whole body's would be (:func:`refuse_held`), with the usage reported.
        """
        return refuse_held(Reply(
            text="".join(self.text_parts),
            tool_calls=list(self.tool_calls),
            usage=self.usage,
            model=self.model,
            finish_reason=self.finish_reason,
            reasoning=list(self.reasoning),
            media=list(self.media),
            notes=list(self.notes),
            refused=self.refused,
        ))


def _int_or_infinity(digits: str) -> int | float:
    """A JSON integer, or an infinity of its sign when it is too long for ``int()``."""
    try:
        return int(digits)
    except ValueError:  # past sys.get_int_max_str_digits(): no provider counts that high
        return -math.inf if digits.startswith("-") else math.inf


def provider_json(data: str | bytes) -> Any:
    """A provider's JSON text (a body, an event's data) parsed; :class:`ValueError` if not JSON.

    An integer too long for Python's ``int()`` (over 4,300 digits by default) does not make
    the text unparseable: it becomes an infinity, a number out of every range, which the
    rules of its field then refuse as any other (a usage count as one out of range, so a
    complete answer stands). Parsed again only then: every other text takes the default
    parser's fast path.
    """
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError:  # int() refused a digit string
        return json.loads(data, parse_int=_int_or_infinity)


def parse_json_event(event: SSEEvent) -> dict[str, Any]:
    """An SSE event's data as a JSON object, else :class:`MalformedPayload`."""
    try:
        value = provider_json(event.data)
    except (ValueError, RecursionError) as exc:
        raise MalformedPayload(f"event data is not JSON: {exc}") from exc
    return require_object(value, "event data")


class Codec(ABC):
    """One wire protocol: pure functions from an Envelope to a request, and back from bytes."""

    protocol: ClassVar[WireProtocol]

    @abstractmethod
    def build_request(self, route: Route, envelope: Envelope) -> WireRequest:
        """URL, non-secret headers and JSON body. Raises InvalidArgument on misuse."""

    @abstractmethod
    def auth_headers(self, secret: str) -> dict[str, str]:
        """The headers that carry the credential (never the URL: URLs end up in logs)."""

    @abstractmethod
    def parse_reply(self, data: Any) -> Reply:
        """A non-streaming body. Raises MalformedPayload or ProviderErrorPayload."""

    @abstractmethod
    def new_stream(self) -> StreamState:
        """A fresh accumulator for one streamed answer."""


_CODECS: dict[WireProtocol, Codec] = {}


def register_codec(codec: Codec) -> None:
    """Make ``codec`` the one used for routes of ``codec.protocol``."""
    _CODECS[codec.protocol] = codec


def codec_for(protocol: WireProtocol) -> Codec:
    """The codec registered for ``protocol``.

    Raises:
        InvalidArgument: no codec is registered for it (``field`` is ``route.protocol``).
    """
    try:
        return _CODECS[protocol]
    except KeyError:
        raise InvalidArgument(
            f"no adapter for protocol {protocol.value!r}; set Route.protocol to one of "
            f"{sorted(p.value for p in _CODECS)} or register a codec with register_codec()",
            field="route.protocol",
        ) from None


def join_url(endpoint: str, path: str) -> str:
    """``endpoint`` and ``path`` joined by exactly one slash."""
    return endpoint.rstrip("/") + "/" + path.lstrip("/")


def check_params(route: Route, params: Mapping[str, Any]) -> None:
    """Refuse (InvalidArgument) parameters a request may not carry on ``route``.

    Those are parameters that would overwrite the request's structure or that ``route``'s
    protocol refuses (:data:`~ledger.domain.params.RESERVED_PARAMS`) and those the route
    declares it does not support (``Capabilities.parameters``). A turn never gets here with
    one: preflight makes such a route ineligible before any Attempt is begun
    (:func:`~ledger.domain.params.refused_params`); this is for a codec called directly.
    """
    refused = refused_params(route, params)
    if refused:
        raise refused[0].error()


# --------------------------------------------------------------------------------------------
# Images, documents and reasoning items


def reasoning_data(route: Route, item: Mapping[str, Any]) -> bytes:
    """The data of a part that carries ``item`` (a reasoning item) back to ``route``.

    Canonical JSON of the route's id and protocol and the item, so the part hashes alike
    whoever rebuilds it from the same answer.
    """
    return canonical_json({"route": route.id, "protocol": route.protocol.value,
                           "item": dict(item)}).encode("utf-8")


def dropped_reasoning(route: Route, part: Part, index: int) -> str:
    """The note of a reasoning item left out of a request to ``route`` (another route's)."""
    found = reasoning_item(part)
    origin = f"route {found[0]!r} ({found[1]})" if found else "an unreadable origin"
    return (f"envelope.parts[{index}]: a reasoning item of {origin} is left out of the request "
            f"to route {route.id!r} ({route.protocol.value}): reasoning is carried only to the "
            "route that produced it (another route cannot read it); the conversation's text and "
            "tool calls go on")


def empty_text_note(route: Route, index: int) -> str:
    """The note of an empty text part left out of a request to ``route``."""
    return (f"envelope.parts[{index}]: an empty text part is left out of the request to route "
            f"{route.id!r}: {route.protocol.value} refuses an empty text block (an answer "
            "that stopped while thinking has no text)")


#: The text that goes before an image or a document a model returned earlier, where the
#: protocol carries files in user messages only (see :func:`assistant_media_note`).
ASSISTANT_MEDIA_TEXT = "[The next file is one the assistant returned in an earlier answer.]"


def assistant_media_note(route: Route, part: Part, index: int) -> str:
    """The note of an assistant's image or document sent in a user message to ``route``."""
    what = "image" if part.kind is MediaKind.IMAGE else "document"
    return (f"envelope.parts[{index}]: an {what} the model returned ({part.media_type}) is sent "
            f"to route {route.id!r} in a user message, after the text "
            f"{ASSISTANT_MEDIA_TEXT!r}: {route.protocol.value} carries images and documents "
            "in user messages only")


def take_output_media(into: Reply | StreamState, where: str, media_type: Any, *,
                      b64data: Any = None, url: Any = None) -> bool:
    """Add an image or a document of the answer to ``into.media``; True if it was added.

    ``b64data`` is the base64 of its bytes, ``url`` a link (an ``https://`` one the provider
    serves, or a ``data:`` URL, which is decoded); ``media_type`` the type the wire names, or
    ``None`` when it names none (an image's type is then read from its signature). What the
    ledger cannot carry as a part (a media type it does not accept, bytes that are not what
    their type says, a link that is not ``https://``) is left out with a note in
    ``into.notes``: the rest of the answer stands.

    Raises:
        MalformedPayload: the bytes are not base64, or the ``data:`` URL does not decode (the
            answer is not the protocol's shape).
    """
    data: bytes | None = None
    link: str | None = None
    if b64data is not None:
        if not isinstance(b64data, str):
            raise MalformedPayload(f"{where} data is not base64 text")
        try:
            data = base64.b64decode(b64data, validate=True)
        except (binascii.Error, ValueError):
            raise MalformedPayload(f"{where} data is not valid base64") from None
    elif isinstance(url, str) and url[:5].lower() == "data:":
        try:
            own, data = decode_data_url(url)
        except DataUrlError as exc:
            raise MalformedPayload(f"{where} data URL {exc}") from None
        media_type = media_type or own
    elif isinstance(url, str):
        link = url
    else:
        raise MalformedPayload(f"{where} carries neither data nor a URL")
    if isinstance(media_type, str):
        media_type = media_type.split(";")[0].strip().lower() or None
    elif media_type is not None:
        raise MalformedPayload(f"{where} media type is not a string")
    if media_type is None and data is not None:
        media_type = sniff_image_type(data)
    what = f"{where}: a file the model returned ({media_type or 'no media type'})"
    if media_type is None or kind_of(media_type) in (None, MediaKind.REASONING):
        into.notes.append(f"{what} is left out of the answer: the ledger carries "
                          f"{', '.join(ACCEPTED_MEDIA_TYPES)} only")
        return False
    try:
        # The part a turn will hold: what cannot be one is left out here, not at settle.
        part = Part(role="assistant", data_class=MODEL_DERIVED, media_type=media_type,
                    **({"data": data} if data is not None else {"url": link}))
    except InvalidArgument as exc:
        into.notes.append(f"{what} is left out of the answer: {exc.message}")
        return False
    into.media.append(OutputMedia(media_type=part.media_type or media_type, data=data,
                                  url=link))
    return True


def media_of(part: Part, index: int, route: Route) -> tuple[MediaKind, bytes | None,
                                                                    str | None]:
    """``(kind, bytes, link)`` of an image or document part (exactly one of the two is set).

    Raises:
        InvalidArgument: a link of a kind ``route``'s protocol cannot carry (preflight skips
            such a route: the selector never sends it there).
    """
    kind = part.kind
    assert kind is not None and kind is not MediaKind.REASONING
    payload = part.payload
    link = part.link
    if link is not None and kind not in URL_KINDS.get(route.protocol, frozenset()):
        raise InvalidArgument(
            f"protocol {route.protocol.value} carries no {kind.value} by link (the ledger never "
            f"fetches one); send the file's bytes as data=, or use a route whose protocol takes "
            f"links; preflight should have refused route {route.id!r}",
            field=f"envelope.parts[{index}].url")
    return kind, payload, link


def document_text(payload: bytes) -> str:
    """A plain-text document's text (UTF-8, checked when its part was built)."""
    return payload.decode("utf-8")


def made_up_call_id() -> str:
    """An id for a tool call the provider gave none: ``call_`` and 24 random hex digits.

    Random, not positional: a ``call_0`` would come back in every answer, so a conversation
    would hold two calls of one id (Anthropic refuses a request whose ``tool_use`` ids repeat,
    and a result would answer the wrong call).
    """
    return "call_" + os.urandom(12).hex()


def wire_order(parts: Sequence[Part], alone: Mapping[int, tuple[int, ...]] | None = None
               ) -> list[tuple[int, Part]]:
    """The envelope's parts, each with its index, in the order every codec sends them.

    The order is the envelope's except within a turn's tool results: a run of consecutive
    ``tool`` parts and user files that opens with a ``tool`` part or right after the
    assistant's tool calls (:func:`~ledger.domain.carried.result_runs`). There the ``tool``
    parts come first, in their order, then the files, in theirs. A tool's file is a user part
    next to its text result (``run.tool_result(call, text)`` then ``run.tool_result(call,
    file)``, call after call), and sent where it stands it would split the results: chat
    completions refuses anything between an assistant message's ``tool_calls`` and a ``tool``
    message for each of them, Anthropic a user message whose ``tool_result`` blocks do not
    come first.

    A call whose tool returned files alone and that no ``tool`` part answers
    (``run.tool_result(call, Part(...))`` alone) gets the empty ``tool`` part it lacks, with
    the call's name, among the results where its first file stands, and with the call's
    index (:func:`~ledger.domain.carried.files_alone`): every wire refuses a call without its
    result, and the codecs send its files as that result, as for an empty result beside its
    files. ``alone``: the parts' :func:`~ledger.domain.carried.files_alone`, when the caller
    has it already (a codec, which sends those files itself).
    """
    if alone is None:
        alone = files_alone(parts)
    return [(k, parts[k]) if call is None else (call, _empty_result(parts[call]))
            for k, call in sent_order(parts, alone)]


def _empty_result(call: Part) -> Part:
    """The empty result of ``call`` (an assistant tool-call part), which its files carry."""
    return Part(role="tool", content="", tool_call_id=call.tool_call_id, name=call.name,
                provenance=call.tool_call_id)


#: The text of a tool result that is files alone, where the protocol carries only text in a
#: tool result (chat completions' ``tool`` message, Gemini's ``functionResponse``): the files
#: follow the turn's tool results, and this says so (see
#: :func:`~ledger.domain.carried.files_alone`).
TOOL_FILES_TEXT = "[The tool returned no text, only the files that follow the tool results.]"


def tool_files_note(route: Route, parts: Sequence[Part], index: int,
                    files: Sequence[int]) -> str:
    """The note of a tool result that is files alone, sent as :data:`TOOL_FILES_TEXT`.

    ``index`` is the empty ``tool`` part's, or the call's for one no ``tool`` part answers
    (:func:`~ledger.domain.carried.files_alone`).
    """
    shown = ", ".join(f"envelope.parts[{k}]" for k in files)
    what = ("the tool call has no tool part, only the files" if parts[index].role == "assistant"
            else "the tool result has no text, only the files")
    return (f"envelope.parts[{index}]: {what} {shown}: "
            f"{route.protocol.value} carries no file in a tool result, so the result is sent "
            f"as {TOOL_FILES_TEXT!r} and the files after the turn's tool results")
