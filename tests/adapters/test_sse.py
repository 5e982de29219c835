"""The shared SSE parser."""

from __future__ import annotations

import pytest

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
