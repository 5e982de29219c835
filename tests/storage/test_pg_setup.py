"""Setting PostgreSQL up as a newcomer does (``docs/postgresql.md``), on a real server.

A database or role that does not exist, refused credentials, a ``pg_hba.conf`` rejection, a role
that may not log in: each is a :class:`~ledger.errors.DatabaseSetupError` (a ``ConfigError``)
naming the fix, never the retry-safe ``DatabaseUnavailable``, on every path (``Ledger.open``,
``AsyncLedger.open``, the hot path's own psycopg connections); a server that is down still is
``DatabaseUnavailable``. ``failover-ledger db init`` creates the database when the role may and
the schema, idempotently, and creates nothing when the role may not. The least-privilege
set-up the page describes (an owner that migrates, a runtime role with row privileges) is run
exactly as written.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger import AsyncLedger, ConfigError, DatabaseSetupError, DatabaseUnavailable, Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.errors import InvalidArgument
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover
from ledger.storage.migrate import head_revision
from ledger.testing.pgserver import PgServer, free_port

from ._readonly import driver_cause
from .helpers import REPO, budget, grant, routes

T0 = 1_700_000_000.0
_n = itertools.count()


def _name(kind: str) -> str:
    return f"{kind}_{os.getpid()}_{next(_n)}"


def _url(srv: PgServer, role: str, db: str, password: str | None = None) -> str:
    auth = role if password is None else f"{role}:{password}"
    return f"postgresql+psycopg://{auth}@127.0.0.1:{srv.port}/{db}"


def _exists(srv: PgServer, db: str) -> bool:
    return srv.psql(f"SELECT count(*) FROM pg_database WHERE datname = '{db}'").strip() == "1"


def _failure(call: Callable[[], Any]) -> BaseException:
    """What ``call()`` (awaited, when it returns an awaitable) raised."""
    try:
        out = call()
        if isinstance(out, Awaitable):
            async def wait() -> Any:
                return await out
            asyncio.run(wait())
    except Exception as e:
        return e
    pytest.fail("the call succeeded; it was expected to fail")


def _setup_error(call: Callable[[], Any], problem: str, *,
                 driver: bool = True) -> DatabaseSetupError:
    """``call`` raised the setup error of ``problem``, chaining the driver's error (``driver``)
    or none (a problem the ledger found before any driver was asked)."""
    err = _failure(call)
    assert isinstance(err, DatabaseSetupError), f"{type(err).__name__}: {err}"
    assert isinstance(err, ConfigError) and not isinstance(err, DatabaseUnavailable)
    assert err.fields["problem"] == problem, err.fields
    assert "retrying will not help" in str(err) and "safe to retry" not in str(err)
    assert (driver_cause(err) is not None) is driver, driver_cause(err)
    return err


def _every_path(url: str, problem: str) -> list[DatabaseSetupError]:
    """The same setup error from the sync and async opening and from the hot path's own
    connections (a ledger opened without migrating touches nothing until its first call)."""
    errors = [_setup_error(lambda: Ledger.open(url), problem),
              _setup_error(lambda: AsyncLedger.open(url), problem)]
    led = Ledger.open(url, clock=ManualClock(T0), migrate_schema=False)
    try:
        for call in (lambda: led.acquire_lease("r1", ttl_s=30),
                     lambda: AsyncLedger(led).acquire_lease("r1", ttl_s=30)):
            err = _setup_error(call, problem)
            # The hot path's connection is psycopg's own, not SQLAlchemy's pool.
            assert type(err.__cause__).__module__.startswith("psycopg"), repr(err.__cause__)
            errors.append(err)
        errors.append(_setup_error(lambda: led.get_run("r1"), problem))  # the cold path
    finally:
        led.close()
    return errors


# -- what the server answers at connection time -------------------------------------------------


@pytest.mark.postgres
def test_a_database_that_does_not_exist_is_a_setup_error_naming_createdb(
        pg_server: PgServer) -> None:
    db = _name("missing")
    url = pg_server.url(db)
    for err in _every_path(url, "database_missing"):
        assert err.fields["database"] == db and err.fields["role"] == "postgres"
        assert f"createdb -h 127.0.0.1 -p {pg_server.port} -O postgres {db}" in str(err)
        assert "failover-ledger db init" in str(err)
    assert not _exists(pg_server, db)  # opening created nothing


@pytest.mark.postgres
def test_a_role_that_does_not_exist_is_a_setup_error_naming_create_role(
        pg_server: PgServer) -> None:
    role = _name("nobody")
    for err in _every_path(_url(pg_server, role, "postgres", "secret"), "role_missing"):
        assert err.fields["role"] == role and err.fields["database"] == "postgres"
        assert f'CREATE ROLE "{role}" LOGIN' in str(err)
        assert "secret" not in str(err) and "secret" not in str(err.fields)


@pytest.mark.postgres
def test_a_role_that_may_not_log_in_is_a_setup_error(pg_server: PgServer) -> None:
    role = _name("nologin")
    pg_server.psql(f"CREATE ROLE {role} NOLOGIN")
    for err in _every_path(_url(pg_server, role, "postgres"), "login_refused"):
        assert err.fields["role"] == role and f'ALTER ROLE "{role}" LOGIN' in str(err)


@pytest.fixture
def hba(pg_server: PgServer) -> Iterator[tuple[str, str]]:
    """Two roles the server authenticates for real (the test server trusts everyone else):
    one with a password (``scram-sha-256``), one that ``pg_hba.conf`` rejects."""
    pw, rejected = _name("pw"), _name("rejected")
    pg_server.psql(f"CREATE ROLE {pw} LOGIN PASSWORD 'right-password'")
    pg_server.psql(f"CREATE ROLE {rejected} LOGIN")
    path = Path(pg_server.datadir) / "pg_hba.conf"
    before = path.read_text()
    path.write_text(f"host all {rejected} 127.0.0.1/32 reject\n"
                    f"host all {pw} 127.0.0.1/32 scram-sha-256\n" + before)
    pg_server.psql("SELECT pg_reload_conf()")
    try:
        yield pw, rejected
    finally:
        path.write_text(before)
        pg_server.psql("SELECT pg_reload_conf()")


@pytest.mark.postgres
def test_refused_credentials_and_a_pg_hba_rejection_are_setup_errors(
        pg_server: PgServer, hba: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    pw, rejected = hba
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", os.devnull)
    for err in _every_path(_url(pg_server, pw, "postgres", "wrong-password"), "auth_failed"):
        assert err.fields["role"] == pw and "password authentication failed" in str(err)
        assert "wrong-password" not in str(err)
    for err in _every_path(_url(pg_server, pw, "postgres"), "password_missing"):
        assert f"postgresql+psycopg://{pw}:PASSWORD@" in str(err)
    for err in _every_path(_url(pg_server, rejected, "postgres"), "hba_rejected"):
        assert (err.fields["role"], err.fields["database"]) == (rejected, "postgres")
        assert "pg_hba.conf" in str(err) and "pg_reload_conf" in str(err)
    # The right password opens the ledger (on a database the role owns).
    db = _name("pwdb")
    pg_server.psql(f"CREATE DATABASE {db} OWNER {pw}")
    Ledger.open(_url(pg_server, pw, db, "right-password")).close()


@pytest.mark.postgres
def test_a_server_that_is_down_stays_database_unavailable() -> None:
    url = f"postgresql+psycopg://postgres:secret@127.0.0.1:{free_port()}/ledger"  # nothing listens
    for call in (lambda: Ledger.open(url), lambda: AsyncLedger.open(url)):
        err = _failure(call)
        assert isinstance(err, DatabaseUnavailable) and not isinstance(err, ConfigError), err
        assert "safe to retry" in str(err) and "secret" not in str(err)
    led = Ledger.open(url, migrate_schema=False)
    try:
        for call in (lambda: led.acquire_lease("r1", ttl_s=30),
                     lambda: AsyncLedger(led).acquire_lease("r1", ttl_s=30)):
            assert isinstance(_failure(call), DatabaseUnavailable)
    finally:
        led.close()


# -- failover-ledger db init ----------------------------------------------------------------------


def _init(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    """``failover-ledger db init ARGS --json`` in this process: (exit code, report, stderr)."""
    rc = main(["db", "init", *args, "--json"])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if rc == 0 else None, err


@pytest.mark.postgres
def test_db_init_creates_the_database_and_its_schema_when_the_role_may(
        pg_server: PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    role, db = _name("creator"), _name("made")
    pg_server.psql(f"CREATE ROLE {role} LOGIN CREATEDB")
    url = _url(pg_server, role, db)
    rc, rep, err = _init(capsys, url)
    assert rc == 0, err
    assert rep == {"backend": "postgresql", "url": url, "database": db,
                   "created_database": True, "schema": "created", "revision_before": None,
                   "revision": head_revision()}
    owner = pg_server.psql(f"SELECT pg_get_userbyid(datdba) FROM pg_database "
                           f"WHERE datname = '{db}'").strip()
    assert owner == role
    with Ledger.open(url, migrate_schema=False) as led:  # the schema is there: no migration
        led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
        assert led.get_run("r1").run_id == "r1"
    # Idempotent: run again, it finds both and changes nothing.
    rc, again, err = _init(capsys, url)
    assert rc == 0, err
    assert (again["created_database"], again["schema"]) == (False, "current")
    assert again["revision_before"] == again["revision"] == head_revision()
    with Ledger.open(url) as led:
        assert led.get_run("r1").run_id == "r1"  # nothing recorded was touched
    # The words a person reads say the same.
    assert main(["db", "init", url]) == 0
    out = capsys.readouterr().out
    assert f"database {db} exists" in out and "nothing to do" in out


@pytest.mark.postgres
def test_db_init_without_createdb_names_the_fix_and_creates_nothing(
        pg_server: PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    role, db = _name("plain"), _name("wanted")
    pg_server.psql(f"CREATE ROLE {role} LOGIN")
    url = _url(pg_server, role, db)
    err = _setup_error(lambda: _init_api(url), "createdb_privilege")
    assert (err.fields["database"], err.fields["role"]) == (db, role)
    assert f"createdb -h 127.0.0.1 -p {pg_server.port} -O {role} {db}" in str(err)
    assert f'ALTER ROLE "{role}" CREATEDB' in str(err)
    assert not _exists(pg_server, db)
    # The command: one line on stderr, exit 2 (a set-up problem), still nothing created.
    res = _cli("db", "init", url)
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1 and "CREATEDB" in res.stderr
    assert not _exists(pg_server, db)
    # Once an administrator made the database for the role, db init creates the schema.
    pg_server.psql(f"CREATE DATABASE {db} OWNER {role}")
    rc, rep, _err = _init(capsys, url)
    assert rc == 0 and (rep["created_database"], rep["schema"]) == (False, "created")


def _init_api(url: str) -> Any:
    from ledger.storage.provision import init_database

    return init_database(url)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("LEDGER_URL", None)
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], env=env,
                          cwd=str(REPO), capture_output=True, text=True, timeout=120)


def _migrate_to(url: str, revision: str) -> None:
    """The schema of ``url`` at an older ``revision``, as an earlier package left it."""
    from alembic import command
    from sqlalchemy import create_engine

    from ledger.storage.migrate import alembic_config

    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_db_init_upgrades_an_older_schema(pg_server: PgServer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    db = _name("older")
    pg_server.psql(f"CREATE DATABASE {db}")
    _migrate_to(pg_server.url(db), "0004")
    rc, rep, err = _init(capsys, pg_server.url(db))
    assert rc == 0, err
    assert (rep["schema"], rep["revision_before"], rep["revision"]) == (
        "upgraded", "0004", head_revision())


def test_db_init_on_sqlite_creates_the_file_and_its_schema(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "new.db"
    rc, rep, err = _init(capsys, str(path))
    assert rc == 0, err
    assert (rep["backend"], rep["database"], rep["created_database"], rep["schema"]) == (
        "sqlite", str(path), True, "created")
    assert path.is_file()
    with Ledger.open(str(path), migrate_schema=False) as led:
        led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    rc, again, err = _init(capsys, str(path))
    assert rc == 0, err
    assert (again["created_database"], again["schema"]) == (False, "current")
    with Ledger.open(str(path), migrate_schema=False) as led:
        assert led.get_run("r1").run_id == "r1"


def test_a_sqlite_path_that_is_a_directory_is_a_setup_error_naming_it(tmp_path: Path) -> None:
    # SQLite's "unable to open database file" read as an outage ("safe to retry"): no retry
    # turns a directory into a file.
    folder = tmp_path / "adir"
    folder.mkdir()
    for call in (lambda: Ledger.open(str(folder)), lambda: AsyncLedger.open(str(folder)),
                 lambda: _init_api(str(folder))):
        err = _setup_error(call, "not_a_file", driver=False)
        assert str(folder) in str(err) and "is a directory" in str(err), err
        assert str(folder / "ledger.db") in str(err)
    assert list(folder.iterdir()) == []


def _app_file(path: Path, *tables: str) -> bytes:
    """Another application's SQLite file holding ``tables`` (its rollback journal, not WAL)."""
    conn = sqlite3.connect(path)
    for t in tables:
        conn.execute(f"CREATE TABLE {t} (id INTEGER PRIMARY KEY, name TEXT)")
    conn.commit()
    conn.close()
    return path.read_bytes()


def test_a_sqlite_file_of_another_application_is_never_made_a_ledger(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A mistyped path to the application's own database must not gain the ledger's tables,
    # indexes and triggers (after which every command would take it for a ledger), whether
    # it has a table named like one of the ledger's or not; nor may a file that is not a
    # database at all be touched.
    files = {tmp_path / "app.db": _app_file(tmp_path / "app.db", "customers"),
             tmp_path / "jobs.db": _app_file(tmp_path / "jobs.db", "runs", "alembic_x"),
             tmp_path / "notes.db": b"not a database"}
    (tmp_path / "notes.db").write_bytes(files[tmp_path / "notes.db"])
    for path, before in files.items():
        for call in (lambda p=path: Ledger.open(str(p)), lambda p=path: AsyncLedger.open(str(p)),
                     lambda p=path: _init_api(str(p))):
            err = _setup_error(call, "not_a_ledger", driver=False)
            assert str(path) in str(err) and "pass the path of a new file" in str(err), err
        assert main(["db", "init", str(path)]) == 2
        assert "pass the path of a new file" in capsys.readouterr().err
        assert path.read_bytes() == before, path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db", "jobs.db", "notes.db"]
    # A file with no table yet (touched, or only SQLite's header) is still made a ledger.
    empty = tmp_path / "empty.db"
    empty.touch()
    header = tmp_path / "header.db"
    _app_file(header, "dropped")
    with contextlib.closing(sqlite3.connect(header)) as conn:
        conn.execute("DROP TABLE dropped")
        conn.commit()
    assert header.stat().st_size > 0
    for path in (empty, header):
        with Ledger.open(str(path), clock=ManualClock(T0)) as led:
            led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())


def test_a_wal_mode_file_of_another_application_is_refused_leaving_its_folder_as_it_was(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Reading it read-only made its -wal and -shm files and left them beside it.
    path = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO customers (name) VALUES ('ana')")
        conn.commit()
    before = path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]
    for call in (lambda: Ledger.open(str(path)), lambda: AsyncLedger.open(str(path)),
                 lambda: _init_api(str(path))):
        _setup_error(call, "not_a_ledger", driver=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]
    assert main(["db", "init", str(path)]) == 2
    assert "pass the path of a new file" in capsys.readouterr().err
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]
    # While the application has it open, its -wal and -shm files are its own: the refusal
    # leaves them, and the rows only its WAL holds, in place.
    with contextlib.closing(sqlite3.connect(path)) as app:
        app.execute("INSERT INTO customers (name) VALUES ('bo')")
        app.commit()
        sides = sorted(p.name for p in tmp_path.iterdir())
        assert sides == ["app.db", "app.db-shm", "app.db-wal"]
        _setup_error(lambda: Ledger.open(str(path)), "not_a_ledger", driver=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == sides
        app.execute("INSERT INTO customers (name) VALUES ('cy')")
        app.commit()
        assert [r[0] for r in app.execute("SELECT name FROM customers ORDER BY id")] == [
            "ana", "bo", "cy"]
    with contextlib.closing(sqlite3.connect(path)) as app:
        assert [r[0] for r in app.execute("SELECT name FROM customers ORDER BY id")] == [
            "ana", "bo", "cy"]


def test_db_init_refuses_what_is_not_a_database_and_creates_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such" / "folder" / "x.db"
    err = _setup_error(lambda: _init_api(str(missing)), "folder_missing", driver=False)
    assert "mkdir -p" in str(err) and not missing.parent.exists()
    # Also what Ledger.open says: retrying will not create a folder.
    _setup_error(lambda: Ledger.open(str(missing)), "folder_missing", driver=False)
    for url, words in (("https://example.com/ledger", "unsupported database backend"),
                       ("mysql://u@h/db", "unsupported database backend"),
                       ("postgresql+psycopg://postgres@127.0.0.1:5432", "names no database"),
                       ("postgresql+asyncpg://u@h/db", "unsupported PostgreSQL driver")):
        with pytest.raises(InvalidArgument, match=words) as ei:
            _init_api(url)
        assert ei.value.field == "url"
        assert main(["db", "init", url]) == 2
        assert words in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.postgres
def test_a_url_that_names_no_database_is_refused_on_every_path_and_touches_none(
        pg_server: PgServer, pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    role = _name("nodb")
    pg_server.psql(f"CREATE ROLE {role} LOGIN")
    # Where libpq goes when the URL names no database: the one named after the user.
    pg_server.psql(f"CREATE DATABASE {role} OWNER {role}")
    base = f"postgresql+psycopg://{role}@127.0.0.1:{pg_server.port}"
    for url in (base, base + "/", base + "/?dbname="):
        for call in (lambda u=url: Ledger.open(u), lambda u=url: AsyncLedger.open(u)):
            err = _failure(call)
            assert isinstance(err, InvalidArgument) and err.field == "url", repr(err)
            assert "names no database; add it to the URL" in str(err), str(err)
        err = _failure(lambda u=url: Ledger.open(pg_url, read_url=u))
        assert isinstance(err, InvalidArgument) and err.field == "read_url", repr(err)
        assert "names no database" in str(err)
        assert main(["--db", url, "actions"]) == 2
        assert "names no database; add it to the URL" in capsys.readouterr().err
    assert pg_server.psql("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'",
                          db=role).strip() == "0"
    # libpq's own dbname= names it too.
    Ledger.open(base + "/?dbname=" + role).close()


# -- the least-privilege set-up of docs/postgresql.md, as written ---------------------------------


def _documented_grants() -> str:
    """The SQL block of docs/postgresql.md that creates and grants the runtime role."""
    page = (REPO / "docs" / "postgresql.md").read_text()
    blocks = re.findall(r"```sql\n(.*?)```", page, re.S)
    [block] = [b for b in blocks if "ledger_app" in b]
    return block


def _documented_setup(pg_server: PgServer,
                      capsys: pytest.CaptureFixture[str]) -> tuple[str, str, str, str]:
    """A ledger made by ``db init`` as its owner, and the runtime role granted as the page
    says: (owner, runtime role, database, the owner's part of the grants)."""
    owner, app, db = _name("owner"), _name("app"), _name("ledger")
    pg_server.psql(f"CREATE ROLE {owner} LOGIN CREATEDB")
    rc, rep, err = _init(capsys, _url(pg_server, owner, db))
    assert rc == 0 and rep["created_database"], err
    superuser, as_owner = (
        part.replace("ledger_owner", owner).replace("ledger_app", app)
        .replace("DATABASE ledger", f"DATABASE {db}")
        for part in _documented_grants().split("-- as ledger_owner, in the ledger database:"))
    pg_server.psql(superuser)
    pg_server.psql(f"SET ROLE {owner};\n{as_owner}", db=db)
    return owner, app, db, as_owner


@pytest.mark.postgres
def test_a_runtime_role_with_the_documented_grants_runs_the_ledger_the_owner_migrated(
        pg_server: PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    owner, app, db, as_owner = _documented_setup(pg_server, capsys)

    clock = ManualClock(T0)
    url = _url(pg_server, app, db)
    with Ledger.open(url, clock=clock) as led:  # the default open: the schema is current
        led.configure_group("g", max_in_flight=2)
        led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r1", ttl_s=30)
        att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e1", reserve="0.01")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=10,
                           completion_tokens=5, cost=Decimal("0.004"))
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e2", reserve="0.01",
                          turn_id="turn-2")  # left dispatching: the executor "dies"
        clock.advance(60)
        report = recover(led, sleeper=clock)
        assert [r.run_id for r in report.runs] == ["r1"] and report.unknown_attempts == 1
        books = reconcile(led)
        assert books.ok and books.attempts == 2, books.violations
    # The runtime role cannot change the schema: on a database whose schema is missing or
    # older than the package it stops at once, naming db init, and changes nothing.
    bare = _name("bare")
    pg_server.psql(f"CREATE DATABASE {bare} OWNER {owner}")
    pg_server.psql(f"GRANT CONNECT ON DATABASE {bare} TO {app}")
    err = _setup_error(lambda: Ledger.open(_url(pg_server, app, bare)), "schema_privilege")
    assert "failover-ledger db init" in str(err) and err.fields["role"] == app
    assert pg_server.psql("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'",
                          db=bare).strip() == "0"
    older = _name("older")
    pg_server.psql(f"CREATE DATABASE {older} OWNER {owner}")
    _migrate_to(_url(pg_server, owner, older), "0004")
    pg_server.psql(f"SET ROLE {owner};\n{as_owner.replace(db, older)}", db=older)
    err = _setup_error(lambda: Ledger.open(_url(pg_server, app, older)), "schema_privilege")
    assert "0004" in str(err) and head_revision() in str(err)
    assert pg_server.psql("SELECT version_num FROM alembic_version", db=older).strip() == "0004"


def _finished_run(led: Ledger, clock: ManualClock, run_id: str, at: float) -> None:
    clock.set(at)
    led.admit_run(run_id, plan=routes(), budget=budget(), grant=grant())
    lease = led.acquire_lease(run_id, ttl_s=30)
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e1", reserve="0.01")
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=10,
                       completion_tokens=5, cost=Decimal("0.004"))
    led.finish_run(lease, "succeeded")
    led.release_lease(lease)


@pytest.mark.postgres
def test_retention_as_the_runtime_role_is_a_setup_error_naming_the_owner(
        pg_server: PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    owner, app, db, _ = _documented_setup(pg_server, capsys)
    clock = ManualClock(T0)
    # Before there is anything to drop or make: refused all the same, so a retention job set
    # up under the runtime role fails its first run, not months later.
    with Ledger.open(_url(pg_server, app, db), clock=clock) as led:
        err = _setup_error(lambda: led.drop_history(90 * 86400), "schema_privilege",
                           driver=False)
        assert f'role "{app}"' in str(err) and f'"{owner}"' in str(err), str(err)
        assert led.drop_history(90 * 86400, dry_run=True).dropped == []
    # The owner's history lands in its month's partition (its open made it); the runtime
    # role's, of a month without one, in the default partition, which retention splits.
    with Ledger.open(_url(pg_server, owner, db), clock=clock) as led:
        _finished_run(led, clock, "in-a-partition", T0)
    with Ledger.open(_url(pg_server, app, db), clock=clock) as led:
        _finished_run(led, clock, "in-the-default", T0 - 400 * 86400)
    later = ManualClock(T0 + 400 * 86400)
    with Ledger.open(_url(pg_server, app, db), clock=later) as led:
        err = _setup_error(lambda: led.drop_history(90 * 86400), "schema_privilege",
                           driver=False)
        assert f'role "{app}"' in str(err) and f'"{owner}"' in str(err), str(err)
        assert "failover-ledger retention" in str(err) and "read-only" not in str(err)
        assert main(["--db", _url(pg_server, app, db), "retention", "--older-than",
                     "90d"]) == 2
        assert "failover-ledger retention" in capsys.readouterr().err
        # A dry run only reads, old rows in the default partition or not: no DDL.
        assert led.drop_history(90 * 86400, dry_run=True).dropped
        assert main(["--db", _url(pg_server, app, db), "retention", "--older-than", "90d",
                     "--dry-run"]) == 0
        capsys.readouterr()
        pg_server.psql("DELETE FROM attempts_default; DELETE FROM events_default", db=db)
        assert led.drop_history(90 * 86400, dry_run=True).dropped
        err = _setup_error(lambda: led.drop_history(90 * 86400), "schema_privilege",
                           driver=False)
        assert f'"{owner}"' in str(err) and "read-only" not in str(err), str(err)
    with Ledger.open(_url(pg_server, owner, db), clock=later) as led:
        assert Audit(led).actions(kinds=["retention"]).items == []
        assert led.drop_history(90 * 86400).dropped  # the owner may


def _held_run(led: Ledger, clock: ManualClock, run_id: str, at: float) -> None:
    """A Run whose Attempt is left dispatching (its executor "died"): held by retention."""
    clock.set(at)
    led.admit_run(run_id, plan=routes(), budget=budget(), grant=grant())
    lease = led.acquire_lease(run_id, ttl_s=30)
    led.begin_attempt(lease, route="a", envelope_hash="sha256:e1", reserve="0.01")


@pytest.mark.postgres
def test_a_retention_dry_run_needs_only_select_and_reports_what_the_owner_would_drop(
        pg_server: PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    """Old months whose rows sit in the default partition (written by the runtime role, which
    may not make their partitions) are counted in place by a dry run, with plain SELECTs: a
    role that may only read the tables gets the owner's report, and nothing is made."""
    owner, app, db, _ = _documented_setup(pg_server, capsys)
    reader = _name("reader")
    pg_server.psql(f"CREATE ROLE {reader} LOGIN; GRANT CONNECT ON DATABASE {db} TO {reader}")
    pg_server.psql(f"SET ROLE {owner}; GRANT USAGE ON SCHEMA public TO {reader}; "
                   f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {reader}", db=db)
    clock = ManualClock(T0)
    with Ledger.open(_url(pg_server, owner, db), clock=clock) as led:
        _finished_run(led, clock, "in-a-partition", T0)
    with Ledger.open(_url(pg_server, app, db), clock=clock) as led:
        _finished_run(led, clock, "in-the-default", T0 - 400 * 86400)
        _held_run(led, clock, "held-in-the-default", T0 - 300 * 86400)
    parts = ("SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
             "WHERE c.relname LIKE 'attempts_p%' OR c.relname LIKE 'events_p%'")
    made = pg_server.psql(parts, db=db).strip()
    later = ManualClock(T0 + 90 * 86400)
    reports = {}
    for role in (reader, app, owner):
        with Ledger.open(_url(pg_server, role, db), clock=later,
                         migrate_schema=False) as led:
            reports[role] = led.drop_history(90 * 86400, dry_run=True)
    assert reports[reader] == reports[app] == reports[owner]
    dry = reports[reader]
    month = {p.partition: p for p in dry.dropped + dry.kept}
    assert month["attempts_p202210"].rows == 1 and month["attempts_p202210"] in dry.dropped
    assert "open (unknown or dispatching) attempt" in (month["attempts_p202301"].held or "")
    # Nothing made or moved: the old rows are still in the default partition.
    assert pg_server.psql(parts, db=db).strip() == made
    assert pg_server.psql("SELECT count(*) FROM attempts_default", db=db).strip() == "2"
    assert main(["--db", _url(pg_server, reader, db), "retention", "--older-than", "90d",
                 "--dry-run"]) == 0
    assert "attempts_p202210" in capsys.readouterr().out
    # The owner's run drops (and keeps) what the dry runs said, under the same names.
    with Ledger.open(_url(pg_server, owner, db), clock=later) as led:
        done = led.drop_history(90 * 86400, by="ops", reason="keep 90 days")
    assert (done.dropped, done.kept) == (dry.dropped, dry.kept)


@pytest.mark.postgres
def test_a_search_path_naming_no_schema_is_a_setup_error_naming_create_schema(
        pg_server: PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    # The server answers "no schema has been selected to create in" (3F000); it was a plain
    # StorageError ("database error: ...", exit 1) with no fix, where every other set-up
    # mistake is a DatabaseSetupError naming one (exit 2).
    role, db = _name("pathless"), _name("pathless")
    pg_server.psql(f"CREATE ROLE {role} LOGIN CREATEDB")
    url = _url(pg_server, role, db) + "?options=-csearch_path%3Dnowhere"
    err = _setup_error(lambda: _init_api(url), "schema_missing")
    assert "CREATE SCHEMA name AUTHORIZATION" in str(err) and "search_path" in str(err)
    assert main(["db", "init", url]) == 2
    assert "no schema of the search_path exists" in capsys.readouterr().err
