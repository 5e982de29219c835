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
    (:func:`ledger.storage.partitions.ensure_partitions`); without it nothing is touched until
    the first call. ``lease_margin_s``: how long
    before its end a lease stops starting work (the clock skew between hosts the ledger
    tolerates). Arguments are checked by the caller (:meth:`ledger.Ledger.open`).

    Raises :class:`~ledger.errors.InvalidArgument` (a URL that names no supported database,
    PostgreSQL without its driver installed), :class:`~ledger.errors.DatabaseSetupError` (the
    database is not set up for the URL: no such database, role or folder, credentials refused,
    no privilege to migrate), :class:`~ledger.errors.DatabaseUnavailable` (the database cannot
    be reached), :class:`~ledger.errors.SchemaTooNew` (migrated by a newer ledger).
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
    return store


def context_class(parsed: URL) -> type[SqliteContext] | type[PostgresContext]:
    """The context of the parsed URL ``parsed`` (checked by
    :func:`ledger.storage.engine.parse`): the one place that tells the backends apart."""
    from ledger.storage.postgres import PostgresContext
    from ledger.storage.sqlite import SqliteContext

    kinds: dict[str, type[SqliteContext] | type[PostgresContext]] = {
        "sqlite": SqliteContext, "postgresql": PostgresContext}
    return kinds[parsed.get_backend_name()]


__all__ = ["DEFAULT_LEASE_MARGIN_S", "context_class", "open_store"]
