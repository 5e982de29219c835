"""Small builders shared by the storage tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ledger import Ledger
from ledger.domain.envelope import Envelope
from ledger.domain.facts import Category, FailureFact, Phase, Scope
from ledger.domain.records import Lease
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import DatabaseUnavailable
from ledger.storage.context import SqlContext

REPO = Path(__file__).resolve().parents[2]

# A process that takes a SQLite database's write lock (argv[1]), runs the statements of the
# further arguments in that transaction (a write held uncommitted), says "locked", holds the
# lock until a line arrives on its stdin, then commits and says "released".
SQLITE_LOCK_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
for statement in sys.argv[2:]:
    conn.execute(statement)
print("locked", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
print("released", flush=True)
"""


def impatient_url(db_url: str, request: Any) -> str:
    """``db_url`` (a ``db_url`` fixture's) as a ledger whose writes wait only a tenth of a
    second for another connection's lock (SQLite's busy timeout, PostgreSQL's
    ``lock_timeout`` of the test's database); ``request`` is the test's fixture request."""
    if "://" not in db_url:
        return f"sqlite:///{db_url}?timeout=0.1"
    db = db_url.rsplit("/", 1)[1]
    request.getfixturevalue("pg_server").psql(f"ALTER DATABASE {db} SET lock_timeout = '100ms'")
    return db_url


def sql_context(led: Any) -> SqlContext:
    """The SQL context under a ledger, for white-box tests that reach its engine or its
    transactions (reached, as ops and tools reach it, through ``storage_of``)."""
    from ledger.api.face import storage_of

    return storage_of(led).context


def downgrade_schema(url: str, revision: str, table: str = "attempts") -> set[str]:
    """Take the ledger's schema at ``url`` back to ``revision`` (an older package's); the
    columns ``table`` has there."""
    from alembic import command
    from sqlalchemy import create_engine, inspect

    from ledger.storage.engine import normalize_url
    from ledger.storage.migrate import alembic_config

    engine = create_engine(normalize_url(url))
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, revision)
            return {c["name"] for c in inspect(conn).get_columns(table)}
    finally:
        engine.dispose()


def routes() -> list[Route]:
    return [
        # Made-up providers the price table cannot know: priced explicitly (free).
        Route(id="a", provider="p1", model="m1", group="g", recipient="r1", price=Price()),
        Route(id="b", provider="p1", model="m2", group="g", recipient="r1", price=Price()),
        Route(id="c", provider="p2", model="m1", group="h", recipient="r2", price=Price()),
    ]


def budget(calls: int = 10, retries: int = 3, cost: str = "1.00") -> Budget:
    return Budget(max_calls=calls, max_retries=retries, max_cost=cost)  # type: ignore[arg-type]


def grant() -> Grant:
    return Grant(recipients={"r1": ["user_input", "model_derived"], "r2": ["user_input"]})


def spawn(worker: str, *args: object) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.storage._workers", worker, *map(str, args)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def collect(procs: list[subprocess.Popen[str]], timeout: float = 240) -> list[dict[str, int]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"worker failed ({p.returncode}): {stderr[-3000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def as_an_earlier_version(led: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``led.name(*args, **kwargs)`` without the argument checks: the rows a version of the
    library that lacked a later check wrote, through the same flow (a real write). The
    arguments must be as the checks would have given them (models, not mappings)."""
    return led._runner.run(getattr(type(led), name).__wrapped__(led, *args, **kwargs))


def stray_never_sent_hold(led: Any, lease: Any, state: str, *, tokens: int = 40) -> str:
    """A never-sent Attempt (``not_sent`` or ``rejected``) of ``lease``'s Run whose debit of
    0.10 (and ``tokens`` token reserve) is still ``reserved`` and counted on the Run: what
    recovery's takeover repairs. The write path voids such a hold in the transaction that
    settles or refuses the Attempt, so no API reaches this state; it is made by rewriting a
    settled ``not_sent`` Attempt's rows as an older version or a hand edit could have left
    them. Returns the Attempt's id."""
    from sqlalchemy import update

    from ledger.domain.records import to_micros
    from ledger.storage import schema as s

    a = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.10",
                          reserve_tokens=tokens, turn_id="stray")
    led.settle_attempt(lease, a.attempt_id, outcome="not_sent")
    att, deb, r = s.attempts.c, s.debits.c, s.runs.c
    with sql_context(led).engine.begin() as conn:
        conn.execute(update(s.attempts).where(att.attempt_id == a.attempt_id)
                     .values(state=state))
        conn.execute(update(s.debits).where(deb.attempt_id == a.attempt_id)
                     .values(state="reserved", settled_at=None))
        conn.execute(update(s.runs).where(r.run_id == lease.run_id).values(
            reserved_micros=r.reserved_micros + to_micros(a.reserved),
            tokens_reserved=r.tokens_reserved + tokens))
    return str(a.attempt_id)


def session_failing_once(led: Any, terms: dict[str, Any], envelope: Envelope, again: str,
                         failed: Callable[[DatabaseUnavailable], None],
                         around: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
                         ) -> BaseException | None:
    """Run ``r``'s session (``led`` a ``Ledger`` or an ``AsyncLedger``) inside ``around()``:
    its first turn raises :class:`DatabaseUnavailable`, handed to ``failed``; with ``again ==
    "next_turn"`` a second turn follows, otherwise the error leaves the block. What the block
    raised (a ``DatabaseUnavailable``), or ``None``."""
    if isinstance(led, Ledger):
        try:
            with around(), led.run("r", **terms) as run:
                try:
                    run.turn(envelope)
                except DatabaseUnavailable as e:
                    failed(e)
                    if again != "next_turn":
                        raise
                    run.turn(envelope)
        except DatabaseUnavailable as e:
            return e
        return None

    async def main() -> BaseException | None:
        try:
            with around():
                async with led.run("r", **terms) as run:
                    try:
                        await run.turn(envelope)
                    except DatabaseUnavailable as e:
                        failed(e)
                        if again != "next_turn":
                            raise
                        await run.turn(envelope)
        except DatabaseUnavailable as e:
            return e
        return None

    return asyncio.run(main())


def overloaded() -> FailureFact:
    """A 503 overload answered after the headers: a failure that moves on and counts for the
    route's health (what health tests fail a route with)."""
    return FailureFact(category=Category.OVERLOADED, status=503, phase=Phase.AFTER_HEADERS,
                       scope=Scope.ROUTE, moves_on=True, resubmit=True)


def health_lease(led: Ledger, run_id: str) -> Lease:
    """``run_id`` admitted on :func:`routes` under ``failure-domain``, and its lease."""
    led.admit_run(run_id, plan=routes(), budget=budget(cost="1.00"), grant=grant(),
                  policy="failure-domain")
    return led.acquire_lease(run_id)


def begin_on_a(led: Ledger, lease: Lease) -> str:
    """An Attempt begun on route ``a`` with nothing held: its id."""
    return led.begin_attempt(lease, route="a", envelope_hash="sha256:e",
                             reserve="0").attempt_id


@contextlib.contextmanager
def sqlite_held(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection holding ``path``'s lock against readers and writers alike until the
    block ends (or it is closed): SQLite's exclusive locking mode, which a WAL file grants only
    to a connection that has it alone, so it is taken before the ledger's connections open."""
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode=EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("SELECT count(*) FROM sqlite_master").fetchall()
        yield holder
    finally:
        holder.close()


@contextlib.contextmanager
def lock_waits(pg_url: str) -> Iterator[Callable[[], int]]:
    """A count, asked each time it is called, of the sessions of ``pg_url``'s database that
    wait for a lock (``pg_stat_activity``), on a connection of its own."""
    from sqlalchemy import create_engine, text

    from ledger.storage.engine import normalize_url

    watcher = create_engine(normalize_url(pg_url))

    def waiting() -> int:
        with watcher.connect() as conn:
            return int(conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()")).scalar_one())

    try:
        yield waiting
    finally:
        watcher.dispose()


def until(cond: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Wait until ``cond()`` holds, polling other sessions' state (not passing time), or fail
    saying ``what`` never happened."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
