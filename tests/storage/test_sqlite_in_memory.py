"""SQLite's in-memory database, in every spelling, is no ledger file.

The ledger needs a SQLite *file*: its SQLAlchemy engine and its own sqlite3 connections open
it separately, and several processes share it. ``:memory:`` and ``sqlite:///:memory:`` were
refused, but SQLite's URI spellings were not: ``sqlite:///file::memory:?cache=shared`` (no
``uri=true``) made a file called ``file::memory:`` in the working folder, ``file::memory:``
as a path opened that file through the engine and a private in-memory database through the
ledger's own connections (SQLite built with URI filenames on), and ``...?mode=memory&uri=true``
opened a ledger whose data was gone with its last connection. A ``file:`` URI filename that
names a file is refused too: the engine and the ledger's connections opened two files.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from ledger import AsyncLedger, InvalidArgument, Ledger

IN_MEMORY = [
    ":memory:",
    "sqlite:///:memory:",
    "sqlite:///file::memory:",
    "sqlite:///file::memory:?cache=shared",
    "sqlite:///file::memory:?cache=shared&uri=true",
    "sqlite:///file:memdb1?mode=memory&cache=shared&uri=true",
    "sqlite:///file:memdb1?mode=memory&cache=shared",
    "sqlite:///ledger.db?mode=memory&uri=true",
    "sqlite:///file:/memdb2?vfs=memdb&uri=true",
    "file::memory:",
    "file::memory:?cache=shared",
    "file:x?mode=memory",
    "file:x?mode=memory&cache=shared&uri=true",
]


@pytest.mark.parametrize("url", IN_MEMORY)
def test_every_spelling_of_an_in_memory_sqlite_database_is_refused_as_no_ledger_file(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument) as info:
        Ledger.open(url)
    assert info.value.fields["field"] == "url"
    message = str(info.value)
    assert "names an in-memory database: the ledger needs a SQLite *file*" in message
    assert "pass a path such as ./ledger.db" in message
    assert os.listdir(tmp_path) == []  # no file called file::memory: (or -wal, -shm)


@pytest.mark.parametrize("url", ["sqlite:///file:", "file:", "sqlite:///file:?cache=shared"])
def test_a_sqlite_uri_filename_naming_no_file_is_refused_as_no_file(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``file:`` with an empty path is SQLite's private temporary database."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument, match="names no file: the ledger needs a SQLite"):
        Ledger.open(url)
    assert os.listdir(tmp_path) == []


def test_the_async_face_refuses_the_same_spellings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for url in ("file::memory:", "sqlite:///file:memdb1?mode=memory&cache=shared&uri=true"):
        with pytest.raises(InvalidArgument, match="in-memory database"):
            asyncio.run(AsyncLedger.open(url))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url", ["sqlite:///file:led.db", "file:led.db",
                                 "sqlite:///file:led.db?uri=true"])
def test_a_sqlite_uri_filename_is_refused_not_opened_as_two_databases(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sqlite:///file:led.db`` migrated a file called ``file:led.db`` (SQLAlchemy reads the
    name as a path without ``uri=true``) while the ledger's own connections opened ``led.db``
    (SQLite reads it as a URI where URI filenames are on): two databases for one ledger."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument) as info:
        Ledger.open(url)
    assert info.value.fields["field"] == "url"
    assert "names the SQLite URI filename 'file:led.db'" in str(info.value)
    assert "pass the file's path, such as ./ledger.db" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_a_file_whose_name_only_mentions_memory_is_still_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("memory.db", "x:memory:.db", "mode=memory.db"):
        with Ledger.open(name) as led:
            assert led.backend == "sqlite"
        assert (tmp_path / name).is_file()


@pytest.mark.parametrize("url", ["sqlite:///led.db?uri=true&mode=ro", "sqlite:///led.db?mode=ro",
                                 "sqlite:///led.db?uri=true&immutable=1",
                                 "sqlite:///led.db?uri=true&cache=shared&timeout=5"])
def test_sqlite_uri_options_the_hot_path_would_not_take_are_refused_before_anything_opens(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``?uri=true&mode=ro`` opened the schema's connection read-only (SQLAlchemy hands URI
    options to SQLite) and the Attempts' read-write (the hot path opens the file as named);
    without ``uri=true`` SQLAlchemy dropped them with a warning: an option that says what the
    database is must hold for every connection or be refused."""
    monkeypatch.chdir(tmp_path)
    for opening in (lambda: Ledger.open(url), lambda: asyncio.run(AsyncLedger.open(url))):
        with pytest.raises(InvalidArgument) as info:
            opening()
        assert info.value.fields["field"] == "url"
        assert "which the ledger's own connections do not take" in str(info.value)
        assert "timeout=SECONDS is the one option it takes" in str(info.value)
    assert os.listdir(tmp_path) == []
