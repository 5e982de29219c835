"""No driver or SQLAlchemy exception escapes a public method: each way a database fails is a
:class:`~ledger.errors.LedgerError`, with the driver's exception chained as its cause, and what
was recorded before the failure is still there after it.

Every kind runs through the public faces — :class:`Ledger`, :class:`AsyncLedger`, the audit,
recovery, reconciliation — on SQLite and on a real PostgreSQL server, except where a kind has
no faithful counterpart on one backend (said at the test):

* SQLite has no server to go away: the database is a local file, read by the process itself;
* on SQLite a second writer cannot interleave with a write transaction (``BEGIN IMMEDIATE``
  serializes them), so an attempt id recorded by another run *during* a begin happens only on
  PostgreSQL; a duplicate key on SQLite is driven through the benchmarks' bulk loader
  (``benchmarks.generate``), which maps driver errors with the storage's own mapping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from benchmarks.generate import generate
from ledger import faults
from ledger.api.facade import AsyncLedger, Ledger
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, Lease
from ledger.errors import (
    Conflict,
    DatabaseReadOnly,
    DatabaseSetupError,
    DatabaseUnavailable,
    LedgerError,
    NotFound,
    SchemaTooNew,
    StorageError,
)
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover
from ledger.storage.engine import normalize_url
from ledger.testing.pgserver import PgServer, free_port
from tests.pgroles import reader_role

from ._readonly import driver_cause
from .helpers import REPO, budget, grant, routes, sql_context

T0 = 1_700_000_000.0
ENV = "sha256:env"
T = TypeVar("T")


# -- what every failure must look like --------------------------------------------------------


async def _awaited(aw: Awaitable[Any]) -> Any:
    return await aw


def _failure(call: Callable[[], Any]) -> BaseException:
    """What ``call()`` (awaited, when it returns an awaitable) raised."""
    try:
        out = call()
        if isinstance(out, Awaitable):
            asyncio.run(_awaited(out))
    except Exception as e:
        return e
    pytest.fail("the call succeeded; it was expected to fail")


def mapped(call: Callable[[], Any], kind: type[LedgerError], *,
           driver: bool = True) -> LedgerError:
    """Run ``call``: it must raise ``kind`` (a ledger error, never a driver's), whose causes
    hold the driver's exception (``driver``) or none at all (a failure the ledger found)."""
    err = _failure(call)
    name = f"{type(err).__module__}.{type(err).__name__}"
    assert isinstance(err, LedgerError), f"{name} escaped: {err}"
    assert isinstance(err, kind), f"{name} instead of {kind.__name__}: {err}"
    cause = driver_cause(err)
    if driver:
        assert cause is not None, f"{name} does not chain the driver's error: {err}"
    else:
        assert cause is None, f"{name} chains a driver error it should not have met: {cause!r}"
    return err


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


def _seed(led: Ledger) -> tuple[Lease, str]:
    """Run r1, leased, with one Attempt dispatching: what a failure must not lose."""
    led.configure_group("g", max_in_flight=None)
    led.configure_group("h", max_in_flight=None)
    led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    lease = led.acquire_lease("r1", ttl_s=30, executor_id="w1")
    att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01")
    return lease, att.attempt_id


def _still_there(url: str, attempt_id: str, state: AttemptState) -> None:
    """The seeded Run and its Attempt as they were, and the books in order."""
    with Ledger.open(url, clock=ManualClock(T0), migrate_schema=False) as led:
        assert led.get_attempt(attempt_id).state is state
        assert led.timeline("r1")[0].attempt_id == attempt_id
        assert reconcile(led).violations == []


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def unreachable(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        # The file's storage is away (a link into a volume that is not there): the driver
        # cannot open it, and it may come back. (A path that is a folder is a set-up error.)
        link = tmp_path / "ledger.db"
        link.symlink_to(tmp_path / "unmounted" / "ledger.db")
        return str(link)
    return f"postgresql+psycopg://nobody:secret@127.0.0.1:{free_port()}/x"  # nothing listens


# -- the database cannot be reached ------------------------------------------------------------


def test_an_unreachable_database_is_database_unavailable_on_every_face(unreachable: str,
                                                                      clock: ManualClock
                                                                      ) -> None:
    err = mapped(lambda: Ledger.open(unreachable), DatabaseUnavailable)
    assert "secret" not in str(err)
    mapped(lambda: AsyncLedger.open(unreachable), DatabaseUnavailable)
    # Opened without migrating, nothing is touched until the first call; then every call of
    # every face is the same typed error, from the cold path and from the hot path's driver.
    led = Ledger.open(unreachable, clock=clock, migrate_schema=False)
    aled = AsyncLedger(led)
    lease = Lease("r1", "w1", 1, T0 + 30)
    try:
        for call in (
            lambda: led.get_run("r1"),
            lambda: led.admit_run("r1", plan=routes(), budget=budget(), grant=grant()),
            lambda: led.acquire_lease("r1"),
            lambda: led.mark_unknown(lease, "att-1", "stop"),
            lambda: led.health(),
            lambda: led.attempts(limit=10),
            lambda: aled.acquire_lease("r1"),
            lambda: aled.mark_unknown(lease, "att-1", "stop"),
            lambda: aled.get_run("r1"),
            lambda: Audit(led).runs(),
            lambda: Audit(led).health(),
            lambda: reconcile(led),
            lambda: recover(led, sleeper=ManualClock(T0)),  # retried, then told
        ):
            mapped(call, DatabaseUnavailable)
    finally:
        led.close()


def test_a_multi_host_url_no_host_answers_names_every_host_and_why() -> None:
    # libpq tries each host in turn; its error's first line is only the last one's failure,
    # so an operator whose first host is the one misconfigured was never told of it.
    first, second = free_port(), free_port()
    url = f"postgresql+psycopg://nobody:secret@127.0.0.1:{first},127.0.0.1:{second}/x"
    err = mapped(lambda: Ledger.open(url), DatabaseUnavailable)
    text = str(err)
    assert f"127.0.0.1:{first} (Connection refused)" in text, text
    assert f"127.0.0.1:{second} (Connection refused)" in text, text
    assert "secret" not in text


def test_a_sqlite_file_in_a_missing_folder_is_refused_before_the_driver(tmp_path: Path) -> None:
    # The ledger checks the folder itself (SQLite would create the file anywhere it can), so
    # this one carries no driver error: there was none. Retrying cannot create the folder: a
    # set-up problem, not an unavailable database.
    err = mapped(lambda: Ledger.open(f"{tmp_path}/no/such/dir/x.db"), DatabaseSetupError,
                 driver=False)
    assert "does not exist" in str(err) and err.fields["problem"] == "folder_missing"
    assert not isinstance(err, DatabaseUnavailable)


def test_a_full_disk_is_named_as_such_and_safe_to_retry(tmp_path: Path) -> None:
    """A write the disk has no room for is ``DatabaseUnavailable`` (nothing was written, a retry
    is safe) whose message names the fix, free space, and ``fields["disk_full"]`` says so: it
    read as an outage ("unavailable, safe to retry once the database is back"). The errors are
    the drivers' own: SQLite's from a file held to two pages, PostgreSQL's disk-full class."""
    from ledger.storage.failure import ledger_error

    conn = sqlite3.connect(tmp_path / "full.db")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.execute("PRAGMA max_page_count = 2")
    with pytest.raises(sqlite3.OperationalError) as full:
        conn.execute("INSERT INTO t VALUES (randomblob(100000))")
    conn.close()
    psycopg = pytest.importorskip("psycopg")
    for cause in (full.value, psycopg.errors.DiskFull("could not extend file: No space left")):
        err = ledger_error(cause, "the-url")
        assert isinstance(err, DatabaseUnavailable) and err.fields["disk_full"] is True
        assert "disk is full" in str(err) and "free" in str(err)


@pytest.mark.postgres
def test_a_deadlock_is_told_as_a_deadlock_rolled_back_and_retry_safe_not_an_outage(
        pg_url: str) -> None:
    """Two transactions locking two Runs' rows in opposite orders: the server rolls one back
    (SQLSTATE 40P01). It is ``DatabaseUnavailable`` (what callers retry on), but its message
    says what happened and that a retry can go at once: "unavailable ... once the database is
    back" sent the operator looking for an outage that never was."""
    led = Ledger.open(pg_url, clock=ManualClock(T0))
    try:
        for r in ("r1", "r2"):
            led.admit_run(r, plan=routes(), budget=budget(), grant=grant())
        ctx = sql_context(led)
        first_locked, second_locked = threading.Event(), threading.Event()
        lock = "SELECT 1 FROM runs WHERE run_id = :r FOR UPDATE"

        def locking(mine: str, other: str, locked: threading.Event,
                    then: threading.Event) -> None:
            with ctx.writing() as conn:
                conn.execute(text(lock), {"r": mine})
                locked.set()
                assert then.wait(30)
                conn.execute(text(lock), {"r": other})

        errors: list[BaseException] = []

        def run(*args: Any) -> None:
            try:
                locking(*args)
            except LedgerError as e:
                errors.append(e)

        one = threading.Thread(target=run, args=("r1", "r2", first_locked, second_locked))
        two = threading.Thread(target=run, args=("r2", "r1", second_locked, first_locked))
        one.start()
        two.start()
        one.join(60)
        two.join(60)
        [err] = errors  # the other went through once the victim let go
        assert isinstance(err, DatabaseUnavailable) and err.fields["contention"] == "40P01"
        said = str(err)
        assert "deadlock detected" in said and "rolled back" in said
        assert "safe to retry now" in said and "unavailable" not in said
        assert driver_cause(err) is not None
    finally:
        led.close()


def test_a_serialization_failure_and_a_lock_timeout_are_told_as_such() -> None:
    psycopg = pytest.importorskip("psycopg")
    from ledger.storage.failure import ledger_error

    for cause, state, said in (
            (psycopg.errors.SerializationFailure("could not serialize access"), "40001",
             "serialization failure"),
            (psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"),
             "55P03", "lock timeout")):
        err = ledger_error(cause, "the-url")
        assert isinstance(err, DatabaseUnavailable) and err.fields["contention"] == state
        assert said in str(err) and "unavailable" not in str(err)


# -- the server goes away while in use (PostgreSQL) --------------------------------------------


def _kill_sessions(server: PgServer, url: str) -> None:
    """Terminate every session of ``url``'s database (waiting until they are gone)."""
    db = url.rsplit("/", 1)[1]
    server.psql("SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
                f"WHERE datname = '{db}' AND pid <> pg_backend_pid()")


def _again(call: Callable[[], T]) -> T:
    """``call()``; once more if it met a connection the server had dropped (the retry a
    caller makes: every ledger call is safe to retry after DatabaseUnavailable)."""
    try:
        return call()
    except DatabaseUnavailable as e:
        assert driver_cause(e) is not None, e
        return call()


@pytest.mark.postgres
def test_a_server_that_drops_the_connections_is_database_unavailable_and_loses_nothing(
        pg_server: PgServer, pg_url: str, clock: ManualClock) -> None:
    led = Ledger.open(pg_url, clock=clock)
    aled = AsyncLedger(led)
    try:
        lease, att = _seed(led)
        # Between calls: every pooled connection is dead. Both paths take their connections
        # from the store's one pool, which sees the server's goodbye on an idle connection
        # before it lends it, and connects afresh at once: no call fails.
        _kill_sessions(pg_server, pg_url)
        assert led.get_run("r1").run_id == "r1"  # the cold path's SQLAlchemy
        _kill_sessions(pg_server, pg_url)
        assert led.get_attempt(att).state is AttemptState.DISPATCHING  # the hot path's
        _kill_sessions(pg_server, pg_url)
        assert led.settle_attempt(lease, att, outcome="succeeded").state is \
            AttemptState.SUCCEEDED
        for call in (lambda: Audit(led).timeline("r1"), lambda: reconcile(led)):
            _kill_sessions(pg_server, pg_url)
            _again(call)  # typed, or (when the pool noticed first) answered

        # Inside a transaction, just before its commit: the connection dies as the COMMIT is
        # sent, so its outcome is unknown to the client. The settle is resolved (run again
        # under the Run's row lock, on a new connection) and the call returns its record.
        second = _again(lambda: led.begin_attempt(lease, route="a", envelope_hash=ENV,
                                                  reserve="0.01"))
        faults.arm("settle.before_commit", lambda _name: _kill_sessions(pg_server, pg_url))
        try:
            assert led.settle_attempt(lease, second.attempt_id, outcome="succeeded").state \
                is AttemptState.SUCCEEDED
        finally:
            faults.disarm("settle.before_commit")

        def kill_twice(name: str) -> None:  # the settle's connection, then its resolution's
            _kill_sessions(pg_server, pg_url)
            faults.arm(name, lambda _name: _kill_sessions(pg_server, pg_url))

        # The asyncio driver: its own idle connection dies the same way and is replaced before
        # use; when a settle's connection and its resolution's both die inside the
        # transaction, the first DatabaseUnavailable leaves (not resolved) and nothing is
        # written.
        async def go() -> BaseException | None:
            third = await aled.begin_attempt(lease, route="a", envelope_hash=ENV,
                                             reserve="0.01")
            _kill_sessions(pg_server, pg_url)
            assert (await aled.get_attempt(third.attempt_id)).state is \
                AttemptState.DISPATCHING
            faults.arm("settle.before_commit", kill_twice)
            try:
                await aled.settle_attempt(lease, third.attempt_id, outcome="succeeded")
            except Exception as e:
                faults.disarm("settle.before_commit")
                assert (await aled.get_attempt(third.attempt_id)).state is \
                    AttemptState.DISPATCHING
                await aled.settle_attempt(lease, third.attempt_id, outcome="succeeded")
                return e
            finally:
                faults.disarm("settle.before_commit")
            return None

        err = asyncio.run(go())
        assert isinstance(err, DatabaseUnavailable) and driver_cause(err) is not None
        assert err.fields["operation"] == "settle" and err.fields["resolved"] is False
        assert err.fields["commit"] == "unknown"

        # Recovery retries through a connection dropped inside its takeover instead of failing.
        clock.advance(60)
        faults.arm("recover.before_commit", lambda _name: _kill_sessions(pg_server, pg_url))
        try:
            report = recover(led, sleeper=ManualClock(T0))
        finally:
            faults.disarm("recover.before_commit")
        assert report.retries >= 1 and [r.run_id for r in report.runs] == ["r1"]
        assert [a.state for a in led.timeline("r1")] == [AttemptState.SUCCEEDED] * 3
        assert reconcile(led).violations == []
    finally:
        led.close()


# -- another connection holds the write lock ---------------------------------------------------


@contextlib.contextmanager
def _write_lock(url: str) -> Iterator[None]:
    """Another connection, of the driver itself, holding r1's and group g's write locks (on
    SQLite: the database's write lock)."""
    if "://" not in url:
        conn = sqlite3.connect(url, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    import psycopg

    conninfo = make_url(normalize_url(url)).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with psycopg.connect(conninfo) as pg:  # a transaction until the end
        pg.execute("SELECT 1 FROM runs WHERE run_id = 'r1' FOR UPDATE")
        pg.execute("SELECT 1 FROM capacity_groups WHERE group_id = 'g' FOR UPDATE")
        yield
        pg.rollback()


def _impatient(db_url: str, pg_server: Any) -> str:
    """``db_url`` whose connections wait at most a moment for another's lock: SQLite's busy
    timeout from the URL, PostgreSQL's ``lock_timeout`` of the database."""
    if "://" not in db_url:
        return f"sqlite:///{db_url}?timeout=0"
    db = db_url.rsplit("/", 1)[1]
    pg_server.psql(f"ALTER DATABASE {db} SET lock_timeout = '100ms'")
    return db_url


def test_a_write_lock_held_past_the_busy_timeout_is_database_unavailable(
        db_url: str, clock: ManualClock, request: pytest.FixtureRequest) -> None:
    pg_server = request.getfixturevalue("pg_server") if "://" in db_url else None
    with Ledger.open(db_url, clock=clock) as led:
        lease, att = _seed(led)
    url = _impatient(db_url, pg_server)
    led = Ledger.open(url, clock=clock, migrate_schema=False)
    aled = AsyncLedger(led)
    try:
        with _write_lock(db_url):
            for call in (
                lambda: led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01"),
                lambda: led.settle_attempt(lease, att, outcome="succeeded"),
                lambda: led.renew_lease(lease, ttl_s=30),
                lambda: led.configure_group("g", max_in_flight=2),
                lambda: aled.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01"),
                lambda: aled.settle_attempt(lease, att, outcome="succeeded"),
            ):
                mapped(call, DatabaseUnavailable)
            # Readers never wait for a writer (WAL; MVCC).
            assert led.get_attempt(att).state is AttemptState.DISPATCHING
            assert Audit(led).timeline("r1").attempts[0].attempt_id == att
            assert reconcile(led).violations == []
            clock.advance(60)  # r1's lease expires: recovery has a run to take over
            if led.backend == "sqlite":
                # The takeover is one write transaction: retried, then told.
                mapped(lambda: recover(led, sleeper=ManualClock(T0)), DatabaseUnavailable)
            else:
                # A run another transaction holds is skipped (SKIP LOCKED), not waited for.
                assert recover(led, sleeper=ManualClock(T0)).skipped == ["r1"]
        assert recover(led, sleeper=ManualClock(T0)).runs[0].newly_unknown == [att]
    finally:
        led.close()
    _still_there(db_url, att, AttemptState.UNKNOWN)


# -- the database is read-only to this connection ----------------------------------------------


@pytest.mark.postgres
def test_a_read_only_postgres_database_refuses_writes_and_still_answers_reads(
        pg_server: PgServer, pg_url: str, clock: ManualClock) -> None:
    with Ledger.open(pg_url, clock=clock) as led:
        lease, att = _seed(led)
    db = pg_url.rsplit("/", 1)[1]
    pg_server.psql(f"ALTER DATABASE {db} SET default_transaction_read_only = on")
    led = Ledger.open(pg_url, clock=clock)  # at head already: the migration only reads
    aled = AsyncLedger(led)
    try:
        for call in (
            lambda: led.configure_group("g2", max_in_flight=1),
            lambda: led.admit_run("r2", plan=routes(), budget=budget(), grant=grant()),
            lambda: led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01"),
            lambda: led.settle_attempt(lease, att, outcome="succeeded"),
            lambda: aled.mark_unknown(lease, att, "stop"),
            lambda: aled.acquire_lease("r1", executor_id="w1"),
        ):
            err = mapped(call, StorageError)
            assert not isinstance(err, DatabaseUnavailable)  # retrying would not help
            assert err.fields["read_only"] is True and "read-only" in str(err)
        clock.advance(60)
        err = mapped(lambda: recover(led, sleeper=ManualClock(T0)), StorageError)
        assert err.fields["read_only"] is True
        assert led.get_attempt(att).state is AttemptState.DISPATCHING
        assert Audit(led).runs().items[0].run_id == "r1"
        assert reconcile(led).violations == []
    finally:
        led.close()
    pg_server.psql(f"ALTER DATABASE {db} SET default_transaction_read_only = off")
    _still_there(pg_url, att, AttemptState.DISPATCHING)


def _writes(led: Ledger, aled: AsyncLedger, lease: Lease, att: str
            ) -> list[Callable[[], Any]]:
    """A write of each path: the cold path's (SQLAlchemy) and the hot path's, blocking and
    asyncio."""
    return [
        lambda: led.configure_group("g2", max_in_flight=1),
        lambda: led.admit_run("r2", plan=routes(), budget=budget(), grant=grant()),
        lambda: led.clear_cooldown("a", reason="audit", by="ops"),
        lambda: led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01"),
        lambda: led.settle_attempt(lease, att, outcome="succeeded"),
        lambda: led.renew_lease(lease, ttl_s=30),
        lambda: aled.mark_unknown(lease, att, "stop"),
        lambda: aled.acquire_lease("r1", executor_id="w9"),
    ]


@pytest.mark.postgres
@pytest.mark.parametrize("read_only_sessions", [True, False],
                         ids=["read_only_sessions", "select_only"])
def test_a_reader_roles_write_on_the_primary_is_a_set_up_error_naming_the_role_never_a_retry(
        pg_server: PgServer, pg_url: str, clock: ManualClock, read_only_sessions: bool) -> None:
    # docs/auditor-role.md's role: SELECT only, its sessions read-only or not. The server
    # refuses its writes with 25006 (the SQLSTATE a standby answers too: here the server is
    # the primary, asked) or 42501; no retry gets past either.
    with Ledger.open(pg_url, clock=clock) as owner:
        lease, att = _seed(owner)
    ro_url = reader_role(pg_server, pg_url, read_only_sessions=read_only_sessions)
    role = ro_url.split("://", 1)[1].split("@", 1)[0]
    led = Ledger.open(ro_url, clock=clock, migrate_schema=False)
    aled = AsyncLedger(led)
    try:
        for call in _writes(led, aled, lease, att):
            err = mapped(call, DatabaseReadOnly)
            assert isinstance(err, DatabaseSetupError) and isinstance(err, StorageError)
            assert not isinstance(err, DatabaseUnavailable), err  # not a standby's
            assert err.fields["problem"] == ("read_only" if read_only_sessions
                                             else "write_privilege"), err
            assert err.fields["read_only"] is True and err.fields["role"] == role
            assert f'role "{role}"' in str(err) and "retrying will not help" in str(err)
            assert "the role that writes the ledger" in str(err)
            cause = driver_cause(err)
            assert getattr(getattr(cause, "orig", cause), "sqlstate", None) == (
                "25006" if read_only_sessions else "42501")
        # Its connections were not dropped as a standby's, and it still reads.
        assert led.get_attempt(att).state is AttemptState.DISPATCHING
        assert Audit(led).runs().items[0].run_id == "r1"
        # A read of a table it was not granted is 42501 too: not told as a refused write.
        pg_server.psql(f"REVOKE SELECT ON runs FROM {role}", pg_url.rsplit("/", 1)[1])
        err = mapped(lambda: Audit(led).runs(), DatabaseReadOnly)
        assert "refused the statement" in str(err) and "refused the write" not in str(err)
        assert "grant it SELECT" in str(err), err
    finally:
        led.close()
    _still_there(pg_url, att, AttemptState.DISPATCHING)


def _unprivileged(args: list[str]) -> Any:
    """The JSON a Python child with ``args`` prints last, run where file modes bind: as root,
    without CAP_DAC_OVERRIDE (root reads and writes whatever the modes say otherwise)."""
    cmd = [sys.executable, *args]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set=-dac_override", *cmd]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_read_only_sqlite_file_refuses_writes_and_still_answers_reads(
        tmp_path: Path, clock: ManualClock) -> None:
    path = str(tmp_path / "ledger.db")
    with Ledger.open(path, clock=clock) as led:
        lease, att = _seed(led)
    files = [p for p in tmp_path.iterdir() if p.name.startswith("ledger.db")]
    for p in files:
        p.chmod(0o444)
    # File modes do not bind root: then the reader runs without CAP_DAC_OVERRIDE.
    try:
        got = _unprivileged(["-m", "tests.storage._readonly", path, "r1", lease.executor,
                             str(lease.fence), att])
    finally:
        for p in files:
            p.chmod(0o644)
    writes = ("configure_group", "admit_run", "begin_attempt", "settle_attempt",
              "AsyncLedger.mark_unknown", "recover")
    for name in writes:
        out = got[name]
        # A set-up problem (also the StorageError it was before it had a class of its own).
        assert out.get("error") == "ledger.errors.DatabaseReadOnly", (name, out)
        assert out["read_only"] is True and out["cause"], (name, out)
        assert "retrying will not help" in out["message"], (name, out)
    # Opening at head only reads the revision (under the write lock SQLite grants a reader).
    for name in ("Ledger.open", "get_run", "timeline", "Audit.runs", "reconcile"):
        assert got[name] == {"ok": True}, (name, got[name])
    _still_there(path, att, AttemptState.DISPATCHING)


def _ledger_in_a_read_only_folder(tmp_path: Path, clock: ManualClock) -> Path:
    """A folder (mode 0555; the caller makes it writable again) holding ledger ``old.db``."""
    folder = tmp_path / "ro"
    folder.mkdir()
    with Ledger.open(str(folder / "old.db"), clock=clock) as led:
        _seed(led)
    folder.chmod(0o555)
    return folder


def test_a_sqlite_ledger_in_a_folder_it_cannot_write_is_a_setup_error_naming_the_folder(
        tmp_path: Path, clock: ManualClock) -> None:
    """SQLite must create the ledger's file, and its -wal and -shm files even to read it, in
    the ledger's folder: in a folder this process may not write, a new ledger was
    ``DatabaseUnavailable`` ("safe to retry") and an existing one a ``StorageError`` blaming
    the file. Both are ``DatabaseSetupError`` naming the folder, with nothing created."""
    folder = _ledger_in_a_read_only_folder(tmp_path, clock)
    child = ("import json, sys\n"
             "from ledger import Ledger\n"
             "from ledger.errors import DatabaseSetupError\n"
             "out = {}\n"
             "for name in sys.argv[1:]:\n"
             "    try:\n"
             "        Ledger.open(name).close()\n"
             "        out[name] = 'opened'\n"
             "    except DatabaseSetupError as e:\n"
             "        out[name] = [e.fields['problem'], str(e)]\n"
             "print(json.dumps(out))\n")
    try:
        got = _unprivileged(["-c", child, str(folder / "old.db"), str(folder / "new.db")])
    finally:
        folder.chmod(0o755)
    for name in ("old.db", "new.db"):
        problem, message = got[str(folder / name)]
        assert problem == "folder_read_only", got
        assert str(folder) in message and "not writable" in message
    assert sorted(p.name for p in folder.iterdir()) == ["old.db"]


def test_a_report_on_a_sqlite_ledger_in_a_folder_it_cannot_write_names_the_folder(
        tmp_path: Path, clock: ManualClock) -> None:
    """The reporting commands first ask whether the file is a ledger, reading it without
    writing. In a folder it may not write, that read met SQLite's "attempt to write a readonly
    database" (a WAL reader needs its -shm file there) and the command told a refused write
    and "use it only to read", which the operator was doing. The file is a ledger; the folder
    is the problem, and the error names it, with nothing created beside the file."""
    folder = _ledger_in_a_read_only_folder(tmp_path, clock)
    child = ("import contextlib, io, json, sys\n"
             "from ledger.cli.main import main\n"
             "from ledger.storage.engine import file_holds\n"
             "err = io.StringIO()\n"
             "with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
             "    rc = main(['--db', sys.argv[1], 'runs'])\n"
             "print(json.dumps([file_holds(sys.argv[1]), rc, err.getvalue()]))\n")
    try:
        holds, rc, said = _unprivileged(["-c", child, str(folder / "old.db")])
    finally:
        folder.chmod(0o755)
    assert holds == "ledger"
    assert rc == 2 and f"folder {str(folder)!r} is not writable" in said, said
    assert "refused the write" not in said
    assert sorted(p.name for p in folder.iterdir()) == ["old.db"]


# -- a row that does not exist ---------------------------------------------------------------


def test_a_missing_row_is_not_found_on_every_face(db_url: str, clock: ManualClock) -> None:
    with Ledger.open(db_url, clock=clock) as led:
        lease, att = _seed(led)
        aled = AsyncLedger(led)
        for call in (
            lambda: led.get_attempt("att-missing"),
            lambda: led.settle_attempt(lease, "att-missing", outcome="succeeded"),
            lambda: led.mark_unknown(lease, "att-missing", "stop"),
            lambda: aled.get_attempt("att-missing"),
            lambda: aled.settle_attempt(lease, "att-missing", outcome="succeeded"),
            lambda: aled.mark_unknown(lease, "att-missing", "stop"),
            lambda: led.get_run("r-missing"),
            lambda: led.timeline("r-missing"),
            lambda: led.debit("d-missing"),
            lambda: led.acquire_lease("r-missing"),
            lambda: aled.acquire_lease("r-missing"),
            lambda: Audit(led).timeline("r-missing"),
        ):
            mapped(call, NotFound, driver=False)  # found missing by the ledger, not a driver
        assert recover(led, run_ids=["r-missing"]).runs == []
        assert led.get_attempt(att).state is AttemptState.DISPATCHING


# -- a key that is recorded already -----------------------------------------------------------


def test_history_loaded_twice_is_a_conflict_that_adds_nothing(db_url: str,
                                                              clock: ManualClock) -> None:
    from sqlalchemy import func, select

    from benchmarks.bulk import bulk_insert
    from benchmarks.generate import POLICY_HASH
    from ledger.api.face import storage_of
    from ledger.storage import schema as s

    with Ledger.open(db_url, clock=clock) as led:
        _lease, att = _seed(led)
        generate(led, attempts=40, days=1.0, end=T0, seed=3)
        before = reconcile(led)
        # Rows recorded already, loaded again after a new Run's: the insert hits the primary
        # keys, and the batch goes whole (the new Run too).
        engine = storage_of(led).context.engine
        with engine.connect() as conn:
            runs = [dict(r._mapping) for r in conn.execute(
                select(s.runs).where(s.runs.c.policy_hash == POLICY_HASH)
                .order_by(s.runs.c.run_id).limit(3))]
        mapped(lambda: bulk_insert(led, {"runs": [{**runs[0], "run_id": "fresh"}, *runs]}),
               Conflict)
        after = reconcile(led)
        assert (after.runs, after.attempts, after.by_state) == (
            before.runs, before.attempts, before.by_state)
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(s.runs)
                                .where(s.runs.c.run_id == "fresh")).scalar_one() == 0
        assert led.get_attempt(att).state is AttemptState.DISPATCHING


@pytest.mark.postgres
def test_an_attempt_id_recorded_meanwhile_by_another_run_is_a_conflict(pg_url: str,
                                                                        clock: ManualClock
                                                                        ) -> None:
    with Ledger.open(pg_url, clock=clock) as led, \
            Ledger.open(pg_url, clock=clock, migrate_schema=False) as other:
        lease, att = _seed(led)
        led.admit_run("r2", plan=routes(), budget=budget(), grant=grant())
        theirs = other.acquire_lease("r2", ttl_s=30, executor_id="w2")

        def meanwhile(_point: str) -> None:
            # Between r1's begin reading that the id is free and its writes.
            other.begin_attempt(theirs, route="c", envelope_hash=ENV, reserve="0.01",
                                attempt_id="att-shared")

        faults.arm("begin.before_commit", meanwhile)
        try:
            mapped(lambda: led.begin_attempt(lease, route="a", envelope_hash=ENV,
                                             reserve="0.01", attempt_id="att-shared"),
                   Conflict)
        finally:
            faults.disarm("begin.before_commit")
        assert led.get_attempt("att-shared").run_id == "r2"
        assert [a.attempt_id for a in led.timeline("r1")] == [att]  # the begin left nothing
        assert led.get_run("r1").calls_used == 1
        assert reconcile(led).violations == []


# -- a schema newer than the code --------------------------------------------------------------


def test_a_newer_schema_is_schema_too_new_and_its_records_stay(db_url: str,
                                                               clock: ManualClock) -> None:
    with Ledger.open(db_url, clock=clock) as led:
        _lease, att = _seed(led)
    eng = create_engine(normalize_url(db_url))
    try:
        with eng.begin() as conn:
            old = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            conn.execute(text("UPDATE alembic_version SET version_num = 'f00dfeed9999'"))
        mapped(lambda: Ledger.open(db_url), SchemaTooNew, driver=False)
        mapped(lambda: AsyncLedger.open(db_url), SchemaTooNew, driver=False)
        # Without migrating too: a reader would read rows by rules it does not know.
        mapped(lambda: Ledger.open(db_url, migrate_schema=False), SchemaTooNew, driver=False)
        mapped(lambda: AsyncLedger.open(db_url, migrate_schema=False), SchemaTooNew,
               driver=False)
        with eng.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": old})
    finally:
        eng.dispose()
    _still_there(db_url, att, AttemptState.DISPATCHING)


def test_an_older_schema_opened_without_migration_is_a_setup_error_that_writes_nothing(
        db_url: str, clock: ManualClock) -> None:
    """A process on this package that opens a database still at an older package's schema
    without migrating (``migrate_schema=False``: every command but ``db init``, the
    dashboard, an application that never migrates) is refused at open with
    :class:`DatabaseSetupError` naming ``db init`` and the two revisions, sync and async. One
    that opened before the schema went back (or while the server was away, so the revision
    could not be read at open) fails at its first statement that needs what the older schema
    lacks, sync, async and in the audit; that transaction leaves nothing, and once ``db init``
    ran the same call works."""
    from ledger.storage.migrate import head_revision
    from ledger.storage.provision import init_database

    from .helpers import downgrade_schema

    with Ledger.open(db_url, clock=clock) as led:
        _lease, att = _seed(led)
        led.admit_run("r2", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r2", ttl_s=30, executor_id="w2")
    opened = Ledger.open(db_url, clock=clock, migrate_schema=False)
    try:
        assert "labels" not in downgrade_schema(db_url, "0009")  # the package before the 0010

        # The Run's row is read with its mark of a failover (0012) and what a Child gave back
        # (0018): the database names whichever it misses first.
        def outdated(err: LedgerError,
                     lacks: str | tuple[str, ...] = ("failed_over", "returned_")) -> None:
            assert err.fields["problem"] == "schema_outdated", err.fields
            assert "failover-ledger db init" in str(err), str(err)
            assert any(x in str(err) for x in ((lacks,) if isinstance(lacks, str) else lacks)
                       ), str(err)

        at_open = f"it is at revision 0009, this ledger needs {head_revision()}"
        outdated(mapped(lambda: Ledger.open(db_url, clock=clock, migrate_schema=False),
                        DatabaseSetupError, driver=False), at_open)
        outdated(mapped(lambda: AsyncLedger.open(db_url, clock=clock, migrate_schema=False),
                        DatabaseSetupError, driver=False), at_open)

        led = opened
        # The Run's row is read by admission and begin.
        outdated(mapped(lambda: led.admit_run("r3", plan=routes(), budget=budget(),
                                              grant=grant()), DatabaseSetupError))
        outdated(mapped(lambda: led.begin_attempt(lease, route="a", envelope_hash=ENV,
                                                  reserve="0.01"), DatabaseSetupError))
        # The totals look for the hours rolled up (0011) first.
        outdated(mapped(lambda: Audit(led).costs(by="label", label="team"), DatabaseSetupError),
                 "rollup_hours")

        async def async_begin() -> None:
            aled = AsyncLedger(opened)
            alease = await aled.acquire_lease("r2", ttl_s=30, executor_id="w3")
            await aled.begin_attempt(alease, route="a", envelope_hash=ENV, reserve="0.01")

        clock.advance(31)  # w2's lease lapsed
        outdated(mapped(async_begin, DatabaseSetupError))
    finally:
        opened.close()
    eng = create_engine(normalize_url(db_url))
    try:
        with eng.connect() as conn:  # the begins' transactions left nothing, holds included
            assert conn.execute(text("SELECT count(*) FROM attempts WHERE run_id = 'r2'")
                                ).scalar() == 0
            assert conn.execute(text("SELECT calls_used, reserved_micros FROM runs "
                                     "WHERE run_id = 'r2'")).one() == (0, 0)
            assert conn.execute(text("SELECT count(*) FROM runs WHERE run_id = 'r3'")
                                ).scalar() == 0
    finally:
        eng.dispose()

    assert init_database(db_url).schema == "upgraded"
    clock.advance(31)  # w3's lease lapsed
    with Ledger.open(db_url, clock=clock, migrate_schema=False) as led:
        lease = led.acquire_lease("r2", ttl_s=30, executor_id="w4")
        begun = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01")
        assert [a.attempt_id for a in led.timeline("r2")] == [begun.attempt_id]
    _still_there(db_url, att, AttemptState.DISPATCHING)
