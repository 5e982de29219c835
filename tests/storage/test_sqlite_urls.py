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


@pytest.mark.parametrize("name", ["my?file.db", "p%20q.db", "a#b.db", "a?b=1.db", "100%.db"])
def test_a_plain_path_is_the_file_of_that_name_whatever_characters_it_holds(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A URL's path ends at '?' or '#' and is percent-decoded: "my?file.db" opened "my",
    # "p%20q.db" opened "p q.db", and "a?b=1.db" was refused as an option 'b'. A plain path is a
    # file name, not a URL.
    from ledger.cli.main import main

    monkeypatch.chdir(tmp_path)
    for opening in _openings(name):
        opening()
        assert os.listdir(tmp_path) == [name]
    capsys.readouterr()
    assert main(["--db", name, "runs"]) == 0
    assert "RUN" in capsys.readouterr().out
    assert os.listdir(tmp_path) == [name]
