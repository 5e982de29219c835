"""Preflight: may this exact request be sent to this exact route (seed 003, section 5)?

Three independent claims must all hold before any Attempt is begun on a route:

1. **capability** - the route can serve the request: protocol, tools, streaming, prefill,
   its parameters (none the protocol builds itself,
   :data:`~ledger.domain.params.RESERVED_PARAMS`, and only those ``Capabilities.parameters``
   lists), parts and parameter values its protocol's codec can build a request of
   (:mod:`ledger.domain.carried`: a tool-call part with its name and JSON-object arguments, a
   tool result naming its call, something to send besides system parts, the Responses API's
   built-in ``tools``, and on every protocol text and params a UTF-8 JSON body can carry: no
   lone surrogate, no NaN or infinity), a context window that fits the request's token
   estimate, and the request's images and documents (``image input``, ``pdf input``: declared
   by the route's :class:`~ledger.domain.values.Capabilities`, sizes, links the provider must
   fetch and links the protocol cannot carry at all). A request the route cannot serve is
   rejected here, never "tested by sending" and learning from a 400.
2. **role qualification** - the exact route is qualified for the Run's role (``route.roles``
   ``None`` means every role), the Run's grant allows the role, and the route is not switched
   off in the *current* configuration.
3. **disclosure** - the route's data recipient is approved in the Run's frozen grant for every
   data class in the request, no current denial revokes that recipient, and every part other
   than ``user_input`` has provenance that is *covered*: its producer reference is recorded and
   the part's content hash is among the hashes recorded for it. A copied part whose content
   was edited, or which gained an extra field such as an "authorized" flag, hashes differently
   and so does not inherit the original's provenance. And no ``https://`` link a model or a
   tool chose (a ``model_derived`` or ``tool_result`` part, or one of an assistant's or a
   tool's role) is sent, covered or not: the provider would fetch it, and the link's host, whom
   no grant names, would receive whatever the URL carries (:data:`OUTPUT_CLASSES`). Two things
   in ``Envelope.params`` count too (:func:`param_disclosures`): tool definitions a parameter
   carries (the legacy ``functions``, a ``custom`` tool in ``params["tools"]``) are
   ``tool_description`` data, as ``Envelope.tools`` are; and a server a parameter makes the
   provider forward the conversation to (an ``mcp`` tool, Anthropic's ``mcp_servers``) is a
   recipient of its own, which the grant must approve, by its URL, for every class in the
   request.

The request is either a full :class:`~ledger.domain.envelope.Envelope` plus the ledger's record of
provenance (``ref -> recorded content hashes``), or a lighter :class:`RequestNeeds` whose parts
already carry a provenance verdict (what the conformance vectors express). Pure: no I/O. The
selector (:mod:`ledger.decide.select`) runs :func:`preflight` for every candidate route and skips
one that fails, naming the first failed check in :class:`Check` order; nothing here raises unless
a host asks (:meth:`PreflightResult.require`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from ledger.domain.carried import Uncarried, refusals_for, uncarried
from ledger.domain.envelope import (
    DERIVED_ROLE_CLASS,
    EXEMPT_CLASSES,
    MODEL_DERIVED,
    TOOL_DESCRIPTION,
    TOOL_RESULT,
    Envelope,
    Part,
)
from ledger.domain.facts import WireProtocol
from ledger.domain.media import (
    UNREAD_IMAGE_TYPES,
    URL_KINDS,
    MediaKind,
    bytes_over,
    image_size,
    pdf_pages,
)
from ledger.domain.params import ParamRefusal, refused_params
from ledger.domain.values import Grant, Route, canonical_json
from ledger.errors import InvalidArgument, PreflightRefused
from ledger.policy.model import EnvelopePolicy

# Classes that need no provenance: the user's own current input and the host's own system
# text are, by definition, what the Run's grant was confirmed against (the grant still decides
# which recipients may receive them). Everything else (model output, tool results, memory,
# private documents) must prove where it came from; so must an assistant's or a tool's part
# whatever class it claims (Part refuses such a label, but model_copy skips validation).
PROVENANCE_EXEMPT: frozenset[str] = EXEMPT_CLASSES

#: The classes of what a model or a tool produced. A link of one of these classes (or of an
#: assistant's or a tool's part) is refused for every route: whoever chose it, a prompt
#: injection included, chose where the provider's fetch goes, and the URL can carry the
#: conversation's data (``?d=ACCOUNT-12000-ACME``) to a host no grant names. The host's own
#: links (``user_input``, ``system``, its documents' and memories' classes) are its choice.
OUTPUT_CLASSES: frozenset[str] = frozenset({MODEL_DERIVED, TOOL_RESULT})


def needs_cover(data_class: str, derived: bool) -> bool:
    """Whether the disclosure check asks a part of ``data_class`` for covering provenance.

    ``derived``: the part is a model's or a tool's (by its role), which always needs it. Only
    these parts' references are worth looking up: an exempt part's coverage is never read,
    whatever reference it carries.
    """
    return derived or data_class not in PROVENANCE_EXEMPT


class Check(StrEnum):
    """The preflight checks, in the order the selector applies them.

    The values equal the selector's skip reasons, so a failed check names the skip directly.
    """

    CAPABILITY = "capability"
    NOT_QUALIFIED = "not_qualified"
    DISCLOSURE = "disclosure"


_CHECK_ORDER = {c: i for i, c in enumerate(Check)}


class Coverage(StrEnum):
    """A part's provenance verdict."""

    OK = "ok"  # the producer reference is recorded with this exact content hash
    MISSING = "missing"  # no reference, or nothing recorded for it
    MISMATCH = "mismatch"  # the reference is recorded, but not with this content


@dataclass(frozen=True, slots=True)
class PartNeed:
    """One part of a request, reduced to what disclosure needs."""

    data_class: str
    coverage: Coverage | None = None  # None: no provenance claimed at all
    ref: str | None = None  # the producer reference, for messages only
    derived: bool = False  # an assistant's or a tool's part: never exempt from provenance


@dataclass(frozen=True, slots=True)
class MediaNeed:
    """One image or document of a request, reduced to what capability and disclosure need.

    ``size`` is the bytes the ledger holds (0 for an ``https://`` link, which the provider
    fetches); ``link`` whether it is such a link; ``output`` whether a model or a tool produced
    the part (its role, or a class of :data:`OUTPUT_CLASSES`), so that a link of it was chosen
    by one (refused by disclosure).
    """

    index: int
    kind: MediaKind
    media_type: str
    size: int = 0
    link: bool = False
    output: bool = False


@dataclass(frozen=True, slots=True)
class ForwardNeed:
    """A server a request parameter makes the provider send the conversation to.

    ``param`` names the parameter (``tools[0]``, ``mcp_servers[1]``); ``recipient`` is the
    server as the grant names it (its URL, or an OpenAI connector's id), ``None`` when the
    parameter does not say which server it is.
    """

    param: str
    recipient: str | None


@dataclass(frozen=True, slots=True)
class RequestNeeds:
    """What a request requires of a route, without its content.

    ``None`` / ``False`` / empty means "no requirement". ``classes`` lists data classes present
    outside ``parts`` (e.g. tool descriptions) that the recipient must also be approved for;
    ``param_tools`` the parameters that carry tool definitions (their class is in
    ``classes``); ``forwards`` the third-party servers the provider would send the request's
    content to, each of which the grant must approve for every class the request carries;
    ``uncarried`` what of the request some protocols' codecs cannot build a request of
    (:func:`~ledger.domain.carried.uncarried`): the routes of those protocols cannot serve it.
    """

    tools: bool = False
    context_tokens: int | None = None
    prefill: bool = False
    streaming: bool = False
    parameters: frozenset[str] = frozenset()
    protocols: frozenset[WireProtocol] | None = None
    parts: tuple[PartNeed, ...] = ()
    classes: frozenset[str] = frozenset()
    media: tuple[MediaNeed, ...] = ()
    param_tools: tuple[str, ...] = ()
    forwards: tuple[ForwardNeed, ...] = ()
    uncarried: tuple[Uncarried, ...] = ()

    @property
    def data_classes(self) -> frozenset[str]:
        """Every data class the request carries (its parts' and its tools')."""
        return frozenset(p.data_class for p in self.parts) | self.classes


@runtime_checkable
class TokenCounter(Protocol):
    """Estimates the prompt tokens of an envelope for a route (tokenizers differ by model).

    A counter may also have ``sharing_key(route)``: routes with one key get one estimate, so
    the selector counts once per key (:class:`CharEstimator`'s is the protocol); or
    ``route_independent = True``: one estimate for every route. Without either it is asked once
    per candidate.
    """

    def count_tokens(self, envelope: Envelope, route: Route) -> int:
        """The prompt tokens of ``envelope`` on ``route`` (an estimate is fine)."""
        ...


# Per-protocol token rules for images and PDF pages, from each provider's published rule (or,
# where none is published, a conservative estimate); docs/adapters.md lists them with sources.
_OPENAI_LIKE = (WireProtocol.OPENAI, WireProtocol.OPENAI_RESPONSES)
#: Tokens per PDF page: OpenAI puts each page's extracted text and an image of it in context
#: (~765 image tokens at high detail plus the text), Anthropic "1,500-3,000 tokens per page"
#: of text plus the page image (the upper end is taken), Gemini 258 per page.
PDF_PAGE_TOKENS: Mapping[WireProtocol, int] = {
    WireProtocol.OPENAI: 1600, WireProtocol.OPENAI_RESPONSES: 1600,
    WireProtocol.ANTHROPIC: 3000, WireProtocol.GEMINI: 258}
#: Tokens of an image whose size is unknown (a link): each rule's largest likely answer
#: (OpenAI's tile rule at its most, 8 tiles; Anthropic's ~1,600 cap; Gemini for 2048x2048).
UNKNOWN_IMAGE_TOKENS: Mapping[WireProtocol, int] = {
    WireProtocol.OPENAI: 1445, WireProtocol.OPENAI_RESPONSES: 1445,
    WireProtocol.ANTHROPIC: 1600, WireProtocol.GEMINI: 2322}


def image_tokens(width: int, height: int, protocol: WireProtocol) -> int:
    """The prompt tokens of one ``width`` x ``height`` image under ``protocol``'s rule.

    OpenAI (chat and Responses, detail ``auto``/``high``): fit within 2048x2048, scale the
    short side to 768, then 170 per 512-pixel tile plus 85. Anthropic: fit the long edge within
    1568, then ``width * height / 750``, at most ~1,600. Gemini: 258 for an image within
    384x384, else 258 per 768x768 tile. A protocol without a rule (``generic``) takes the
    largest of the three.
    """
    if protocol in _OPENAI_LIKE:
        w, h = float(width), float(height)
        fit = min(1.0, 2048 / max(w, h))
        w, h = w * fit, h * fit
        short = min(1.0, 768 / min(w, h))
        w, h = w * short, h * short
        return 85 + 170 * math.ceil(w / 512) * math.ceil(h / 512)
    if protocol is WireProtocol.ANTHROPIC:
        fit = min(1.0, 1568 / max(width, height))
        return min(1600, math.ceil(width * fit * height * fit / 750))
    if protocol is WireProtocol.GEMINI:
        if width <= 384 and height <= 384:
            return 258
        return 258 * math.ceil(width / 768) * math.ceil(height / 768)
    return max(image_tokens(width, height, p) for p in
               (WireProtocol.OPENAI, WireProtocol.ANTHROPIC, WireProtocol.GEMINI))


def _by_protocol(table: Mapping[WireProtocol, int], protocol: WireProtocol) -> int:
    return table.get(protocol, max(table.values()))


@dataclass(frozen=True, slots=True)
class CharEstimator:
    """The default :class:`TokenCounter`: characters over ``chars_per_token``, plus media.

    Text (parts, plain-text documents, tool descriptions, carried reasoning items) is counted
    as characters divided by ``chars_per_token``, rounded up: model-agnostic and slightly
    pessimistic for English. Images and PDFs follow the route's protocol
    (:func:`image_tokens`; :data:`PDF_PAGE_TOKENS` per page, the pages
    :func:`~ledger.domain.media.pdf_pages` reads). A PDF whose page count its objects do not
    tell (uncompressed or in object streams it can inflate) is taken to have one page per
    ``pdf_bytes_per_page`` bytes; a PDF link (the provider fetches it, the ledger never does)
    ``link_pdf_pages`` pages; an image link :data:`UNKNOWN_IMAGE_TOKENS`; a plain-text document link
    ``link_text_tokens``. A host with a real tokenizer plugs in its own counter.
    """

    chars_per_token: float = 4.0
    pdf_bytes_per_page: int = 50 * 1024
    link_pdf_pages: int = 10
    link_text_tokens: int = 8192

    def sharing_key(self, route: Route) -> WireProtocol:
        """Routes of one protocol get one estimate, so a selection counts once per protocol."""
        return route.protocol

    def count_tokens(self, envelope: Envelope, route: Route) -> int:
        """The estimate of ``envelope``'s prompt on ``route`` (see the class docstring)."""
        chars = 0
        tokens = 0
        for p in envelope.parts:
            if p.media_type is None:
                chars += len(p.content)
            else:
                media_tokens, media_chars = self._media(p, route.protocol)
                tokens += media_tokens
                chars += media_chars
        for tool in envelope.tools:
            chars += (len(tool.name) + len(tool.description)
                      + len(canonical_json(tool.parameters)))
        return tokens + math.ceil(chars / self.chars_per_token)

    def _media(self, part: Part, protocol: WireProtocol) -> tuple[int, int]:
        """(tokens, characters) of one binary part."""
        payload = part.payload
        kind = part.kind
        if kind is MediaKind.IMAGE:
            size = image_size(payload, part.media_type or "") if payload is not None else None
            if size is None:
                return _by_protocol(UNKNOWN_IMAGE_TOKENS, protocol), 0
            return image_tokens(*size, protocol), 0
        if kind is MediaKind.PDF:
            if payload is None:
                pages = self.link_pdf_pages
            else:
                pages = pdf_pages(payload) or max(
                    1, math.ceil(len(payload) / max(1, self.pdf_bytes_per_page)))
            return pages * _by_protocol(PDF_PAGE_TOKENS, protocol), 0
        if payload is None:
            return self.link_text_tokens, 0
        # A plain-text document (UTF-8, checked when the part was built) or a reasoning item.
        return 0, len(payload.decode("utf-8", errors="replace"))


DEFAULT_TOKEN_COUNTER: TokenCounter = CharEstimator()


@dataclass(frozen=True, slots=True)
class Denials:
    """Denials in the *current* configuration.

    The Run's frozen grant and plan may still allow these, but historical permission never
    overrides a current denial for a new Attempt.
    """

    routes: frozenset[str] = frozenset()  # route ids switched off
    recipients: frozenset[str] = frozenset()  # recipients whose approval was revoked


NO_DENIALS = Denials()


@dataclass(frozen=True, slots=True)
class PreflightFailure:
    """One failed check, what exactly failed (``detail``) and how to fix it (``fix``).

    ``fix`` is empty where nothing the host does makes the route eligible for this request
    (an operator switched it off, say).
    """

    check: Check
    detail: str
    fix: str = ""


@dataclass(frozen=True, slots=True)
class PreflightResult:
    """Every failed check for one route (empty = the route may be used for this request)."""

    route: str
    failures: tuple[PreflightFailure, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return not self.failures

    @property
    def first(self) -> PreflightFailure | None:
        """The failure the selector reports: the earliest in check order."""
        if not self.failures:
            return None
        return min(self.failures, key=lambda f: _CHECK_ORDER[f.check])

    @property
    def checks(self) -> frozenset[Check]:
        """The checks that failed."""
        return frozenset(f.check for f in self.failures)

    def require(self) -> None:
        """Raise :class:`~ledger.errors.PreflightRefused` naming every failed check."""
        first = self.first
        if first is None:
            return
        fix = first.fix or "choose another route or change the request"
        raise PreflightRefused(
            f"route {self.route!r} refused by preflight ({first.check}): {first.detail}; "
            f"fix: {fix}",
            route=self.route, reason=first.check.value, detail=first.detail, fix=first.fix,
            failures=[(f.check.value, f.detail) for f in self.failures],
        )


def fresh_content_hash(part: Part) -> str:
    """The part's hash computed from its current fields.

    :attr:`Part.content_hash` is a plain property (never cached), so an edited copy made with
    ``model_copy(update=...)``, which skips validation, still hashes what it now holds and
    cannot inherit the original's provenance.
    """
    return part.content_hash


def _has_foreign_attributes(part: Part) -> bool:
    """True when the instance carries attributes that are not Part fields.

    ``Part`` forbids unknown fields on validation, but ``model_copy(update={"authorized": True})``
    skips validation and plants the attribute anyway, invisible to the hash. Such a part is not
    what the ledger recorded, so it is not covered, whatever its content.
    """
    return not _PART_ATTRIBUTES.issuperset(vars(part))


# Every attribute a Part instance may hold (the cached hash of older versions lived there too).
_PART_ATTRIBUTES = frozenset(Part.model_fields) | {"content_hash"}


def part_coverage(part: Part, recorded: Mapping[str, Set[str]], digest: str | None = None,
                  ) -> Coverage:
    """Whether the ledger recorded this part's producer with this exact content.

    The part's hash covers role, content, data class and tool linkage (see
    :class:`~ledger.domain.envelope.Part`), so any edit makes a different hash. ``digest``: the
    part's hash when the caller computed it already from this very part.
    """
    if part.provenance is None or part.provenance not in recorded:
        return Coverage.MISSING
    if digest is None:
        digest = fresh_content_hash(part)
    if _has_foreign_attributes(part) or digest not in recorded[part.provenance]:
        return Coverage.MISMATCH
    return Coverage.OK


def needs_from_envelope(
    envelope: Envelope,
    route: Route,
    *,
    recorded: Mapping[str, Set[str]],
    token_counter: TokenCounter = DEFAULT_TOKEN_COUNTER,
    protocols: frozenset[WireProtocol] | None = None,
) -> RequestNeeds:
    """Reduce an envelope to its needs for ``route``.

    The context need is the prompt estimate plus ``max_output_tokens``: a window that holds
    the prompt but not the requested output would fail on the provider side.
    """
    base = envelope_needs(envelope, recorded=recorded, protocols=protocols)
    return with_prompt(base, envelope, token_counter.count_tokens(envelope, route))


def envelope_needs(
    envelope: Envelope,
    *,
    recorded: Mapping[str, Set[str]],
    protocols: frozenset[WireProtocol] | None = None,
    part_hashes: Sequence[str] | None = None,
    found: Sequence[Uncarried] | None = None,
) -> RequestNeeds:
    """The needs of an envelope that hold for every route: all but the context size.

    Part coverage re-hashes every part, the costliest check; the selector computes it once per
    decision instead of once per candidate (see :func:`with_prompt`); ``part_hashes``, the
    parts' hashes in order, saves even that when the caller has them, as ``found`` (what
    :func:`~ledger.domain.carried.uncarried` found in it, as :func:`require_carried` returns it)
    saves reading its tool parts again.
    """
    digests: Sequence[str | None] = (
        part_hashes if part_hashes is not None else [None] * len(envelope.parts)
    )
    param_tools, forwards = param_disclosures(envelope.params)
    # A ToolSpec's own data_class is added to tool_description, never put in its place: a
    # relabelled definition must not reach a recipient not approved for tool descriptions.
    classes = {c for t in envelope.tools for c in t.data_classes}
    if param_tools:
        classes.add(TOOL_DESCRIPTION)
    return RequestNeeds(
        tools=bool(envelope.tools) or bool(param_tools),
        prefill=envelope.prefill,
        streaming=envelope.stream,
        parameters=frozenset(envelope.params),
        protocols=protocols,
        parts=tuple(
            PartNeed(p.data_class, part_coverage(p, recorded, h), p.provenance,
                     p.role in DERIVED_ROLE_CLASS)
            for p, h in zip(envelope.parts, digests, strict=True)
        ),
        classes=frozenset(classes),
        media=media_needs(envelope),
        param_tools=param_tools,
        forwards=forwards,
        uncarried=tuple(found) if found is not None else uncarried(envelope),
    )


# Keys of a tool entry that say it is the host's own tool, described in its words: a function
# (chat-style ``{"type": "function", "function": {...}}`` or flat) or a Responses custom tool.
# A provider's built-in tool (web_search, file_search, code_interpreter, image_generation, ...)
# has none of them: its description is the provider's, and it runs at the provider.
_HOST_TOOL_TYPES = frozenset({"function", "custom"})
_HOST_TOOL_KEYS = frozenset({"description", "function", "parameters", "input_schema"})


def param_disclosures(params: Mapping[str, Any],
                      ) -> tuple[tuple[str, ...], tuple[ForwardNeed, ...]]:
    """What ``params`` disclose beyond the parts: tool definitions, and forwarding servers.

    Judged on the parameters whatever the route's protocol: a codec sends a parameter it does
    not know as it is, so it reaches the recipient all the same.

    Tool definitions (class ``tool_description``): the legacy chat ``functions``, and any entry
    of ``tools`` (on the Responses API, the parameter for built-in tools) of type ``function``
    or ``custom`` or carrying a description or a schema. Forwarding servers: a ``tools`` entry
    of type ``mcp`` (its ``server_url``, or a connector's ``connector_id``) and every entry of
    Anthropic's ``mcp_servers`` (its ``url``): the provider calls that server with what the
    model takes from the conversation, so it receives the request's content. A stored prompt
    (Responses ``prompt``) or a cached content (Gemini ``cachedContent``) is sent by reference:
    whatever tools it declares the provider holds already, and this request discloses none.

    Returns:
        The parameters carrying tool definitions (``functions``, ``tools[2]``) and the
        forwarding servers, in the order the parameters hold them.
    """
    defined: list[str] = []
    forwards: list[ForwardNeed] = []
    if "functions" in params:
        defined.append("functions")
    tools = params.get("tools")
    for k, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, Mapping):
            continue
        kind = tool.get("type")
        if kind == "mcp":
            forwards.append(ForwardNeed(f"tools[{k}]", _named(tool, "server_url",
                                                              "connector_id")))
        elif kind in _HOST_TOOL_TYPES or not _HOST_TOOL_KEYS.isdisjoint(tool):
            defined.append(f"tools[{k}]")
    servers = params.get("mcp_servers")
    if servers is not None:
        # Anything else in mcp_servers still names servers the provider would call: one the
        # ledger cannot name is a recipient no grant approves.
        entries = servers if isinstance(servers, list) else [servers]
        for k, server in enumerate(entries):
            url = _named(server, "url") if isinstance(server, Mapping) else None
            forwards.append(ForwardNeed(f"mcp_servers[{k}]", url))
    return tuple(defined), tuple(forwards)


def _named(entry: Mapping[str, Any], *keys: str) -> str | None:
    for key in keys:
        value = entry.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def media_needs(envelope: Envelope) -> tuple[MediaNeed, ...]:
    """The images and documents of ``envelope`` (carried reasoning items are no media)."""
    out = []
    for i, p in enumerate(envelope.parts):
        kind = p.kind
        if kind is None or kind is MediaKind.REASONING:
            continue
        payload = p.payload
        out.append(MediaNeed(i, kind, p.media_type or "", len(payload) if payload else 0,
                             payload is None,
                             p.role in DERIVED_ROLE_CLASS or p.data_class in OUTPUT_CLASSES))
    return tuple(out)


_INPUT = {MediaKind.IMAGE: "image input", MediaKind.PDF: "pdf input",
          MediaKind.TEXT: "document input"}


def _parts_list(media: Sequence[MediaNeed]) -> str:
    return ", ".join(f"part {m.index} ({m.media_type})" for m in media)


def _media_capability(route: Route, needs: RequestNeeds) -> list[tuple[str, str]]:
    """The media a route cannot read. Each detail starts with what is missing (``image input``).

    Unknown (``None``) is no restriction, as for every capability; what a wire protocol cannot
    carry at all (a PDF link to OpenAI chat completions) is known, whatever the route says.
    """
    caps = route.capabilities
    out: list[tuple[str, str]] = []
    images = [m for m in needs.media if m.kind is MediaKind.IMAGE]
    pdfs = [m for m in needs.media if m.kind is MediaKind.PDF]
    for items, declared, limit, what, field in (
            (images, caps.image_input, caps.max_image_bytes, "image", "image_input"),
            (pdfs, caps.pdf_input, caps.max_pdf_bytes, "pdf", "pdf_input")):
        if not items:
            continue
        if declared is False:
            out.append((f"{what} input: the request carries {_parts_list(items)}; route "
                        f"{route.id!r} declares {field}=False",
                        f"plan a route that reads {what}s (Capabilities.{field}), or send the "
                        f"request without the {what}"))
            continue
        big = [m for m in items if limit is not None and m.size > limit]
        if big and limit is not None:
            m = big[0]
            shown, bound = bytes_over(m.size, limit)
            out.append((f"{what} input: part {m.index} ({m.media_type}) is "
                        f"{shown}; route {route.id!r} takes {what}s up to "
                        f"{bound} (max_{what}_bytes)",
                        f"send a smaller {what}, or plan a route that takes larger ones"))
    unread = UNREAD_IMAGE_TYPES.get(route.protocol, frozenset())
    odd = [m for m in images if m.media_type in unread]
    if odd and caps.image_input is not False:
        m = odd[0]
        out.append((f"image input: part {m.index} is {m.media_type}, which protocol "
                    f"{route.protocol.value} does not read (route {route.id!r})",
                    f"send the image as PNG, JPEG or WEBP, or plan a route whose protocol "
                    f"reads {m.media_type} (see docs/adapters.md)"))
    links = [m for m in needs.media if m.link]
    if links and caps.url_input is False:
        m = links[0]
        out.append((f"{_INPUT[m.kind]}: part {m.index} ({m.media_type}) is a link the provider "
                    f"would fetch; route {route.id!r} declares url_input=False",
                    "send the file's bytes as data= (fetch it yourself), or plan a route that "
                    "fetches links"))
    carried = URL_KINDS.get(route.protocol, frozenset(MediaKind))
    for m in links:
        if m.kind not in carried:
            out.append((f"{_INPUT[m.kind]}: part {m.index} ({m.media_type}) is a link, and "
                        f"protocol {route.protocol.value} carries no {m.kind.value} by link",
                        "send the file's bytes as data=, or plan a route whose protocol takes "
                        "links (see docs/adapters.md)"))
            break
    return out


def check_envelope_limits(envelope: Envelope, limits: EnvelopePolicy,
                          field: str = "envelope") -> None:
    """Refuse an envelope whose binary parts exceed the policy's ``envelope`` bounds.

    Counted are the bytes the ledger holds (``data=`` and ``data:`` URLs); an ``https://``
    link weighs nothing (the provider fetches it).

    Raises:
        InvalidArgument: a part over ``max_part_bytes`` (``field`` is
            ``envelope.parts[i].data``), or parts together over ``max_envelope_bytes``
            (``envelope.parts``); the message names the part, its size and the fix.
    """
    total = 0
    for i, p in enumerate(envelope.parts):
        payload = p.payload if p.media_type is not None else None
        if payload is None:
            continue
        size = len(payload)
        total += size
        if size > limits.max_part_bytes:
            shown, bound = bytes_over(size, limits.max_part_bytes)
            raise InvalidArgument(
                f"part {i} ({p.media_type}{', ' + repr(p.name) if p.name else ''}) is "
                f"{shown}, over the Run's policy limit envelope.max_part_bytes "
                f"({bound}); send a smaller file (fewer pages, a "
                "scaled-down image), a link the provider fetches (url='https://...'), or "
                "raise envelope.max_part_bytes in the policy of new Runs",
                field=f"{field}.parts[{i}].data", size=size, limit=limits.max_part_bytes)
    if total > limits.max_envelope_bytes:
        shown, bound = bytes_over(total, limits.max_envelope_bytes)
        raise InvalidArgument(
            f"the envelope's images and documents are {shown} together, over the "
            f"Run's policy limit envelope.max_envelope_bytes "
            f"({bound}); send fewer or smaller files (drop "
            "the ones earlier turns already answered), or raise envelope.max_envelope_bytes in "
            "the policy of new Runs",
            field=f"{field}.parts", size=total, limit=limits.max_envelope_bytes)


def with_prompt(base: RequestNeeds, envelope: Envelope, prompt_tokens: int) -> RequestNeeds:
    """``base`` with the context need of a prompt of ``prompt_tokens`` for one route."""
    return replace(base, context_tokens=prompt_tokens + (envelope.max_output_tokens or 0))


def _capability(route: Route, needs: RequestNeeds) -> list[PreflightFailure]:
    caps = route.capabilities
    out: list[tuple[str, str]] = []
    # An absent (None) capability is unknown, and unknown is no restriction: only an explicit
    # "no" or a known limit rules a route out.
    if needs.protocols is not None and route.protocol not in needs.protocols:
        wanted = ", ".join(sorted(needs.protocols))
        out.append((f"protocol {route.protocol} is not one of the required ({wanted})",
                    "plan a route that speaks one of them"))
    if needs.tools and caps.tools is False:
        out.append(("request uses tools; route has no tool support",
                    "send the request without tools, or plan a route with tool support"))
    if needs.streaming and caps.streaming is False:
        out.append(("request streams; route cannot stream",
                    "send it with stream=False, or plan a route that streams"))
    if needs.prefill and caps.prefill is False:
        out.append(("request continues an assistant prefill; route does not support prefill",
                    "drop the prefill, or plan a route that supports it"))
    if (
        needs.context_tokens is not None
        and caps.context_window is not None
        and needs.context_tokens > caps.context_window
    ):
        out.append((
            f"request needs ~{needs.context_tokens} tokens; context window is "
            f"{caps.context_window}",
            "shorten the conversation (or max_output_tokens), or plan a route with a larger "
            "context window"))
    if needs.parameters:
        out.extend(_param_capability(route, needs.parameters))
    if needs.uncarried:
        out.extend((f"{u.field}: {u.message} (protocol {route.protocol.value})", u.fix)
                   for u in refusals_for(route.protocol, needs.uncarried, route.id))
    out.extend(_media_capability(route, needs))
    return [PreflightFailure(Check.CAPABILITY, d, f) for d, f in out]


def _param_capability(route: Route, names: frozenset[str]) -> list[tuple[str, str]]:
    """The parameters ``route`` cannot carry: its protocol builds them, or it declares others.

    A name one protocol builds itself may be another's own parameter (``tools`` holds the
    Responses API's built-in tools, ``max_output_tokens`` is Gemini's), so only this route is
    ruled out; a turn whose plan has no route left for them is refused before any begin
    (:func:`require_carried`).
    """
    refused = refused_params(route, sorted(names))
    out: list[tuple[str, str]] = []
    built = [r for r in refused if r.why is not None]
    if built:
        listed = ", ".join(r.name for r in built)
        out.append((f"Envelope.params may not set {listed} on protocol {route.protocol.value}: "
                    + "; ".join(f"{r.name}: {r.why}" for r in built),
                    f"leave {listed} out of Envelope.params, or plan a route whose protocol "
                    "takes them"))
    unsupported = ", ".join(r.name for r in refused if r.why is None)
    if unsupported:
        out.append((f"unsupported parameters: {unsupported}",
                    f"leave out {unsupported}, or plan a route that takes them"))
    return out


def require_carried(envelope: Envelope, plan: Sequence[Route]) -> tuple[Uncarried, ...]:
    """Refuse a request no route of ``plan`` can build: its parameters, parts or values.

    A route cannot carry a parameter its protocol builds itself or its
    ``Capabilities.parameters`` leaves out (:func:`~ledger.domain.params.refused_params`), nor
    what its protocol's codec cannot build a request of
    (:func:`~ledger.domain.carried.uncarried`). Each such route is ineligible (preflight,
    capability); with none left the request itself is wrong, and the turn refuses it before
    anything is recorded: no Attempt, no hold, no retry permission. Checked once per turn.

    Returns:
        What :func:`~ledger.domain.carried.uncarried` found (for :func:`envelope_needs`, so
        the selector does not read the parts again); empty for the usual request.

    Raises:
        InvalidArgument: naming the field (``envelope.params.<name>``,
            ``envelope.parts[<i>]``, ``envelope.parts[<i>].content``,
            ``envelope.params.tools[<k>]``) the plan's first route refuses first, with what
            every route refuses (``routes``: route id -> fields).
    """
    found = uncarried(envelope)
    params = envelope.params
    if not plan or (not params and not found):
        return found
    per_route: list[tuple[Route, list[ParamRefusal | Uncarried]]] = []
    for r in plan:
        refused: list[ParamRefusal | Uncarried] = [
            *(refused_params(r, params) if params else ()), *refusals_for(r.protocol, found, r.id)]
        if not refused:
            return found  # the usual case: the first route carries it, the rest is preflight's
        per_route.append((r, refused))
    first = per_route[0][1][0]
    rest = "".join(f"; {_refusal(r, refused[0])}" for r, refused in per_route[1:])
    raise InvalidArgument(
        f"no route of the Run's plan can carry this request: "
        f"{_refusal(per_route[0][0], first)}{rest}; fix: {first.fix}", field=first.field,
        routes={r.id: [x.field for x in refused] for r, refused in per_route})


def _refusal(route: Route, refused: ParamRefusal | Uncarried) -> str:
    if isinstance(refused, ParamRefusal):
        return refused.message  # names the route already
    return f"route {route.id!r} ({route.protocol.value}): {refused.field}: {refused.message}"


def _qualification(
    route: Route, role: str, grant: Grant | None, denials: Denials
) -> list[PreflightFailure]:
    out: list[tuple[str, str]] = []
    if route.roles is not None and role not in route.roles:
        out.append((f"route is not qualified for role {role!r} (qualified: {route.roles})",
                    f"add {role!r} to Route(id={route.id!r}).roles"))
    if grant is not None and grant.roles is not None and role not in grant.roles:
        out.append((f"the run's grant does not allow role {role!r}",
                    f"add {role!r} to Grant.roles"))
    # Qualification binds to the exact route as currently configured: an operator switching a
    # route off withdraws its qualification for every new Attempt, whatever the frozen plan says.
    if route.id in denials.routes:
        out.append(("route is switched off in the current configuration", ""))
    return [PreflightFailure(Check.NOT_QUALIFIED, d, f) for d, f in out]


def _disclosure(
    route: Route, needs: RequestNeeds, grant: Grant | None, denials: Denials
) -> list[PreflightFailure]:
    out: list[tuple[str, str]] = []
    recipient = route.recipient
    if recipient in denials.recipients:
        out.append((f"recipient {recipient!r} is revoked in the current configuration", ""))
    if grant is not None:
        unapproved = sorted(c for c in needs.data_classes if not grant.approves(recipient, c))
        if unapproved:
            classes = ", ".join(unapproved)
            fix = f"add {classes} to Grant.recipients[{recipient!r}]"
            if TOOL_DESCRIPTION in unapproved and needs.param_tools:
                # The host may not know a parameter counts: name it, and the way without it.
                fix += (f", or leave the tool definitions of Envelope.params "
                        f"({', '.join(needs.param_tools)}) out of the request")
            out.append((f"recipient {recipient!r} is not approved for: {classes}", fix))
    out.extend(_forwarded(needs, grant, denials))
    for i, p in enumerate(needs.parts):
        if not needs_cover(p.data_class, p.derived) or p.coverage is Coverage.OK:
            continue
        verdict = p.coverage or Coverage.MISSING
        ref = f" (ref {p.ref!r})" if p.ref else ""
        fix = _coverage_fix(verdict, p.derived)
        out.append((f"part {i} ({p.data_class}) has no covering provenance: {verdict}{ref}",
                    fix))
    out.extend(_output_links(needs))
    return [PreflightFailure(Check.DISCLOSURE, d, f) for d, f in out]


def _output_links(needs: RequestNeeds) -> list[tuple[str, str]]:
    """The links a model or a tool chose: none is sent to any route, grant or no grant.

    A grant names who receives the request; a link makes the provider send a request of its
    own, to the link's host, and the URL (its query, its path, even its host name) is what the
    model wrote. The detail names neither the URL nor its host: they may carry the very data
    the link would have sent, and the detail is recorded and logged.
    """
    return [(f"part {m.index} ({m.media_type}) is an https:// link a model or a tool chose; "
             "the provider would fetch it, and the link's host, which no grant names, would "
             "receive whatever the URL carries",
             "fetch the file yourself, check it, and send its bytes as a user part "
             "(Part(data=..., media_type=..., data_class=...) of the class you decide, with "
             "recorded provenance unless it is user_input), or leave the part out")
            for m in needs.media if m.link and m.output]


def _forwarded(needs: RequestNeeds, grant: Grant | None,
               denials: Denials) -> list[tuple[str, str]]:
    """The forwarding servers the request may not reach: each is a recipient of its own.

    ``grant=None`` approves the plan's recipients only; a server named in a parameter is none.
    """
    out: list[tuple[str, str]] = []
    wanted = sorted(needs.data_classes)
    for f in needs.forwards:
        where = f"Envelope.params {f.param}"
        drop = (f"or drop {f.param} from Envelope.params (call the server yourself, as a tool "
                "of Envelope.tools)")
        if f.recipient is None:
            out.append((f"{where} makes the provider send the conversation to a server it does "
                        "not name by URL",
                        f"name the server by its URL (server_url, url) and approve it in the "
                        f"Run's Grant, {drop}"))
            continue
        if f.recipient in denials.recipients:
            out.append((f"{where} sends the conversation to {f.recipient!r}, revoked in the "
                        "current configuration", drop.removeprefix("or ")))
            continue
        unapproved = [c for c in wanted
                      if grant is None or not grant.approves(f.recipient, c)]
        if unapproved:
            classes = ", ".join(unapproved)
            whose = "the Run's grant" if grant is not None else "the Run (no grant: its plan's)"
            out.append((f"{where} makes the provider send the conversation to "
                        f"{f.recipient!r}, which {whose} does not approve for: {classes}",
                        f"add {classes} to Grant.recipients[{f.recipient!r}] if that server may "
                        f"receive them, {drop}"))
    return out


def _coverage_fix(verdict: Coverage, derived: bool) -> str:
    """How to cover a part; a model's or a tool's part is covered only as the ledger made it."""
    if derived:
        if verdict is Coverage.MISMATCH:
            return ("send the part exactly as the ledger returned it (a RunResult's parts, "
                    "RunSession.tool_result): an edited copy is not covered")
        # The ledger looks provenance up in the Run's tree only: a host that did carry a
        # part as returned, but to a Run of another task, must learn that the tree is why.
        return ("carry the part as a turn of this Run's tree returned it (of this Run, its "
                "parent, a Child or a sibling: the ledger recorded its provenance then); a "
                "part rebuilt by hand, or returned to a Run of another tree, is not covered")
    # A document or memory the host brings is covered by what the host recorded for it, so the
    # fix names led.record_provenance, not only the parts the ledger returns.
    record = ("led.record_provenance(run.lease, ref, part.content_hash, kind) with the part "
              "carrying provenance=ref")
    if verdict is Coverage.MISMATCH:
        return ("send the part exactly as its provenance was recorded (an edited copy is not "
                f"covered), or record this version: {record}")
    return (f"record its provenance before sending it: {record} (a RunResult's parts and "
            "RunSession.tool_result's carry theirs already); or give it data class user_input "
            "if it is the user's own")


def preflight(
    route: Route,
    request: Envelope | RequestNeeds,
    *,
    grant: Grant | None,
    role: str,
    provenance: Mapping[str, Set[str]] | None = None,
    token_counter: TokenCounter | None = None,
    denials: Denials | None = None,
) -> PreflightResult:
    """Check one route against one request; every failed check is named.

    Pure. The selector runs it for every candidate and skips a route that fails, naming the
    first failed check; :meth:`PreflightResult.require` turns a failure into
    :class:`~ledger.errors.PreflightRefused` for a host that checks by itself.

    Args:
        route: The (frozen) route the request would go to.
        request: The request: an :class:`~ledger.domain.envelope.Envelope`, or its
            :class:`RequestNeeds` with each part's provenance verdict already known.
        grant: The Run's frozen grant; ``None`` means the Run approved every recipient of its
            plan for every class (the caller only passes plan routes).
        role: The Run's role.
        provenance: The ledger's record (producer reference -> recorded content hashes), read
            only for an Envelope; with no record nothing non-exempt is covered.
        token_counter: Estimates the prompt tokens for the context-window check (default:
            :class:`CharEstimator`).
        denials: Routes and recipients switched off in the current configuration.

    Returns:
        The :class:`PreflightResult`: empty when the route may be used.

    Example:
        >>> r = preflight(route, Envelope(parts=[question]), grant=grant,  # doctest: +SKIP
        ...               role="research", provenance=recorded)
        >>> r.ok, r.checks  # doctest: +SKIP
    """
    if isinstance(request, Envelope):
        needs = needs_from_envelope(
            request,
            route,
            recorded=provenance or {},
            token_counter=token_counter or DEFAULT_TOKEN_COUNTER,
        )
    else:
        needs = request
    den = denials or NO_DENIALS
    failures = (
        _capability(route, needs)
        + _qualification(route, role, grant, den)
        + _disclosure(route, needs, grant, den)
    )
    return PreflightResult(route=route.id, failures=tuple(failures))


def narrow_grant(parent: Grant, requested: Grant) -> Grant:
    """A Child's grant: what it asks for, cut down to what the parent holds (never broader).

    Recipients the parent never approved vanish; a recipient keeps only the classes both
    approve; roles are intersected (``None`` = unrestricted on that side).
    """
    recipients: dict[str, list[str]] = {}
    for r, classes in requested.recipients.items():
        allowed = [c for c in classes if parent.approves(r, c)]
        if allowed:
            recipients[r] = allowed
    roles: list[str] | None
    if parent.roles is None:
        roles = requested.roles
    elif requested.roles is None:
        roles = list(parent.roles)
    else:
        roles = [r for r in requested.roles if r in parent.roles]
    return Grant(recipients=recipients, roles=roles)


__all__ = [
    "DEFAULT_TOKEN_COUNTER",
    "NO_DENIALS",
    "OUTPUT_CLASSES",
    "PDF_PAGE_TOKENS",
    "PROVENANCE_EXEMPT",
    "UNKNOWN_IMAGE_TOKENS",
    "CharEstimator",
    "Check",
    "Coverage",
    "Denials",
    "ForwardNeed",
    "MediaNeed",
    "PartNeed",
    "PreflightFailure",
    "PreflightResult",
    "RequestNeeds",
    "TokenCounter",
    "check_envelope_limits",
    "envelope_needs",
    "fresh_content_hash",
    "image_tokens",
    "media_needs",
    "narrow_grant",
    "needs_cover",
    "needs_from_envelope",
    "param_disclosures",
    "part_coverage",
    "preflight",
    "require_carried",
    "with_prompt",
]
