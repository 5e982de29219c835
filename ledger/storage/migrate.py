"""Creating and upgrading the schema with the Alembic scripts, safely from many processes.

Concurrent openers serialize on the database's own lock (a PostgreSQL advisory lock; on SQLite
the write lock of the migrating transaction, taken up front with ``BEGIN IMMEDIATE``), then each
one re-reads the revision under it, so all converge on ``head`` and only the first does the
work. Nothing is left behind: no lock file, no lock held after the call.

A database already at head (every open but the first) is recognised from one read of its
revision, without the lock and without importing Alembic: the revisions are read from the
scripts' text (:func:`script_revisions`), and the revision of a database only moves forward.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, text

from ledger.errors import DatabaseSetupError, DatabaseUnavailable, SchemaTooNew, StorageError
from ledger.storage.engine import mapped_errors, redact_url
from ledger.storage.failure import init_command, setup_error

if TYPE_CHECKING:
    from alembic.config import Config

    from ledger.storage.context import SqlContext

# Any constant works; it only has to be the same for every ledger process.
_PG_MIGRATION_LOCK = 0x1ED6E5
#: How long a statement of a migration waits for a lock on a ledger table (PostgreSQL's
#: ``lock_timeout``, for the migrating transaction only). An ``ALTER TABLE`` queued behind a
#: session that holds the table (a transaction left open: ``idle in transaction``) holds every
#: other session's statements on that table behind it, the workers' reads included, for as
#: long as that session lasts. The workers' own transactions take milliseconds, so a wait of
#: 10 s is not theirs; and 10 s is a third of the pool's checkout timeout
#: (:data:`~ledger.storage.pgpool.CHECKOUT_TIMEOUT_S`), so the workers held up meanwhile
#: carry on once it gives up. It bounds each lock wait, not the migration's work.
MIGRATION_LOCK_TIMEOUT = "10s"
_REVISION = re.compile(r"""^revision\s*=\s*['"]([^'"]+)['"]""", re.M)
_DOWN = re.compile(r"""^down_revision\s*=\s*(?:['"]([^'"]+)['"]|None)""", re.M)


def script_location() -> str:
    """The Alembic scripts: inside the installed wheel, else the repository's ``migrations/``."""
    pkg = Path(__file__).resolve().parent.parent
    for candidate in (pkg / "_migrations", pkg.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return str(candidate)
    raise FileNotFoundError(
        "the ledger's Alembic scripts are missing: reinstall the package (pip install .)"
    )


def alembic_config() -> Config:
    """Alembic's configuration of the ledger's scripts (imports Alembic)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", script_location())
    return cfg


@functools.cache
def script_revisions() -> tuple[str, frozenset[str]]:
    """(the head revision, every revision) of the scripts, read from their text: a script
    names its ``revision`` and ``down_revision``, and the head is the one nobody follows.
    ``tests/storage/test_schema.py`` checks this against Alembic's own reading."""
    revisions: set[str] = set()
    followed: set[str] = set()
    for script in (Path(script_location()) / "versions").glob("*.py"):
        body = script.read_text(encoding="utf-8")
        rev, down = _REVISION.search(body), _DOWN.search(body)
        if rev is None or down is None:
            raise FileNotFoundError(f"{script} names no revision: reinstall the package")
        revisions.add(rev.group(1))
        if down.group(1):
            followed.add(down.group(1))
    heads = revisions - followed
    if len(heads) != 1:
        raise FileNotFoundError(f"the ledger's Alembic scripts have heads {sorted(heads)}, "
                                "not one: reinstall the package")
    return heads.pop(), frozenset(revisions)


def comparison_options(dialect: str) -> dict[str, Any]:
    """Alembic's options for comparing a ``dialect`` database with the declared schema
    (autogenerate, the schema test): types compared; the partitions of partitioned tables
    (PostgreSQL, :mod:`ledger.storage.partitions`) are not declared tables, and a constraint
    declared for another database only is not expected here."""
    from ledger.storage.partitions import is_partition_name
    from ledger.storage.schema import declared_for

    def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
        return not (type_ == "table" and name is not None and is_partition_name(name))

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool,
                       compare_to: Any) -> bool:
        return reflected or declared_for(obj, dialect)

    return {"compare_type": True, "include_name": include_name,
            "include_object": include_object}


def head_revision() -> str:
    """The revision this ledger's schema is at once migrated."""
    return script_revisions()[0]


def current_revision(ctx: SqlContext, conn: Connection) -> str | None:
    """The database's schema revision (``None``: no schema yet), read on ``conn`` of ``ctx``."""
    if not ctx.has_table(conn, "alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def check_not_newer(rev: str | None, url: str) -> None:
    """Refuse a database migrated by a newer ledger (a revision our scripts do not know)."""
    head, known = script_revisions()
    if rev is not None and rev not in known:
        raise SchemaTooNew(
            f"database {redact_url(url)} is at schema revision {rev!r}, newer than this ledger "
            f"understands (head {head!r}); upgrade the ledger package",
            revision=rev,
        )


def check_current(ctx: SqlContext, url: str) -> None:
    """Refuse to open, without migrating, a database whose schema is not this ledger's head:
    an older one is a :class:`~ledger.errors.DatabaseSetupError` (``problem="schema_outdated"``)
    naming ``db init``, a newer one :class:`~ledger.errors.SchemaTooNew`. One read, at open.

    A missing table or column alone does not tell an older schema: a revision may change only
    what a row means (0017: how an unreadable answer is settled), and a reader of the older
    rows would report them the new way. A database without the ledger's schema, or one that
    cannot be read now (away, credentials refused), is left to the first call, which names
    its own fix as before (a process may open while its server is away); a SQLite file that
    is not a ledger is not connected to (the engine's first connection writes)."""
    if not ctx.holds_schema():
        return
    try:
        with mapped_errors(url), ctx.engine.connect() as conn:
            found = current_revision(ctx, conn)
            conn.rollback()
    except (StorageError, DatabaseSetupError):
        return
    check_not_newer(found, url)
    head = head_revision()
    if found is not None and found != head:
        raise setup_error("schema_outdated", redact_url(url),
                          text=f"it is at revision {found}, this ledger needs {head}")


def upgrade(ctx: SqlContext, url: str) -> str | None:
    """Bring the schema of ``ctx``'s database to head; safe when many processes call it at
    once. Returns the revision found before (``None``: no schema); it equals
    :func:`head_revision` when there was nothing to do.

    A SQLite file holding another application's tables is refused first, untouched
    (:meth:`~ledger.storage.sqlite.SqliteContext.refuse_foreign`).
    A role that may read and write the ledger's rows but not create or alter its tables opens
    a database already at head (it only reads the revision); anywhere else the refusal is a
    :class:`~ledger.errors.DatabaseSetupError` (``problem="schema_privilege"``) naming the fix.

    A statement of the migration that waits longer than :data:`MIGRATION_LOCK_TIMEOUT` for a
    lock on a ledger table (PostgreSQL) gives up, the migration rolled back whole: a
    :class:`~ledger.errors.DatabaseUnavailable` (``contention="55P03"``) naming the session in
    the way and the fix.
    """
    head = head_revision()
    ctx.refuse_foreign()  # before the first connection, which may write (SQLite's WAL switch)
    with mapped_errors(url), ctx.engine.connect() as conn:
        found = current_revision(ctx, conn)
        conn.rollback()
    check_not_newer(found, url)
    if found == head:
        return found
    from alembic import command

    try:
        with mapped_errors(url), ctx.migration_lock() as conn:
            # For the transaction that migrates (SET LOCAL), not for the pooled connection.
            ctx.bounded_locks(conn, MIGRATION_LOCK_TIMEOUT)
            # Again, under the lock: another may have migrated.
            found = current_revision(ctx, conn)
            check_not_newer(found, url)
            if found == head:
                conn.rollback()
                return found
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")  # inside the locked transaction: all of it or nothing
            conn.commit()
    except DatabaseUnavailable as e:
        if e.fields.get("contention") != "55P03":
            raise
        raise _blocked(redact_url(url), found, head, e) from e
    except StorageError as e:
        if not e.fields.get("read_only"):
            raise
        cause = e.__cause__
        said = str(getattr(cause, "orig", None) or cause or e).strip().splitlines()[0]
        raise setup_error("schema_privilege", redact_url(url), text=(
            f"schema at revision {found or 'none'}, this ledger needs {head}; the server "
            f"said: {said}")) from e
    return found


def _blocked(where: str, found: str | None, head: str, e: DatabaseUnavailable
             ) -> DatabaseUnavailable:
    """The error of a migration that gave up waiting for a lock another session held."""
    cause = e.__cause__
    said = str(getattr(cause, "orig", None) or cause or e).strip().splitlines()[0]
    return DatabaseUnavailable(
        f"database {where} was not migrated to schema revision {head}: a statement of the "
        f"migration waited {MIGRATION_LOCK_TIMEOUT} for a lock on a ledger table that another "
        f"session holds ({said}), and gave up rather than hold every worker's statements on "
        "that table behind it; nothing changed (the migration rolled back whole, the schema "
        f"is at revision {found or 'none'} still). The session is a transaction left open (a "
        "process paused or stuck in the middle of one, `idle in transaction`; or a migrating "
        "process killed while its statement waited) or a long query: find it with SELECT pid, "
        "state, xact_start, query FROM pg_stat_activity WHERE datname = current_database() "
        "AND state <> 'idle' ORDER BY xact_start; end it (resume or stop its process, or "
        f"SELECT pg_terminate_backend(pid)), then run {init_command(where)} again",
        url=where, contention="55P03", revision=found, head=head)


@contextmanager
def postgres_lock(engine: Engine) -> Iterator[Connection]:
    """A connection whose work is serialized against every other migrating process: a
    session-level advisory lock, held on a second connection and released at the end."""
    with engine.connect() as lock_conn:
        lock_conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
        lock_conn.commit()
        try:
            with engine.connect() as conn:
                yield conn
        finally:
            lock_conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_MIGRATION_LOCK})
            lock_conn.commit()


@contextmanager
def sqlite_lock(engine: Engine) -> Iterator[Connection]:
    """A connection whose transaction begins with ``BEGIN IMMEDIATE`` (the engine's write
    option), so the revision is read and the scripts run under the database's write lock;
    other openers wait on the busy timeout, then find head. SQLite's DDL is transactional, so
    a crash mid-way leaves the previous revision, never half of one."""
    with engine.connect().execution_options(ledger_write=True) as conn:
        yield conn
