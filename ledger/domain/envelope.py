"""The envelope: the complete prepared request, as typed parts with data classes and provenance.

A part is text, or an image or a document (bytes with a media type, or a link). Its hash covers
its canonical encoding (role, content, data class, tool linkage; a binary part's media type and
the sha256 of its bytes, or its URL), so a copy with edited content or bytes, or with an extra
"authorized" flag, hashes differently and does not inherit the provenance of the part it was
copied from.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ledger.domain.bounds import MAX_TOKENS
from ledger.domain.media import (
    ACCEPTED_MEDIA_TYPES,
    MAX_BINARY_BYTES,
    MAX_URL_LENGTH,
    DataUrlError,
    MediaKind,
    bytes_digest,
    bytes_over,
    content_problem,
    decode_data_url,
    kind_of,
)
from ledger.domain.validation import Id, Problem, StrictModel, as_id, text
from ledger.domain.values import content_hash
from ledger.errors import InvalidArgument

# Data classes the ledger knows; a host may use any other string for classes it registers.
USER_INPUT = "user_input"
MODEL_DERIVED = "model_derived"
TOOL_DESCRIPTION = "tool_description"
TOOL_RESULT = "tool_result"
MEMORY = "memory"
PRIVATE_DOCUMENT = "private_document"
SYSTEM = "system"

# The data class of an assistant or a tool part when none is given (any other part's is
# user_input). The user's and the host's own text need no provenance
# (decide.preflight.PROVENANCE_EXEMPT); a model's answer and a tool's result do, so they may
# not be labelled with those classes (EXEMPT_CLASSES).
DERIVED_ROLE_CLASS = {"assistant": MODEL_DERIVED, "tool": TOOL_RESULT}
EXEMPT_CLASSES = frozenset({USER_INPUT, SYSTEM})


#: What a lone surrogate is, and the fix, as every refusal of one says it.
SURROGATE_PROBLEM = ("holds a lone surrogate (a character from U+D800 to U+DFFF, half of a "
                     "UTF-16 pair), which no UTF-8 request body can carry")
SURROGATE_FIX = ("mend or drop it before it goes in the request: "
                 "text.encode('utf-8', 'replace').decode('utf-8') makes each one a '?' (a JSON "
                 "text escaping one, \"\\ud800\", decodes to one)")
_NOT_JSON = ("is not JSON data", "pass only strings, finite numbers, booleans, None, lists and "
             "mappings with string keys")
# Built once: json.dumps with options builds a new encoder on each call.
_STRICT_JSON = json.JSONEncoder(sort_keys=True, allow_nan=False)
_RAW_JSON = json.JSONEncoder(ensure_ascii=False)


def lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (U+D800 to U+DFFF), or ``None``.

    A str holds one when it was decoded leniently: ``json.loads`` of a JSON string escaping one
    (a JavaScript string cut between the two halves of an emoji), a file read with
    ``errors="surrogateescape"``. Every request body is sent as UTF-8 JSON, and UTF-8 has no
    encoding for one. ASCII text, the usual part, is answered without reading it
    (``str.isascii`` reads a flag in CPython).
    """
    if text.isascii():
        return None
    try:
        text.encode("utf-8")  # C speed, several times a regular expression's scan
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def json_data_problem(value: Any) -> tuple[str, str] | None:
    """What keeps ``value`` out of a JSON request body, with the fix; ``None``: nothing does.

    JSON data is strings, finite numbers, booleans, ``None``, lists and mappings with string
    keys; a set, an object, ``NaN`` or an infinity is not, nor a string (value or key) holding
    a lone surrogate (:func:`lone_surrogate`). The one rule of ``Envelope.params`` and
    ``ToolSpec.parameters``, when they are built and when a turn sends them.
    """
    try:
        text = _STRICT_JSON.encode(value)
    except (TypeError, ValueError, RecursionError):
        return _NOT_JSON
    # The ASCII encoding writes every surrogate as \udXXX (and every character beyond the BMP
    # as a pair of them): without one, there is nothing to look for.
    if "\\ud" in text and lone_surrogate(_RAW_JSON.encode(value)) is not None:
        return SURROGATE_PROBLEM, SURROGATE_FIX
    return None


def _json_data(value: Any) -> Any:
    """``value`` itself, when it is JSON data a request body can carry (:func:`json_data_problem`).

    Parameters are hashed into the Attempt's envelope hash and sent as JSON.
    """
    problem = json_data_problem(value)
    if problem is not None:
        raise Problem(*problem)
    return value


def _text(value: str) -> str:
    """``value`` itself, when it holds no lone surrogate (a tool's description is sent)."""
    if lone_surrogate(value) is not None:
        raise Problem(SURROGATE_PROBLEM, SURROGATE_FIX)
    return value


# The rules of a part's tool linkage, as its fields declare them: ``tool_call_id`` is an
# identifier (Id's own rule), ``name`` a short printable text (Text's). An adapter judges a
# provider's tool call by these very rule objects before it builds the call's part
# (tool_link_problem), so what it lets through is what a part keeps.
_LINK_RULES = {"tool_call_id": as_id, "name": text()}
_CallId = Annotated[StrictStr, _LINK_RULES["tool_call_id"]]
_PartName = Annotated[StrictStr, _LINK_RULES["name"]]


def tool_link_problem(field: Literal["tool_call_id", "name"], value: str) -> str | None:
    """What keeps ``value`` from being a part's ``tool_call_id`` or ``name``; ``None``: nothing.

    The rule the field itself applies: an id is 1 to 200 printable characters, not only
    whitespace; a name at most 200 printable characters (no NUL, line break or other control
    character, no lone surrogate). An adapter asks it of a provider's tool call before the
    call becomes a part of the answer (:func:`ledger.adapters.contract.proposed_call`).
    """
    try:
        _LINK_RULES[field](value)
    except Problem as e:
        return e.problem
    return None


class Part(StrictModel):
    """One part of a prepared request: text, or an image or a document.

    A text part has ``content``. A binary part carries an image or a document either as bytes
    (``data=`` with ``media_type=``) or as a URL (``url=``: ``https://``, fetched by the
    provider, never by the ledger; or a ``data:`` URL, which carries its own bytes and media
    type), and no text. Media types: ``image/png``, ``image/jpeg``, ``image/gif``,
    ``image/webp``, ``application/pdf``, ``text/plain``, ``text/markdown``, ``text/csv``
    (:mod:`ledger.domain.media`); the bytes must be what the type says. A binary part is the
    user's (``role="user"``); its ``data_class`` is ``user_input`` unless given (a private
    upload is ``private_document``, and needs recorded provenance like any other class but
    ``user_input``); ``name`` is its file name where a protocol sends one. An image or a
    document a model returned is the model's (``role="assistant"``), of class
    ``model_derived`` with the Attempt that produced it as ``provenance``: a turn's
    ``RunResult.parts`` hold it so, and a copy of it is covered only while its bytes are the
    ones recorded. A link a model or a tool returned is never sent on (disclosure preflight
    refuses it: the provider would fetch it, and its host, which no grant names, would receive
    what the URL carries); the host fetches the file and sends its bytes.

    ``data_class`` follows ``role`` unless given: ``user_input`` for a user's or a system part,
    ``model_derived`` for an assistant's, ``tool_result`` for a tool's. An assistant or a tool
    part may not say ``user_input`` or ``system``, the classes that need no provenance: a
    model's answer or a tool's result reaches a recipient only as what it is, with the
    provenance the ledger recorded (the parts of ``RunResult.parts`` and of
    ``run.tool_result(...)`` carry it; a copy rebuilt by hand has none).

    ``data_class``, ``provenance`` and ``tool_call_id`` are identifiers (1 to 200 printable
    characters); ``name`` a short printable text; ``content`` any text (one holding a lone
    surrogate, which no UTF-8 request body can carry, is refused when a turn or an adapter
    would send it, naming ``envelope.parts[i].content``: :func:`lone_surrogate`).

    Example:
        >>> Part(data=open("10-K.pdf", "rb").read(), media_type="application/pdf",
        ...      name="10-K.pdf", data_class="private_document", provenance="doc-10k")
        ...  # doctest: +SKIP
    """

    # The binary fields come first: the validators of the later fields read them.
    data: bytes | None = None
    url: str | None = None
    media_type: str | None = Field(default=None, validate_default=True)
    role: Literal["system", "user", "assistant", "tool"] = Field(default="user",
                                                                 validate_default=True)
    content: str = Field(default="", validate_default=True)
    # Left out, it follows the role (the model validator fills it in from DERIVED_ROLE_CLASS);
    # validated either way, so an assistant or tool part never carries a class exempt from
    # provenance.
    data_class: Id = Field(default=USER_INPUT, validate_default=True)
    # The Attempt id (model output) or tool-call id (tool result) that produced this content.
    provenance: Id | None = None
    tool_call_id: _CallId | None = Field(default=None, validate_default=True)
    name: _PartName | None = None

    # Bytes travel as base64 in JSON (a dumped envelope validates back to the same parts).
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    @model_validator(mode="before")
    @classmethod
    def _something(cls, data: Any) -> Any:
        if isinstance(data, dict) and not {"content", "data", "url"} & data.keys():
            raise Problem("a part carries nothing",
                          "pass content= (text), or data= (bytes) or url= with media_type= "
                          "(an image or a document)")
        if isinstance(data, dict) and "data_class" not in data:
            # A static default of user_input would let a model's answer or a tool's result,
            # rebuilt by hand, pass as the user's own text: exempt from provenance and sent
            # to every recipient approved for user input.
            role = data.get("role")
            if isinstance(role, str) and role in DERIVED_ROLE_CLASS:
                data = {**data, "data_class": DERIVED_ROLE_CLASS[role]}
        return data

    @field_validator("data", mode="before")
    @classmethod
    def _bytes(cls, v: Any, info: ValidationInfo) -> Any:
        # Python callers pass bytes; JSON carries them as base64 text (val_json_bytes).
        if info.mode == "python" and v is not None and not isinstance(v, bytes):
            if isinstance(v, bytearray | memoryview):
                return bytes(v)
            raise Problem(f"data is {type(v).__name__}, not bytes",
                          "pass the file's bytes (open(path, 'rb').read()); text goes in "
                          "content=")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        if info.data.get("data") is not None:
            raise Problem("a part carries data= (bytes) and url= at once",
                          "pass the bytes as data=, or the link as url=, not both")
        scheme = v.split(":", 1)[0].lower() if ":" in v else ""
        if scheme in ("data", "https"):
            # A scheme is case-insensitive (RFC 3986 3.1) and its canonical spelling is lower
            # case: one link hashes one way, and no provider is handed "HTTPS://".
            v = scheme + v[len(scheme):]
        if scheme == "data":
            try:
                decode_data_url(v)
            except DataUrlError as e:
                fix = "pass data:<media type>;base64,<data>, or the bytes as data="
                raise Problem(f"the data: URL {e}", fix) from None
            return v
        if scheme != "https":
            shown = f"scheme {scheme!r}" if scheme else "no scheme"
            raise Problem(f"url has {shown}; a part's URL is https:// (fetched by the "
                          "provider) or a data: URL",
                          "pass an https:// link, a data: URL, or the bytes as data=")
        if len(v) > MAX_URL_LENGTH:
            raise Problem(f"url is {len(v)} characters long", f"pass at most {MAX_URL_LENGTH} "
                          "characters, or the bytes as data=")
        # The scheme alone passed above: "https:host/p" and "https:/host/p" have no "//".
        if (any(c.isspace() or not c.isprintable() for c in v) or v[:8] != "https://"
                or not re.split(r"[/?#]", v[8:])[0]):
            raise Problem("url is not a usable https:// URL (no host, or spaces or control "
                          "characters)", "pass a full https://host/path link")
        return v

    @field_validator("media_type")
    @classmethod
    def _media_type(cls, v: str | None, info: ValidationInfo) -> str | None:
        data, url = info.data.get("data"), info.data.get("url")
        if data is None and url is None:
            if "data" not in info.data or "url" not in info.data:
                return v  # data= or url= was refused already
            if v is not None:
                raise Problem("media_type= describes data= or url=, and this part has neither",
                              "pass the bytes as data= (or a url=), or leave media_type out")
            return v
        own = None
        if url is not None and url[:5].lower() == "data:":
            own, data = decode_data_url(url)
        if v is None:
            if own is None:
                raise Problem("a binary part needs media_type=",
                              f"pass one of {', '.join(ACCEPTED_MEDIA_TYPES)}")
            v = own
        if not isinstance(v, str):
            raise Problem("is not a string", "pass a media type such as 'application/pdf'")
        v = v.strip().lower()
        if own is not None and own != v:
            raise Problem(f"media_type {v!r} differs from the data: URL's {own!r}",
                          "pass the data: URL's own media type, or leave media_type out")
        kind = kind_of(v)
        if kind is None:
            fix = "use image/jpeg" if v == "image/jpg" else (
                f"pass one of {', '.join(ACCEPTED_MEDIA_TYPES)}")
            raise Problem(f"media type {v!r} is not one the ledger sends", fix)
        if kind is MediaKind.REASONING and data is None:
            raise Problem("a reasoning item carries its bytes", "pass data=")
        if data is not None:
            if not data:
                raise Problem("data is empty", "pass the file's bytes, or leave the part out")
            if len(data) > MAX_BINARY_BYTES:
                shown, bound = bytes_over(len(data), MAX_BINARY_BYTES)
                raise Problem(f"data is {shown}, over the ledger's ceiling of {bound}",
                              "send a smaller file (or a link as url=)")
            problem = content_problem(v, data)
            if problem is not None:
                raise Problem(f"the data {problem}", "pass the media type the bytes really "
                              "have, or the right file")
        return v

    @field_validator("role")
    @classmethod
    def _role(cls, v: str, info: ValidationInfo) -> str:
        kind = kind_of(info.data.get("media_type") or "")
        if kind is MediaKind.REASONING and v != "assistant":
            raise Problem("a reasoning item is the model's: role must be 'assistant'",
                          "pass role='assistant'")
        if kind is not None and kind is not MediaKind.REASONING and v not in ("user",
                                                                            "assistant"):
            raise Problem(f"an image or a document is the user's or the model's, not the "
                          f"{v}'s",
                          "pass role='user' (the default), or role='assistant' for one a "
                          "model returned; a tool's file is a user part after the tool "
                          "result with data_class='tool_result' and the call's recorded "
                          "provenance: run.tool_result(call, Part(data=..., media_type=...)) "
                          "builds it and records that")
        return v

    @field_validator("data_class")
    @classmethod
    def _model_derived(cls, v: str, info: ValidationInfo) -> str:
        role = info.data.get("role")
        if role in DERIVED_ROLE_CLASS and v in EXEMPT_CLASSES:
            source = "a turn's result.parts" if role == "assistant" else "run.tool_result(...)"
            fix = (f"pass data_class={DERIVED_ROLE_CLASS[role]!r} (the default for this role) "
                   f"and the provenance the ledger recorded: carry the part {source} returned "
                   "as it is; or role='user' if the text is the user's own")
            raise Problem(f"a part of role {role!r} is not the user's input nor the host's "
                          f"system text, so its data class cannot be {v!r} (a class that needs "
                          "no provenance)", fix)
        kind = kind_of(info.data.get("media_type") or "")
        if (kind is not None and kind is not MediaKind.REASONING
                and info.data.get("role") == "assistant" and v != MODEL_DERIVED):
            raise Problem(f"an image or a document of role 'assistant' is what a model "
                          f"returned, so its data class is {MODEL_DERIVED!r}, not {v!r}",
                          f"pass data_class={MODEL_DERIVED!r} with the producing Attempt as "
                          "provenance= (a turn's result.parts carry both), or role='user' for "
                          "the user's own file")
        return v

    @field_validator("content")
    @classmethod
    def _content(cls, v: str, info: ValidationInfo) -> str:
        if v and (info.data.get("data") is not None or info.data.get("url") is not None):
            raise Problem("a binary part carries no text",
                          "put the text (a caption, a question) in its own part")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _not_a_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("media_type") is not None:
            raise Problem("a binary part is not a tool call or a tool result",
                          "leave tool_call_id out; send the file in a user part")
        return v

    @property
    def kind(self) -> MediaKind | None:
        """What a binary part is (``image``, ``pdf``, ``text``, ``reasoning``); ``None``: text."""
        return kind_of(self.media_type) if self.media_type is not None else None

    @property
    def payload(self) -> bytes | None:
        """The part's bytes: ``data``, or a ``data:`` URL's; ``None`` for text and https links."""
        if self.data is not None:
            return self.data
        if self.url is not None and self.url[:5].lower() == "data:":
            return decode_data_url(self.url)[1]
        return None

    @property
    def link(self) -> str | None:
        """The ``https://`` URL the provider fetches, or ``None``."""
        return self.url if self.url is not None and self.payload is None else None

    # A plain property, not cached: model_copy(update=...) would carry a cached hash over to an
    # edited copy, which would then pass for the original.
    @property
    def content_hash(self) -> str:
        """``sha256:<hex>`` of role, content, data class and tool linkage (not provenance).

        A binary part's hash also covers its media type and its bytes (their sha256), or, for
        an ``https://`` link, the URL text (the ledger never fetches it; a ``data:`` URL is
        hashed as the bytes it carries, so it hashes as the same ``data=`` part).

        Provenance is what the hash is checked *against*: the ledger records, per producer,
        the hashes of what it produced, and a part is covered only if its hash is among them.
        """
        fields: dict[str, Any] = {
            "role": self.role,
            "content": self.content,
            "data_class": self.data_class,
            "tool_call_id": self.tool_call_id,
            "name": self.name,
        }
        if self.media_type is not None:
            # Only binary parts add keys: a text part hashes exactly as it always did, so the
            # provenance recorded before binary parts existed still covers it.
            fields["media_type"] = self.media_type
            payload = self.payload
            if payload is not None:
                fields["data_sha256"] = bytes_digest(payload)
            else:
                fields["url"] = self.url
        return content_hash(fields)


class ToolSpec(StrictModel):
    """A tool the model may call (its description is data too).

    ``name`` is an identifier; ``parameters`` (a JSON schema) must be JSON data and
    ``description`` text a request body can carry (:func:`json_data_problem`: no NaN, no
    lone surrogate). One built without validation (``model_construct``,
    ``model_copy(update=...)``) or changed in place is judged again by a turn, before any
    Attempt, and by the adapter (:func:`ledger.domain.carried.tool_refusals`): refused with
    :class:`~ledger.errors.InvalidArgument` on ``envelope.tools[i]...``.

    The tool's definition (name, description, parameters) is always ``tool_description``
    data. ``data_class`` adds a class for a definition that carries more than that (a
    ``secret`` or ``pii`` description, say): the tool is then disclosed under both
    classes (:attr:`data_classes`), and only a recipient the grant approves for both receives
    it. It never replaces ``tool_description``, so no label the host gives (``user_input``
    included) sends a tool description to a recipient not approved for tool descriptions.
    """

    name: Id
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)
    data_class: Id = TOOL_DESCRIPTION

    _parameters_are_json = field_validator("parameters")(_json_data)
    _description_is_text = field_validator("description")(_text)

    @property
    def data_classes(self) -> frozenset[str]:
        """The classes a recipient must be approved for: ``tool_description``, ``data_class``."""
        return frozenset((TOOL_DESCRIPTION, self.data_class))


#: The output tokens a request is taken to allow when its envelope sets no
#: ``max_output_tokens``: what the Anthropic adapter sends as the ``max_tokens`` its protocol
#: requires, and what the Run's hold counts, so that the hold covers what that request may be
#: billed. A protocol that needs no limit is sent none, and its provider
#: may write more; set ``max_output_tokens`` to make the budget a bound on every route.
DEFAULT_OUTPUT_TOKENS = 4096


_NO_PARTS = ("the envelope has no parts", "add at least one user part")


class Envelope(StrictModel):
    """The complete request. Its :attr:`hash` is what an Attempt records.

    ``parts`` holds at least one part (a turn checks it again, :func:`require_parts`, for one
    built without validation); ``params`` (temperature, top_p, ...) must be JSON data a
    request body can carry (:func:`json_data_problem`: finite numbers, no lone surrogate; a
    turn checks them again, for an envelope built without validation), and a
    route whose protocol builds one of their names itself (``messages``, ``contents``, ...) or
    whose ``Capabilities.parameters`` leaves one out cannot carry them
    (:mod:`ledger.domain.params`: preflight skips it; a turn whose plan has no route left
    refuses the envelope before any Attempt); ``max_output_tokens`` an integer from 1 to
    10^15, or ``None``.
    """

    parts: list[Part]
    tools: list[ToolSpec] = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict)  # temperature, top_p, ...
    stream: StrictBool = False
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)

    _params_are_json = field_validator("params")(_json_data)

    @field_validator("parts")
    @classmethod
    def _something_to_send(cls, v: list[Part]) -> list[Part]:
        # Refused here, not by the adapter: by then a turn has selected a route and begun an
        # Attempt, and a caller's own send function would send it.
        if not v:
            raise Problem(*_NO_PARTS)
        return v

    @property
    def prefill(self) -> bool:
        """True when the last part is an assistant part the model should continue."""
        return bool(self.parts) and self.parts[-1].role == "assistant"

    @property
    def data_classes(self) -> set[str]:
        """Every data class the request carries (its parts' and its tools')."""
        classes = {p.data_class for p in self.parts}
        for t in self.tools:
            classes |= t.data_classes
        return classes

    @property
    def hash(self) -> str:
        """``sha256:<hex>`` of the whole request (parts, tools, params, stream, max output)."""
        return self.hash_with([p.content_hash for p in self.parts])

    def hash_with(self, part_hashes: Sequence[str]) -> str:
        """:attr:`hash` from the parts' hashes computed already.

        The retry owner hashes the parts once per turn and checks coverage with the same hashes.
        """
        return content_hash(
            {
                "parts": list(part_hashes),
                "tools": [t.model_dump(mode="json") for t in self.tools],
                "params": self.params,
                "stream": self.stream,
                "max_output_tokens": self.max_output_tokens,
            }
        )


# Every field Part.content_hash reads (payload and link derive from data and url). The memo
# checks each of them on lookup: a part is frozen only against ordinary assignment.
_HASHED_FIELDS = ("role", "content", "data_class", "tool_call_id", "name", "media_type", "data",
                  "url")
_read_hashed = operator.attrgetter(*_HASHED_FIELDS)
# The types whose values cannot change in place: a field holding one, seen to be the very same
# object again, still holds the content that was hashed.
_IMMUTABLE = (str, bytes, type(None))


class PartHashes:
    """The content hashes of a conversation's parts, each part hashed once.

    A conversation re-sends every earlier part on every turn; hashing them all again makes a
    turn's cost grow with the Run's length. Keep one ``PartHashes`` per conversation and pass
    it to :func:`~ledger.execute` (a Run session keeps its own): a part is reused only when it
    is the very same object as in the previous turn *and* every field its hash covers (role,
    content, data class, tool linkage, name, media type, bytes, URL) still holds the very same
    (immutable) value it held when hashed, and only the latest envelope's parts are kept, so
    the memo is as large as the conversation and never outlives it. A part is frozen only
    against ordinary assignment: one changed in place (``object.__setattr__(part, "content",
    ...)``, by the host or a library it uses) is hashed again, so it is judged by the content
    it carries now, never vouched for by the hash of what it held before. A copy, even an
    identical one, is hashed afresh, so an edited copy never inherits a recorded hash; and the
    hashes are always computed here, never taken from the caller.
    """

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        # id(part) -> (part, the hashed fields' values when hashed, its content hash)
        self._memo: dict[int, tuple[Part, tuple[object, ...], str]] = {}

    def of(self, envelope: Envelope) -> tuple[str, ...]:
        """The envelope's part hashes, in order (:attr:`Part.content_hash` of each)."""
        old = self._memo
        new: dict[int, tuple[Part, tuple[object, ...], str]] = {}
        out = []
        for p in envelope.parts:
            fields: tuple[object, ...] = _read_hashed(p)
            hit = old.get(id(p))
            # Identity, not equality: O(1) per field whatever the content's size, and no
            # __eq__ of a value planted in place is consulted.
            if hit is not None and hit[0] is p and all(map(operator.is_, hit[1], fields)):
                digest = hit[2]
            else:
                digest = p.content_hash
                if not all(type(v) in _IMMUTABLE for v in fields):
                    # A value that can change in place (a bytearray planted as data) would
                    # still be the same object after an edit: such a part is hashed every time.
                    out.append(digest)
                    continue
            new[id(p)] = (p, fields, digest)
            out.append(digest)
        self._memo = new
        return tuple(out)


def require_parts(envelope: Envelope, field: str = "envelope.parts") -> None:
    """Refuse ``envelope`` if it has no parts, with the error ``Envelope(parts=[])`` gets.

    Validation refuses such an envelope when it is built, but one built without it
    (``Envelope.model_construct``, ``model_copy(update={"parts": []})``) arrives with none. A
    turn checks here before it reads or writes anything: no request could be made of it, so
    no Attempt may be begun for it. Raises :class:`~ledger.errors.InvalidArgument` naming
    ``field`` (the argument's path to the parts) and the fix.
    """
    if not envelope.parts:
        problem, fix = _NO_PARTS
        problem += f" (got {envelope.parts!r})"
        raise InvalidArgument(f"invalid {field}: {problem}; {fix}", field=field,
                              errors=[(field, problem, fix)])


__all__ = [
    "DEFAULT_OUTPUT_TOKENS",
    "MEMORY",
    "MODEL_DERIVED",
    "PRIVATE_DOCUMENT",
    "SURROGATE_FIX",
    "SURROGATE_PROBLEM",
    "SYSTEM",
    "TOOL_DESCRIPTION",
    "TOOL_RESULT",
    "USER_INPUT",
    "Envelope",
    "Part",
    "PartHashes",
    "ToolSpec",
    "json_data_problem",
    "lone_surrogate",
    "require_parts",
    "tool_link_problem",
]
