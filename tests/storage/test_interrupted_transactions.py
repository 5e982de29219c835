"""A transaction an interruption cuts short leaves nothing behind that later ones wait for.

A host that catches ``KeyboardInterrupt`` (or ``SystemExit``, or a cancellation delivered to
the thread) goes on using the ledger, and may keep the interruption's traceback for good: a
REPL or a notebook keeps the last one in ``sys.last_traceback``; here the test keeps it in a
list. Whatever that traceback holds (a cursor whose rows were never read), the connection the
transaction ran on is not given back to the pool, nor closed, with a statement still live:
on SQLite such a connection kept its transaction's write lock (closed with a live statement,
it stays open underneath until the statement is finalized), and every later write, of this
process or another, waited out the whole busy timeout to be told ``database is locked``.

The interruption is raised where a Ctrl-C lands: as a statement returns from the driver
(SQLAlchemy's ``do_execute``), before a result's rows are read (its ``one()``), and, on the
hot path's SQLite driver, as its ``COMMIT`` is sent. The SQLite ledgers wait at most
:data:`BUSY_S` for a lock, so that a transaction left holding one fails the test at once.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Result
from sqlalchemy.engine.default import DefaultDialect

from ledger import Budget, Grant, Ledger, Price, Route
from ledger.api.face import storage_of
from ledger.storage.driver import Q, SqliteDriver
from ledger.storage.statements import Stmt

BUSY_S = 0.5  # the SQLite busy timeout here: a lock left held fails fast, not after 30 s
ROUTE = Route(id="a", provider="fake", model="m", group="g", recipient="fake",
              endpoint="http://127.0.0.1:9/v1", price=Price())
GRANT = Grant(recipients={"fake": ["user_input"]})
BUDGET = Budget(max_calls=2, max_retries=0, max_cost=Decimal("1"))


def _bounded(db_url: str) -> str:
    """``db_url`` whose SQLite busy timeout is :data:`BUSY_S` (a PostgreSQL URL as it is)."""
    return db_url if "://" in db_url else f"sqlite:///{db_url}?timeout={BUSY_S}"


def _admit(led: Ledger, run_id: str) -> None:
    led.admit_run(run_id, plan=[ROUTE], grant=GRANT, budget=BUDGET)


def _later_sessions_go_through(led: Ledger, tag: str) -> None:
    """Admit and run two sessions (admission, lease, finish): none waits for a lock."""
    for n in range(2):
        with led.run(f"{tag}-later-{n}", plan=[ROUTE], grant=GRANT, budget=BUDGET):
            pass
        assert led.get_run(f"{tag}-later-{n}").lease_holder is None


class _Statements:
    """Counts the statements the engine sends; armed with ``at``, raises
    ``KeyboardInterrupt`` as the ``at``-th statement from then returns from the driver."""

    def __init__(self) -> None:
        self.sent = 0
        self.at: int | None = None

    def do_execute(self, real: Any, dialect: Any, cursor: Any, statement: str,
                   parameters: Any, context: Any = None) -> None:
        real(dialect, cursor, statement, parameters, context)
        self.sent += 1
        if self.at is not None and self.sent == self.at:
            self.at = None
            raise KeyboardInterrupt  # Ctrl-C arriving as the statement returns


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> _Statements:
    counter = _Statements()
    real = DefaultDialect.do_execute

    def do_execute(dialect: Any, cursor: Any, statement: str, parameters: Any,
                   context: Any = None) -> None:
        counter.do_execute(real, dialect, cursor, statement, parameters, context)

    monkeypatch.setattr(DefaultDialect, "do_execute", do_execute)
    return counter


def test_an_admission_interrupted_as_any_of_its_statements_returns_leaves_no_lock_held(
        db_url: str, statements: _Statements) -> None:
    """Each statement of an admission in turn: the audit's was the last, the read of the
    admitted run, whose row was then never read (SQLite: the write lock stayed held)."""
    kept: list[BaseException] = []  # the tracebacks, as a REPL keeps the last one
    with Ledger.open(_bounded(db_url)) as led:
        before = statements.sent
        _admit(led, "counted")
        count = statements.sent - before
        assert count >= 3  # BEGIN (SQLite), the reads and the writes
        for k in range(1, count + 1):
            statements.sent, statements.at = 0, k
            with pytest.raises(KeyboardInterrupt) as caught:
                _admit(led, f"cut-{k}")
            kept.append(caught.value)
            _later_sessions_go_through(led, f"after-{k}")


def _interrupting_the_next_read(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A KeyboardInterrupt as a result's one row is read, once each time ``armed[0]`` is set
    (SQLAlchemy's ``Result.one``: after the driver returned, before the rows are read)."""
    armed = [False]
    real_one = Result.one

    def one(self: Result[Any]) -> Any:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return real_one(self)

    monkeypatch.setattr(Result, "one", one)
    return armed


def test_an_admission_interrupted_before_reading_its_rows_leaves_no_lock_held(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interruption lands after the driver returned, before the result's rows are read:
    SQLAlchemy sees nothing of it. Left live, the statement kept a SQLite connection's
    snapshot, so its next write transaction was refused ``database is locked``."""
    armed = _interrupting_the_next_read(monkeypatch)
    kept: list[BaseException] = []
    with Ledger.open(_bounded(db_url)) as led:
        for k in range(3):  # more than the pool holds idle, so that every one is used again
            armed[0] = True
            with pytest.raises(KeyboardInterrupt) as caught:
                _admit(led, f"cut-{k}")
            kept.append(caught.value)
            _later_sessions_go_through(led, f"after-{k}")


def test_a_connection_an_interruption_cut_a_transaction_short_on_is_not_used_again(
        tmp_path: Any, sqlite_template: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rolled back, and still not given back to the pool as it is: the interruption may have
    landed anywhere, in SQLAlchemy's own rollback too. It is closed for good."""
    import shutil

    path = str(tmp_path / "ledger.db")
    shutil.copyfile(sqlite_template, path)
    armed = _interrupting_the_next_read(monkeypatch)
    used: list[Any] = []
    with Ledger.open(_bounded(path)) as led:
        engine = storage_of(led).context.engine

        def seen(conn: Any, *_execute: Any) -> None:
            used.append(conn.connection.dbapi_connection)

        event.listen(engine, "before_cursor_execute", seen)
        armed[0] = True
        kept: list[BaseException] = []
        with pytest.raises(KeyboardInterrupt) as caught:
            _admit(led, "cut")
        kept.append(caught.value)
        cut, since = used[-1], len(used)
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            cut.execute("SELECT 1")
        _admit(led, "after")
        assert cut not in used[since:]


# -- the hot path's SQLite driver ----------------------------------------------------------


class _InterruptedCommit(sqlite3.Connection):
    """A connection on which a Ctrl-C lands as the next ``COMMIT`` is sent, before SQLite
    runs it."""

    armed = False

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == "COMMIT" and _InterruptedCommit.armed:
            _InterruptedCommit.armed = False
            raise KeyboardInterrupt
        return super().execute(sql, *args)


WRITE = Stmt("write", "UPDATE runs SET updated_at = updated_at WHERE run_id = :run_id",
             ("run_id",), (), None)


def test_a_hot_path_transaction_interrupted_as_it_commits_leaves_no_transaction_open(
        tmp_path: Any, sqlite_template: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's write transaction is interrupted as its ``COMMIT`` is sent: it is rolled
    back, not left open on the thread's connection holding the write lock (every other
    writer waited it out; this thread's next transaction was refused)."""
    import shutil

    path = str(tmp_path / "ledger.db")
    shutil.copyfile(sqlite_template, path)
    real_connect = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        return real_connect(*args, factory=_InterruptedCommit, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    driver = SqliteDriver(path, busy_timeout_s=BUSY_S)

    def tx() -> Iterator[Any]:
        yield Q(WRITE, {"run_id": "r"})

    try:
        _InterruptedCommit.armed = True
        kept: list[BaseException] = []
        with pytest.raises(KeyboardInterrupt) as caught:
            driver.run(tx(), write=True)
        kept.append(caught.value)
        assert not driver.connection().in_transaction
        with Ledger.open(_bounded(path)) as led:  # another connection writes at once
            _admit(led, "other")
        driver.run(tx(), write=True)  # and so does this thread's, again
    finally:
        _InterruptedCommit.armed = False
        driver.close()
