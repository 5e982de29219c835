"""The storage layer: the only package that issues SQL or imports a database driver.

Its faces are the hot path's :class:`~ledger.storage.store.Store` (the turn, leases, provenance
and events, as flows its runner performs), the query objects built on the store's
:class:`~ledger.storage.context.SqlContext` (:class:`~ledger.storage.runs.RunQueries`,
:class:`~ledger.storage.recovery.RecoveryQueries`, :class:`~ledger.storage.audit.AuditQueries`,
:class:`~ledger.storage.series.SeriesQueries`), and the one factory that opens a store,
:func:`open_store`. The databases differ in their context
(:class:`~ledger.storage.sqlite.SqliteContext`, :class:`~ledger.storage.postgres.PostgresContext`),
their driver and their hot-path statements.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from ledger.domain.bounds import DEFAULT_LEASE_MARGIN_S

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from ledger.storage.postgres import PostgresContext
    from ledger.storage.sqlite import SqliteContext
    from ledger.storage.store import Store


def open_store(url: str, *, lease_margin_s: float = DEFAULT_LEASE_MARGIN_S,
               migrate_schema: bool = True, now: float | None = None) -> Store:
    """The store on the database at ``url`` (a SQLite file path or URL, or a
    ``postgresql+psycopg://`` URL), on the context :func:`context_class` picks.

    ``migrate_schema`` creates or upgrades the schema first (safe from many processes at
    once) and, on PostgreSQL, the partitions of the history for the month of ``now`` (the
    ledger clock's time; default the system's) and the next ones
    (:func:`ledger.storage.partitions.ensure_partitions`); without it the schema's revision is
    read once and an older or newer one refused (:func:`ledger.storage.migrate.check_current`),
    and nothing else is touched until the first call. ``lease_margin_s``: how long
    before its end a lease stops starting work (the clock skew between hosts the ledger
    tolerates). Arguments are checked by the caller (:meth:`ledger.Ledger.open`).

    Raises :class:`~ledger.errors.InvalidArgument` (a URL that names no supported database,
    PostgreSQL without its driver installed), :class:`~ledger.errors.DatabaseSetupError` (the
    database is not set up for the URL: no such database, role or folder, credentials refused,
    no privilege to migrate), :class:`~ledger.errors.DatabaseUnavailable` (the database cannot
    be reached), :class:`~ledger.errors.SchemaTooNew` (migrated by a newer ledger),
    :class:`~ledger.errors.DatabaseSetupError` ``problem="schema_outdated"`` (opened without
    migrating, an older schema).
    """
    from ledger.storage import engine, migrate, partitions

    norm, parsed = engine.parse(url)
    store = context_class(parsed).open(norm, parsed, lease_margin_s=lease_margin_s)
    if migrate_schema:
        try:
            migrate.upgrade(store.context, norm)
            with engine.mapped_errors(norm):
                partitions.ensure_partitions(store.context,
                                             time.time() if now is None else now)
        except BaseException:
            with contextlib.suppress(Exception):  # the migration's error is the one to tell
                store.close()
            raise
    else:
        try:
            migrate.check_current(store.context, norm)
        except BaseException:
            with contextlib.suppress(Exception):
                store.close()
            raise
    return store


def open_reads(url: str, read_url: str) -> Store:
    """The store of a read replica of the PostgreSQL database at ``url``, for audit and
    dashboard reads (``read_url=`` of :meth:`ledger.Ledger.open`): read-only sessions, a
    standby preferred when ``read_url`` names several servers, nothing touched until the first
    read, never migrated.

    Raises :class:`~ledger.errors.InvalidArgument` (``field="read_url"``, before any name is
    looked up) when ``read_url`` cannot be read or is not a PostgreSQL URL, or ``url`` is a
    SQLite ledger's (a file has no replica: its readers read the file).
    """
    from ledger.errors import InvalidArgument
    from ledger.storage import engine
    from ledger.storage.postgres import PostgresContext

    _, main = engine.parse(url)
    if context_class(main) is not PostgresContext:
        raise InvalidArgument(
            "read_url is for a ledger on PostgreSQL; a SQLite ledger has no read replica (its "
            "readers open the same file): drop read_url", field="read_url")
    try:
        norm, parsed = engine.parse(read_url)
        if context_class(parsed) is not PostgresContext:
            raise InvalidArgument(
                "read_url must be the postgresql+psycopg:// URL of a replica of the ledger's "
                f"database, not {engine.redact_url(engine.normalize_url(read_url))!r}",
                field="read_url")
        engine.postgres_conninfo(norm, parsed, reads=True)  # every fault, before any lookup
    except InvalidArgument as e:
        if e.field == "read_url":
            raise
        raise InvalidArgument(f"read_url: {e}", field="read_url") from e
    return PostgresContext.open(norm, parsed, reads=True)


def database_key(url: str) -> str:
    """Which database ``url`` names, one string per database wherever that can be told (a
    SQLite file by its resolved path; a PostgreSQL database by its URL normalized). Raises
    what :func:`ledger.storage.engine.parse` raises."""
    from ledger.storage import engine

    norm, parsed = engine.parse(url)
    return context_class(parsed).database_key(norm, parsed)


def context_class(parsed: URL) -> type[SqliteContext] | type[PostgresContext]:
    """The context of the parsed URL ``parsed`` (checked by
    :func:`ledger.storage.engine.parse`): the one place that tells the backends apart."""
    # Only the picked backend is imported: a SQLite ledger never loads PostgreSQL's side
    # (nor SQLAlchemy's PostgreSQL dialect).
    if parsed.get_backend_name() == "sqlite":
        from ledger.storage.sqlite import SqliteContext

        return SqliteContext
    from ledger.storage.postgres import PostgresContext

    return PostgresContext


__all__ = ["DEFAULT_LEASE_MARGIN_S", "context_class", "database_key", "open_reads",
           "open_store"]
