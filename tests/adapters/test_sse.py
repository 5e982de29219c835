"""The shared SSE parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.adapters.sse import SSEError, SSEEvent, SSEParser


def feed_all(chunks: list[bytes]) -> list[SSEEvent]:
    p = SSEParser()
    out: list[SSEEvent] = []
    for c in chunks:
        out.extend(p.feed(c))
    out.extend(p.close())
    return out


def test_events_across_arbitrary_chunk_boundaries() -> None:
    raw = b"event: a\r\ndata: 1\r\n\r\n: keep-alive\n\ndata: x\ndata: y\n\nevent: b\rdata: 2\r\r"
    whole = feed_all([raw])
    assert [(e.event, e.data) for e in whole] == [("a", "1"), ("message", "x\ny"), ("b", "2")]
    for size in (1, 2, 3, 7):
        pieces = [raw[i : i + size] for i in range(0, len(raw), size)]
        assert feed_all(pieces) == whole


def test_complete_lines_without_blank_line_dispatch_at_eof_but_partial_lines_do_not() -> None:
    assert [e.data for e in feed_all([b"data: [DONE]\n"])] == ["[DONE]"]
    assert feed_all([b'data: {"cut": "mid']) == []


def test_no_space_after_colon_and_unknown_fields() -> None:
    (ev,) = feed_all([b"data:x\nretry: 10\nfoo: bar\nid: 7\n\n"])
    assert (ev.data, ev.id) == ("x", "7")


def test_a_line_without_end_is_bounded() -> None:
    p = SSEParser(max_line_bytes=100)
    with pytest.raises(SSEError):
        p.feed(b"data: " + b"x" * 200)


# -- the WHATWG rules, property-tested --------------------------------------------------------

_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=40
)
_NAME = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n:"), min_size=1,
                max_size=12)
_ENDING = st.sampled_from(["\r\n", "\n", "\r"])


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, str, str | None]]]:
    """An event stream in random but valid framing, and the events it must yield."""
    lines: list[str] = []
    expected: list[tuple[str, str, str | None]] = []
    last_id: str | None = None
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            lines.append(":" + draw(_TEXT))  # a comment
        name = draw(st.none() | _NAME.filter(lambda n: n.strip() == n))
        if name is not None:
            lines.append(f"event: {name}" if draw(st.booleans()) else f"event:{name}")
        if draw(st.booleans()):
            ident = draw(_TEXT.filter(lambda t: "\x00" not in t))
            lines.append(f"id: {ident}")
            last_id = ident
        if draw(st.booleans()):
            lines.append(f"retry: {draw(st.integers(0, 10_000))}")
        if draw(st.booleans()):
            lines.append("x-unknown-field: " + draw(_TEXT))
        data = draw(st.lists(_TEXT, min_size=1, max_size=3))
        for d in data:
            lines.append("data: " + d if d.startswith(" ") or draw(st.booleans()) else "data:" + d)
        lines.append("")
        expected.append((name or "message", "\n".join(data), last_id))
    text = ""
    prev = ""
    for line in lines:
        ending = draw(_ENDING)
        if prev == "\r" and line == "" and ending == "\n":
            ending = "\r"  # a LF right after a CR would join it as one CRLF line end
        text += line + ending
        prev = ending
    raw = text.encode("utf-8")
    if draw(st.booleans()):
        raw = b"\xef\xbb\xbf" + raw
    return raw, expected


@settings(max_examples=300, deadline=None)
@given(_streams(), st.lists(st.integers(1, 9), max_size=40))
def test_any_valid_framing_split_anywhere_yields_every_event(
    stream: tuple[bytes, list[tuple[str, str, str | None]]], sizes: list[int]
) -> None:
    raw, expected = stream
    chunks, i = [], 0
    for n in sizes:
        chunks.append(raw[i : i + n])  # cuts inside CRLF, inside the BOM, inside UTF-8
        i += n
    chunks.append(raw[i:])
    got = [(e.event, e.data, e.id) for e in feed_all(chunks)]
    assert got == expected


def test_a_leading_bom_is_skipped_and_only_there() -> None:
    assert [e.data for e in feed_all([b"\xef\xbb\xbfdata: HELLO\n\ndata: WORLD\n\n"])] == [
        "HELLO", "WORLD"]
    assert [e.data for e in feed_all([b"\xef", b"\xbb", b"\xbfdata: HELLO\n\n"])] == ["HELLO"]
    # A second BOM is part of the next line's field name, which is then unknown (as specified).
    assert [e.data for e in feed_all([b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\ndata: y\n\n"])] == ["y"]


def test_cr_only_line_endings() -> None:
    assert [e.data for e in feed_all([b"data: HELLO\r\rdata: WORLD\r\r"])] == ["HELLO", "WORLD"]
    assert [e.data for e in feed_all([b"data: a\r", b"", b"\ndata: b\r\n\r\n"])] == ["a\nb"]


def test_field_parsing_details() -> None:
    events = feed_all(
        [b"data\n\ndata:  two spaces\n\nevent: only-a-name\n\nid: 1\x002\ndata: z\n\n"]
    )
    assert [(e.event, e.data, e.id) for e in events] == [
        ("message", "", None), ("message", " two spaces", None), ("message", "z", None)]
    assert [e.id for e in feed_all([b"id: 7\ndata: a\n\ndata: b\n\n"])] == ["7", "7"]


def test_invalid_utf8_is_an_error_not_a_replacement() -> None:
    with pytest.raises(SSEError, match="UTF-8"):
        feed_all([b"data: caf\xc3\n\n"])
    # A character split across chunks is fine.
    assert [e.data for e in feed_all([b"data: caf\xc3", b"\xa9\n\n"])] == ["caf\u00e9"]


def test_complete_huge_lines_and_endless_events_are_bounded() -> None:
    p = SSEParser(max_line_bytes=100)
    with pytest.raises(SSEError, match="exceeded 100 bytes"):
        p.feed(b"data: " + b"x" * 200 + b"\n\n")
    p = SSEParser(max_line_bytes=100, max_event_bytes=1000)
    with pytest.raises(SSEError, match="event's data exceeded"):
        for _ in range(100):
            p.feed(b"data: " + b"y" * 50 + b"\n")


def test_feeding_a_long_line_byte_by_byte_is_linear() -> None:
    import time

    p = SSEParser()
    started = time.perf_counter()
    for _ in range(200_000):
        p.feed(b"x")
    assert time.perf_counter() - started < 5.0
