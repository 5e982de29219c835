"""The media type of a file a framework gives by link or by name: the same on every host."""

from __future__ import annotations

import mimetypes

import pytest

from ledger.errors import InvalidArgument
from ledger.integrations._run import media_type_of


@pytest.mark.parametrize(("url", "filename", "expected"), [
    ("https://ex.example/notes.md", None, "text/markdown"),
    ("https://ex.example/pic.webp?sig=1", None, "image/webp"),
    ("https://ex.example/A.PNG", None, "image/png"),
    ("https://ex.example/download", "table.csv", "text/csv"),
    (None, "filing.pdf", "application/pdf"),
])
def test_a_supported_type_is_told_without_the_hosts_mime_table(
        monkeypatch: pytest.MonkeyPatch, url: str | None, filename: str | None,
        expected: str) -> None:
    """``mimetypes`` reads /etc/mime.types, which slim images lack: Python's own table has no
    ``.md`` nor ``.webp``, so the same link was sent on one host and refused on another. The
    types a part may carry are told from the ledger's own table."""
    monkeypatch.setattr(mimetypes, "guess_type", lambda *a, **k: (None, None))
    assert media_type_of(url, filename, what="the file", fix="give a type",
                         field="messages") == expected


def test_a_type_no_table_tells_is_refused_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mimetypes, "guess_type", lambda *a, **k: (None, None))
    with pytest.raises(InvalidArgument) as ei:
        media_type_of("https://ex.example/dir.v2/blob", None, what="the link",
                      fix="send it as a data: URL", field="messages")
    assert "send it as a data: URL" in str(ei.value) and ei.value.field == "messages"
