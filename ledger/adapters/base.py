"""The one httpx engine behind every protocol: :class:`HttpAdapter`.

The contract it keeps (results, stream events, what a codec provides) is
:mod:`ledger.adapters.contract`; the codecs are :mod:`~ledger.adapters.openai`,
:mod:`~ledger.adapters.openai_responses`, :mod:`~ledger.adapters.anthropic` and
:mod:`~ledger.adapters.gemini`, the transport mapping is
:mod:`ledger.adapters.transport` and the blocking facade :mod:`ledger.adapters.sync`.

The engine is written once, as a generator of I/O steps (:mod:`ledger.adapters.exchange`):
:class:`HttpAdapter` awaits its steps on the running loop with ``httpx.AsyncClient``, and
:class:`~ledger.adapters.sync.SyncAdapter` performs them on the calling thread with
``httpx.Client``. Everything below holds for both.

An adapter call sends one request on one route and reports exactly what happened. It never raises
for a provider or transport failure, nor for a route whose configuration cannot make a request:
every such failure comes back as an :class:`AdapterResult` with ``ok=False``, ``sent`` saying
whether any byte of the request was handed to the socket, and an
:class:`~ledger.domain.facts.Observation` (transport kind, phase, status, effective output, redacted
evidence). A route that cannot build a request (no endpoint or not a usable http(s) URL, no codec
for its protocol, no secret for its profile or one that cannot go in a header, a body its codec
made that cannot be JSON-encoded, a codec header named like one of the headers that carry the
Attempt's id, a codec header HTTP cannot carry, a codec's ``build_request`` that raises anything
but InvalidArgument or an ``auth_headers`` that raises, a request head h11 refuses before writing
it) is transport ``cannot_build``, phase ``before_send``, source ``local``, with a redacted
message naming the problem and the fix. Only caller misuse (a profile id that is not the
route's, an envelope without parts, streaming, tools or prefill the route's capabilities refuse,
envelope parts or parameters the codec cannot map, text or params no JSON body can carry: a
lone surrogate, NaN) raises :class:`~ledger.errors.InvalidArgument`, always
before anything is sent; a Run's turn never meets one of these here with the built-in codecs:
preflight finds each of them before an Attempt is begun (:mod:`ledger.domain.params`,
:mod:`ledger.domain.carried`). Cancellation by the caller (``asyncio.CancelledError``) and
exceptions raised by the caller's own ``on_event`` callback propagate unchanged: they are the
caller's facts, not the provider's. A failure is put on ``progress.failure`` before its
:class:`Reset` is delivered, so a callback that raises there (or a cancellation while it runs)
does not hide it: the retry owner settles the Attempt with it, then lets the exception go on.

The engine owns no retries: httpx transports are built with ``retries=0`` and nothing here loops.
The Run is the only retry owner.

Transport mapping. Phases follow how far the request got, which httpcore's ``trace`` extension
tells us exactly (``send_request_headers.started`` = the first request byte was handed to the
socket; ``receive_response_headers.complete`` = a status line and headers arrived):

=====================================  ==============================  ======================
what happened                          transport kind                  phase
=====================================  ==============================  ======================
the route cannot build a request       cannot_build                    before_send
LocalProtocolError before any byte     cannot_build                    before_send
  left (h11 refused the request's head)
ConnectError caused by socket.gaierror dns_failure                     before_send
ConnectError caused by ssl.SSLError    tls_error                       before_send
  (certificate, version, handshake;
  not the peer hanging up)
ConnectError caused by ECONNREFUSED    connect_refused                 before_send
ConnectError: reset / EOF in handshake connection_reset                before_send
ConnectError, other OSError            connect_refused                 before_send
ConnectTimeout, PoolTimeout            connect_timeout                 before_send
ProxyError: the proxy refused the      connect_refused                 before_send
  CONNECT tunnel (403, 502, 407...)
ReadError before headers               connection_reset                after_send
RemoteProtocolError before headers,    connection_reset                after_send
  server closed without a response
RemoteProtocolError before headers,    protocol_error                  after_send
  unparsable response
ReadTimeout before headers             read_timeout                    after_send
WriteTimeout (request partly written)  read_timeout                    after_send
ReadError / peer closed mid-body       stream_cut                      mid_stream
RemoteProtocolError mid-body, other    protocol_error                  mid_stream
ReadTimeout mid-body                   stream_stall                    mid_stream
no byte for idle_timeout_s mid-body    stream_stall                    mid_stream
no content by first_token_timeout_s    first_token_timeout             after_headers, or
  (streaming only)                                                     after_send before them
total_timeout_s ran out                total_timeout                   how far it got
clean end without completion signal    stream_cut                      mid_stream
event not parsable / wrong shape       malformed_event                 mid_stream (stream),
                                                                       after_headers (body)
an answer the ledger cannot carry      malformed_event                 after_headers
  (a Responses custom_tool_call, a tool
  call no part can keep, tools proposed
  to a request that offered none), or a
  finished stream's last events that do
  not complete it; refused whole, with
  the usage the answer reported
error event inside a stream, after     (none; status 200, body)        mid_stream
  text, a tool call or media began
error event inside a stream before     (none; status 200, body)        after_headers
  any content (reasoning alone is not
  content)
a stream's final status event          (none; status 200, body)        after_headers
  (Responses response.failed/.incomplete)
2xx body that is an error object       (none; status, body)            after_headers
HTTP status >= 300                     (none; status, headers, body)   after_headers
=====================================  ==============================  ======================

"After send" is conservative on purpose: once a request byte may have reached the peer, the
request may have executed (DESIGN invariant 6), so nothing is reported as ``before_send`` then.
A ``before_send`` phase with a transport kind is a promise that the request never left.

Streaming rules (see :meth:`HttpAdapter.send`): a stream succeeds only when the protocol's
terminator was seen (OpenAI ``data: [DONE]``, the Responses API's ``response.completed``,
Anthropic ``message_stop``) or, when the HTTP body
ended cleanly without it, the protocol's own completion signal was (OpenAI ``finish_reason`` on
every choice, Anthropic ``message_delta.stop_reason``, Gemini ``finishReason``). Anything else is a
failure, and when text or a tool-call proposal was already delivered the failure carries
``effective_output=True`` and the callback receives a :class:`Reset`.

Time limits (``StreamingPolicy``): ``connect_timeout_s`` bounds connecting (and waiting for a
pooled connection); ``read_timeout_s`` bounds every single socket read, so also the wait for the
status line; for a stream, only ``first_token_timeout_s`` (counted from the request's last byte
written) applies until the answer begins (its
first text, tool-call fragment or media, or the first event of a tool the provider runs itself:
a model may think silently, but a hosted tool is work on the answer), then ``idle_timeout_s``
bounds every gap between received bytes; ``total_timeout_s`` bounds the whole call. No call is
unbounded in time.
"""

from __future__ import annotations

import json
import logging
import re
import reprlib
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Annotated, Any, Unpack
from urllib.parse import urlsplit

import httpcore
import httpx
from typing_extensions import TypedDict

from ledger.adapters.contract import (
    AdapterResult,
    Codec,
    EventCallback,
    MalformedPayload,
    ProviderErrorPayload,
    Reply,
    Reset,
    StreamEvent,
    StreamState,
    TextDelta,
    ToolCallProposal,
    Usage,
    WireRequest,
    codec_for,
    offered_calls,
    provider_json,
    reasoning_data,
)
from ledger.adapters.exchange import (
    Close,
    Deliver,
    Drain,
    Driver,
    Exchange,
    Open,
    Read,
    arun,
    async_driver,
)
from ledger.adapters.secrets import (
    EVIDENCE_CAP_BYTES,
    EnvSecretProvider,
    SecretProvider,
    cap_text,
    evidence_excerpt,
    lookup_key,
    redact,
)
from ledger.adapters.sse import SSEError, SSEEvent, SSEParser
from ledger.adapters.transport import (
    ClientRegistry,
    describe_exception,
    map_transport_error,
)
from ledger.decide.effects import SendProgress, SendResult, attempt_headers
from ledger.domain.carried import require_encodable
from ledger.domain.envelope import Envelope, require_parts
from ledger.domain.facts import Observation, Phase, Source, Transport
from ledger.domain.media import MediaKind
from ledger.domain.validation import (
    Id,
    Secrets,
    amount_in_range,
    checked,
    function,
    instance,
    integers,
    tokens_in_range,
)
from ledger.domain.values import Route
from ledger.errors import InvalidArgument
from ledger.policy.model import StreamingPolicy
from ledger.redaction import install_log_redaction

log = logging.getLogger("ledger.adapters")

# An error body is read up to this many bytes (enough to keep a large JSON error parsable so
# its structured fields survive the evidence cap; a body beyond it is cut, not buffered).
_ERROR_BODY_READ_CAP = 1024 * 1024
# After a stream's terminator, the rest of the body is drained this long at most, so the
# connection can go back to the pool without holding a finished answer hostage.
_DRAIN_AFTER_TERMINATOR_S = 1.0
# What a codec may raise on a hostile body or event besides MalformedPayload: whatever shape the
# provider sent, the outcome is a malformed_event failure, never an exception out of send().
_BAD_PAYLOAD = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError,
                ArithmeticError)


# --------------------------------------------------------------------------------------------
# The engine


class _CannotBuild(Exception):
    """The route's configuration cannot make a request; ``message`` says what and the fix.

    ``secret`` is the credential resolved before the problem was found, redacted from the
    message with the registered ones.
    """

    def __init__(self, message: str, secret: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.secret = secret


class _Progress:
    """How far the request got, from httpcore's trace events.

    It is mirrored into the caller's :class:`~ledger.decide.effects.SendProgress`, so an
    interrupted call is settled truthfully.
    """

    def __init__(self, report: SendProgress | None, clock: Callable[[], float]) -> None:
        self.request_sent = False
        #: When the request's whole body was written (on ``clock``, the driver's), or None.
        self.body_written_at: float | None = None
        self.clock = clock
        self.headers_received = False
        self.tunnelling = False  # a proxy's CONNECT is under way: its exchange is not ours
        self.report = report
        if report is not None:
            report.sent = False

    def delivered(self) -> None:
        """Output reached the caller: an interrupted call is recorded with effective output."""
        if self.report is not None:
            self.report.delivered = True

    def failed(self, result: AdapterResult) -> None:
        """The call failed as ``result`` says: an interrupted call is settled with it."""
        if self.report is not None:
            self.report.failure = failed_send(result)

    def headers(self) -> None:
        """The response's status line and headers arrived: its first byte, for the report."""
        self.headers_received = True
        if self.report is not None:
            self.report.first_byte()

    def content(self) -> None:
        """A stream's answer began: its first content, or a hosted tool's first event."""
        if self.report is not None and self.report.first_token_at is None:
            self.report.first_token()

    async def trace(self, name: str, info: Mapping[str, Any]) -> None:
        """The ``trace`` extension of an async client (httpcore awaits it)."""
        self.trace_sync(name, info)

    def trace_sync(self, name: str, info: Mapping[str, Any]) -> None:
        """The ``trace`` extension of a blocking client."""
        if name.endswith("send_request_headers.started"):
            # httpcore traces the CONNECT that opens a proxy's tunnel like a request: it goes
            # to the proxy alone, so until the tunnel (and TLS through it) stands nothing of
            # the request can have reached the provider, and the proxy's answer is no head.
            if getattr(info.get("request"), "method", None) == b"CONNECT":
                self.tunnelling = True
                return
            self.request_sent = True
            if self.report is not None:
                self.report.sent = True
        elif name == "http11.send_request_headers.failed" and isinstance(
                info.get("exception"), httpcore.LocalProtocolError):
            # h11 checks the request's head as it serialises it, and the head is written in one
            # write after that: a head it refused never left (a write that failed is a
            # WriteError). A proxy's CONNECT never marked the request sent.
            self.request_sent = False
            if self.report is not None:
                self.report.sent = False
        elif name.endswith("send_request_body.complete") and not self.tunnelling:
            self.body_written_at = self.clock()
        elif name.endswith("receive_response_headers.complete"):
            if self.tunnelling:
                self.tunnelling = False
                return
            self.headers()


# RFC 9110: a field name is a token; a value is visible characters with spaces or tabs
# between them. httpx writes both as ASCII (and h11, which refuses the rest, does so only as the
# request starts to go out).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"(?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?")
# The adapter frames the body it encoded: a codec's own framing would contradict it.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})


def _header_problem(name: object, value: object) -> str | None:
    """What makes ``name: value`` a header no request can carry (never quoting the value)."""
    if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
        return ("is not an HTTP token (ASCII letters, digits and !#$%&'*+-.^_`|~ only: no "
                "spaces, colons or control characters)")
    if name.lower() in _FRAMING_HEADERS:
        return "the adapter sets itself from the body it encodes"
    if not isinstance(value, str):
        return f"has a value of type {type(value).__name__}, not text"
    if _HEADER_VALUE.fullmatch(value):
        return None
    if "\r" in value or "\n" in value:
        return "has a CR or LF in its value (it would start another header)"
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in value):
        return "has a NUL or another control character in its value"
    if not value.isascii():
        return ("has non-ASCII characters in its value (header text is ASCII: percent-encode "
                "them or leave them out)")
    return "has leading or trailing whitespace in its value"


_KEEP_HEADER_VALUE = 256
# Response headers that carry a credential or a cookie, dropped from observations whatever
# their value: the providers' own key headers (Azure OpenAI's api-key among them), cookies
# both ways, a proxy's credential, and a cloud session token.
_DROP_HEADERS = frozenset({
    "set-cookie", "set-cookie2", "cookie", "authorization", "proxy-authorization",
    "x-api-key", "x-goog-api-key", "api-key", "x-amz-security-token",
})


def _response_headers(headers: httpx.Headers, secrets: list[str | None]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers.items():
        low = name.lower()
        if low in _DROP_HEADERS:
            continue
        out[low] = cap_text(redact(value, secrets), _KEEP_HEADER_VALUE)
    return out


def _shown(text: str) -> str:
    """A configuration value for a message: redacted before it is shortened."""
    return cap_text(redact(text), 80)


def _what(exc: BaseException) -> str:
    """A parse error for a message: MalformedPayload says it all, others are named."""
    return str(exc) if isinstance(exc, MalformedPayload) else f"{type(exc).__name__}: {exc}"


def _request_id(headers: httpx.Headers, secrets: list[str | None]) -> str | None:
    # Redacted like the kept headers: a provider or a proxy may echo a secret in it.
    for name in ("x-request-id", "request-id", "x-goog-request-id", "cf-ray"):
        value = headers.get(name)
        if value:
            return cap_text(redact(value, secrets), 128)
    return None


def _reported(model: str | None, secrets: list[str | None]) -> str | None:
    """The model a provider says served the call, redacted (it is the provider's text)."""
    return redact(model, secrets) if model else None


def failed_send(result: AdapterResult) -> SendResult:
    """What the retry owner records for the failed ``result`` (``sent`` as reported).

    It carries the usage the failure reported as an answer does: the provider may have billed
    it (a Responses ``incomplete`` answer, a stream its error event ended), and the Run is
    posted that cost rather than nothing or the whole hold; and the model the provider named
    (``model_reported``), which the failed or unknown Attempt records.
    """
    obs = result.observation or Observation(message="adapter failure without observation")
    return SendResult(ok=False, observation=obs, sent=result.sent,
                      partial_text=result.partial_text, **reported(result))


def reported(result: AdapterResult) -> dict[str, Any]:
    """The usage, cost and model ``result`` reported, as :class:`SendResult`'s fields.

    Usage the adapter refused goes on as the provider's report: the retry owner bounds it
    again, records the Attempt with no usage, and keeps the report in a ``usage_invalid``
    event.
    """
    usage = result.usage or result.rejected_usage
    return {"prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "cached_tokens": usage.cached_tokens if usage else None,
            "reasoning_tokens": usage.reasoning_tokens if usage else None,
            "cost": result.cost, "model_reported": result.model_reported}


@dataclass
class _Call:
    """The mutable state of one call; the engine methods fill it in."""

    route: Route
    codec: Codec
    secret: str | None
    on_event: EventCallback | None
    limits: StreamingPolicy
    stream: bool
    now: Callable[[], float]  # the driver's monotonic clock, which the deadlines are on
    t0: float
    progress: _Progress
    url: str
    content: bytes  # the encoded body
    request_headers: dict[str, str]
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    request_id: str | None = None
    delivered: list[str] = field(default_factory=list)  # text delivered to the caller
    delivered_any: bool = False  # text or a proposal reached the caller
    effective_output: bool = False
    provider_ran: bool = False  # the provider ran something for the request (a hosted tool)
    usage: Usage | None = None
    model: str | None = None
    notes: tuple[str, ...] = ()  # what the codec left out of the request, and why
    offers_tools: bool = True  # whether the request let the model propose tool calls
    client: httpx.Client | httpx.AsyncClient | None = None  # the client the call is sent with

    @property
    def secrets(self) -> list[str | None]:
        return [self.secret]

    def elapsed(self) -> float:
        return self.now() - self.t0


MAX_BYTES_OPTION = 2**40  # a terabyte: beyond any body or stream a process should buffer


#: The default bound of one stream event (and of one of its lines): an event that carries a
#: whole image (a Gemini ``inline_data`` chunk, a Responses ``output_item.done``) is as large
#: as the image's base64.
MAX_EVENT_BYTES = 32 * 1024 * 1024


# The arguments of an adapter and its send(), checked before anything is sent or started.
Bytes = Annotated[int, integers(1, MAX_BYTES_OPTION, f"pass a byte count of at least 1 (and at "
                                f"most {MAX_BYTES_OPTION})")]
Limits = Annotated[StreamingPolicy, instance(StreamingPolicy, "a StreamingPolicy", "pass e.g. "
                                             "the Run's frozen policy.streaming")]
Verify = Annotated[ssl.SSLContext | bool, instance((bool, ssl.SSLContext), "a TLS setting",
                                                   "pass True, False or an ssl.SSLContext")]
Target = Annotated[Route, instance(Route, "a ledger.Route", "pass a ledger.Route")]
Clients = Annotated[ClientRegistry, instance(
    ClientRegistry, "a ClientRegistry", "pass a ledger.adapters.ClientRegistry")]
Request = Annotated[Envelope, instance(Envelope, "a ledger.Envelope", "pass a ledger.Envelope")]
OnEvent = Annotated[EventCallback, function("a function of a StreamEvent (sync or async)")]
Progress = Annotated[SendProgress, instance(SendProgress, "a SendProgress",
                                            "pass the Dispatch's progress")]


class AdapterOptions(TypedDict, total=False):
    """The options of :class:`HttpAdapter` and :class:`~ledger.adapters.sync.SyncAdapter`.

    Attributes:
        secrets: Where each profile's secret comes from (default:
            :class:`~ledger.adapters.secrets.EnvSecretProvider`).
        limits: The default time limits (:class:`~ledger.policy.model.StreamingPolicy`); a
            call may pass its own (the Run's frozen ``policy.streaming``).
        verify: TLS verification of the adapter's own client registry (``True``, ``False`` or
            an ``ssl.SSLContext``; default ``True``).
        max_body_bytes: Largest whole (non-streamed) body read (default 16 MiB).
        evidence_cap_bytes: Largest error excerpt kept as evidence (default 2 KiB).
        max_stream_bytes: Most bytes read from one stream (default 64 MiB).
        max_event_bytes: Largest stream event (and line) parsed: an event carrying an image is
            as large as its base64 (default 32 MiB).
    """

    secrets: Secrets | None
    limits: Limits | None
    verify: Verify
    max_body_bytes: Bytes
    evidence_cap_bytes: Bytes
    max_stream_bytes: Bytes
    max_event_bytes: Bytes


@checked
class HttpAdapter:
    """Sends an Envelope on a Route over httpx, for every registered protocol (async).

    Memory is bounded by ``max_body_bytes``, ``max_stream_bytes`` and ``max_event_bytes``
    (the SSE parser's line and event limit), counted after decompression: a compressed answer
    is inflated only as far as they read (:class:`~ledger.adapters.exchange.BodyDecoder`).
    They count bytes: parsed, a body or an event of tiny JSON values takes about 25 times
    more (16 MiB of ``{},`` about 390 MiB), so lower them to lower a call's worst case
    (docs/adapters.md). Time is bounded by ``limits`` (see the module docstring).
    Use it as ``async with`` or :meth:`aclose` it; :class:`~ledger.adapters.sync.SyncAdapter`
    is its blocking facade.

    Args:
        clients: The pooled httpx clients (default: a private :class:`ClientRegistry`).
        **options: ``secrets``, ``limits``, ``verify``, ``max_body_bytes``,
            ``evidence_cap_bytes``, ``max_stream_bytes``, ``max_event_bytes``
            (:class:`AdapterOptions`).

    Raises:
        InvalidArgument: an option of the wrong type, or a byte count below 1 or above 2**40.

    Example:
        >>> async with HttpAdapter() as adapter:  # doctest: +SKIP
        ...     result = await adapter.send(route, Envelope(parts=[Part(content="Hi")]),
        ...                                 profile_id=None)
        ...     print(result.ok, result.text or result.observation)
    """

    def __init__(self, *, clients: Clients | None = None,
                 **options: Unpack[AdapterOptions]) -> None:
        secrets, limits = options.get("secrets"), options.get("limits")
        self.secrets: SecretProvider = secrets if secrets is not None else EnvSecretProvider()
        self.limits = limits if limits is not None else StreamingPolicy()
        self.clients = (clients if clients is not None
                        else ClientRegistry(verify=options.get("verify", True)))
        self.max_body_bytes = options.get("max_body_bytes", 16 * 1024 * 1024)
        self.evidence_cap_bytes = options.get("evidence_cap_bytes", EVIDENCE_CAP_BYTES)
        self.max_stream_bytes = options.get("max_stream_bytes", 64 * 1024 * 1024)
        self.max_event_bytes = options.get("max_event_bytes", MAX_EVENT_BYTES)

    async def __aenter__(self) -> HttpAdapter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pooled clients of the running event loop.

        A call still in flight on one fails as a local cancellation (``Observation.cancelled``,
        source ``local``), not as a failure of the provider's.
        """
        await self.clients.aclose()

    # -- preparation ---------------------------------------------------------------------------
    #
    # Two kinds of problem are found before anything is sent. Caller misuse (an envelope or a
    # profile id that does not fit the route) raises InvalidArgument: the caller has a bug. A
    # turn's preflight applies the same rules before its begin, so an Attempt never ends here.
    # A route whose configuration cannot make a request (no secret, no usable endpoint, no
    # codec, a body its codec made that cannot be encoded) is a `cannot_build` failure result,
    # never an exception: the Run can skip that route and go on, and it knows nothing was sent.

    @staticmethod
    def _check_misuse(route: Route, envelope: Envelope, profile_id: str | None) -> None:
        if profile_id is None and route.profiles:
            raise InvalidArgument(
                f"route {route.id!r} has credential profiles "
                f"{[p.id for p in route.profiles]}; pass profile_id= one of them",
                field="profile_id",
            )
        if profile_id is not None and route.profiles and profile_id not in {
            p.id for p in route.profiles
        }:
            raise InvalidArgument(
                f"profile {profile_id!r} is not a credential profile of route {route.id!r}; "
                f"use one of {[p.id for p in route.profiles]} or add it to Route.profiles",
                field="profile_id",
            )
        require_parts(envelope)
        # What no UTF-8 JSON body can carry is the caller's: the rule preflight applies
        # (a turn refuses it before its begin), not the route's cannot_build.
        require_encodable(envelope)
        caps = route.capabilities
        if envelope.stream and caps.streaming is False:
            raise InvalidArgument(
                f"route {route.id!r} does not stream; send with Envelope.stream=False",
                field="envelope.stream",
            )
        if envelope.tools and caps.tools is False:
            raise InvalidArgument(
                f"route {route.id!r} does not take tools; preflight should have refused it",
                field="envelope.tools",
            )
        if envelope.prefill and caps.prefill is False:
            raise InvalidArgument(
                f"route {route.id!r} does not support assistant prefill; preflight should have "
                "refused it (or end the envelope with a user part)",
                field="envelope.parts",
            )
        for i, part in enumerate(envelope.parts):
            kind = part.kind
            declared = {MediaKind.IMAGE: caps.image_input, MediaKind.PDF: caps.pdf_input}
            if kind in declared and declared[kind] is False:
                what = "images" if kind is MediaKind.IMAGE else "PDFs"
                raise InvalidArgument(
                    f"route {route.id!r} reads no {what} (Capabilities.{kind.value}_input="
                    f"False); preflight should have refused it (or leave part {i} out)",
                    field=f"envelope.parts[{i}]",
                )

    @staticmethod
    def _check_endpoint(route: Route) -> None:
        endpoint = route.endpoint
        example = "https://api.openai.com/v1"
        if not endpoint or not endpoint.strip():
            raise _CannotBuild(
                f"route {route.id!r} has no endpoint; set Route.endpoint to the provider's base "
                f"URL (e.g. {example})"
            )
        try:
            parts = urlsplit(endpoint.strip())
        except ValueError as exc:  # e.g. an unclosed IPv6 bracket
            raise _CannotBuild(
                f"route {route.id!r} endpoint {_shown(endpoint)!r} is not a usable URL ({exc}); "
                f"set Route.endpoint to the provider's base URL (e.g. {example})"
            ) from None
        shown = f"{parts.scheme}://{parts.hostname}" if parts.hostname else repr(_shown(endpoint))
        if not parts.scheme or not parts.netloc:
            raise _CannotBuild(
                f"route {route.id!r} endpoint {_shown(endpoint)!r} has no http:// or https:// "
                f"scheme and host; write it as a full URL (e.g. {example})"
            )
        if parts.scheme.lower() not in ("http", "https"):
            raise _CannotBuild(
                f"route {route.id!r} endpoint must be an http:// or https:// URL (got scheme "
                f"{parts.scheme!r}); use the provider's https:// base URL"
            )
        if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in parts.netloc):
            raise _CannotBuild(
                f"route {route.id!r} endpoint {_shown(endpoint)!r} has an invalid host name "
                "(spaces or control characters); correct Route.endpoint"
            )
        if not parts.hostname:
            raise _CannotBuild(
                f"route {route.id!r} endpoint {shown} has no host name; set the provider's "
                f"base URL (e.g. {example})"
            )
        if "#" in endpoint:
            # Never sent, and it would cut off the path the protocol joins to the endpoint.
            raise _CannotBuild(
                f"route {route.id!r} endpoint {shown} has a #fragment, which no request "
                "carries; remove it from Route.endpoint"
            )
        if parts.username is not None or parts.password is not None:
            raise _CannotBuild(
                f"route {route.id!r} endpoint {shown} carries credentials in the URL, where they "
                "would reach logs; remove them and use a credential profile"
            )
        try:
            parts.port  # noqa: B018 - validates the port
        except ValueError:
            raise _CannotBuild(
                f"route {route.id!r} endpoint {shown} has an invalid port; use a number "
                "between 1 and 65535"
            ) from None

    def _secret(self, route: Route, profile_id: str | None) -> str | None:
        # The same resolution a Run session checks on entering (ledger.adapters.secrets).
        secret, problem = lookup_key(route, profile_id, self.secrets)
        if problem is not None:
            raise _CannotBuild(problem.message)
        return secret

    @staticmethod
    def _encode(route: Route, body: Any) -> bytes:
        # The same encoding httpx uses for json=, done here so that a failure is ours to report.
        try:
            text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            return text.encode("utf-8")
        except (TypeError, ValueError, RecursionError) as exc:
            raise _CannotBuild(
                f"the request body for route {route.id!r} cannot be JSON-encoded "
                f"({type(exc).__name__}: {exc}); pass only JSON values (finite numbers, text "
                "without lone surrogates) in Envelope.params and parts"
            ) from None

    @staticmethod
    def _codec_method(route: Route, codec: Codec, method: str) -> str:
        """Who made a request: the route and the codec's method, for a message."""
        return (f"route {route.id!r}: {type(codec).__name__}.{method} (the "
                f"{route.protocol.value!r} codec)")

    @classmethod
    def _check_headers(cls, route: Route, codec: Codec, method: str, headers: object,
                       secret: str | None) -> dict[str, str]:
        """``headers`` as the request will carry them, or _CannotBuild naming the bad one.

        httpx writes header text as ASCII and h11 refuses a name that is not a token and a
        value with a line break, a NUL or surrounding whitespace, but only once the request
        has begun to go out: found here, before anything is sent, it is the codec's problem
        and the route's ``cannot_build``, not a request that may have left. A value is never
        shown: a credential header's value is the secret.
        """
        where = cls._codec_method(route, codec, method)
        fix = f"fix {type(codec).__name__}.{method} to make a valid header, or leave it out"
        if not isinstance(headers, Mapping):
            raise _CannotBuild(f"{where} returned headers that are not a mapping of name to text "
                               f"({type(headers).__name__}); {fix}", secret)
        out: dict[str, str] = {}
        for name, value in headers.items():
            problem = _header_problem(name, value)
            if problem is not None:
                shown = (repr(cap_text(redact(name, [secret]), 80)) if isinstance(name, str)
                         else f"<{type(name).__name__}>")
                raise _CannotBuild(f"{where} makes header {shown}, which {problem}; {fix}",
                                   secret)
            out[name] = value
        return out

    def _prepare(
        self, route: Route, envelope: Envelope, profile_id: str | None, attempt_id: str | None
    ) -> tuple[Codec, str | None, WireRequest, bytes, dict[str, str]]:
        """Codec, secret, request, body and headers; raises _CannotBuild or InvalidArgument."""
        self._check_endpoint(route)
        try:
            codec = codec_for(route.protocol)
        except InvalidArgument as exc:
            raise _CannotBuild(exc.message) from None
        # A query (Azure OpenAI's ?api-version=) stays on the request URL, after the path the
        # codec joins to the endpoint's, so the codec sees the endpoint without it.
        base, _, query = (route.endpoint or "").partition("?")
        at = route.model_copy(update={"endpoint": base}) if base != route.endpoint else route
        try:
            wire = codec.build_request(at, envelope)
        except InvalidArgument:
            raise  # envelope misuse: the caller's, as preflight finds it
        except Exception as exc:
            # A host's codec that fails on this route fails every request on it: a route that
            # cannot build, which the Run skips, never an exception out of the turn.
            raise _CannotBuild(
                f"{self._codec_method(route, codec, 'build_request')} failed "
                f"({type(exc).__name__}: {exc}); fix the codec, or take the route out of the "
                "plan") from exc
        if not isinstance(wire, WireRequest):
            raise _CannotBuild(
                f"{self._codec_method(route, codec, 'build_request')} returned "
                f"{type(wire).__name__}, not a WireRequest; fix the codec")
        if query:
            wire = replace(wire, url=wire.url + ("&" if "?" in wire.url else "?") + query)
        secret = self._secret(route, profile_id)
        content = self._encode(route, wire.body)
        headers = self._check_headers(route, codec, "build_request", wire.headers, secret)
        if secret is not None:
            try:
                auth = codec.auth_headers(secret)
            except Exception as exc:
                # Its text may carry the secret it was given: redacted with it (_cannot_build).
                raise _CannotBuild(
                    f"{self._codec_method(route, codec, 'auth_headers')} failed "
                    f"({type(exc).__name__}: {exc}); fix the codec, or take the route out of "
                    "the plan", secret) from exc
            headers.update(self._check_headers(route, codec, "auth_headers", auth, secret))
        if attempt_id is not None:
            # Last, and refused rather than merged when a codec's own header has the same
            # name: the value the ledger recorded with the Attempt is the one that is sent.
            try:
                headers = attempt_headers(attempt_id, route.protocol, onto=headers)
            except InvalidArgument as exc:
                raise _CannotBuild(
                    f"route {route.id!r}: the {route.protocol.value!r} codec sets its own "
                    f"{exc.fields.get('header')!r} header, which carries the Attempt's id (the "
                    "value recorded with it); remove that header from the codec's request or "
                    "credential headers", secret) from None
        return codec, secret, wire, content, headers

    @staticmethod
    def _cannot_build(
        route: Route, message: str, elapsed_s: float, secret: str | None = None
    ) -> AdapterResult:
        obs = Observation(
            protocol=route.protocol,
            provider=route.provider,
            message=cap_text(redact(message, [secret]), 512),
            transport=Transport.CANNOT_BUILD,
            phase=Phase.BEFORE_SEND,
            source=Source.LOCAL,
        )
        return AdapterResult(
            ok=False,
            route_id=route.id,
            observation=obs,
            sent=False,
            elapsed_s=elapsed_s,
        )

    # -- the call ----------------------------------------------------------------------------

    async def send(
        self,
        route: Target,
        envelope: Request,
        *,
        profile_id: Id | None,
        on_event: OnEvent | None = None,
        limits: Limits | None = None,
        progress: Progress | None = None,
        attempt_id: Id | None = None,
    ) -> AdapterResult:
        """Send ``envelope`` on ``route`` with the secret of ``profile_id``; report the outcome.

        A provider or transport failure is never raised: it is the result's ``observation``
        (``ok=False``), and ``sent`` says whether any byte left. A route that cannot make a
        request is a ``cannot_build`` result.

        Args:
            route: The route to call (its protocol picks the codec).
            envelope: The request.
            profile_id: The credential profile to use (one of ``route.profiles``), or ``None``
                for a route without profiles: its key is then read from the route's
                ``api_key_env``, and without one no credential header is sent (a keyless
                local server).
            on_event: Called (sync or async) with each :class:`TextDelta` and
                :class:`ToolCallProposal` as they stream, and a :class:`Reset` when a stream
                fails after delivering any of them.
            limits: This call's time limits (default: the adapter's).
            progress: Told when the first request byte is written, so a cancelled call is
                known to have been sent, or not (the retry owner's ``Dispatch.progress``), and
                told a failure (``failure``) before its :class:`Reset` is delivered.
            attempt_id: The Attempt this call is (the retry owner's ``Dispatch.attempt_id``):
                the request carries it in the headers
                :func:`~ledger.decide.effects.attempt_headers` names (``X-Ledger-Attempt``,
                and the provider's own client-request-id header where it documents one),
                after the codec's and the credential's; a codec header of the same name makes
                the call ``cannot_build``. ``None``: no Attempt, no such header.

        Returns:
            The :class:`AdapterResult` of the one physical call.

        Raises:
            InvalidArgument: caller misuse, before anything is sent: a ``profile_id`` that is
                not the route's, an ``attempt_id`` that is not an id, an envelope without
                parts, streaming, tools or prefill the route's capabilities refuse, parts or
                parameters the codec cannot map.
        """
        driver = async_driver()
        call = self._start(route, envelope, profile_id, on_event, limits, progress, attempt_id,
                           driver)
        if isinstance(call, AdapterResult):
            return call
        return await arun(self._exchange(call, await self.clients.aget(call.url),
                                         call.progress.trace))

    def _start(self, route: Route, envelope: Envelope, profile_id: str | None,
               on_event: EventCallback | None, limits: StreamingPolicy | None,
               progress: SendProgress | None, attempt_id: str | None, driver: Driver
               ) -> _Call | AdapterResult:
        """The call, prepared, or its ``cannot_build`` result (logged).

        Raises InvalidArgument on misuse. Both drivers share it: nothing here does I/O.
        """
        tracker = _Progress(progress, driver.now)  # tells `progress` nothing is sent yet
        self._check_misuse(route, envelope, profile_id)
        install_log_redaction()
        t0 = driver.now()
        try:
            codec, secret, wire, content, headers = self._prepare(route, envelope, profile_id,
                                                                  attempt_id)
        except _CannotBuild as cb:
            result = self._cannot_build(route, cb.message, driver.now() - t0, cb.secret)
            self._log(route, result)
            return result
        for note in wire.notes:
            log.info("route %s: %s", route.id, note)
        return _Call(
            route=route,
            codec=codec,
            secret=secret,
            on_event=on_event,
            limits=limits if limits is not None else self.limits,
            stream=envelope.stream,
            now=driver.now,
            t0=t0,
            progress=tracker,
            notes=wire.notes,
            offers_tools=wire.offers_tools,
            url=wire.url,
            content=content,
            request_headers=headers,
        )

    def _exchange(self, call: _Call, client: httpx.Client | httpx.AsyncClient,
                  trace: Callable[..., Any]) -> Exchange[AdapterResult]:
        """The whole call as steps (:mod:`ledger.adapters.exchange`), logged at its end."""
        result = yield from self._steps(call, client, trace)
        self._log(call.route, result)
        return result

    def _steps(self, call: _Call, client: httpx.Client | httpx.AsyncClient,
               trace: Callable[..., Any]) -> Exchange[AdapterResult]:
        lim = call.limits
        call.client = client
        try:
            request = client.build_request(
                "POST",
                call.url,
                content=call.content,
                headers=call.request_headers,
                timeout=httpx.Timeout(
                    connect=lim.connect_timeout_s,
                    read=lim.read_timeout_s,
                    write=lim.read_timeout_s,
                    pool=lim.connect_timeout_s,
                ),
                extensions={"trace": trace},
            )
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            return self._cannot_build(
                call.route,
                f"route {call.route.id!r} endpoint is not a usable URL ({exc}); set "
                "Route.endpoint to the provider's base URL",
                call.elapsed(),
                call.secret,
            )
        except (ValueError, TypeError) as exc:
            # The URL's problems are InvalidURL: this is the headers' or the body's, which the
            # codec made (_prepare checks the headers; this is for what it does not foresee).
            return self._cannot_build(
                call.route,
                f"{self._codec_method(call.route, call.codec, 'build_request')} made a request "
                f"httpx cannot build ({type(exc).__name__}: {exc}); fix the codec's headers",
                call.elapsed(),
                call.secret,
            )
        return (yield from self._run(call, client, request))

    @staticmethod
    def _log(route: Route, result: AdapterResult) -> None:
        if result.ok:
            log.debug(
                "route %s: ok status=%s model=%s in %.3fs",
                route.id,
                result.http_status,
                result.model_reported,
                result.elapsed_s,
            )
            return
        obs = result.observation
        log.info(
            "route %s: failed transport=%s phase=%s status=%s sent=%s effective_output=%s: %s",
            route.id,
            obs.transport.value if obs and obs.transport else None,
            obs.phase.value if obs and obs.phase else None,
            result.http_status,
            result.sent,
            result.effective_output,
            obs.message if obs else None,
        )

    def _run(
        self, call: _Call, client: httpx.Client | httpx.AsyncClient, request: httpx.Request
    ) -> Exchange[AdapterResult]:
        # All deadlines are absolute times on the driver's monotonic clock (call.now).
        total_at = call.t0 + call.limits.total_timeout_s
        wait = call.limits.first_token_timeout_s
        try:
            # A stream's first-token limit counts from the request's last byte written, so an
            # upload's length (a large document on a slow uplink) is not the provider's
            # silence; the upload itself is bounded by the write and total limits.
            response = yield Open(client, request, total_at, wait if call.stream else None)
        except TimeoutError:
            written = call.progress.body_written_at
            first = call.stream and written is not None and written + wait < total_at
            return (yield from self._deadline_failure(call, first_token=first))
        except httpx.UnsupportedProtocol as exc:
            return self._cannot_build(
                call.route,
                f"route {call.route.id!r} endpoint uses an unsupported scheme ({exc}); use an "
                "http:// or https:// URL",
                call.elapsed(),
                call.secret,
            )
        except httpx.LocalProtocolError as exc:
            if call.progress.request_sent:
                return (yield from self._transport_failure(call, exc))
            # h11 refused the request's head before any byte of it was written (_Progress):
            # the request the codec built, not the provider, which never saw it.
            return self._cannot_build(
                call.route,
                f"{self._codec_method(call.route, call.codec, 'build_request')} made a request "
                f"HTTP/1.1 cannot carry, refused before sending ({describe_exception(exc)}); "
                "fix the codec's headers",
                call.elapsed(),
                call.secret,
            )
        except httpx.HTTPError as exc:
            return (yield from self._transport_failure(call, exc))
        call.progress.headers()
        call.status = response.status_code
        call.headers = _response_headers(response.headers, call.secrets)
        call.request_id = _request_id(response.headers, call.secrets)
        try:
            if not 200 <= response.status_code < 300:
                return (yield from self._status_failure(call, response, total_at))
            ctype = response.headers.get("content-type", "")
            if call.stream and "text/event-stream" in ctype:
                written = call.progress.body_written_at
                first_token_at = (call.now() if written is None else written) + wait
                return (yield from self._stream(call, response, total_at, first_token_at))
            return (yield from self._body(call, response, total_at))
        finally:
            # Closing a response we did not read to the end drops its connection instead of
            # returning it to the pool, so a half-read stream can never leak into the next call.
            yield Close(response)

    # -- outcomes ----------------------------------------------------------------------------

    def _observation(
        self,
        call: _Call,
        *,
        transport: Transport | None,
        phase: Phase,
        message: str,
        body: str | None = None,
        closed: bool = False,
    ) -> Observation:
        return Observation(
            status=call.status,
            headers=dict(call.headers),
            body=body,
            protocol=call.route.protocol,
            provider=call.route.provider,
            message=cap_text(redact(message, call.secrets), 512),
            transport=transport,
            phase=phase,
            effective_output=call.effective_output,
            # A tool the provider ran (a hosted MCP call, a web search) would run again on any
            # resubmission, as a host tool would: the same stop, under every policy (inv. 9).
            tool_started=call.provider_ran,
            # The provider took the request and ran it: whatever failed after a 2xx status
            # may be billed, reported usage or not.
            accepted=call.status is not None and 200 <= call.status < 300,
            cancelled=closed,
            source=Source.LOCAL if closed else Source.PROVIDER,
        )

    @staticmethod
    def _billing(call: _Call, usage: Usage | None
                 ) -> tuple[Usage | None, Decimal | None, Usage | None]:
        """``(usage, cost, rejected)`` as a caller may record them.

        A report the ledger cannot store (a count above 10^15 tokens, or a cost at the route's
        price above 10^12) is no usage: the answer stands with ``usage`` and ``cost`` ``None``
        (the whole hold is then posted, never a made-up figure), and the report is handed
        back as ``rejected`` evidence, so ``settle_attempt`` never refuses what the adapter
        returned and a delivered answer is never lost to a hostile or buggy counter.
        """
        if usage is None:
            return None, None, None
        if tokens_in_range(usage.prompt_tokens) and tokens_in_range(usage.completion_tokens):
            cost = call.route.cost(usage.prompt_tokens, usage.completion_tokens)
            if amount_in_range(cost):
                return usage, cost, None
        log.warning("route %s: reported usage out of range or not token counts (prompt_tokens=%s, "
                    "completion_tokens=%s); recorded as not reported", call.route.id,
                    # Shortened: a value that is not a count may be a whole list or a long text.
                    reprlib.repr(usage.prompt_tokens), reprlib.repr(usage.completion_tokens))
        return None, None, usage

    def _fail(
        self,
        call: _Call,
        *,
        transport: Transport | None,
        phase: Phase,
        message: str,
        body: str | None = None,
        evidence: str | None = None,
        closed: bool = False,
    ) -> Exchange[AdapterResult]:
        obs = self._observation(call, transport=transport, phase=phase, message=message, body=body,
                                closed=closed)
        usage, cost, rejected = self._billing(call, call.usage)
        result = AdapterResult(
            ok=False,
            route_id=call.route.id,
            usage=usage,
            model_reported=_reported(call.model, call.secrets),
            cost=cost,
            rejected_usage=rejected,
            observation=obs,
            effective_output=call.effective_output,
            http_status=call.status,
            evidence=evidence if evidence is not None else body,
            partial_text=redact("".join(call.delivered), call.secrets),
            request_id=call.request_id,
            elapsed_s=call.elapsed(),
            sent=call.progress.request_sent,
            notes=call.notes,
        )
        # Known before the caller hears more: its callback may raise on the Reset, or be
        # cancelled in it, and the failure is still the provider's (the retry owner settles
        # the Attempt with it, then lets the callback's exception go on).
        call.progress.failed(result)
        if call.delivered_any and call.on_event is not None:
            # Tell the caller that what it showed is not an answer; the Run decides what's next.
            reason = "cancelled" if closed else transport.value if transport else "provider_error"
            yield from self._deliver(call, Reset(reason=reason))
        return result

    def _success(self, call: _Call, reply: Reply) -> AdapterResult:
        usage, cost, rejected = self._billing(call, reply.usage)
        for note in reply.notes:  # what of the answer cannot be a part, and why
            log.info("route %s: %s", call.route.id, note)
        return AdapterResult(
            ok=True,
            route_id=call.route.id,
            text=reply.text,
            tool_calls=tuple(reply.tool_calls),
            usage=usage,
            model_reported=_reported(reply.model, call.secrets),
            cost=cost,
            rejected_usage=rejected,
            finish_reason=reply.finish_reason,
            effective_output=bool(reply.text or reply.tool_calls or reply.media),
            http_status=call.status,
            request_id=call.request_id,
            elapsed_s=call.elapsed(),
            reasoning=tuple(reasoning_data(call.route, item) for item in reply.reasoning),
            notes=call.notes + tuple(reply.notes),
            media=tuple(reply.media),
        )

    def _transport_failure(self, call: _Call, exc: BaseException) -> Exchange[AdapterResult]:
        kind, phase = map_transport_error(
            exc,
            request_sent=call.progress.request_sent,
            headers_received=call.progress.headers_received,
        )
        message = describe_exception(exc)
        if call.client is not None and call.client.is_closed:
            # Closed here, under the call (HttpAdapter.aclose, SyncAdapter.close, a Run
            # session's block left while its turn was in flight): whatever the socket raised
            # then is our own doing, not the provider's, so it is no evidence against the route.
            # The transport kind stays: an answer cut by our close, as by the caller's own
            # cancellation, is unknown (the provider may go on and bill), its hold kept.
            message = (f"the adapter's client was closed while this call was in flight (the "
                       f"adapter closed, or the Run session's block left under its turn): a "
                       f"local cancellation, not the provider's ({message})")
            return (yield from self._fail(call, transport=kind, phase=phase, message=message,
                                          closed=True))
        if isinstance(exc, httpx.ProxyError) and phase is Phase.BEFORE_SEND:
            message = (f"the proxy refused the tunnel (CONNECT) to the provider, so nothing was "
                       f"sent to it: {message}")
        if isinstance(exc, httpx.TimeoutException):
            lim = call.limits
            limit = (
                f"connect_timeout_s={lim.connect_timeout_s}"
                if kind is Transport.CONNECT_TIMEOUT
                else f"read_timeout_s={lim.read_timeout_s}"
            )
            message = f"{message} (limit {limit})"
        return (yield from self._fail(call, transport=kind, phase=phase, message=message))

    def _deadline_failure(self, call: _Call, *, first_token: bool) -> Exchange[AdapterResult]:
        p = call.progress
        if p.headers_received:
            phase = Phase.AFTER_HEADERS if first_token else Phase.MID_STREAM
        else:
            phase = Phase.AFTER_SEND if p.request_sent else Phase.BEFORE_SEND
        if first_token:
            lim = call.limits.first_token_timeout_s
            msg = f"no content within first_token_timeout_s={lim}"
            return (yield from self._fail(
                call, transport=Transport.FIRST_TOKEN_TIMEOUT, phase=phase, message=msg
            ))
        lim = call.limits.total_timeout_s
        if p.headers_received and not call.stream:
            phase = Phase.MID_STREAM  # the body was being received
        return (yield from self._fail(
            call,
            transport=Transport.TOTAL_TIMEOUT,
            phase=phase,
            message=f"the call exceeded total_timeout_s={lim}",
        ))

    @staticmethod
    def _read_capped(
        response: httpx.Response, deadline: float, cap: int
    ) -> Exchange[tuple[bytes, bool]]:
        """Up to ``cap`` bytes of the body, and whether the body was longer."""
        buf = bytearray()
        while (chunk := (yield Read(response, deadline))) is not None:
            buf.extend(chunk)
            if len(buf) > cap:
                return bytes(buf[:cap]), True
        return bytes(buf), False

    def _status_failure(
        self, call: _Call, response: httpx.Response, total_at: float
    ) -> Exchange[AdapterResult]:
        note = f"HTTP {response.status_code}"
        raw: bytes | None
        try:
            raw, _more = yield from self._read_capped(response, total_at, _ERROR_BODY_READ_CAP)
        except TimeoutError:
            raw, note = None, note + " (error body not read: total deadline)"
        except httpx.HTTPError as exc:
            # The status is the fact that matters; a body we could not read is noted, not a
            # different failure.
            raw, note = None, note + f" (error body not read: {describe_exception(exc)})"
        excerpt = evidence_excerpt(raw, call.secrets, self.evidence_cap_bytes) if raw else None
        return (yield from self._fail(
            call, transport=None, phase=Phase.AFTER_HEADERS, message=note, body=excerpt
        ))

    def _body(self, call: _Call, response: httpx.Response, total_at: float
              ) -> Exchange[AdapterResult]:
        try:
            raw, more = yield from self._read_capped(response, total_at, self.max_body_bytes)
        except TimeoutError:
            return (yield from self._deadline_failure(call, first_token=False))
        except httpx.HTTPError as exc:
            return (yield from self._transport_failure(call, exc))
        if more:
            return (yield from self._fail(
                call,
                transport=Transport.PROTOCOL_ERROR,
                phase=Phase.AFTER_HEADERS,
                message=f"response body larger than max_body_bytes={self.max_body_bytes}",
            ))
        try:
            data = provider_json(raw)
        except (ValueError, RecursionError) as exc:
            return (yield from self._fail(
                call,
                transport=Transport.MALFORMED_EVENT,
                phase=Phase.AFTER_HEADERS,
                message=f"response body is not JSON: {exc}",
                evidence=evidence_excerpt(raw, call.secrets, self.evidence_cap_bytes),
            ))
        return (yield from self._parsed_reply(call, data, raw))

    def _parsed_reply(self, call: _Call, data: Any, raw: bytes) -> Exchange[AdapterResult]:
        try:
            reply = call.codec.parse_reply(data)
            # Kept before the checks below: a refusal of the parsed answer is a failure after
            # whatever the provider ran (invariant 9), and is posted at the usage the answer
            # reported, not the whole hold.
            call.provider_ran |= reply.provider_ran
            call.usage, call.model = reply.usage, reply.model
            offered_calls(reply.tool_calls, call.offers_tools)
        except ProviderErrorPayload as exc:
            call.usage, call.model = exc.usage or call.usage, exc.model or call.model
            call.provider_ran |= exc.provider_ran
            return (yield from self._fail(
                call,
                transport=None,
                phase=Phase.AFTER_HEADERS,
                message=str(exc),
                body=evidence_excerpt(exc.body, call.secrets, self.evidence_cap_bytes),
            ))
        except _BAD_PAYLOAD as exc:
            if isinstance(exc, MalformedPayload):
                # An answer refused whole may still say what it cost and who answered.
                call.usage, call.model = exc.usage or call.usage, exc.model or call.model
                call.provider_ran |= exc.provider_ran
            return (yield from self._fail(
                call,
                transport=Transport.MALFORMED_EVENT,
                phase=Phase.AFTER_HEADERS,
                message=f"response body has not the protocol's shape: {_what(exc)}",
                evidence=evidence_excerpt(raw, call.secrets, self.evidence_cap_bytes),
            ))
        return (yield from self._complete(call, reply))

    def _complete(self, call: _Call, reply: Reply) -> Exchange[AdapterResult]:
        """The success, unless the answer holds text no caller could store or send on.

        Whole, or a stream that finished: such an answer is refused as a whole body is
        (phase ``after_headers``), at the usage it reported (``call.usage``).
        """
        parts = [reply.text] + [f"{c.id}{c.name}{c.arguments_json}" for c in reply.tool_calls]
        try:
            for text in parts:
                text.encode("utf-8")
        except UnicodeEncodeError:
            return (yield from self._fail(
                call,
                transport=Transport.MALFORMED_EVENT,
                phase=Phase.AFTER_HEADERS,
                message="the answer holds unpaired surrogate escapes (\\ud800-\\udfff), which "
                "are not text",
            ))
        return self._success(call, reply)

    def _deliver(self, call: _Call, event: StreamEvent) -> Exchange[None]:
        # Output is *effective* once a caller was handed it: text streamed into a buffer that
        # nobody saw can still be discarded, and the turn may move on (seed 003 section 7).
        watched = call.on_event is not None
        if isinstance(event, TextDelta):
            if not event.text:
                return
            call.delivered.append(event.text)
            call.delivered_any = True
            call.effective_output = call.effective_output or watched
        elif isinstance(event, ToolCallProposal):
            call.delivered_any = True
            call.effective_output = call.effective_output or watched
        if watched and call.effective_output:
            # Told before the callback runs: a caller that cancels from inside it was shown it.
            call.progress.delivered()
        if call.on_event is not None:
            yield Deliver(call.on_event, event)

    def _stream(
        self,
        call: _Call,
        response: httpx.Response,
        total_at: float,
        first_token_at: float,
    ) -> Exchange[AdapterResult]:
        parser = SSEParser(max_line_bytes=self.max_event_bytes,
                           max_event_bytes=self.max_event_bytes)
        state = call.codec.new_stream()
        last_byte = call.now()
        received = 0
        idle = call.limits.idle_timeout_s

        def handle(events: list[SSEEvent]) -> Exchange[AdapterResult | None]:
            for ev in events:
                if state.terminated:
                    return None  # anything after the terminator is not part of the answer
                try:
                    out = state.feed(ev)
                except ProviderErrorPayload as exc:
                    self._absorb(call, state)
                    call.provider_ran |= exc.provider_ran
                    # What the error itself reported (Gemini's blocked prompt carries its
                    # usage), as for a whole body.
                    call.usage, call.model = exc.usage or call.usage, exc.model or call.model
                    # An event that is the answer's final status is the provider's whole,
                    # known verdict, decided as the same body would be. So is an error event
                    # before any content: no answer was begun, shown or buffered, and the
                    # provider refused the request as an error status would have (Anthropic
                    # sends an in-stream overloaded_error where a 529 would say the same).
                    # A hosted tool the provider ran is an answer begun, though nothing of
                    # it is the host's content. Only an error that broke off an answer under
                    # way leaves it mid-stream.
                    verdict = exc.final or not (
                        state.begun or call.delivered_any
                        or call.effective_output)
                    return (yield from self._fail(
                        call,
                        transport=None,
                        phase=Phase.AFTER_HEADERS if verdict else Phase.MID_STREAM,
                        message=str(exc),
                        body=evidence_excerpt(exc.body, call.secrets, self.evidence_cap_bytes),
                    ))
                except _BAD_PAYLOAD as exc:
                    self._absorb(call, state)
                    final = isinstance(exc, MalformedPayload) and exc.final
                    return (yield from self._fail(
                        call,
                        transport=Transport.MALFORMED_EVENT,
                        # Refused on the answer's completion: its verdict is the whole body's.
                        phase=Phase.AFTER_HEADERS if final else Phase.MID_STREAM,
                        message=f"malformed {ev.event[:64]!r} event: {_what(exc)}",
                        evidence=evidence_excerpt(ev.data, call.secrets, self.evidence_cap_bytes),
                    ))
                # Before any proposal is delivered: a refused one never reaches the caller.
                self._hold_offered(call, state, out)
                if state.refused is not None:
                    # A refused answer (take_call) is read to its end for the usage it reports
                    # (refused then, as a whole body is), and none of it reaches the caller.
                    out = []
                if state.begun:
                    call.progress.content()
                for item in out:
                    yield from self._deliver(call, item)
            return None

        eof = False
        while not state.terminated:
            # Before the answer begins (content, or a hosted tool the provider runs) only the
            # first-token limit applies (a model may think silently); after it, a gap longer
            # than the idle limit is a stall.
            waiting_first = not state.begun and first_token_at < total_at
            if state.begun:
                deadline = min(total_at, last_byte + idle)
            else:
                deadline = min(total_at, first_token_at)
            try:
                chunk = yield Read(response, deadline, read_limit=False)
            except TimeoutError:
                self._absorb(call, state)
                if waiting_first:
                    return (yield from self._deadline_failure(call, first_token=True))
                if deadline >= total_at:
                    return (yield from self._deadline_failure(call, first_token=False))
                return (yield from self._fail(
                    call,
                    transport=Transport.STREAM_STALL,
                    phase=Phase.MID_STREAM,
                    message=f"no data for idle_timeout_s={idle}",
                ))
            except httpx.HTTPError as exc:
                self._absorb(call, state)
                return (yield from self._transport_failure(call, exc))
            if chunk is None:
                eof = True
                break
            last_byte = call.now()
            received += len(chunk)
            if received > self.max_stream_bytes:
                self._absorb(call, state)
                return (yield from self._fail(
                    call,
                    transport=Transport.PROTOCOL_ERROR,
                    phase=Phase.MID_STREAM,
                    message=f"the stream exceeded max_stream_bytes={self.max_stream_bytes}",
                ))
            try:
                events = parser.feed(chunk)
            except SSEError as exc:
                self._absorb(call, state)
                return (yield from self._fail(
                    call,
                    transport=Transport.MALFORMED_EVENT,
                    phase=Phase.MID_STREAM,
                    message=str(exc),
                    evidence=evidence_excerpt(chunk, call.secrets, self.evidence_cap_bytes),
                ))
            failed = yield from handle(events)
            if failed is not None:
                return failed
        if eof:
            failed = yield from handle(parser.close())
            if failed is not None:
                return failed
        else:
            yield Drain(response, min(total_at, call.now() + _DRAIN_AFTER_TERMINATOR_S))
        if not (state.terminated or state.completed):
            self._absorb(call, state)
            return (yield from self._fail(
                call,
                transport=Transport.STREAM_CUT,
                phase=Phase.MID_STREAM,
                message="the stream ended before the protocol's completion signal",
            ))
        try:
            final = state.end()
            self._hold_offered(call, state, final)
            reply = state.reply()
            call.provider_ran |= state.provider_ran or reply.provider_ran
            offered_calls(reply.tool_calls, call.offers_tools)
        except _BAD_PAYLOAD as exc:
            self._absorb(call, state)
            # The provider finished the answer (its terminator or completion signal came):
            # refused whole, as the same body would be, and posted at the usage it reported.
            # A verdict, not a stream that broke off with its execution unknown.
            what = ("the streamed answer is refused" if exc is state.refused
                    else "the stream's last events do not complete the answer")
            return (yield from self._fail(
                call,
                transport=Transport.MALFORMED_EVENT,
                phase=Phase.AFTER_HEADERS,
                message=f"{what}: {_what(exc)}",
            ))
        for item in final:
            yield from self._deliver(call, item)
        # Finished too: an answer no caller could store is refused as the body would be.
        self._absorb(call, state)
        return (yield from self._complete(call, reply))

    @staticmethod
    def _hold_offered(call: _Call, state: StreamState, events: list[StreamEvent]) -> None:
        """Hold in ``state.refused`` the refusal of proposals no offered tool asked for.

        Held as a codec holds a call no part can keep
        (:func:`~ledger.adapters.contract.take_call`): the answer is read
        to its end for its usage, then refused whole.
        """
        if state.refused is None:
            try:
                offered_calls([e.call for e in events if isinstance(e, ToolCallProposal)],
                              call.offers_tools)
            except MalformedPayload as exc:
                state.refused = exc

    @staticmethod
    def _absorb(call: _Call, state: StreamState) -> None:
        # A failed stream still reports the usage and model it saw: they may be billed.
        call.usage = state.usage
        call.model = state.model
        call.provider_ran |= state.provider_ran
