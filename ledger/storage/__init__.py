"""The storage layer: the only package that issues SQL or imports a database driver.

Its face is the storage port (:class:`~ledger.storage.port.StoragePort`) and the one factory
that opens it, :func:`open_store`; the two implementations are
:class:`~ledger.storage.sqlite.SqliteStore` and :class:`~ledger.storage.postgres.PostgresStore`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from ledger.storage.port import StoragePort
    from ledger.storage.store import SqlStore

#: The default of ``lease_margin_s`` (seconds): processes whose clocks differ by less than this
#: never both believe they may use one capacity slot (``docs/operations.md``).
DEFAULT_LEASE_MARGIN_S = 0.5


def open_store(url: str, *, lease_margin_s: float = DEFAULT_LEASE_MARGIN_S,
               migrate_schema: bool = True) -> StoragePort:
    """The storage port on the database at ``url`` (a SQLite file path or URL, or a
    ``postgresql+psycopg://`` URL): :class:`~ledger.storage.sqlite.SqliteStore` or
    :class:`~ledger.storage.postgres.PostgresStore`, picked by :func:`store_class`.

    ``migrate_schema`` creates or upgrades the schema first (safe from many processes at
    once); without it nothing is touched until the first call. ``lease_margin_s``: how long
    before its end a lease stops starting work (the clock skew between hosts the ledger
    tolerates). Arguments are checked by the caller (:meth:`ledger.Ledger.open`).

    Raises :class:`~ledger.errors.InvalidArgument` (a URL that names no supported database,
    PostgreSQL without its driver installed), :class:`~ledger.errors.DatabaseSetupError` (the
    database is not set up for the URL: no such database, role or folder, credentials refused,
    no privilege to migrate), :class:`~ledger.errors.DatabaseUnavailable` (the database cannot
    be reached), :class:`~ledger.errors.SchemaTooNew` (migrated by a newer ledger).
    """
    from ledger.storage import engine, migrate

    norm, parsed = engine.parse(url)
    store = store_class(parsed).connect(norm, parsed, lease_margin_s=lease_margin_s)
    if migrate_schema:
        try:
            migrate.upgrade(store.migration_lock(), norm)
        except BaseException:
            with contextlib.suppress(Exception):  # the migration's error is the one to tell
                store.close()
            raise
    return store


def store_class(parsed: URL) -> type[SqlStore]:
    """The store implementation of the parsed URL ``parsed`` (checked by
    :func:`ledger.storage.engine.parse`): the one place that tells the backends apart."""
    from ledger.storage.postgres import PostgresStore
    from ledger.storage.sqlite import SqliteStore

    kinds: dict[str, type[SqlStore]] = {"sqlite": SqliteStore, "postgresql": PostgresStore}
    return kinds[parsed.get_backend_name()]


__all__ = ["DEFAULT_LEASE_MARGIN_S", "open_store", "store_class"]
