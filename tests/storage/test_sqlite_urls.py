"""A SQLite URL the ledger cannot take is refused as the URL's own fault, before anything opens.

``sqlite://host/x.db`` (two slashes: a host) ended in SQLAlchemy's ``ArgumentError``, and
``sqlite+aiosqlite:///x.db`` in an ``ImportError`` about greenlet: raw tracebacks from every
command, ``Ledger.open`` and ``db init``. ``?foo=1`` drew a SQLAlchemy warning and was ignored,
and ``?timeout=5&timeout=6`` was taken silently. Each is an
:class:`~ledger.errors.InvalidArgument` (``field="url"``) naming the fault and the fix; the
spellings the docs give (a path, ``sqlite:///``, ``sqlite:////``, ``?timeout=SECONDS``) open.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ledger import AsyncLedger, InvalidArgument, Ledger
from ledger.storage.provision import init_database


def _openings(url: str) -> list[Callable[[], Any]]:
    async def opened() -> None:
        led = await AsyncLedger.open(url)
        await led.close()

    return [lambda: Ledger.open(url).close(), lambda: asyncio.run(opened()),
            lambda: init_database(url)]


@pytest.mark.parametrize(("url", "fault"), [
    ("sqlite://host/led.db", "gives a SQLite file a host"),
    ("sqlite://host:5/led.db", "gives a SQLite file a host and a port"),
    ("sqlite://me@/led.db", "gives a SQLite file a user"),
    ("sqlite+aiosqlite:///led.db", "unsupported SQLite driver 'aiosqlite'"),
    ("sqlite+pysqlcipher:///led.db", "unsupported SQLite driver 'pysqlcipher'"),
    ("sqlite:///led.db?foo=1", "gives the option 'foo', which a SQLite ledger does not take"),
    ("sqlite:///led.db?Timeout=5", "gives the option 'Timeout'"),
    ("sqlite:///led.db?timeout=5&timeout=6", "gives the SQLite option 'timeout' 2 times"),
    ("sqlite:///led.db?uri=true", "gives the SQLite URI option uri"),
    ("sqlite:///led.db?timeout=", "gives the option 'timeout' no value"),
    ("sqlite:///led.db?timeout", "gives the option 'timeout' no value"),
    ("sqlite:///led.db?timeout=5&foo", "gives the option 'foo' no value"),
])
def test_a_sqlite_url_the_ledger_cannot_take_is_invalid_argument_naming_its_fault(
        url: str, fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for opening in _openings(url):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # SQLAlchemy's warning of an option it drops
            with pytest.raises(InvalidArgument) as caught:
                opening()
        assert caught.value.fields["field"] == "url"
        assert fault in str(caught.value), str(caught.value)
    assert os.listdir(tmp_path) == []


def test_a_password_in_a_sqlite_url_is_refused_without_showing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument) as caught:
        Ledger.open("sqlite://me:Hunter2@/led.db")
    assert "a user and a password" in str(caught.value) and "Hunter2" not in str(caught.value)
    assert os.listdir(tmp_path) == []


def test_every_documented_sqlite_spelling_still_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for url in ("a.db", "sqlite:///b.db", f"sqlite:///{tmp_path / 'c.db'}",
                "sqlite+pysqlite:///d.db", "sqlite:///e.db?timeout=5",
                f"sqlite:///{tmp_path / 'f.db'}?timeout=0.5"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with Ledger.open(url) as led:
                assert led.backend == "sqlite"
    assert sorted(os.listdir(tmp_path)) == ["a.db", "b.db", "c.db", "d.db", "e.db", "f.db"]


@pytest.mark.parametrize(("path", "opens", "refused"), [
    ("100%.db", "100%.db", None),
    ("a#b.db", "a#b.db", None),
    ("led.db?timeout=5", "led.db", None),  # a plain path's '?' begins its options, as always
    ("my?file.db", None, "gives the option 'file.db' no value"),
    ("a?b=1.db", None, "gives the option 'b', which a SQLite ledger does not take"),
    ("p%20q.db", None, "holds '%20', which a database URL reads as a percent-escape (it "
                       "would open 'p q.db')"),
])
def test_a_plain_path_opens_the_file_it_names_or_is_refused_never_another(
        path: str, opens: str | None, refused: str | None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # "my?file.db" opened "my" (SQLAlchemy dropped the option without a value) and "p%20q.db"
    # opened "p q.db": each without a word. Quoting the path instead would have moved
    # "led.db?timeout=5" to a new, empty file of that name.
    from ledger.cli.main import main

    monkeypatch.chdir(tmp_path)
    for opening in _openings(path):
        if refused is None:
            opening()
            assert os.listdir(tmp_path) == [opens]
        else:
            with pytest.raises(InvalidArgument) as caught:
                opening()
            assert caught.value.fields["field"] == "url"
            assert refused in str(caught.value), str(caught.value)
            assert os.listdir(tmp_path) == []
    capsys.readouterr()
    assert main(["--db", path, "runs"]) == (0 if refused is None else 2)
    assert os.listdir(tmp_path) == ([opens] if opens else [])


def test_opening_a_ledger_behind_a_held_lock_waits_no_longer_than_the_urls_timeout(
        tmp_path: Path) -> None:
    # The look at the file before the schema's first connection waited 5 s whatever the URL
    # asked: a URL of timeout=0.2 heard of a held lock after 5 s.
    import time

    from ledger.errors import DatabaseUnavailable

    from .helpers import sqlite_held

    path = tmp_path / "ledger.db"
    Ledger.open(str(path)).close()
    with sqlite_held(path):
        for migrate in (True, False):
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable):
                led = Ledger.open(f"sqlite:///{path}?timeout=0.2", migrate_schema=migrate)
                try:
                    led.get_run("r-1")  # the first statement, when opening read nothing
                finally:
                    led.close()
            assert time.monotonic() - started < 2.5, migrate
