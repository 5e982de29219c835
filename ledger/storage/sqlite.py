"""SQLite: :class:`SqliteContext`, and the store it opens.

One file shared by every process on the host: the hot path runs on :mod:`sqlite3` directly (one
connection per thread, ``BEGIN IMMEDIATE`` for writes, WAL with ``synchronous=FULL``), the cold
path on a SQLAlchemy engine over the same file. Writers serialize on the database's write lock,
so no statement takes a row lock; a connection waits for another's write lock up to the busy
timeout (30 s, or the URL's ``?timeout=`` in seconds), then answers
:class:`~ledger.errors.DatabaseUnavailable`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import (
    Connection,
    Float,
    Integer,
    Select,
    Text,
    case,
    cast,
    func,
    literal,
    select,
    union_all,
)
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL

from ledger.domain.bounds import DEFAULT_LEASE_MARGIN_S
from ledger.storage import engine as eng
from ledger.storage import migrate, statements
from ledger.storage import schema as s
from ledger.storage.context import SqlContext
from ledger.storage.driver import SqliteDriver
from ledger.storage.engine import redact_url
from ledger.storage.store import Store


class SqliteContext(SqlContext):
    """One SQLite file, for the queries built on it."""

    backend = "sqlite"

    #: The longest a queued begin waits without a signal before it begins again: another
    #: process's settle signals nothing on SQLite.
    QUEUE_POLL_S = 0.1

    @classmethod
    def open(cls, norm: str, parsed: URL, *,
             lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> Store:
        """The store on the SQLite file of ``parsed`` (its folder must exist), without
        touching it yet (the first transaction connects)."""
        path = eng.sqlite_file(norm, parsed)
        timeout = eng.sqlite_busy_timeout(parsed)
        ctx = cls(eng.sqlite_engine(parsed, timeout), redact_url(norm),
                  lease_margin_s=lease_margin_s)
        return Store(ctx, SqliteDriver(path, busy_timeout_s=timeout), statements.SQLITE,
                     queue_poll_s=cls.QUEUE_POLL_S)

    @classmethod
    def prepare_database(cls, norm: str, parsed: URL) -> bool:
        """Its folder must exist; the file itself is made by the first connection (the
        migration's), so ``True`` says it does not exist yet."""
        return not os.path.exists(eng.sqlite_file(norm, parsed))

    def migration_lock(self) -> AbstractContextManager[Connection]:
        """:func:`ledger.storage.migrate.sqlite_lock`."""
        return migrate.sqlite_lock(self.engine)

    def insert_for(self, table: Any) -> Any:
        """SQLite's INSERT (with ``ON CONFLICT``)."""
        return sqlite_dialect.insert(table)

    def claiming(self, query: Select[Any]) -> Select[Any]:
        """As it is: ``BEGIN IMMEDIATE`` serializes writers, so the re-check suffices."""
        return query

    def lock_hour(self, conn: Connection, hour: int, *, wait: bool = True) -> bool:
        """Nothing to take: the write transaction (``BEGIN IMMEDIATE``) holds every writer
        off."""
        return True

    def consistent(self, conn: Connection) -> None:
        """Nothing to do: a SQLite read transaction is one snapshot already."""

    def aggregating(self, conn: Connection) -> None:
        """Nothing: SQLite sizes its sorts by its page cache, per connection, not per query."""

    def bucket(self, col: Any, since: float, width: float) -> Any:
        """Truncation: SQLite lacks ``floor()`` before 3.35, and ``col >= since``."""
        return cast((col - since) / width, Integer)

    def label(self, key: str, labels: Any = None) -> Any:
        """``json_extract`` of the labels' JSON text."""
        return func.json_extract(s.runs.c.labels if labels is None else labels, f'$."{key}"')

    def json_text(self, col: Any, *path: str) -> Any:
        """``json_extract`` at the quoted path, as text."""
        where = "$" + "".join(f'."{k}"' for k in path)
        return cast(func.json_extract(col, where), Text)

    def percentiles(self, values: Sequence[Any], keys: Mapping[str, Any], where: Sequence[Any],
                    fractions: Sequence[float]) -> Select[Any]:
        """PostgreSQL's ``percentile_cont`` with window functions, per key and value: each
        row's 0-based rank ``i`` in its key's order and the key's count ``n``; at
        ``pos = fraction * (n - 1)`` the values of ranks ``floor(pos)`` and ``ceil(pos)``,
        interpolated as PostgreSQL does (``lo + (hi - lo) * (pos - floor(pos))``, in double
        precision). The keys come from one more pass each, so a key none of whose rows has a
        value is there with a count of 0, as on PostgreSQL; the keys' rows in one UNION ALL."""
        parts: list[Select[Any]] = []
        for name, key in keys.items():
            found = (select(key.label("key")).select_from(s.attempts).where(*where).distinct()
                     .subquery())
            cols: list[Any] = [literal(name).label("by"), found.c.key]
            joined: Any = found
            for j, value in enumerate(values):
                one = self._percentiles_of(value, key, where, fractions).subquery()
                joined = joined.outerjoin(one, one.c.key == found.c.key)
                cols.append(func.coalesce(one.c.n, 0).label(f"n{j}"))
                cols.extend(one.c[f"p{i}"].label(f"p{j}_{i}") for i in range(len(fractions)))
            parts.append(select(*cols).select_from(joined))
        return parts[0] if len(parts) == 1 else select(union_all(*parts).subquery())

    @staticmethod
    def _percentiles_of(value: Any, key: Any, where: Sequence[Any],
                        fractions: Sequence[float]) -> Select[Any]:
        """Per key with a ``value``: ``n`` and ``p0``, ``p1``, ... of it."""
        ranked = (select(key.label("key"), value.label("v"),
                         (func.row_number().over(partition_by=key, order_by=value) - 1)
                         .label("i"),
                         func.count().over(partition_by=key).label("n"))
                  .select_from(s.attempts).where(value.is_not(None), *where).subquery())
        n = func.max(ranked.c.n)
        cols: list[Any] = [ranked.c.key.label("key"), n.label("n")]
        for i, f in enumerate(fractions):
            frac = literal(float(f), Float(precision=53))
            pos = (ranked.c.n - 1) * frac  # per row: the same for every row of a key
            low = cast(pos, Integer)  # floor: pos >= 0
            high = low + case((pos > low, 1), else_=0)
            lo = func.max(case((ranked.c.i == low, ranked.c.v)))
            hi = func.max(case((ranked.c.i == high, ranked.c.v)))
            at = (n - 1) * frac
            cols.append((lo + (hi - lo) * (at - cast(at, Integer))).label(f"p{i}"))
        return select(*cols).group_by(ranked.c.key)


__all__ = ["SqliteContext"]
