"""An incremental Server-Sent Events parser shared by the three protocols.

It follows the WHATWG event-stream rules that matter for model APIs: lines end in CRLF, LF or CR;
``field: value`` with one optional space after the colon; ``data`` lines of one event are joined
with ``\\n``; a line starting with ``:`` is a comment (keep-alive); a blank line dispatches.

Two deliberate choices:

* At end of input, an event whose lines were complete but which lacked its blank line is still
  dispatched (some servers end with ``data: [DONE]\\n``), while an unterminated last line is
  dropped: it may be cut mid-value, and the protocol's completion rules then decide.
* A line longer than ``max_line_bytes`` raises :class:`SSEError`: a peer that never sends a line
  break must not make us buffer without bound.
"""

from __future__ import annotations

from dataclasses import dataclass


class SSEError(ValueError):
    """The byte stream is not a usable event stream."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    event: str  # "message" when the stream named none
    data: str
    id: str | None = None


class SSEParser:
    """Feed bytes, get complete events."""

    def __init__(self, *, max_line_bytes: int = 1 << 20) -> None:
        self._buf = bytearray()
        self._max = max_line_bytes
        self._event: str | None = None
        self._data: list[str] = []
        self._id: str | None = None
        self._has_fields = False
        self._skip_lf = False  # a CR ended the previous chunk; a leading LF belongs to it

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._skip_lf and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._skip_lf = False
        self._buf.extend(chunk)
        out: list[SSEEvent] = []
        start = 0
        buf = self._buf
        n = len(buf)
        i = 0
        while i < n:
            c = buf[i]
            if c == 0x0A or c == 0x0D:
                line = bytes(buf[start:i])
                if c == 0x0D:
                    if i + 1 < n:
                        if buf[i + 1] == 0x0A:
                            i += 1
                    else:
                        self._skip_lf = True
                i += 1
                start = i
                ev = self._line(line)
                if ev is not None:
                    out.append(ev)
                continue
            i += 1
        del buf[:start]
        if len(buf) > self._max:
            raise SSEError(f"an event-stream line exceeded {self._max} bytes without a line break")
        return out

    def close(self) -> list[SSEEvent]:
        """End of input: dispatch a pending event whose lines were complete."""
        self._buf.clear()
        ev = self._dispatch()
        return [ev] if ev is not None else []

    def _line(self, raw: bytes) -> SSEEvent | None:
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
            self._data.append(value)
            self._has_fields = True
        elif field == "event":
            self._event = value
            self._has_fields = True
        elif field == "id":
            self._id = value
        # "retry" and unknown fields are ignored, as the standard says.
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._has_fields or not self._data:
            # An event without data is not dispatched (standard); reset its name.
            self._event = None
            self._has_fields = False
            self._data = []
            return None
        ev = SSEEvent(event=self._event or "message", data="\n".join(self._data), id=self._id)
        self._event = None
        self._data = []
        self._has_fields = False
        return ev


__all__ = ["SSEError", "SSEEvent", "SSEParser"]
