"""The adapter contract: results, stream events, and what a protocol codec provides."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, ClassVar, TypeAlias

from ledger.adapters.sse import SSEEvent
from ledger.domain.envelope import Envelope
from ledger.domain.facts import Observation, WireProtocol
from ledger.domain.values import Route
from ledger.errors import InvalidArgument
from ledger.redaction import redact

# --------------------------------------------------------------------------------------------
# Results and events


@dataclass(frozen=True, slots=True)
class Usage:
    """The tokens the provider reported for one call (prompt and completion)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the model proposed. ``arguments_json`` is the model's text, verbatim."""

    id: str
    name: str
    arguments_json: str = "{}"

    @property
    def arguments(self) -> dict[str, Any] | None:
        """The arguments as an object, or ``None`` when the model's JSON is not an object."""
        try:
            value = json.loads(self.arguments_json or "{}")
        except (ValueError, RecursionError):
            return None
        return value if isinstance(value, dict) else None


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

    ``reason`` is the transport kind (or ``provider_error``) that ended the stream.
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
    cannot store (a count above 10^15 tokens, a cost above 10^12): such a report is kept as
    ``rejected_usage``, evidence for the record, and never handed on as a figure.

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
    rejected_usage: Usage | None = None


# --------------------------------------------------------------------------------------------
# What a protocol codec provides: pure request building and response parsing


@dataclass(frozen=True, slots=True)
class WireRequest:
    """What a codec builds: the URL, the non-secret headers and the JSON body."""

    url: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass(slots=True)
class Reply:
    """What a codec parsed from an answer: text, tool calls, usage, served model, finish."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage | None = None
    model: str | None = None
    finish_reason: str | None = None


class MalformedPayload(ValueError):
    """A body or event that does not have the protocol's shape."""


class ProviderErrorPayload(Exception):
    """The provider answered with an error object (in a stream, or in a 2xx body)."""

    def __init__(self, message: str, body: str) -> None:
        super().__init__(message)
        self.body = body


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


def token_count(value: Any, what: str) -> int:
    """``value`` as a token count (``None`` is 0), else :class:`MalformedPayload`."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedPayload(f"{what} is not a token count")
    return value


class StreamState(ABC):
    """Accumulates one protocol's stream; :meth:`feed` returns the events to deliver."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.usage: Usage | None = None
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.terminated = False  # the protocol's terminator arrived
        self.completed = False  # the protocol's completion signal arrived
        self.content_seen = False  # any text or tool-call fragment (stops the first-token clock)

    @abstractmethod
    def feed(self, event: SSEEvent) -> list[StreamEvent]:
        """Consume one SSE event. Raises MalformedPayload or ProviderErrorPayload."""

    def end(self) -> list[StreamEvent]:
        """The body ended (or the terminator arrived): flush anything complete."""
        return []

    def reply(self) -> Reply:
        """What the stream accumulated, as the :class:`Reply` a whole body would have parsed to."""
        return Reply(
            text="".join(self.text_parts),
            tool_calls=list(self.tool_calls),
            usage=self.usage,
            model=self.model,
            finish_reason=self.finish_reason,
        )


def parse_json_event(event: SSEEvent) -> dict[str, Any]:
    """An SSE event's data as a JSON object, else :class:`MalformedPayload`."""
    try:
        value = json.loads(event.data)
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


def check_params(route: Route, params: Mapping[str, Any], reserved: set[str]) -> None:
    """Refuse (InvalidArgument) parameters a request may not carry on ``route``.

    Those are parameters that would overwrite the request's structure (``reserved``) and those
    the route declares it does not support (``Capabilities.parameters``).
    """
    for name in params:
        if name in reserved:
            raise InvalidArgument(
                f"Envelope.params may not set {name!r}: the adapter builds it from the envelope",
                field=f"envelope.params.{name}",
            )
        allowed = route.capabilities.parameters
        if allowed is not None and name not in allowed:
            raise InvalidArgument(
                f"route {route.id!r} does not support parameter {name!r} (supported: {allowed}); "
                "drop it or add it to Capabilities.parameters",
                field=f"envelope.params.{name}",
            )


def tool_arguments(part_content: str, field_name: str) -> dict[str, Any]:
    """The arguments of an assistant tool-call part, which carries them as a JSON object."""
    try:
        value = json.loads(part_content or "{}")
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise InvalidArgument(
            "an assistant part with tool_call_id carries the call's arguments as a JSON object "
            "in its content",
            field=field_name,
        )
    return value
