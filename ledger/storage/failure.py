"""Driver errors as ledger errors: the one place that knows what :mod:`sqlite3`, psycopg and
SQLAlchemy raise.

Every place in :mod:`ledger.storage` that talks to a database — the hot-path drivers, the
SQLAlchemy transactions, the migrations, the floor benchmark — hands what it caught to
:func:`ledger_error` and raises the answer ``from`` it, so the driver's exception stays the
``__cause__`` and nothing of a driver reaches a caller of the ledger. The kinds:

* the server answered that the database is not set up for this URL — the database or the
  role does not exist, the credentials or ``pg_hba.conf`` were refused, the role may not log in
  or connect (SQLSTATE class 28, 3D000 and their kin): :class:`~ledger.errors.DatabaseSetupError`
  (a :class:`~ledger.errors.ConfigError`) naming the fix. Retrying cannot help, so it is never
  told as retry-safe (:func:`setup_error` builds it, also for ``db init`` and migrations);
* the database cannot be reached, went away, or is busy (another connection holds the write
  lock past the busy timeout, the server shuts down or kills the session):
  :class:`~ledger.errors.DatabaseUnavailable`. The transaction was rolled back, or
  its commit outcome is unknown; every write is idempotent per id, so retrying is safe (a
  full disk is one, ``disk_full=True``, its message naming the fix: free space). So is a
  PostgreSQL transaction another one was in the way of (a deadlock, a serialization
  failure, a lock not granted within the lock timeout): its message says which, and
  ``contention`` holds the SQLSTATE (``40P01``, ``40001``, ``55P03``);
* a write the database refuses to make at all (a read-only file, a role whose sessions are
  read-only, a role without the privilege): :class:`~ledger.errors.DatabaseReadOnly` (a
  :class:`~ledger.errors.DatabaseSetupError` and a :class:`~ledger.errors.StorageError`, with
  ``read_only=True``) naming the role and the fix. Retrying will not help; the message says
  so. SQLSTATE 25006 is also what a standby (a server in recovery) answers every write, where
  a retry that reaches the primary does help: the code that holds the connection tells the two
  apart before it maps the error (:func:`ledger.storage.pgpool.read_only_session`: the
  driver, the engine's ``handle_error``), and a standby's refusal is
  :class:`~ledger.errors.DatabaseUnavailable` with ``standby=True``: the connection is
  dropped, and the retry reaches the primary. A 25006 that reaches :func:`ledger_error`
  unmarked was a primary's;
* a table or column the ledger uses is missing (SQLSTATE 42P01 and 42703; SQLite's ``no such
  table``/``no such column``): the schema is older than this code, because the ledger was
  opened with ``migrate_schema=False`` (a command other than ``db init``, the dashboard, a
  read-only role) before any process of this version migrated it (an older revision is
  refused at open already: :func:`ledger.storage.migrate.check_current`).
  :class:`~ledger.errors.DatabaseSetupError` (``problem="schema_outdated"``) naming
  ``failover-ledger db init``; the statement's transaction was rolled back. A month's
  partition of the history (``attempts_p202601``, ``events_p202601``) missing is no such
  thing: a statement that names one (retention's) found it dropped after it listed it (by
  another retention run, or by hand), and a run again plans from what is left:
  :class:`~ledger.errors.DatabaseUnavailable` (``partition`` its name) saying so;
* a statement prepared on the server before a migration changed the type of a column it
  returns (PostgreSQL's ``cached plan must not change result type``, SQLSTATE 0A000: a
  connection prepares the statements it repeats, and the server refuses such a one on it until
  it is prepared again): :class:`~ledger.errors.DatabaseUnavailable` (``schema_changed=True``),
  retry-safe, for the transaction was rolled back, and psycopg's rollback lets go of what the
  connection prepared; the hot path's driver runs the transaction again once from its start on
  that connection (:class:`~ledger.storage.driver.PgDriver`), and the cold path prepares
  nothing (:meth:`~ledger.storage.pgpool.PgPool.lend`);
* a row whose key is already recorded (a unique or primary key): :class:`~ledger.errors.Conflict`;
* anything else the database said: :class:`~ledger.errors.StorageError`.

Which driver an error came from is found by its type; a driver that was never imported cannot
have raised, so psycopg is looked up only when it is loaded (it is an optional extra).
"""

from __future__ import annotations

import re
import shlex
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ledger.errors import (
    Conflict,
    DatabaseReadOnly,
    DatabaseSetupError,
    DatabaseUnavailable,
    InvalidState,
    LedgerError,
    StorageError,
)

# SQLite's primary result codes (the extended codes share their name's prefix, e.g.
# SQLITE_BUSY_SNAPSHOT, SQLITE_IOERR_FSYNC, SQLITE_READONLY_DBMOVED).
_SQLITE_UNAVAILABLE = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN", "SQLITE_IOERR",
                       "SQLITE_FULL", "SQLITE_PROTOCOL")
_SQLITE_REFUSED = ("SQLITE_READONLY", "SQLITE_PERM", "SQLITE_AUTH")
_SQLITE_DUPLICATE = ("SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY")
# PostgreSQL SQLSTATEs of a refused write: read-only transaction, insufficient privilege.
_PG_REFUSED = ("25006", "42501")
_PG_DUPLICATE = "23505"
_PG_DISK_FULL = "53100"
# invalid_schema_name: "no schema has been selected to create in" (a search_path naming no
# schema that exists), a set-up problem like a database that does not exist.
_PG_NO_SCHEMA = "3F000"
# A transaction another one was in the way of: what happened, and when a retry can go through.
_PG_CONTENTION = {
    "40P01": ("deadlock detected: this transaction and another each waited for a lock the "
              "other held, and the server rolled this one back", "now"),
    "40001": ("serialization failure: a concurrent transaction changed what this one read",
              "now"),
    "55P03": ("a lock was not granted within the lock timeout: another session's transaction "
              "held it (a long query, or a transaction left open: see pg_stat_activity)",
              "once that transaction ends"),
}
# What a PostgreSQL server answers when the set-up is wrong, not the server away. A connection
# that never opened carries no SQLSTATE to psycopg (libpq keeps only the server's text), so the
# server's own messages are recognised; they are English unless the server's lc_messages says
# otherwise, and a message not recognised stays DatabaseUnavailable, as it was.
_PG_SETUP: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), problem) for pattern, problem in (
    (r'database "(?P<database>[^"]*)" does not exist', "database_missing"),
    (r'role "(?P<role>[^"]*)" does not exist', "role_missing"),
    (r'role "(?P<role>[^"]*)" is not permitted to log in', "login_refused"),
    (r'(?:no pg_hba\.conf entry|pg_hba\.conf rejects connection) for host "[^"]*", '
     r'user "(?P<role>[^"]*)", database "(?P<database>[^"]*)"', "hba_rejected"),
    (r'authentication failed for user "(?P<role>[^"]*)"', "auth_failed"),
    (r"no password supplied", "password_missing"),
    (r'permission denied for database "(?P<database>[^"]*)"', "connect_privilege"),
    (r'database "(?P<database>[^"]*)" is not currently accepting connections',
     "connections_disabled"),
))
# A table or column the statement names is not there: the schema is older than the code.
_PG_SCHEMA_MISSING = ("42P01", "42703")
# ... unless it is a month's partition of the history (ledger.storage.partitions' names,
# spelled here: this module runs without SQLAlchemy): no migration makes one, a retention run
# drops it, and a statement naming one it had listed finds it gone.
_PG_PARTITION_GONE = re.compile(
    r'relation "(?:[^"]*\.)?(?P<name>(?:attempts|events)_p\d{6})" does not exist')
_SQLITE_SCHEMA_MISSING = re.compile(r"(?:no such (?:table|column)|table \S+ has no column "
                                    r"named)\b")
# The server's refusal of a statement prepared before a migration changed what it returns. Its
# SQLSTATE (feature_not_supported) says nothing on its own; the server's text does, and a
# server speaking another language (lc_messages) is told a plain StorageError, as before.
_PG_STALE_PLAN = ("0A000", "cached plan must not change result type")
# SQLSTATEs of the same answers when a statement carries one: invalid authorization (class
# 28) and invalid catalog name (the database does not exist).
_PG_SETUP_STATES = {"3D000": "database_missing", "28P01": "auth_failed"}


# libpq's account of a multi-host connection string that no host answered: a line per host
# tried after this one. Its first line is only the last host's failure.
_EVERY_HOST = "Multiple connection attempts failed. All failures were:"
_HOST_TRIED = re.compile(r"^- host: '(?P<host>[^']*)', port: '(?P<port>[^']*)'[^:]*: "
                         r"(?:.*? port \d+ failed: )?(?P<why>.*)$")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    if not text:
        return type(e).__name__
    lines = text.splitlines()
    if _EVERY_HOST in lines:
        tried = [m for m in map(_HOST_TRIED.match, lines[lines.index(_EVERY_HOST) + 1:]) if m]
        if tried:
            return "no host answered: " + "; ".join(
                f"{m['host']}:{m['port']} ({m['why'].strip()})" for m in tried)
    return lines[0]


def _unavailable(text: str, where: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"database {where} is unavailable ({text}); the transaction was rolled back (or its "
        "commit outcome is unknown) and is safe to retry once the database is back",
        url=where)


def _contention(state: str, text: str, where: str) -> DatabaseUnavailable:
    # The server is there and well: another transaction was in the way. Still
    # DatabaseUnavailable, the error every caller retries on, but told as what it was, since
    # "once the database is back" would send an operator looking for an outage.
    what, now = _PG_CONTENTION[state]
    return DatabaseUnavailable(
        f"database {where}: {what} ({text}); the transaction was rolled back and nothing of "
        f"it was recorded; it is safe to retry {now}", url=where, contention=state)


def _full(text: str, where: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"database {where} could not write: its disk is full ({text}); the transaction was "
        "rolled back and is safe to retry once space is freed where the database keeps its "
        "files", url=where, disk_full=True)


def _standby(text: str, where: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"database {where} did not take the write ({text}): the server is a standby (in "
        "recovery), not the primary; nothing was written and the connection was dropped, so "
        "the call is safe to retry once the primary answers (a URL that names every server "
        "reconnects to it: docs/high-availability.md)", url=where, standby=True)


def _partition_gone(name: str, text: str, where: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"database {where}: the history changed under this statement ({text}): partition "
        f"{name} was dropped (by a retention run, or by hand) after the statement named it; "
        "the transaction was rolled back and nothing of it was recorded; run it again: it "
        "reads (or drops) what is left", url=where, partition=name)


def stale_plan(e: BaseException) -> bool:
    """Whether ``e`` (a psycopg error) is the server's refusal of a statement prepared before
    a migration changed the type of a column it returns (:data:`_PG_STALE_PLAN`)."""
    state, said = _PG_STALE_PLAN
    return getattr(e, "sqlstate", None) == state and said in str(e)


def _schema_changed(text: str, where: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"database {where}: the schema changed under a statement this connection had prepared "
        f"({text}): a migration changed a column's type since (`failover-ledger db init`, or a "
        "ledger of a newer version opening the database); the transaction was rolled back and "
        "nothing of it was recorded, and what the connection had prepared was let go with it: "
        "a retry prepares the statement anew and goes through", url=where, schema_changed=True)


def _refused(text: str, where: str, *, privilege: bool = False) -> DatabaseReadOnly:
    """A write the database refused because it is read-only to this connection (``privilege``:
    the role lacks a privilege on a table, PostgreSQL's 42501; else its sessions, the database
    or the file are read-only)."""
    problem = "write_privilege" if privilege else "read_only"
    if not where.startswith("postgresql"):
        return DatabaseReadOnly(
            f"database {where} refused the write ({text}): the file (or its folder) is "
            "read-only to this process; nothing was written, and retrying will not help: make "
            "it writable for the user this process runs as, or use it only to read (an audit)",
            url=where, problem=problem, database=None, role=None, read_only=True)
    database, role, _host = _names(where)
    who = f"role {_quoted(role, '')}" if role else "the role of this URL"
    if privilege:
        # 42501 is also a read the role may not make (a table it was not granted SELECT on):
        # the statement is not known to be a write.
        return DatabaseReadOnly(
            f"database {where} refused the statement ({text}): {who} lacks a privilege it "
            "needs on the ledger's tables; nothing was written, and retrying will not help: "
            "connect as the role that writes the ledger (the one that runs `failover-ledger "
            "db init`) to write, or, for a reader's role, grant it SELECT on every ledger "
            "table (docs/auditor-role.md)", url=where, problem=problem, database=database,
            role=role, read_only=True)
    why = (f"{who} may not write here: its sessions are read-only (default_transaction_"
           "read_only is on for the role, the database or the URL's options, as for a "
           "reader's role: docs/auditor-role.md), and the server is the primary, not a "
           "standby")
    return DatabaseReadOnly(
        f"database {where} refused the write ({text}): {why}; nothing was written, and "
        "retrying will not help: connect as the role that writes the ledger (the one that "
        "runs `failover-ledger db init`), or use this one only to read (an audit, the "
        "dashboard without --allow-actions)", url=where, problem=problem, database=database,
        role=role, read_only=True)


def _duplicate(text: str, where: str) -> Conflict:
    return Conflict(
        f"a row with the same key is already recorded in {where} ({text}); another writer "
        "recorded it first: read it back, or use a new id", url=where)


def _names(where: str) -> tuple[str | None, str | None, str]:
    """(database, role, "host:port") of the URL ``where``, as far as it says."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(where)
    except (ArgumentError, ValueError):
        return None, None, where
    # Several hosts are in the query as libpq's lists (ledger.storage.pgurl): told as such.
    listed = {k: v if isinstance(v, str) else ",".join(v) for k, v in url.query.items()}
    hosts = url.host or listed.get("host") or "localhost"
    host = f"{hosts}:{url.port or listed.get('port') or 5432}"
    return url.database, url.username, host


def _quoted(name: str | None, placeholder: str) -> str:
    """An SQL identifier as psql takes it (double quotes doubled), or the placeholder."""
    return '"' + name.replace('"', '""') + '"' if name else placeholder


def init_command(where: str, *, option: str = "") -> str:
    """```failover-ledger db init URL``` for a message: ``where`` (the URL without its
    password) shell-quoted after ``option`` (``"--db "`` or nothing). The password is never
    printed, so where it was masked (``***``) the command cannot be pasted as shown: the hint
    says to put it back, or to hand the URL over in ``$LEDGER_URL``, which ``db init`` reads."""
    command = f"`failover-ledger db init {option}{shlex.quote(where)}`"
    if "***" not in where:
        return command
    return (f"{command} (*** stands for the password, which is never printed: put yours back "
            "in its place, or set LEDGER_URL to the whole URL and run `failover-ledger db "
            "init` alone)")


def setup_error(problem: str, where: str, *, database: str | None = None,
                role: str | None = None, text: str = "") -> DatabaseSetupError:
    """The :class:`~ledger.errors.DatabaseSetupError` of ``problem`` on the database at
    ``where`` (its URL without the password; the database and role default to the URL's),
    with the fix in its message; ``text`` is what the server said, when it said something."""
    url_db, url_role, host = _names(where)
    database = database or url_db
    role = role or url_role
    db, who = _quoted(database, "DBNAME"), _quoted(role, "ROLE")
    server = f"the server at {host}"
    said = f" ({text})" if text else ""
    hostname, _, port = host.rpartition(":")
    fixes = {
        "database_missing": (
            f"database {db} does not exist on {server}: create it as a role that may "
            f"create databases, `createdb -h {hostname} -p {port} -O {role or 'ROLE'} "
            f"{database or 'DBNAME'}` (in psql: CREATE DATABASE {db} OWNER {who};), or, with "
            f"a role that has CREATEDB, run {init_command(where)}"),
        "role_missing": (
            f"role {who} does not exist on {server}: create it as a superuser (in psql: "
            f"CREATE ROLE {who} LOGIN PASSWORD '...';) or correct the user name in the URL"),
        "login_refused": (
            f"role {who} may not log in (it is NOLOGIN): as a superuser, ALTER ROLE {who} "
            "LOGIN; or put a role that may log in in the URL"),
        "auth_failed": (
            f"{server} refused the credentials of role {who}{said}: correct the password in "
            f"the URL (or in PGPASSWORD or ~/.pgpass), or set it as a superuser: ALTER ROLE "
            f"{who} PASSWORD '...';"),
        "password_missing": (
            f"{server} asks role {who} for a password and none was given: put it in the URL "
            f"(postgresql+psycopg://{role or 'ROLE'}:PASSWORD@{host}/{database or 'DBNAME'}), "
            "in PGPASSWORD or in ~/.pgpass"),
        "hba_rejected": (
            f"{server} does not let role {who} connect to database {db} from this host{said}: "
            f"add a line such as `host {database or 'DBNAME'} {role or 'ROLE'} ADDRESS/32 "
            "scram-sha-256` to its pg_hba.conf (before any line that rejects) and reload the "
            "server (SELECT pg_reload_conf();)"),
        "connect_privilege": (
            f"role {who} may not connect to database {db}: as its owner, GRANT CONNECT ON "
            f"DATABASE {db} TO {who};"),
        "createdb_privilege": (
            f"database {db} does not exist on {server} and role {who} may not create "
            f"databases{said}: create it as a role that may, `createdb -h {hostname} -p {port} "
            f"-O {role or 'ROLE'} {database or 'DBNAME'}` (in psql: CREATE DATABASE {db} OWNER "
            f"{who};), or give this role the right as a superuser (ALTER ROLE {who} CREATEDB;), "
            "then run `failover-ledger db init` again"),
        "schema_privilege": (
            f"role {who} may not create or change the ledger's tables in database {db}{said}: "
            "run `failover-ledger db init URL` once as the role that owns the database and "
            f"its tables (`createdb -O OWNER {database or 'DBNAME'}` makes one), then open it "
            "with this role"),
        "schema_outdated": (
            f"the ledger's schema in {_shown(database, where)} is older than this ledger, or "
            f"was never created{said}: the ledger was opened with migrate_schema=False (any "
            "command but db init, the dashboard, a role that may not migrate) before a "
            "process of this version migrated it; as the role that owns its tables, run "
            f"{init_command(where)} (or open it once with migrate_schema=True); nothing was "
            "written"),
        "schema_missing": (
            f"no schema of the search_path exists in database {db} for role {who}{said}: the "
            "ledger creates its tables in the first schema of search_path, and the URL's "
            "options (-c search_path=...) or the role's setting name none that exists; create "
            f"it as the database's owner (in psql: CREATE SCHEMA name AUTHORIZATION {who};) or "
            "correct search_path"),
        "connections_disabled": (
            f"database {db} does not accept connections: as its owner, ALTER DATABASE {db} "
            "ALLOW_CONNECTIONS true;"),
    }
    message = fixes.get(problem, f"{server} refused the connection{said}")
    return DatabaseSetupError(
        f"{message.rstrip(';')}; retrying will not help (docs/postgresql.md)", url=where,
        problem=problem, database=database, role=role)


def _shown(database: str | None, where: str) -> str:
    """How a message names the database: PostgreSQL's by name, a SQLite file by its path."""
    return f"database {_quoted(database, 'DBNAME')}" if where.startswith("postgresql") else where


def _pg_setup(e: BaseException, state: str | None, where: str) -> DatabaseSetupError | None:
    """The set-up problem the server's answer ``e`` names, or ``None`` (not one)."""
    if state is not None and state not in _PG_SETUP_STATES and not state.startswith("28"):
        return None  # a statement's error with its own SQLSTATE: another kind
    text = str(e)
    for pattern, problem in _PG_SETUP:
        found = pattern.search(text)
        if found is not None:
            names = found.groupdict()
            return setup_error(problem, where, database=names.get("database"),
                               role=names.get("role"), text=_server_text(text))
    if state is not None:
        return setup_error(_PG_SETUP_STATES.get(state, "auth_failed"), where,
                           text=_first_line(e))
    return None


def _server_text(text: str) -> str:
    """What the server said, without libpq's ``connection to server ... failed:`` lead."""
    line = text.strip().splitlines()[0] if text.strip() else text
    return line.rsplit("FATAL:", 1)[-1].strip() if "FATAL:" in line else line


def _sqlite(e: sqlite3.Error, where: str) -> LedgerError:
    text = _first_line(e)
    name = getattr(e, "sqlite_errorname", "") or ""
    if name.startswith(_SQLITE_REFUSED):
        return _refused(text, where)
    if name.startswith("SQLITE_FULL"):
        return _full(text, where)
    if name.startswith(_SQLITE_UNAVAILABLE):
        return _unavailable(text, where)
    if name in _SQLITE_DUPLICATE:
        return _duplicate(text, where)
    if isinstance(e, sqlite3.OperationalError) and _SQLITE_SCHEMA_MISSING.match(text):
        return setup_error("schema_outdated", where, text=text)
    if not name and isinstance(e, sqlite3.OperationalError) and any(
            w in text for w in ("locked", "busy", "unable to open", "disk")):
        return _unavailable(text, where)  # raised by the module itself, without a code
    return StorageError(f"database error: {text}", url=where)


def _psycopg(e: BaseException, where: str, psycopg: Any) -> LedgerError:
    text = _first_line(e)
    state = getattr(getattr(e, "diag", None), "sqlstate", None) or getattr(e, "sqlstate", None)
    setup = _pg_setup(e, state, where)
    if setup is not None:
        return setup
    if state == _PG_NO_SCHEMA:
        return setup_error("schema_missing", where, text=text)
    if state in _PG_REFUSED:
        return _refused(text, where, privilege=state == "42501")
    if state == _PG_DISK_FULL:
        return _full(text, where)
    if state == _PG_DUPLICATE:
        return _duplicate(text, where)
    gone = _PG_PARTITION_GONE.search(text) if state == "42P01" else None
    if gone is not None:
        return _partition_gone(gone["name"], text, where)
    if state in _PG_SCHEMA_MISSING:
        return setup_error("schema_outdated", where, text=text)
    if state in _PG_CONTENTION:
        return _contention(state, text, where)
    if stale_plan(e):
        return _schema_changed(text, where)
    # OperationalError covers a refused or lost connection, a server shutting down, a killed
    # session; InterfaceError a connection already closed.
    if isinstance(e, psycopg.OperationalError | psycopg.InterfaceError):
        return _unavailable(text, where)
    return StorageError(f"database error: {text}", url=where)


def ledger_error(e: BaseException, where: str) -> LedgerError | None:
    """The ledger error for a driver's or SQLAlchemy's exception ``e`` (``where``: the
    database, its URL without the password); ``None`` when ``e`` came from neither (a bug, a
    cancellation: the caller lets it through)."""
    if isinstance(e, LedgerError):
        return e
    # Only a loaded library can have raised: the hot path runs without SQLAlchemy.
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is not None and isinstance(e, sa_exc.DBAPIError):
        orig = e.orig
        psycopg = sys.modules.get("psycopg")
        if psycopg is not None and isinstance(orig, psycopg.Error):
            # Before the invalidation check: a refused login is told by what the server said.
            state = getattr(getattr(orig, "diag", None), "sqlstate", None)
            setup = _pg_setup(orig, state, where)
            if setup is not None:
                return setup
        if e.connection_invalidated:
            text = _first_line(orig if orig is not None else e)
            if getattr(orig, "sqlstate", None) == "25006":  # dropped as a standby's (engine.py)
                return _standby(text, where)
            return _unavailable(text, where)
        if orig is not None:
            inner = ledger_error(orig, where)
            if inner is not None:
                return inner
        if isinstance(e, sa_exc.OperationalError):
            return _unavailable(_first_line(e), where)
        return StorageError(f"database error: {_first_line(e)}", url=where)
    if sa_exc is not None and isinstance(e, sa_exc.TimeoutError):  # every pooled one busy
        return _unavailable(_first_line(e), where)
    if sa_exc is not None and isinstance(e, sa_exc.SQLAlchemyError):
        return StorageError(f"database error: {_first_line(e)}", url=where)
    if isinstance(e, sqlite3.Error):
        return _sqlite(e, where)
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(e, psycopg.Error):
        return _psycopg(e, where, psycopg)
    alembic_exc = sys.modules.get("alembic.util.exc")
    if alembic_exc is not None and isinstance(e, alembic_exc.CommandError):
        return StorageError(f"schema migration failed: {_first_line(e)}", url=where)
    return None


def driver_error(e: BaseException, where: str) -> LedgerError:
    """:func:`ledger_error` for an exception a driver call raised (always a ledger error)."""
    return ledger_error(e, where) or StorageError(f"database error: {_first_line(e)}",
                                                  url=where)


def standby_error(e: BaseException, where: str) -> DatabaseUnavailable:
    """The error of a write a standby refused (``e``: SQLSTATE 25006 on a connection whose
    server is in recovery): retry-safe, unlike a read-only database's refusal."""
    return _standby(_first_line(e), where)


@contextmanager
def mapped(where: str) -> Iterator[None]:
    """Raise the ledger error of any driver or SQLAlchemy exception leaving the block, with
    the original as its ``__cause__``; ledger errors and everything else pass unchanged."""
    try:
        yield
    except Exception as e:
        err = ledger_error(e, where)
        if err is None or err is e:
            raise
        raise err from e


def closed_error(where: str) -> InvalidState:
    """A connection asked of a store whose ledger was closed (also a call in flight when it
    closed): closing releases every connection for good, so nothing may quietly open new ones.
    """
    return InvalidState(f"the ledger of {where} is closed; open a new one with Ledger.open "
                        f"(or AsyncLedger.open) to use the database again",
                        problem="ledger_closed", database=where)


__all__ = ["closed_error", "driver_error", "ledger_error", "mapped", "setup_error",
           "stale_plan", "standby_error"]
