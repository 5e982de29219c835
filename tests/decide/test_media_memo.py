"""What the media memo keeps: facts about recent files, never more than its budget of them.

A conversation re-sends its documents every turn, so their digest, page count and decoded
``data:`` URL are memoised by the bytes themselves; keying by the bytes keeps them alive, so the
memo is bounded by the bytes it holds (:data:`~ledger.domain.media.MEDIA_MEMO_BYTES`), not by a
number of entries: a server must not keep every recent upload alive after its host dropped it.
"""

from __future__ import annotations

import base64
import gc
import tracemalloc

import pytest

from ledger.decide.preflight import CharEstimator
from ledger.domain import media
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.values import Route
from tests.media import pdf

ROUTE = Route(id="r", provider="p", model="m", group="g", recipient="p",
              protocol=WireProtocol.ANTHROPIC)
MIB = 1024 * 1024


def _a_turn_with(part: Part) -> None:
    env = Envelope(parts=[Part(content="Summarise."), part])
    assert env.hash.startswith("sha256:")
    assert CharEstimator().count_tokens(env, ROUTE) > 0


def test_dropped_uploads_keep_no_more_memory_alive_than_the_media_memo_budget() -> None:
    # 24 distinct 8 MiB PDFs and 8 distinct 4 MiB data: URLs, each hashed and estimated as a
    # turn does, then dropped: 267 MiB went through; a count-bounded cache kept all of it.
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(24):
            blob = pdf(1) + i.to_bytes(4, "big") + bytes(8 * MIB)
            _a_turn_with(Part(data=blob, media_type="application/pdf"))
            del blob
        for i in range(8):
            url = ("data:application/pdf;base64,"
                   + base64.b64encode(pdf(1) + i.to_bytes(4, "big") + bytes(4 * MIB)).decode())
            _a_turn_with(Part(url=url))
            del url
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept <= media.MEDIA_MEMO_BYTES + MIB, f"{kept / MIB:.0f} MiB still alive"
    assert media._MEMO._bytes <= media.MEDIA_MEMO_BYTES


def test_a_document_resent_every_turn_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real = media._pdf_pages

    def counted(data: bytes) -> int | None:
        reads.append(len(data))
        return real(data)

    monkeypatch.setattr(media, "_pdf_pages", counted)
    doc = pdf(3) + b"%resent"
    for _ in range(3):
        # The host rebuilds its parts each turn (as the integrations do): equal bytes, new objects.
        assert media.pdf_pages(bytes(bytearray(doc))) == 3
    assert len(reads) == 1


def test_a_file_larger_than_the_memo_budget_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    memo = media._PayloadMemo(budget=100)
    calls: list[bytes] = []

    def digest(data: bytes) -> str:
        return memo.get(("sha256", data), lambda: calls.append(data) or "d", lambda _: (data,))

    big, small = b"x" * 101, b"y" * 60
    assert digest(big) == digest(big) == "d" and len(calls) == 2  # computed each time, not kept
    digest(small)
    digest(b"z" * 60)  # 120 bytes: the least recently used entry goes
    assert memo._bytes == 60
    digest(b"z" * 60)
    digest(small)
    assert len(calls) == 5  # z was a hit, small had been evicted
