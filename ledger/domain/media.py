"""Images and documents in an envelope: media types, data URLs, and what the bytes say.

A binary :class:`~ledger.domain.envelope.Part` carries an image or a document, as bytes with a
media type or as a URL. This module holds the facts about those values that every room reads
alike: which media types the ledger accepts and of which kind they are, how a ``data:`` URL
decodes, whether bytes are what their media type claims, an image's size in pixels, a PDF's
page count, and which wire protocol can carry which kind of part by URL. Pure functions over
bytes; nothing is fetched (the ledger never follows a URL).

=====================  ==============  ===============================================
media type             kind            wire (see docs/adapters.md)
=====================  ==============  ===============================================
``image/png``          ``image``       every protocol's image block
``image/jpeg``         ``image``
``image/gif``          ``image``       (not Gemini's: a route of it is skipped)
``image/webp``         ``image``
``application/pdf``    ``pdf``         every protocol's document / file block
``text/plain``         ``text``        text where the protocol has no text document
``text/markdown``      ``text``        (sent as ``text/plain`` where a type is needed)
``text/csv``           ``text``
=====================  ==============  ===============================================

:data:`REASONING_MEDIA_TYPE` is the ledger's own: an opaque reasoning item a provider returned
(the OpenAI Responses API's encrypted reasoning, an Anthropic thinking block, a Gemini thought
signature), carried back to the route that produced it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable
from enum import StrEnum
from typing import TypeVar
from urllib.parse import unquote_to_bytes

from ledger.domain.facts import WireProtocol


class MediaKind(StrEnum):
    """What a binary part is, for capabilities, token estimates and codecs."""

    IMAGE = "image"
    PDF = "pdf"
    TEXT = "text"  # a plain-text document (a .txt, .md or .csv file)
    REASONING = "reasoning"  # an opaque reasoning item of one route (never a user's part)


IMAGE_MEDIA_TYPES: frozenset[str] = frozenset({"image/png", "image/jpeg", "image/gif",
                                                "image/webp"})
DOCUMENT_MEDIA_TYPES: frozenset[str] = frozenset({"application/pdf", "text/plain",
                                                   "text/markdown", "text/csv"})
#: The media type of an opaque reasoning item (JSON: the route that produced it and the item).
REASONING_MEDIA_TYPE = "application/vnd.ledger.reasoning+json"

_KINDS: dict[str, MediaKind] = {
    **{t: MediaKind.IMAGE for t in IMAGE_MEDIA_TYPES},
    "application/pdf": MediaKind.PDF,
    "text/plain": MediaKind.TEXT,
    "text/markdown": MediaKind.TEXT,
    "text/csv": MediaKind.TEXT,
    REASONING_MEDIA_TYPE: MediaKind.REASONING,
}

#: Every media type a part may carry (the user's; the reasoning type is the adapters').
ACCEPTED_MEDIA_TYPES: tuple[str, ...] = tuple(sorted(IMAGE_MEDIA_TYPES | DOCUMENT_MEDIA_TYPES))

#: The largest part any policy may allow (``envelope.max_part_bytes`` is at most this): one
#: request's bytes are held in memory, base64-encoded once more to be sent.
MAX_BINARY_BYTES = 512 * 1024 * 1024
#: The longest ``https://`` URL a part may carry (as a route's endpoint).
MAX_URL_LENGTH = 8192


def kind_of(media_type: str) -> MediaKind | None:
    """The kind of ``media_type`` (already lower-case), or ``None`` when the ledger refuses it."""
    return _KINDS.get(media_type)


def wire_media_type(media_type: str) -> str:
    """The media type a protocol that knows only ``text/plain`` documents is sent."""
    return "text/plain" if kind_of(media_type) is MediaKind.TEXT else media_type


# -- data: URLs -----------------------------------------------------------------------------

_DATA_URL = re.compile(r"^data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.I)


class DataUrlError(ValueError):
    """A ``data:`` URL that does not decode; the message says why."""


def decode_data_url(url: str) -> tuple[str, bytes]:
    """``(media type, bytes)`` of a ``data:`` URL (base64 or percent-encoded).

    Memoised by the URL as :func:`bytes_digest` (the URL and its bytes both counted): a part's
    bytes are read to build it, for its hash, its estimate and its request.

    Raises:
        DataUrlError: not a data URL, no media type, or a payload that is not valid base64.
    """
    return _MEMO.get(("data_url", url), lambda: _decode_data_url(url),
                     lambda decoded: (url, decoded[1]))


def _decode_data_url(url: str) -> tuple[str, bytes]:
    m = _DATA_URL.match(url)
    if m is None:
        raise DataUrlError("is not a data: URL of the form data:<media type>;base64,<data>")
    media_type = m.group("type").strip().lower()
    if not media_type:
        raise DataUrlError("names no media type (data:<media type>;base64,...)")
    params = [p.strip().lower() for p in m.group("params").split(";") if p.strip()]
    payload = url[m.end():]
    if "base64" in params:
        try:
            return media_type, base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise DataUrlError("has a payload that is not valid base64") from None
    return media_type, unquote_to_bytes(payload)


def data_url(media_type: str, data: bytes) -> str:
    """``data:<media type>;base64,<data>``: how most wire protocols inline bytes."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def b64(data: bytes) -> str:
    """Standard base64 of ``data``, as text."""
    return base64.b64encode(data).decode("ascii")


# -- what the bytes are ---------------------------------------------------------------------

_SIGNATURES: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/gif": (b"GIF87a", b"GIF89a"),
}


def content_problem(media_type: str, data: bytes) -> str | None:
    """What is wrong with ``data`` as ``media_type`` (a sentence), or ``None`` if it fits.

    Images and PDFs must start with their format's signature (a provider answers a mislabelled
    file with a 400 the Run could only record); text documents must be UTF-8.
    """
    kind = kind_of(media_type)
    if kind is MediaKind.IMAGE:
        if media_type == "image/webp":
            ok = data[:4] == b"RIFF" and data[8:12] == b"WEBP"
        else:
            ok = data.startswith(_SIGNATURES[media_type])
        if not ok:
            return f"is not {media_type} (its first bytes are not that format's signature)"
    elif kind is MediaKind.PDF:
        # The PDF header may follow some leading bytes (ISO 32000-1, 7.5.2 allows it).
        if b"%PDF-" not in data[:1024]:
            return "is not a PDF (no %PDF- header in its first 1024 bytes)"
    elif kind is MediaKind.TEXT:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"is not UTF-8 text (byte {e.start} does not decode)"
    return None


def sniff_image_type(data: bytes) -> str | None:
    """The image media type ``data``'s signature names (PNG, JPEG, GIF, WebP), or ``None``.

    For answers that carry an image without naming its type (the Responses API's
    ``image_generation_call`` may leave its format out).
    """
    for media_type in sorted(IMAGE_MEDIA_TYPES):
        if content_problem(media_type, data) is None:
            return media_type
    return None


# -- the memo of what the bytes say ----------------------------------------------------------

#: The most bytes of payloads (files, ``data:`` URLs and their decoded bytes) the media memo
#: keeps alive, all entries together: the most a process keeps of uploads its hosts dropped.
#: The default policy's largest envelope (32 MiB) fits, even sent as ``data:`` URLs (their text
#: and their bytes); a conversation carrying more reads its files again on every turn.
MEDIA_MEMO_BYTES = 128 * 1024 * 1024

_T = TypeVar("_T")


class _PayloadMemo:
    """What was computed from recent payloads, kept while those payloads fit in ``budget`` bytes.

    A conversation re-sends the same documents every turn, and a host (an integration) may
    rebuild its parts each turn, so the facts are keyed by the payload itself, not by a part:
    an edited copy is other bytes, so never a hit. Keying by the payload keeps it alive, so the
    memo is bounded by the bytes it holds, not by a number of entries: a count bound let a
    server keep every recent 20 MiB upload alive long after its Run ended. A payload is
    counted once however many entries hold it (a ``data:`` URL's decoded bytes are both a value
    and a key); least recently used entries go first, and a payload larger than the budget is
    never kept.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        # key -> (fact, the payloads it holds alive)
        self._entries: OrderedDict[Hashable, tuple[object, tuple[bytes | str, ...]]] = (
            OrderedDict())
        self._held: dict[int, tuple[bytes | str, int]] = {}  # id -> (payload, entries holding)
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[Hashable, ...], compute: Callable[[], _T],
            holds: Callable[[_T], tuple[bytes | str, ...]]) -> _T:
        """The fact under ``key``, computed (outside the lock) and kept when it is missing.

        ``key`` holds the payload it is computed from; ``holds(fact)`` names every payload the
        entry keeps alive (the key's, and a value's that is a payload itself).
        """
        hash(key)  # a payload's hash is computed once and cached: not under the lock
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]  # type: ignore[return-value]
        fact = compute()
        payloads = holds(fact)
        if sum(len(p) for p in {id(p): p for p in payloads}.values()) > self.budget:
            return fact
        with self._lock:
            if key in self._entries:
                return fact
            self._entries[key] = (fact, payloads)
            for p in payloads:
                held = self._held.get(id(p))
                if held is None:
                    self._bytes += len(p)
                self._held[id(p)] = (p, 1 if held is None else held[1] + 1)
            while self._bytes > self.budget:
                _, (_, gone) = self._entries.popitem(last=False)
                for p in gone:
                    obj, count = self._held[id(p)]
                    if count > 1:
                        self._held[id(p)] = (obj, count - 1)
                    else:
                        del self._held[id(p)]
                        self._bytes -= len(obj)
        return fact


_MEMO = _PayloadMemo(MEDIA_MEMO_BYTES)


def bytes_digest(data: bytes) -> str:
    """The sha256 hex digest of ``data``.

    Memoised by the bytes themselves, within :data:`MEDIA_MEMO_BYTES` (an edited copy is other
    bytes, so never a hit): a conversation re-sends the same document every turn, and hashing
    20 MB costs milliseconds.
    """
    return _MEMO.get(("sha256", data), lambda: hashlib.sha256(data).hexdigest(),
                     lambda _: (data,))


def image_size(data: bytes, media_type: str) -> tuple[int, int] | None:
    """``(width, height)`` in pixels from the image's header, or ``None`` when unreadable.

    Memoised as :func:`bytes_digest` (a JPEG's header may be read through many segments).
    """
    return _MEMO.get(("image_size", data, media_type), lambda: _image_size(data, media_type),
                     lambda _: (data,))


def _image_size(data: bytes, media_type: str) -> tuple[int, int] | None:
    try:
        if media_type == "image/png":
            if data[12:16] == b"IHDR":
                w, h = struct.unpack(">II", data[16:24])
                return _positive(w, h)
        elif media_type == "image/gif":
            w, h = struct.unpack("<HH", data[6:10])
            return _positive(w, h)
        elif media_type == "image/webp":
            return _webp_size(data)
        elif media_type == "image/jpeg":
            return _jpeg_size(data)
    except (struct.error, IndexError):
        return None
    return None


def _positive(w: int, h: int) -> tuple[int, int] | None:
    return (w, h) if w > 0 and h > 0 else None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X":
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return _positive(w, h)
    if chunk == b"VP8L" and data[20:21] == b"\x2f":
        bits = int.from_bytes(data[21:25], "little")
        return _positive((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", data[26:30])
        return _positive(w & 0x3FFF, h & 0x3FFF)
    return None


# Start-of-frame markers (baseline, progressive, ...): not DHT (C4), JPG (C8) or DAC (CC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    n = len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if marker in _SOF:
            h, w = struct.unpack(">HH", data[i + 5:i + 9])
            return _positive(w, h)
        if length < 2:
            return None
        i += 2 + length
    return None


_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z])")
# A page tree node's /Type /Pages and its /Count are paired when no '>' (a dictionary's end)
# lies between them: each gap between two tokens is looked into once, so the time is linear in
# the file (a pattern with a lazy [^>]*? between the two rescanned to the end from every
# /Count: 75 s for 360 KB of "/Count 1 ", hours for a 20 MiB upload, in a turn's preflight).
_TREE = re.compile(rb"/Type\s*/Pages\b|/Count\s+(\d+)")
# No page count has more digits than this (int() of a longer one would be refused anyway).
_COUNT_DIGITS = 15


def _tree_counts(text: bytes) -> list[int]:
    """Every ``/Count`` of a ``/Type /Pages`` dictionary in ``text``."""
    counts: list[int] = []
    pending: list[int] = []
    tree = False
    end = 0
    for m in _TREE.finditer(text):
        if text.find(b">", end, m.start()) >= 0:  # the dictionary ended: a new one
            if tree:
                counts += pending
            pending, tree = [], False
        end = m.end()
        digits = m.group(1)
        if digits is None:
            tree = True
        elif len(digits) <= _COUNT_DIGITS:
            pending.append(int(digits))
    return counts + pending if tree else counts


#: The most bytes a PDF's compressed object streams are inflated to, all together, to count
#: its pages; past it (a deflate bomb) they are read as unreadable.
PDF_INFLATE_BYTES = 16 * 1024 * 1024
# The most object streams read in one PDF: far more than a document of thousands of pages
# needs (each stream packs many objects), few enough to bound a file made of stream markers.
_MAX_OBJECT_STREAMS = 4096
# How far an object stream's dictionary may reach either side of its /Type /ObjStm.
_DICT_REACH = 4096
_OBJSTM = re.compile(rb"/Type\s*/ObjStm\b")
_FLATE_ONLY = re.compile(rb"/Filter\s*(?:/FlateDecode|\[\s*/FlateDecode\s*\])")


def _object_streams(data: bytes) -> list[bytes] | None:
    """The inflated text of ``data``'s ``/FlateDecode`` object streams (PDF 1.5).

    ``None`` when they cannot all be read within bounds: more than :data:`PDF_INFLATE_BYTES`
    inflated in all, or more than ``_MAX_OBJECT_STREAMS`` of them (each costs a look either
    side of its marker). Streams never overlap (a marker inside the one before is skipped), so
    no input byte is inflated twice; a stream with another filter, decode parameters or corrupt
    (or encrypted) data is skipped.
    """
    out: list[bytes] = []
    left = PDF_INFLATE_BYTES
    read_to = 0
    examined = 0
    view = memoryview(data)
    for m in _OBJSTM.finditer(data):
        if m.start() < read_to:
            continue
        examined += 1
        if examined > _MAX_OBJECT_STREAMS:
            return None
        begin = data.rfind(b"obj", max(read_to, m.start() - _DICT_REACH), m.start())
        keyword = data.find(b"stream", m.end(), m.end() + _DICT_REACH)
        if begin < 0 or keyword < 0:
            continue
        head = data[begin:keyword]
        if b"endobj" in head or b"/DecodeParms" in head or _FLATE_ONLY.search(head) is None:
            continue
        start = keyword + len(b"stream")
        start += 2 if data[start:start + 2] == b"\r\n" else 1  # EOL after the keyword
        end = data.find(b"endstream", start)
        read_to = end = len(data) if end < 0 else end
        try:
            text = zlib.decompressobj().decompress(view[start:end], left + 1)
        except zlib.error:
            continue
        if len(text) > left:
            return None
        left -= len(text)
        out.append(text)
    return out


def pdf_pages(data: bytes) -> int | None:
    """The page count a PDF declares, or ``None`` when it hides it.

    The larger of the page tree's ``/Count`` and the number of ``/Type /Page`` objects, read
    from the uncompressed objects and from the object streams compressed with ``/FlateDecode``
    (PDF 1.5, as pdfTeX, Word and Chrome write them), inflated up to :data:`PDF_INFLATE_BYTES`
    in all. A PDF whose object streams are larger than that (a deflate bomb), otherwise
    filtered, or encrypted is read from its uncompressed objects alone; where these declare
    nothing, callers estimate (see :class:`ledger.decide.preflight.CharEstimator`). A count
    above the file's byte length is not trusted: every page is an object of many bytes, so no
    true count is that large, and a doctored one would otherwise hold an impossible number of
    tokens. Memoised as :func:`bytes_digest`.
    """
    return _MEMO.get(("pdf_pages", data), lambda: _pdf_pages(data), lambda _: (data,))


def _pdf_pages(data: bytes) -> int | None:
    texts = [data, *(_object_streams(data) or ())]
    counts = [n for text in texts for n in _tree_counts(text) if n <= len(data)]
    objects = sum(len(_PAGE.findall(text)) for text in texts)
    pages = max([*counts, objects if objects <= len(data) else 0])
    return pages or None


# -- what each protocol carries by URL ------------------------------------------------------

#: The kinds each protocol can send as a URL for the provider to fetch (the ledger never
#: fetches). OpenAI chat completions takes images only (``file`` wants the bytes), the
#: Responses API and Anthropic images and PDFs, Gemini any (``file_data``).
URL_KINDS: dict[WireProtocol, frozenset[MediaKind]] = {
    WireProtocol.OPENAI: frozenset({MediaKind.IMAGE}),
    WireProtocol.OPENAI_RESPONSES: frozenset({MediaKind.IMAGE, MediaKind.PDF}),
    WireProtocol.ANTHROPIC: frozenset({MediaKind.IMAGE, MediaKind.PDF}),
    WireProtocol.GEMINI: frozenset({MediaKind.IMAGE, MediaKind.PDF, MediaKind.TEXT}),
    WireProtocol.GENERIC: frozenset({MediaKind.IMAGE, MediaKind.PDF, MediaKind.TEXT}),
}


#: Image types a protocol's providers refuse although the ledger accepts them. Gemini reads PNG,
#: JPEG, WEBP, HEIC and HEIF, not GIF (its image-understanding docs list the types; a GIF is
#: answered 400 ``INVALID_ARGUMENT``), inline or by link alike.
UNREAD_IMAGE_TYPES: dict[WireProtocol, frozenset[str]] = {
    WireProtocol.GEMINI: frozenset({"image/gif"}),
}


def human_bytes(n: int) -> str:
    """``n`` bytes for a message: ``512 B``, ``3.2 KiB``, ``20 MiB``."""
    value = float(n)
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f}".removesuffix(".0") + f" {unit}"


def bytes_over(size: int, limit: int) -> tuple[str, str]:
    """``size`` and ``limit`` for a message saying the one exceeds the other.

    Rounded as :func:`human_bytes`, with the exact byte counts added when the rounding makes
    them read alike: "20 MiB, over 20 MiB" would look within the limit.
    """
    shown, bound = human_bytes(size), human_bytes(limit)
    if shown != bound:
        return shown, bound
    return f"{shown} ({size} B)", f"{bound} ({limit} B)"


__all__ = [
    "ACCEPTED_MEDIA_TYPES",
    "DOCUMENT_MEDIA_TYPES",
    "IMAGE_MEDIA_TYPES",
    "MAX_BINARY_BYTES",
    "MAX_URL_LENGTH",
    "MEDIA_MEMO_BYTES",
    "PDF_INFLATE_BYTES",
    "REASONING_MEDIA_TYPE",
    "UNREAD_IMAGE_TYPES",
    "URL_KINDS",
    "DataUrlError",
    "MediaKind",
    "b64",
    "bytes_digest",
    "bytes_over",
    "content_problem",
    "data_url",
    "decode_data_url",
    "human_bytes",
    "image_size",
    "kind_of",
    "pdf_pages",
    "sniff_image_type",
    "wire_media_type",
]
