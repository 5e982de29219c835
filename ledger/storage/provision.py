"""Setting a database up for the ledger: ``failover-ledger db init URL``.

:func:`init_database` makes sure the database exists (creating it where the backend must and
the role may: a SQLite file; a PostgreSQL database, through the server's maintenance database,
when the role has ``CREATEDB``) and brings the ledger's schema to head with the same migration
as :meth:`ledger.Ledger.open`. Running it again finds the database and the schema in place and
changes nothing; its :class:`InitReport` says what it did either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ledger.errors import InvalidArgument


@dataclass(frozen=True)
class InitReport:
    """What :func:`init_database` found and did.

    Attributes:
        backend: ``"sqlite"`` or ``"postgresql"``.
        url: The database's URL, without its password.
        database: The database's name (PostgreSQL) or file (SQLite).
        created_database: Whether the database was created by this call.
        revision_before: The schema's revision before (``None``: there was no schema).
        revision: The schema's revision now (the ledger's head).
    """

    backend: str
    url: str
    database: str
    created_database: bool
    revision_before: str | None
    revision: str

    @property
    def schema(self) -> str:
        """What happened to the schema: ``created``, ``upgraded`` or ``current``."""
        if self.revision_before is None:
            return "created"
        return "current" if self.revision_before == self.revision else "upgraded"

    def to_json(self) -> dict[str, Any]:
        """The report as JSON data."""
        return {"backend": self.backend, "url": self.url, "database": self.database,
                "created_database": self.created_database, "schema": self.schema,
                "revision_before": self.revision_before, "revision": self.revision}


def init_database(url: str) -> InitReport:
    """Create the database at ``url`` if it is missing, and its schema; idempotent.

    ``url`` is a SQLite file path (or ``sqlite:///`` URL) or a ``postgresql+psycopg://`` URL
    naming its database. Raises :class:`~ledger.errors.InvalidArgument` (``field="url"``) for
    a URL that names no supported database, :class:`~ledger.errors.DatabaseSetupError` for a
    database that cannot be made or migrated by this role (the message names the fix; nothing
    was created), :class:`~ledger.errors.DatabaseUnavailable` for a server that cannot be
    reached.
    """
    from ledger.storage import DEFAULT_LEASE_MARGIN_S, context_class, engine, migrate, partitions

    if not isinstance(url, str):
        raise InvalidArgument(f"url must be a string (a SQLite path or a database URL), not "
                              f"{type(url).__name__}", field="url")
    norm, parsed = engine.parse(url)
    cls = context_class(parsed)
    created = cls.prepare_database(norm, parsed)
    store = cls.open(norm, parsed, lease_margin_s=DEFAULT_LEASE_MARGIN_S)
    try:
        before = migrate.upgrade(store.context, norm)
        with engine.mapped_errors(norm):  # the owner makes the coming months' partitions
            partitions.ensure_partitions(store.context, time.time())
    finally:
        store.close()
    return InitReport(backend=store.backend, url=engine.redact_url(norm),
                      database=str(engine.database_name(parsed)), created_database=created,
                      revision_before=before, revision=migrate.head_revision())


__all__ = ["InitReport", "init_database"]
