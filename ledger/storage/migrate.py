"""Creating and upgrading the schema with the Alembic scripts, safely from many processes.

Concurrent openers serialize on the database's own lock (a PostgreSQL advisory lock; on SQLite
the write lock of the migrating transaction, taken up front with ``BEGIN IMMEDIATE``), then each
one re-reads the revision under it, so all converge on ``head`` and only the first does the
work. Nothing is left behind: no lock file, no lock held after the call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from ledger.errors import SchemaTooNew, StorageError
from ledger.storage.engine import mapped_errors, redact_url
from ledger.storage.failure import setup_error

# Any constant works; it only has to be the same for every ledger process.
_PG_MIGRATION_LOCK = 0x1ED6E5


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
    cfg = Config()
    cfg.set_main_option("script_location", script_location())
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def check_not_newer(conn: Connection, url: str) -> None:
    """Refuse a database migrated by a newer ledger (a revision our scripts do not know)."""
    rev = current_revision(conn)
    if rev is None:
        return
    scripts = ScriptDirectory.from_config(alembic_config())
    known = {s.revision for s in scripts.walk_revisions()}
    if rev not in known:
        raise SchemaTooNew(
            f"database {redact_url(url)} is at schema revision {rev!r}, newer than this ledger "
            f"understands (head {scripts.get_current_head()!r}); upgrade the ledger package",
            revision=rev,
        )


def upgrade(lock: AbstractContextManager[Connection], url: str) -> str | None:
    """Bring the schema to head; safe when many processes call it at once. ``lock`` is the
    backend's (:func:`postgres_lock` or :func:`sqlite_lock` of its engine). Returns the
    revision found before (``None``: no schema); it equals :func:`head_revision` when there
    was nothing to do.

    A role that may read and write the ledger's rows but not create or alter its tables opens
    a database already at head (it only reads the revision); anywhere else the refusal is a
    :class:`~ledger.errors.DatabaseSetupError` (``problem="schema_privilege"``) naming the fix.
    """
    head = head_revision()
    found: str | None = None
    try:
        with mapped_errors(url), lock as conn:
            check_not_newer(conn, url)
            found = current_revision(conn)
            if found == head:
                conn.rollback()
                return found
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")  # inside the locked transaction: all of it or nothing
            conn.commit()
    except StorageError as e:
        if not e.fields.get("read_only"):
            raise
        cause = e.__cause__
        said = str(getattr(cause, "orig", None) or cause or e).strip().splitlines()[0]
        raise setup_error("schema_privilege", redact_url(url), text=(
            f"schema at revision {found or 'none'}, this ledger needs {head}; the server "
            f"said: {said}")) from e
    return found


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
