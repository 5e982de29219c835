"""The storage port on PostgreSQL: :class:`PostgresStore`.

The hot path runs on psycopg 3 directly (a small pool of blocking and of asyncio connections,
autocommit with ``BEGIN`` and ``COMMIT`` pipelined with the statements, prepared statements on
the server), the cold path on a SQLAlchemy engine over the same database. Writes that carry a
fence lock the run row (``SELECT ... FOR UPDATE``); claims of work items skip rows another
transaction holds (``SKIP LOCKED``); migrations serialize on an advisory lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import Connection, Select, cast, func
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import URL

from ledger.storage import DEFAULT_LEASE_MARGIN_S, hot, migrate
from ledger.storage import engine as eng
from ledger.storage import schema as s
from ledger.storage.driver import PgDriver
from ledger.storage.engine import redact_url
from ledger.storage.store import SqlStore


class PostgresStore(SqlStore):
    """The storage port over one PostgreSQL database."""

    backend = "postgresql"
    SQL = hot.POSTGRES_SQL
    ANALYZE = "ANALYZE runs, attempts, debits, events, health, capacity_groups"

    #: Notifications wake waiters at once; polling only finds slots of leases that expired.
    QUEUE_POLL_S = 1.0

    @classmethod
    def connect(cls, norm: str, parsed: URL, *,
                lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> PostgresStore:
        """A store on the database of ``parsed`` (a ``postgresql+psycopg://`` URL)."""
        engine = eng.postgres_engine(norm, parsed)
        conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        where = redact_url(norm)
        return cls(engine, where, PgDriver(conninfo, where=where), lease_margin_s=lease_margin_s)

    def _listen(self, told: Callable[[str], None], stop: threading.Event) -> None:
        """LISTEN on the queue channel until ``stop``; ``told("")`` once listening."""
        import psycopg

        conninfo = self.driver.conninfo  # type: ignore[attr-defined]
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f"LISTEN {hot.QUEUE_CHANNEL}")
            told("")
            while not stop.is_set():
                for note in conn.notifies(timeout=0.5):
                    told(note.payload)

    def migration_lock(self) -> AbstractContextManager[Connection]:
        """:func:`ledger.storage.migrate.postgres_lock`."""
        return migrate.postgres_lock(self.engine)

    def insert_for(self, table: Any) -> Any:
        """PostgreSQL's INSERT (with ``ON CONFLICT``)."""
        return pg_dialect.insert(table)

    def claiming(self, query: Select[Any]) -> Select[Any]:
        """``FOR UPDATE SKIP LOCKED``: a run another process holds is left to it."""
        return query.with_for_update(skip_locked=True)

    def consistent(self, conn: Connection) -> None:
        """``REPEATABLE READ``: every statement of the transaction sees one snapshot."""
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")

    def bucket(self, col: Any, since: float, width: float) -> Any:
        """``floor`` of the offset in widths."""
        return func.floor((col - since) / width)

    def label(self, key: str) -> Any:
        """The labels as ``jsonb``, ``->> key``."""
        return cast(s.runs.c.labels, JSONB).op("->>")(key)


__all__ = ["PostgresStore"]
