"""Driver errors as ledger errors: the one place that knows what :mod:`sqlite3`, psycopg and
SQLAlchemy raise.

Every place in :mod:`ledger.storage` that talks to a database — the hot-path drivers, the
SQLAlchemy transactions, the migrations, the floor benchmark — hands what it caught to
:func:`ledger_error` and raises the answer ``from`` it, so the driver's exception stays the
``__cause__`` and nothing of a driver reaches a caller of the ledger. The kinds:

* the database cannot be reached, went away, or is busy (another connection holds the write
  lock past the busy timeout, the server shuts down or kills the session, a serialization
  failure): :class:`~ledger.errors.DatabaseUnavailable`. The transaction was rolled back, or
  its commit outcome is unknown; every write is idempotent per id, so retrying is safe;
* a write the database refuses to make at all (a read-only file or transaction, a role without
  the privilege): :class:`~ledger.errors.StorageError` with ``read_only=True``. Retrying will
  not help; the message says so;
* a row whose key is already recorded (a unique or primary key): :class:`~ledger.errors.Conflict`;
* anything else the database said: :class:`~ledger.errors.StorageError`.

Which driver an error came from is found by its type; a driver that was never imported cannot
have raised, so psycopg is looked up only when it is loaded (it is an optional extra).
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import exc as sa_exc

from ledger.errors import Conflict, DatabaseUnavailable, LedgerError, StorageError

# SQLite's primary result codes (the extended codes share their name's prefix, e.g.
# SQLITE_BUSY_SNAPSHOT, SQLITE_IOERR_FSYNC, SQLITE_READONLY_DBMOVED).
_SQLITE_UNAVAILABLE = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN", "SQLITE_IOERR",
                       "SQLITE_FULL", "SQLITE_PROTOCOL")
_SQLITE_REFUSED = ("SQLITE_READONLY", "SQLITE_PERM", "SQLITE_AUTH")
_SQLITE_DUPLICATE = ("SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY")
# PostgreSQL SQLSTATEs of a refused write: read-only transaction, insufficient privilege.
_PG_REFUSED = ("25006", "42501")
_PG_DUPLICATE = "23505"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _unavailable(text: str, where: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"database {where} is unavailable ({text}); the transaction was rolled back (or its "
        "commit outcome is unknown) and is safe to retry once the database is back",
        url=where)


def _refused(text: str, where: str) -> StorageError:
    return StorageError(
        f"database {where} refused the write ({text}): it is read-only to this connection; "
        "open the ledger with a role (or a file) that may write, or use it only to read "
        "(an audit)", url=where, read_only=True)


def _duplicate(text: str, where: str) -> Conflict:
    return Conflict(
        f"a row with the same key is already recorded in {where} ({text}); another writer "
        "recorded it first: read it back, or use a new id", url=where)


def _sqlite(e: sqlite3.Error, where: str) -> LedgerError:
    text = _first_line(e)
    name = getattr(e, "sqlite_errorname", "") or ""
    if name.startswith(_SQLITE_REFUSED):
        return _refused(text, where)
    if name.startswith(_SQLITE_UNAVAILABLE):
        return _unavailable(text, where)
    if name in _SQLITE_DUPLICATE:
        return _duplicate(text, where)
    if not name and isinstance(e, sqlite3.OperationalError) and any(
            w in text for w in ("locked", "busy", "unable to open", "disk")):
        return _unavailable(text, where)  # raised by the module itself, without a code
    return StorageError(f"database error: {text}", url=where)


def _psycopg(e: BaseException, where: str, psycopg: Any) -> LedgerError:
    text = _first_line(e)
    state = getattr(getattr(e, "diag", None), "sqlstate", None) or getattr(e, "sqlstate", None)
    if state in _PG_REFUSED:
        return _refused(text, where)
    if state == _PG_DUPLICATE:
        return _duplicate(text, where)
    # OperationalError covers a refused or lost connection, a server shutting down, a killed
    # session, a serialization failure or deadlock; InterfaceError a connection already closed.
    if isinstance(e, psycopg.OperationalError | psycopg.InterfaceError):
        return _unavailable(text, where)
    return StorageError(f"database error: {text}", url=where)


def ledger_error(e: BaseException, where: str) -> LedgerError | None:
    """The ledger error for a driver's or SQLAlchemy's exception ``e`` (``where``: the
    database, its URL without the password); ``None`` when ``e`` came from neither (a bug, a
    cancellation: the caller lets it through)."""
    if isinstance(e, LedgerError):
        return e
    if isinstance(e, sa_exc.DBAPIError):
        orig = e.orig
        if e.connection_invalidated:
            return _unavailable(_first_line(orig if orig is not None else e), where)
        if orig is not None:
            inner = ledger_error(orig, where)
            if inner is not None:
                return inner
        if isinstance(e, sa_exc.OperationalError):
            return _unavailable(_first_line(e), where)
        return StorageError(f"database error: {_first_line(e)}", url=where)
    if isinstance(e, sa_exc.TimeoutError):  # every pooled connection stayed busy
        return _unavailable(_first_line(e), where)
    if isinstance(e, sa_exc.SQLAlchemyError):
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


__all__ = ["driver_error", "ledger_error", "mapped"]
