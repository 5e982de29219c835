"""Generated histories, made once per test session and copied for each test that reads one.

``ledger.tools.generate`` writes its history through the ledger's public API, turn by turn:
seconds for a few hundred attempts. Tests that read such a history (and then change their own
copy of it) start from a copy of one generated once per database server and parameters: a
SQLite file copied with SQLite's backup API, a PostgreSQL database created with the generated
one as its template. The copy opens under the generating ledger's executor id and at its
clock's last reading, so a test gets the ledger generation left, less what it held in memory
(nothing a test reads: its writes were all acknowledged).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import sqlite3
import tempfile
import time
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url

from ledger import Ledger, ManualClock
from ledger.storage.engine import normalize_url
from ledger.tools.generate import generate

#: What was generated: (server, start, parameters) -> (its location, clock reading, executor).
_MADE: dict[tuple[Any, ...], tuple[str, float, str]] = {}
_DIR: list[str] = []
_NAMES = itertools.count()
PATIENCE_S = 60


def generated(url: str, *, start: float, **params: Any) -> Ledger:
    """A ledger at ``url`` (a database not opened yet) holding ``generate(led, **params)``'s
    history, generated on a clock starting at ``start``."""
    parsed = make_url(normalize_url(url))
    pg = parsed.get_backend_name() == "postgresql"
    key = (parsed.host, parsed.port, pg, start, tuple(sorted(params.items())))
    made = _MADE.get(key)
    if made is None:
        made = _MADE[key] = _make(parsed, pg, start, params)
    where, now, executor = made
    if pg:
        _from_template(parsed, where)
    else:
        _copy_file(where, str(parsed.database))
    return Ledger.open(url, clock=ManualClock(now), executor_id=executor)


def _make(parsed: URL, pg: bool, start: float, params: dict[str, Any]
          ) -> tuple[str, float, str]:
    if pg:
        where = f"gen_{os.getpid()}_{next(_NAMES)}"
        _admin(parsed, f"CREATE DATABASE {where} TEMPLATE ledger_template")
        url = parsed.set(database=where).render_as_string(hide_password=False)
    else:
        if not _DIR:
            # The run's scratch (tests/conftest.py's SCRATCH_ROOT_ENV: in RAM where there is
            # room), else /tmp.
            _DIR.append(tempfile.mkdtemp(prefix="ledger-generated-",
                                         dir=os.environ.get("LEDGER_TEST_SCRATCH_ROOT")))
            atexit.register(shutil.rmtree, _DIR[0], True)
        where = url = os.path.join(_DIR[0], f"gen-{next(_NAMES)}.db")
    led = Ledger.open(url, clock=ManualClock(start))
    try:
        generate(led, **params)
        now, executor = led.clock.now(), led.executor_id
    finally:
        led.close()
    return where, now, executor


def _copy_file(src: str, dst: str) -> None:
    source, target = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()


def _from_template(parsed: URL, template: str) -> None:
    # The test's database was made from the empty template and nobody has opened it yet.
    _admin(parsed, f"DROP DATABASE IF EXISTS {parsed.database} WITH (FORCE)")
    deadline = time.monotonic() + PATIENCE_S
    while True:
        try:
            _admin(parsed, f"CREATE DATABASE {parsed.database} TEMPLATE {template}")
            return
        except Exception as e:
            # The generating ledger's backends may still be exiting after its close.
            if "being accessed by other users" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _admin(parsed: URL, sql: str) -> None:
    eng = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with eng.connect() as conn:
            conn.execute(text(sql))
    finally:
        with contextlib.suppress(Exception):
            eng.dispose()
