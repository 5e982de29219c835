r"""An incremental Server-Sent Events parser shared by the three protocols.

It follows the WHATWG event-stream interpretation rules
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):

* one leading U+FEFF byte-order mark is skipped (also when its bytes arrive in separate
  chunks); a BOM anywhere else is ordinary data;
* lines end in CRLF, LF or CR alone, and a CRLF split across two chunks is one line end;
* a line starting with ``:`` is a comment (keep-alive); ``field: value`` has one optional space
  after the first colon; a line without a colon is a field with an empty value;
* ``data`` lines of one event are joined with ``\n``; ``event`` sets the type (default
  ``message``); ``id`` sets the last event id unless the value contains U+0000, and it persists
  across events; ``retry`` and unknown fields are ignored;
* a blank line dispatches the event, unless its data buffer is empty (then the event is dropped
  and its type reset), so an event that only named itself is never delivered.

Deliberate departures, each because a model answer must never be silently altered or unbounded:

* Bytes that are not valid UTF-8 raise :class:`SSEError` instead of becoming U+FFFD: a replaced
  character in an answer would be a corrupted answer reported as complete.
* A line longer than ``max_line_bytes`` (complete or still open) and an event whose data exceeds
  ``max_event_bytes`` raise :class:`SSEError`: a peer that never sends a line break or a blank
  line must not make us buffer without bound.
* At end of input, an event whose lines were complete but which lacked its blank line is still
  dispatched (some servers end with ``data: [DONE]\n``), while an unterminated last line is
  dropped: it may be cut mid-value, and the protocol's completion rules then decide.

Why not ``httpx-sse``: it reads ``Response.aiter_lines()``, which buffers a line without any
bound and decodes with replacement characters, and it owns the iteration, while the engine needs
the raw chunks to enforce its idle and first-token deadlines between bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOM = b"\xef\xbb\xbf"
_LINE_END = re.compile(rb"[\r\n]")


class SSEError(ValueError):
    """The byte stream is not a usable event stream."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event."""

    event: str  # "message" when the stream named none
    data: str
    id: str | None = None


class SSEParser:
    """Feed bytes, get complete events. Memory is bounded by the two size limits."""

    def __init__(
        self, *, max_line_bytes: int = 1 << 20, max_event_bytes: int = 4 << 20
    ) -> None:
        self._buf = bytearray()
        self._max_line = max_line_bytes
        self._max_event = max_event_bytes
        self._at_start = True  # the BOM may still come
        self._skip_lf = False  # a CR ended the previous chunk; a leading LF belongs to it
        self._event = ""
        self._data: list[str] = []
        self._data_bytes = 0
        self._last_id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume ``chunk``; the events it completed. Raises :class:`SSEError`."""
        if not chunk:
            return []
        buf = self._buf
        scan_from = len(buf)  # what is already buffered holds no line end
        buf.extend(chunk)
        if self._at_start:
            if len(buf) < len(_BOM) and _BOM.startswith(bytes(buf)):
                return []  # could still be a BOM split across chunks
            self._at_start = False
            if buf.startswith(_BOM):
                del buf[: len(_BOM)]
            scan_from = 0
        if self._skip_lf:
            self._skip_lf = False
            if buf[:1] == b"\n":
                del buf[:1]
                scan_from = max(0, scan_from - 1)
        out: list[SSEEvent] = []
        start = 0
        for m in _LINE_END.finditer(buf, scan_from):
            end = m.start()
            if end < start:
                continue  # the LF of a CRLF already consumed
            line = bytes(buf[start:end])
            nxt = end + 1
            if buf[end] == 0x0D:
                if nxt < len(buf):
                    if buf[nxt] == 0x0A:
                        nxt += 1
                else:
                    self._skip_lf = True
            start = nxt
            ev = self._line(line)
            if ev is not None:
                out.append(ev)
        del buf[:start]
        if len(buf) > self._max_line:
            raise SSEError(
                f"an event-stream line exceeded {self._max_line} bytes without a line break"
            )
        return out

    def close(self) -> list[SSEEvent]:
        """End of input: dispatch a pending event whose lines were complete."""
        self._buf.clear()
        ev = self._dispatch()
        return [ev] if ev is not None else []

    def _line(self, raw: bytes) -> SSEEvent | None:
        if len(raw) > self._max_line:
            raise SSEError(f"an event-stream line exceeded {self._max_line} bytes")
        if not raw:
            return self._dispatch()
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEError("an event-stream line is not valid UTF-8") from exc
        if line.startswith(":"):
            return None
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data_bytes += len(raw)
            if self._data_bytes > self._max_event:
                raise SSEError(f"an event's data exceeded {self._max_event} bytes")
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\x00" not in value:
            self._last_id = value
        # "retry" and unknown fields are ignored, as the standard says.
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, name = self._data, self._event
        self._data, self._event, self._data_bytes = [], "", 0
        if not data:
            return None  # an event without data is not dispatched (its type is reset)
        return SSEEvent(event=name or "message", data="\n".join(data), id=self._last_id)


__all__ = ["SSEError", "SSEEvent", "SSEParser"]
